"""A grid run's record (result.json): its keys, and the checks every record read back passes."""
from __future__ import annotations

import json
import math
import reprlib
from pathlib import Path
from typing import Any, Callable

from .checkpoint import CheckpointError


RESULT_NAME = "result.json"
REPORT_TITLE = "# Grid "   # results.md's first line begins so: a report grid.py wrote
COLUMNS = ["variant", "seed", "final_val_bpc", "best_val_bpc", "tokens_per_s", "peak_memory_mb", "parameters",
           "steps", "wall_time_s", "data"]
RECORD_KEYS = [*COLUMNS, "val_steps", "val_bpc", "scores", "config"]   # a run's result.json
# Also in a run's result.json since the train-split estimate was added (absent from older records):
# train_bpc, the estimate at each val step (None where a run from before it was resumed), and the
# training split's length in bytes, which gives the passes over it.
FIT_KEYS = ("train_bpc", "train_bytes")
# Optional in a run's result.json: eval.py --ar-split adds ar_split.<split>.<seq_len> with these
# scores (bpc on associative-recall hits and on the other bytes, the hits' share of the bytes).
AR_SPLIT_KEYS = ("hit_bpc", "rest_bpc", "hit_fraction")
# With --far-window W, those scores also hold "far": {"window": W, <match>: {<class>_bpc, <class>_fraction}}:
# the bytes split by how far back the nearest earlier copy of each match (its length in bytes) lies.
FAR_MATCHES = {"bigram": 2, "match8": 8}
FAR_CLASSES = ("near", "far", "none")
FAR_KEYS = tuple(f"{kind}_{what}" for kind in FAR_CLASSES for what in ("bpc", "fraction"))
# The sha256 the run's ckpt.pt was sealed with when its result was written (absent from older records):
# a checkpoint sealed since (trained on by a later --resume, say) means the result is stale.
DIGEST_KEY = "checkpoint_sha256"
Records = dict[tuple[int, str], dict[str, Any]]
# The fields of a record the report reads, by kind (scores, curves and config are checked apart).
TEXT_FIELDS = ("variant", "data")
COUNT_FIELDS = ("seed", "steps", "parameters")
NUMBER_FIELDS = ("final_val_bpc", "best_val_bpc", "tokens_per_s", "peak_memory_mb", "wall_time_s")   # NaN: none
CONFIG_FIELDS = {"attention": str, "feature_map": str, "rope": str, "abs_pos": bool, "feature_map_options": dict,
                 "seq_len": int}


def read_record(path: Path) -> dict[str, Any] | None:
    """A run's result.json, None while there is none (the run is not finished); a file that cannot
    be read, is not JSON or lacks a field the report reads, or holds one of the wrong type or shape,
    is refused in one line: the report would fail on it, or silently leave the run out."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as error:
        raise damaged(path, f"cannot read it ({getattr(error, 'strerror', None) or error})") from None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError) as error:   # RecursionError: nesting deeper than the parser goes
        raise damaged(path, f"not valid JSON ({error})") from None
    problem = record_problem(record)
    if problem:
        raise damaged(path, problem)
    return record


def damaged(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}; delete it and run grid.py again with --resume, which scores "
                           "that run again from its checkpoint")


def record_problem(record: Any) -> str | None:
    """What in a record the report cannot read, or None."""
    if not isinstance(record, dict):
        return f"it holds a {type(record).__name__}, not a run's record"
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        return f"no field {', '.join(missing)}"
    checks = [*((key, isinstance(record[key], str), "text") for key in TEXT_FIELDS),
              *((key, is_count(record[key]), "a whole number >= 0") for key in COUNT_FIELDS),
              *((key, is_number(record[key]), "a number") for key in NUMBER_FIELDS),
              ("val_steps", is_list_of(record["val_steps"], is_count), "a list of whole numbers >= 0"),
              ("val_bpc", is_list_of(record["val_bpc"], is_number), "a list of numbers"),
              ("config", isinstance(record["config"], dict), "a dict of settings")]
    for key, ok, expected in checks:
        if not ok:
            return wrong(key, record[key], expected)
    if len(record["val_bpc"]) != len(record["val_steps"]):
        return f"val_bpc has {len(record['val_bpc'])} values for {len(record['val_steps'])} val_steps"
    return (fit_problem(record) or config_problem(record["config"]) or finite_problem(record)
            or scores_problem(record["scores"], record["config"]) or digest_problem(record)
            or ar_split_problem(record.get("ar_split", {})) or mqar_problem(record))


def finite_problem(record: dict[str, Any]) -> str | None:
    """Every val score of the record is finite: a NaN would be reported as a result."""
    values = [("final_val_bpc", record["final_val_bpc"]), ("best_val_bpc", record["best_val_bpc"]),
              *((f"val_bpc at step {step}", value) for step, value in zip(record["val_steps"], record["val_bpc"]))]
    return next((f"{key} is {value}, not a finite score" for key, value in values if not math.isfinite(value)), None)


def digest_problem(record: dict[str, Any]) -> str | None:
    digest = record.get(DIGEST_KEY)
    if digest is None or (isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")):
        return None
    return wrong(DIGEST_KEY, digest, "a sha256 in hex (or null)")


def mqar_problem(record: dict[str, Any]) -> str | None:
    """A --task mqar run's recall scores, where a record has them: val and test bits and accuracy, the state."""
    if "mqar" not in record:
        return None
    recall = record["mqar"]
    if not (isinstance(recall, dict) and isinstance(recall.get("state_size"), str) and all(
            isinstance(recall.get(split), dict) and is_number(recall[split].get("bits"))
            and is_number(recall[split].get("accuracy")) for split in ("val", "test"))):
        return wrong("mqar", recall, "val and test bits and accuracy, and a state_size")
    return None


