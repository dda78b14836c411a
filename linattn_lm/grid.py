"""Train attention variants with several seeds under one budget, score them on the whole val and test
splits, and compare them with error bars (`python grid.py`).

    python grid.py --preset cpu                                        # the 17 default variants, seed 0
    python grid.py --preset cpu --seeds 0,1,2 --eval-multiples 1,2,4,8 \\
        --variants softmax-rope,linear-favor-post,linear-favor-pre,linear-favor-none
    python grid.py --run-name grid-cpu --resume                        # continue it as it started
    tensorboard --logdir runs/grid-cpu

Variants: softmax-rope, softmax-abs, softmax-none, softmax-rope-abs and linear-<map>-<post|pre|none>
for every registered feature map (--import registers more), optionally with -rmsnorm (normalization
rmsnorm) and -abs, in that order, and optionally with feature-map options after '+', e.g.
linear-favor-post-rmsnorm, linear-favor-post+redraw_interval=250: a variant that differs from another
in one factor only (the RoPE placement, the normalization, learned positions, or one option) is compared
with it seed by seed.  Every seed trains every variant (seed-major order, so each finished seed adds a
complete paired comparison); a seed fixes the initial weights, the data order and the FAVOR+ draws,
the same for every variant.

Takes every train.py flag except those that pick the variant; a --feature-map-option applies to the
variants whose map takes it, --chunk-size to linear ones.  Each run lives in
<out-dir>/<run-name>/<variant>/seed-<s> (default run-name grid-<preset>) with its TensorBoard log,
checkpoint and result.json (the curve and the whole-split scores); results.md, results.csv and
val_bpc.png (grid_report.py) are rewritten from those after every run, so an interrupted grid
loses at most the run in progress and --resume continues it.  The grid's directory records its flags,
variants, seeds and --eval-multiples (GRID_MARKER): --resume and --report-only need only --out-dir and
--run-name, and --variants / --seeds given on --resume add to the grid.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import linattn

from . import training
from .checkpoint import CHECKPOINT_NAME, CheckpointError, recorded_digest
from .cli import import_user_code
from .files import check_run_name
from .flags import build_parser, comma_items, config_from_flags, merged_flags, parse_config, variant_skip
from .presets import DEFAULT_PRESET, TASK_PRESETS
from .process import Distributed, distributed, launched_rank
from .results import RunFailed, TrainResult, exit_code, run_reporting_errors
from .resume import config_differences, contradictions
from .lm import ATTENTION_BACKENDS
from .settings import TrainConfig, field_default
from .data import check_window_fits, load_split
from .errors import EXIT_INTERRUPTED, EXIT_SIGNAL_BASE, UsageError
from .evaluate import bpc_table
from .grid_record import (DIGEST_KEY, FIT_KEYS, RECORD_KEYS, REPORT_TITLE, RESULT_NAME, damaged, is_count,
                          is_list_of, read_record, record_problem)
from .grid_report import write_report
from .mqar import held_out_lines, held_out_scores
from .ngram import reference_bpc
from .runlock import GRID_MARKER, LOCK_NAME, DirectoryLock, check_can_write, check_not_nested
from .device import keep_freed_memory
from .files import write_atomically
from .variants import default_variants, variant_flags

EVAL_SPLITS = ("val", "test")
REPORT_FILES = ("results.md", "results.csv", "val_bpc.png")


def grid_name(given: dict[str, Any]) -> str:
    preset = given.get("preset") or TASK_PRESETS.get(given.get("task"), DEFAULT_PRESET)   # --task mqar: mqar
    return given["run_name"] if "run_name" in given else f"grid-{Path(preset).stem}"   # a preset file: its name


def run_configs(given: dict[str, Any], variants: list[str], seeds: list[int]) -> dict[tuple[int, str], TrainConfig]:
    """One TrainConfig per (seed, variant), seed-major, all checked before anything trains.  Each
    variant takes the grid's feature-map options its map accepts, then its own; an option of the
    grid that no variant's map takes is an error.  --backend goes to the variants of the attention
    it names a kernel of (torch/cpp/fla: linear; sdpa/xformers: softmax; auto: both)."""
    shared_options = given.get("feature_map_options", {})
    used: set[str] = set()
    configs = {}
    for seed in seeds:
        for name in variants:
            flags = {**given, **variant_flags(name), "seed": seed, "run_name": f"{grid_name(given)}/{name}/seed-{seed}"}
            if "backend" in flags and flags["backend"] not in ATTENTION_BACKENDS[flags["attention"]]:
                flags.pop("backend")
            if flags["attention"] == "softmax":
                flags.pop("chunk_size", None)
                flags.pop("feature_map_options", None)
            else:
                accepted = {key: value for key, value in shared_options.items()
                            if key in linattn.feature_map_options(flags["feature_map"])}
                used |= set(accepted)
                flags["feature_map_options"] = {**accepted, **flags["feature_map_options"]}
            configs[seed, name] = config_from_flags(flags)
    unused = sorted(set(shared_options) - used)
    if unused:
        raise ValueError(f"no variant's feature map takes option(s) {unused}")
    if "backend" in given and all(config.model.backend != given["backend"] for config in configs.values()):
        raise ValueError(f"--backend {given['backend']} is a kernel of no listed variant's attention (linear: "
                         f"{', '.join(ATTENTION_BACKENDS['linear'])}; softmax: {', '.join(ATTENTION_BACKENDS['softmax'])})")
    if "chunk_size" in given and all(config.model.attention == "softmax" for config in configs.values()):
        raise ValueError("--chunk-size applies to linear variants only, and none is listed: drop it or add one")
    return configs


def saved_record(key: tuple[int, str], config: TrainConfig, multiples: list[int]) -> dict[str, Any] | None:
    """The run's result.json when it was written for this very configuration (every setting that
    may not change on --resume, and the steps) and holds the asked scores; else None, and the run
    is resumed from its checkpoint (which checks its configuration itself) and scored again.  A
    damaged one is refused (read_record), and so is one that names another run than its directory's
    (`key`, the seed and variant): a copy put in the wrong place would be reported, or trained over,
    as the wrong run."""
    path = config.run.run_dir / RESULT_NAME
    record = read_record(path)
    if record is None:
        return None
    seed, name = key
    if (record["seed"], record["variant"]) != (seed, name):
        raise damaged(path, f"it records {record['variant']} seed {record['seed']}, but its directory is {name} "
                            f"seed {seed} (copied to the wrong place? it belongs in "
                            f"<grid>/{record['variant']}/seed-{record['seed']}/)")
    if changed_since_scored(record, config.run.run_dir):
        print(f"{config.run.run_dir}: its checkpoint changed after result.json was written, so that result is "
              "not used (a --resume that lists the run scores it again)", file=sys.stderr)
        return None
    differences = config_differences(record["config"], config.flat(), saved_as="result.json")
    if record["steps"] != config.optim.steps:
        differences.append(f"steps: result.json {record['steps']}, now {config.optim.steps}")
    if differences:   # said, so that a report that leaves the run out never does so in silence
        print(f"{path}: written for other settings ({'; '.join(differences[:3])}), so that result is not used "
              "(a --resume that lists the run trains and scores it again)", file=sys.stderr)
        return None
    wanted = {str(multiple * config.model.seq_len) for multiple in multiples}
    if any(not wanted <= set(record["scores"].get(split, {})) for split in EVAL_SPLITS):
        return None
    return record


def changed_since_scored(record: dict[str, Any], run_dir: Path) -> bool:
    """Whether the run's checkpoint is not the one its result was scored from (the record names its
    digest; records from before it, and runs whose checkpoints are gone, cannot tell)."""
    checkpoint = run_dir / CHECKPOINT_NAME
    recorded = record.get(DIGEST_KEY)
    return recorded is not None and checkpoint.is_file() and recorded_digest(checkpoint) != recorded


def whole_split_scores(result: TrainResult, config: TrainConfig, multiples: list[int]) -> dict[str, dict[str, float]]:
    """bpc on the whole val and test splits in windows of multiple x seq_len (eval.py's scoring)."""
    data_dir = config.run.data_path
    model, scores = result.model.eval(), {}
    lengths = [multiple * config.model.seq_len for multiple in multiples]
    for split in EVAL_SPLITS:
        print(f"{config.run.run_name}: whole {split} split", flush=True)
        rows = bpc_table(model, load_split(data_dir, split).data, lengths, 8, next(model.parameters()).device,
                         result.dtype)
        scores[split] = {str(seq_len): bpc for seq_len, bpc, _ in rows}
    return scores


def mqar_scores(result: TrainResult, config: TrainConfig) -> dict[str, Any]:
    """--task mqar: bits per query and accuracy on the held-out val and test streams (the task's
    whole-split scores), and the decoding state they came from."""
    model = config.model
    scores = held_out_scores(result.model.eval(), model.vocab_size, model.seq_len, config.task.mqar_kv_pairs,
                             config.task.mqar_filler, config.optim.batch_size, model.seed,
                             next(result.model.parameters()).device, result.dtype)
    for line in held_out_lines(scores):   # what the report scores, beside the training's last estimate
        print(f"{config.run.run_name}: {line}", flush=True)
    return {**scores, "state_size": result.state_size}


def make_record(name: str, result: TrainResult, config: TrainConfig,
                scores: dict[str, dict[str, float]], recall: dict[str, Any] | None = None) -> dict[str, Any]:
    record = {"variant": name, "seed": result.seed, "steps": result.steps,
              "final_val_bpc": result.final_val_bpc, "best_val_bpc": result.best_val_bpc,
              "tokens_per_s": result.tokens_per_s, "peak_memory_mb": result.peak_memory_mb,
              "parameters": result.parameters, "wall_time_s": result.wall_seconds, "data": result.data,
              "val_steps": result.val_steps, "val_bpc": result.val_bpc, "scores": scores, "config": config.flat(),
              "train_bpc": result.train_bpc, "train_bytes": result.train_bytes,
              DIGEST_KEY: recorded_digest(config.run.run_dir / CHECKPOINT_NAME)}
    if recall is not None:   # mqar: recall scores; its data never repeats, so no passes over a split
        record = {key: value for key, value in record.items() if key not in FIT_KEYS} | {"mqar": recall}
    assert set(record) == {*RECORD_KEYS, DIGEST_KEY, *(FIT_KEYS if recall is None else ["mqar"])}
    problem = record_problem(record)
    if problem:   # a NaN score, say: the grid stops rather than report it
        raise RunFailed(f"{config.run.run_name}: {problem}; its checkpoint is kept, no result.json is "
                                 "written")
    return record


def train_and_score(name: str, config: TrainConfig, ctx: Distributed, resume: bool,
                    multiples: list[int]) -> dict[str, Any] | int | None:
    """The run's record (main rank; None elsewhere), or the exit code of a run stopped by a signal."""
    checkpoint = config.run.run_dir / CHECKPOINT_NAME
    result = training.train(config, ctx, resume=resume and checkpoint.exists())
    if result.interrupted:
        return exit_code(result)
    if result.late_signal:   # the run is complete: the grid stops before scoring it
        print(f"stopped after {config.run.run_name} finished training; --resume scores it and goes on",
              file=sys.stderr)
        return EXIT_SIGNAL_BASE + result.late_signal
    if not ctx.is_main:
        return None
    try:
        recall = mqar_scores(result, config) if config.task.task == "mqar" else None
        scores = ({split: {str(config.model.seq_len): recall[split]["bits"]} for split in EVAL_SPLITS} if recall
                  else whole_split_scores(result, config, multiples))
    except KeyboardInterrupt:
        print(f"stopped while scoring {config.run.run_name}; its checkpoint is complete, and --resume "
              "scores it again", file=sys.stderr)
        return EXIT_INTERRUPTED
    record = make_record(name, result, config, scores, recall)
    write_atomically(config.run.run_dir / RESULT_NAME, lambda path: path.write_text(json.dumps(record, indent=1) + "\n"))
    return record


def run_grid(configs: dict[tuple[int, str], TrainConfig], grid_dir: Path, resume: bool, multiples: list[int],
             earlier: dict[tuple[int, str], TrainConfig] | None = None) -> int:
    """Train and score the runs in order (a run whose result.json is complete is kept as it is),
    rewriting the report after each; stop on Ctrl-C with the run's checkpoint saved.  The report
    also keeps the `earlier` runs (the grid's finished runs this invocation does not list) whose records
    still match."""
    records: dict[tuple[int, str], dict[str, Any]] = {
        key: record for key, config in (earlier or {}).items() if (record := saved_record(key, config, multiples))}
    # Read, and a damaged one refused, before anything trains.
    finished = {key: saved_record(key, config, multiples) for key, config in configs.items()} if resume else {}
    first = next(iter(configs.values()))
    data_dir = first.run.data_path
    with distributed(first.run.device) as ctx:
        reference = {split: reference_bpc(data_dir, split) for split in EVAL_SPLITS} if ctx.is_main and \
            first.task.task == "enwik8" else {}
        for number, ((seed, name), config) in enumerate(configs.items(), 1):
            record = finished.get((seed, name))
            if ctx.is_main:
                print(f"=== [{number}/{len(configs)}] {name} seed {seed}" + (" (done before)" if record else ""),
                      flush=True)
            if record is None:
                record = train_and_score(name, config, ctx, resume, multiples)
                if isinstance(record, int):
                    return record
            if ctx.is_main:
                records[seed, name] = record
                write_report(grid_dir, dict(sorted(records.items(), key=lambda item: item[0][0])), config, reference)
        if ctx.is_main:
            print(f"\n{(grid_dir / 'results.md').read_text()}\nwrote {grid_dir}/results.md, results.csv, val_bpc.png")
    return 0


def report_finished(configs: dict[tuple[int, str], TrainConfig], grid_dir: Path, multiples: list[int]) -> int:
    """Rewrite the report from the runs whose result.json is complete, training nothing: the tables of
    a grid that is stopped or still under way elsewhere (a copy of its run directories, say)."""
    changed = [run_dir for run_dir in (config.run.run_dir for config in configs.values())
               if (record := read_record(run_dir / RESULT_NAME)) and changed_since_scored(record, run_dir)]
    if changed:
        raise CheckpointError(f"{changed[0]}: its checkpoint changed after its result.json was written (trained on "
                              "since?), so the result is stale; run grid.py --resume to score it again")
    records = {key: record for key, config in configs.items() if (record := saved_record(key, config, multiples))}
    if not records:
        raise CheckpointError(f"{grid_dir} has no finished run of these variants and seeds (a run is finished "
                              "once its result.json holds the asked --eval-multiples): nothing to report")
    first = next(iter(configs.values()))
    reference = ({split: reference_bpc(first.run.data_path, split) for split in EVAL_SPLITS}
                 if first.task.task == "enwik8" else {})
    write_report(grid_dir, records, next(iter(configs.values())), reference)
    print(f"{len(records)} of {len(configs)} runs finished; wrote {grid_dir}/results.md, results.csv, val_bpc.png")
    return 0


def listed(text: str | None, default: list[Any], convert: type, flag: str, what: str) -> list[Any]:
    """A comma-separated flag's distinct values (default when absent); an empty item is refused
    (comma_items)."""
    if text is None:
        return default
    try:
        values = [convert(item) for item in comma_items(text)]
    except ValueError:
        values = []
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{flag} must list distinct {what} separated by commas, with no empty item, got {text!r}")
    return values


def parse_grid_flags(given: dict[str, Any], args: Any) -> tuple[dict[tuple[int, str], TrainConfig],
                                                               dict[tuple[int, str], TrainConfig], list[int], Path,
                                                               dict[str, Any]]:
    """The runs, the earlier ones to report beside them, the scoring multiples, the grid's directory, and
    the settings its marker records.  --resume and --report-only take what the grid's marker recorded
    where the flags leave it out (continued_flags); --variants and --seeds given on --resume add to it."""
    if args.report_only and args.resume:
        raise ValueError("--report-only trains nothing, so --resume does not apply: drop one of them")
    if args.seeds is not None and "seed" in given:
        raise ValueError("give either --seed or --seeds, not both")
    check_run_name(grid_name(given))   # as itself: each run's name holds it, in a message about the run
    grid_dir = Path(given.get("out_dir", field_default("out_dir"))) / grid_name(given)
    started = started_settings(grid_dir) if args.resume or args.report_only else None
    if started:
        check_resolved_unchanged(started, grid_dir)
        given = continued_flags(started["flags"], given)
    before = started or {"variants": [], "seeds": [], "eval_multiples": [1]}
    default_seeds = [given["seed"]] if "seed" in given else before["seeds"] or [0]
    seeds = listed(args.seeds, default_seeds, int, "--seeds", "integer seeds")
    multiples = sorted({1, *listed(args.eval_multiples, before["eval_multiples"], int, "--eval-multiples",
                                   "integers")})
    if any(seed < 0 for seed in seeds):
        raise ValueError(f"--seeds must be >= 0, got {args.seeds}")
    if any(multiple < 1 for multiple in multiples):
        raise ValueError(f"--eval-multiples must be >= 1, got {args.eval_multiples}")
    variants = listed(args.variants, before["variants"] or default_variants(), str, "--variants", "variant names")
    configs = run_configs(given, variants, seeds)
    every_variant = list(dict.fromkeys([*before["variants"], *variants]))
    earlier = earlier_runs(given, every_variant, grid_dir, configs) if args.resume else {}
    flags = {key: value for key, value in given.items() if key not in LOCATION | {"seed"}}
    if "data_dir" in flags:   # as a checkpoint records it: a --resume from another directory finds the same data
        flags["data_dir"] = str(Path(flags["data_dir"]).expanduser().resolve())
    settings = {"flags": flags, "resolved": resolved_settings(flags),
                "variants": every_variant,
                "seeds": sorted({*before["seeds"], *seeds}), "eval_multiples": multiples}
    return configs, earlier, multiples, grid_dir, settings


def resolved_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """Every setting the grid's flags give, its preset's values and the defaults filled in, as JSON
    holds them: what the marker records beside the flags."""
    return json.loads(json.dumps(merged_flags(flags).flat(), default=repr))


def check_resolved_unchanged(started: dict[str, Any], grid_dir: Path) -> None:
    """A grid continues with the values it started with: its recorded flags must still resolve to the
    settings its marker recorded (a preset or a default changed in the code since is refused here,
    before anything trains).  Markers from before they recorded them cannot tell.  Each marker written
    records the flags it continues with and what they resolve to (a --steps given on --resume moves
    the derived decay_steps with it)."""
    if not started.get("resolved"):
        return
    changed = config_differences(started["resolved"], resolved_settings(started["flags"]), saved_as="started with")
    if changed:
        raise ValueError(f"the grid in {grid_dir} started with other values of its preset or of the defaults "
                         f"({'; '.join(changed)}); continue it with the code it started with, or start a new "
                         "grid with another --run-name")


LOCATION = {"out_dir", "run_name"}   # where the marker is found: never taken from it
MARKER_KEYS = {"written_by", "grid", "flags", "resolved", "variants", "seeds", "eval_multiples"}


def started_settings(grid_dir: Path) -> dict[str, Any] | None:
    """The settings a grid's marker records (flags, variants, seeds, eval_multiples); None for a grid
    without them (started before markers recorded them, or no grid at all: main says so)."""
    path = grid_dir / GRID_MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is damaged ({error}); write {{}} into it and give the grid's flags again")
    unknown = sorted(set(marker) - MARKER_KEYS, key=str) if isinstance(marker, dict) else None
    if unknown is None or unknown or marker.get("written_by", "grid.py") != "grid.py":
        found = f"keys {unknown} grid.py does not write" if unknown else f"{marker!r}"[:80]
        raise CheckpointError(f"{path} is not a marker grid.py writes (it holds {found}); give the --out-dir / "
                              "--run-name of a grid, or write {} into it and give the grid's flags again")
    if "flags" not in marker:
        return None
    wrong_key = next((key for key, valid in MARKER_SHAPES.items() if not valid(marker.get(key))), None)
    if wrong_key:   # an empty list too: read as "the defaults" it would start runs the grid never listed
        raise CheckpointError(f"{path} is damaged: its {wrong_key!r} is {marker.get(wrong_key)!r}; write {{}} into it "
                              "and give the grid's flags again")
    try:   # else a wrong value (lr 'abc') reads below as a preset changed in the code
        merged_flags(marker["flags"]).check_types()
    except (ValueError, TypeError, AttributeError) as error:   # TypeError, AttributeError: a value of another kind
        raise CheckpointError(f"{path}: its flags do not load ({error}); continue the grid with the code it "
                              "started with, or write {} into it and give the grid's flags again") from None
    return marker


MARKER_SHAPES = {
    "flags": lambda value: isinstance(value, dict),
    "resolved": lambda value: value is None or isinstance(value, dict),
    "variants": lambda value: bool(value) and is_list_of(value, lambda item: isinstance(item, str) and item != ""),
    "seeds": lambda value: bool(value) and is_list_of(value, is_count),
    "eval_multiples": lambda value: bool(value) and is_list_of(value, lambda item: is_count(item) and item >= 1),
}


def continued_flags(recorded: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The flags the grid started with, and those given now: a setting that may change on --resume
    (RESUMABLE: steps, threads, device, ...) takes the new value; any other must repeat the one the
    grid started with (its flag, else its preset's or the default), and every one that contradicts it
    is named (config.contradictions, as train.py's --resume names them).  --seed picks seeds, as
    --seeds does."""
    started = {**merged_flags(recorded).flat(), "feature_map_options": recorded.get("feature_map_options", {})}
    compared = {key: value for key, value in given.items() if key not in LOCATION | {"imports", "seed"}}
    contradicting = [f"{flag}: started with {before!r}, given {now!r}"
                     for flag, before, now in contradictions(started, compared)]
    if contradicting:
        raise ValueError(f"the grid continues as it started, and these flags contradict its settings: "
                         f"{'; '.join(contradicting)}; drop them, or start a new grid with another --run-name")
    imports = list(dict.fromkeys([*recorded.get("imports", []), *given.get("imports", [])]))
    try:
        import_user_code([name for name in imports if name not in given.get("imports", [])])
    except UsageError as error:
        raise UsageError(f"the grid's recorded --import: {error}") from None
    options = started["feature_map_options"]   # the recorded ones (given ones must repeat them); none: no key
    # decay_steps stays what it resolved to at the start, as train.py's --resume keeps the recorded one: a
    # --steps given now extends the runs with their schedule (and scores a run train.py trained further).
    return {**recorded, **given, "decay_steps": started["decay_steps"],
            **({"feature_map_options": options} if options else {}), **({"imports": imports} if imports else {})}


def earlier_runs(given: dict[str, Any], variants: list[str], grid_dir: Path,
                 listed: dict[tuple[int, str], TrainConfig]) -> dict[tuple[int, str], TrainConfig]:
    """The configurations of the grid's finished runs (those with a result.json) of these variants that
    this invocation does not list: the report keeps them beside the listed ones."""
    finished = {(int(path.parent.name.removeprefix("seed-")), name) for name in variants
                for path in (grid_dir / name).glob(f"seed-*/{RESULT_NAME}")
                if path.parent.name.removeprefix("seed-").isdigit()} - set(listed)
    if not finished:   # run_configs checks the grid's flags against its runs: it needs some
        return {}
    configs = run_configs(given, variants, sorted({seed for seed, _ in finished}))
    return {key: configs[key] for key in sorted(finished)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser("Train a grid of attention variants x seeds (same data, steps) and compare "
                                   "them.  --run-name names the grid directory under --out-dir (default: "
                                   "grid-<preset>).", skip=variant_skip(),
                                   resume_help="continue the grid in <out-dir>/<run-name> with the flags, variants "
                                               "and seeds it started with (--variants / --seeds add to them): "
                                               "finished runs are kept, interrupted ones resume from their "
                                               "checkpoints")
    parser.add_argument("--variants", help="comma-separated variants (default: softmax-rope, softmax-abs and "
                                           "linear-<map>-<post|pre|none> for every registered map)")
    parser.add_argument("--seeds", help="comma-separated seeds, each trains every variant (default: --seed)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: rewrite results.md, results.csv and val_bpc.png from the finished "
                             "runs (those with a complete result.json) of the listed variants and seeds (default: "
                             "the grid's own)")
    parser.add_argument("--eval-multiples", help="score each finished run on the whole val and test splits in "
                                                 "windows of these multiples of --seq-len, e.g. 1,2,4,8 for a "
                                                 "length-extrapolation table (1 is always scored)")
    args, (configs, earlier, multiples, grid_dir, settings) = parse_config(parser, argv,
                                                                                    resolve=parse_grid_flags)
    keep_freed_memory()   # large CPU temporaries reuse freed memory instead of page-faulting

    def run() -> int:
        check_not_nested(grid_dir)
        if (args.resume or args.report_only) and not grid_dir.exists():
            flag = "--report-only reports" if args.report_only else "--resume continues"
            raise CheckpointError(f"{flag} a grid, but there is none at {grid_dir}: give the --out-dir / "
                                  "--run-name it was started with" + ("" if args.report_only else
                                                                      ", or drop --resume to start it"))
        check_grid_directory(grid_dir, args.resume or args.report_only)
        main_process = launched_rank() == 0   # the job's other ranks write nothing here
        if main_process:
            check_can_write(grid_dir)
        check_eval_windows(configs.values(), multiples)
        with DirectoryLock(grid_dir) if main_process else contextlib.nullcontext():   # each run locks its own too
            if main_process and not args.report_only:   # what a later --resume or --report-only continues
                write_atomically(grid_dir / GRID_MARKER, lambda path: path.write_text(
                    json.dumps({"written_by": "grid.py", "grid": grid_dir.name, **settings}, indent=1) + "\n"))
            if args.report_only:
                return report_finished(configs, grid_dir, multiples)
            return run_grid(configs, grid_dir, args.resume, multiples, earlier)
    return run_reporting_errors(run)


def check_grid_directory(grid_dir: Path, existing: bool) -> None:
    """A new grid starts in a directory that is absent or empty (its lock file aside), so that its
    report replaces nobody's files.  --resume and --report-only continue a directory grid.py started:
    one with its marker (GRID_MARKER), or one from before the marker laid out as grid.py lays out a
    grid (report files, and <variant>/seed-<s> run directories), which --resume then marks.  A folder
    of train.py runs is neither."""
    if not grid_dir.is_dir():
        return
    held = sorted(path.name for path in grid_dir.iterdir() if path.name != LOCK_NAME)
    if existing and not held:
        raise CheckpointError(f"{grid_dir} holds no grid (it is empty): drop --resume / --report-only to start one "
                              "there, or give the --out-dir / --run-name of the grid")
    if not existing:
        if held:
            raise CheckpointError(f"{grid_dir} already holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''}: "
                                  "pass --resume to continue the grid there, or choose another --run-name / --out-dir")
        return
    if (grid_dir / GRID_MARKER).is_file():
        return
    foreign = next((name for name in held if not grid_entry(grid_dir / name)), None)
    if foreign is None:
        return
    raise CheckpointError(f"{grid_dir} is not a grid's directory (no {GRID_MARKER} marker, and it holds {foreign}, "
                          "which grid.py does not write): give the --out-dir / --run-name the grid was started with")


def grid_entry(path: Path) -> bool:
    """Whether `path`, in a grid directory, is what grid.py writes there: its report files, or a variant's
    directory of seed-<s> run directories."""
    if path.name in REPORT_FILES:
        return path.name != "results.md" or path.read_text(errors="replace").startswith(REPORT_TITLE)
    return path.is_dir() and all(run.is_dir() and run.name.removeprefix("seed-").isdigit() for run in path.iterdir())


def check_eval_windows(configs, multiples: list[int]) -> None:
    """The longest scoring window fits the val and test splits, checked before the first run trains."""
    if max(multiples) > 1 and any(config.task.task == "mqar" for config in configs):
        raise UsageError("--eval-multiples scores enwik8 splits at longer windows; --task mqar runs are scored at "
                         "their --seq-len only: drop --eval-multiples")
    for data_path, seq_len in {(config.run.data_path, config.model.seq_len) for config in configs
                               if config.task.task == "enwik8"}:   # mqar's streams have no end
        for split in EVAL_SPLITS:
            check_window_fits(len(load_split(data_path, split).data), max(multiples) * seq_len,
                              asked=f"--eval-multiples {max(multiples)} x --seq-len {seq_len} ({split} split)",
                              fix="choose smaller multiples")