def ar_split_problem(ar_split: Any) -> str | None:
    """eval.py --ar-split's scores, where a record has them: split -> window length -> AR_SPLIT_KEYS."""
    if not isinstance(ar_split, dict):
        return wrong("ar_split", ar_split, "a dict of splits")
    for split, by_length in ar_split.items():
        if not isinstance(by_length, dict) or not all(
                isinstance(scores, dict) and all(is_number(scores.get(key)) for key in AR_SPLIT_KEYS)
                for scores in by_length.values()):
            return wrong(f"ar_split.{split}", by_length, f"a dict of window lengths to {', '.join(AR_SPLIT_KEYS)}")
        for length, scores in by_length.items():
            far = scores.get("far", {"window": 1, **{name: dict.fromkeys(FAR_KEYS, 0.0) for name in FAR_MATCHES}})
            if not (isinstance(far, dict) and is_count(far.get("window")) and far["window"] >= 1 and all(
                    isinstance(far.get(name), dict) and all(is_number(far[name].get(key)) for key in FAR_KEYS)
                    for name in FAR_MATCHES)):
                return wrong(f"ar_split.{split}.{length}.far", far, f"a window and {', '.join(FAR_MATCHES)} scores")
    return None


def fit_problem(record: dict[str, Any]) -> str | None:
    """The train-split fields, when the record has them (both or neither)."""
    present = [key for key in FIT_KEYS if key in record]
    if not present:
        return None
    if len(present) < len(FIT_KEYS):
        return f"{present[0]} without {', '.join(key for key in FIT_KEYS if key not in record)}"
    if not (is_count(record["train_bytes"]) and record["train_bytes"] > 0):
        return wrong("train_bytes", record["train_bytes"], "a whole number > 0")
    if not is_list_of(record["train_bpc"], lambda v: v is None or is_number(v)):
        return wrong("train_bpc", record["train_bpc"], "a list of numbers (or null)")
    if len(record["train_bpc"]) != len(record["val_steps"]):
        return f"train_bpc has {len(record['train_bpc'])} values for {len(record['val_steps'])} val_steps"
    return None


def wrong(key: str, value: Any, expected: str) -> str:
    return f"{key} is {reprlib.repr(value)}, not {expected}"


def scores_problem(scores: Any, config: dict[str, Any]) -> str | None:
    """Scores are split -> window length (a positive whole number, as text) -> bpc, finite except past
    learned positions (abs_pos at a length beyond seq_len: n/a, not a score)."""
    if not isinstance(scores, dict):
        return wrong("scores", scores, "a dict of splits")
    for split, by_length in scores.items():
        if not isinstance(by_length, dict):
            return wrong(f"scores.{split}", by_length, "a dict of window lengths")
        for length, bpc in by_length.items():
            if not (length.isascii() and length.isdigit() and int(length) > 0):
                return f"scores.{split} has window length {length!r}, not a positive whole number"
            if not is_number(bpc):
                return wrong(f"scores.{split}.{length}", bpc, "a number")
            if not math.isfinite(bpc) and not (config["abs_pos"] and int(length) > config["seq_len"]):
                return f"scores.{split}.{length} is {bpc}, not a finite score"
    return None


def config_problem(config: dict[str, Any]) -> str | None:
    """The settings the report pairs variants by (normalization: absent in records from before it)."""
    for key, kind in [*CONFIG_FIELDS.items(), *([("normalization", str)] if "normalization" in config else [])]:
        if not isinstance(config.get(key), kind):
            return wrong(f"config.{key}", config.get(key), kind.__name__)
    return None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_list_of(value: Any, check: Callable[[Any], bool]) -> bool:
    return isinstance(value, list) and all(map(check, value))
