"""Read-only loader for the byte-level enwik8 splits written by data/enwik8/prepare.py.

    data_dir = default_data_dir()                     # the repository's data/enwik8, from any working directory
    split = load_split(data_dir, "train")             # uint8 np.memmap + meta.json, validated
    print(split.description)                          # e.g. "enwik8-sample.gz (NON-CANONICAL, 4,154,064 bytes)"
    train = RandomWindows(split, batch_size=32, seq_len=1024, seed=0, rank=rank, world_size=world_size)
    x, y = next(train)                                # int64 (32, 1024) each; y is x shifted by one byte
    state = train.state_dict()                        # resume exactly with train.load_state_dict(state)
    for x, y in SequentialWindows(load_split(data_dir, "val"), batch_size=32, seq_len=1024): ...

This module never writes data: run data/enwik8/prepare.py first. `load_meta` is the one check of
meta.json, shared with `prepare.py --verify`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from linattn import is_integer

SPLITS = ("train", "val", "test")
META_NAME = "meta.json"
META_FORMAT_VERSION = 1
VOCAB_SIZE = 256
DTYPE = "uint8"
# The canonical enwik8 (prepare.py downloads it): meta.json's `canonical` is true for it alone.
ENWIK8_SIZE = 100_000_000
ENWIK8_SHA256 = "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8"

Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ValueError):
    """The prepared data is missing, incomplete or inconsistent, or a request does not fit it."""


class DataNotFoundError(DataError):
    """No prepared data where it was looked for; the message names the command that prepares it."""


def repository_data_dir() -> Path:
    """Where the repository keeps enwik8, found from this file (an editable install or a checkout)."""
    return Path(__file__).resolve().parents[1] / "data" / "enwik8"


def default_data_dir() -> Path:
    """The repository's data/enwik8, the same from any working directory."""
    directory = repository_data_dir()
    if not (directory / "prepare.py").is_file():
        raise DataNotFoundError(
            f"no data/enwik8/prepare.py beside the installed linattn_lm ({directory} does not hold it; "
            "a non-editable install?): prepare the data from a checkout of the repository and pass --data-dir DIR"
        )
    return directory


def shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it, else absolute: a runnable command."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def prepare_hint(data_dir: Path | str) -> str:
    """The command that would (re)prepare `data_dir` (prepare.py itself detects what is wrong)."""
    script = repository_data_dir() / "prepare.py"
    command = f"python {shown(script)}" if script.is_file() else "python data/enwik8/prepare.py (in the repository)"
    is_default = Path(data_dir).resolve() == script.parent
    out_dir = "" if is_default else f" --out-dir {data_dir}"
    return f"run {command}{out_dir} (offline, it uses the sample bundled with the repository)"


# ----------------------------------------------------------------------------- meta.json

# Each key of meta.json that a reader relies on, with the type it must have.
META_FIELDS = {"format_version": int, "description": str, "canonical": bool, "vocab_size": int,
               "dtype": str, "source": dict, "splits": dict, "split_boundaries": list}
SOURCE_FIELDS = {"size": int, "sha256": str, "md5": str}
SPLIT_FIELDS = {"start": int, "end": int, "size": int, "sha256": str}


def field_problem(record: Any, fields: dict[str, type], where: str) -> str | None:
    """What is missing or mistyped in `record` (a JSON object), or None."""
    if not isinstance(record, dict):
        return f"{where} is {type(record).__name__}, not an object"
    for key, kind in fields.items():
        if key not in record:
            return f"{where} lacks {key!r}"
        value = record[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{where}[{key!r}] is {value!r}, not {'an integer' if kind is int else kind.__name__}"
    return None


def meta_problem(meta: Any) -> str | None:
    """Why `meta` is not a meta.json that prepare.py wrote, or None: keys, types, the byte dtype, split
    arithmetic (splits and split_boundaries), and `canonical` against the source's sha256."""
    problem = field_problem(meta, META_FIELDS, "meta.json")
    if problem:
        return problem
    if meta["format_version"] != META_FORMAT_VERSION:
        return f"format_version is {meta['format_version']}, this loader reads {META_FORMAT_VERSION}"
    if meta["vocab_size"] != VOCAB_SIZE:
        return f"vocab_size is {meta['vocab_size']}, byte-level data has {VOCAB_SIZE}"
    if meta["dtype"] != DTYPE:
        return f"dtype is {meta['dtype']!r}, the splits are {DTYPE} bytes"
    problem = field_problem(meta["source"], SOURCE_FIELDS, "source")
    for name in SPLITS:
        problem = problem or (f"splits lacks {name!r}" if name not in meta["splits"]
                              else field_problem(meta["splits"][name], SPLIT_FIELDS, f"splits[{name!r}]"))
    if problem:
        return problem
    position = 0
    for name in SPLITS:
        split = meta["splits"][name]
        if split["start"] != position or split["size"] != split["end"] - split["start"] or split["size"] < 0:
            return f"splits[{name!r}] (start {split['start']}, end {split['end']}, size {split['size']}) " \
                   f"does not continue the previous split at {position}"
        position = split["end"]
    if position != meta["source"]["size"]:
        return f"the splits end at {position}, but the source has {meta['source']['size']} bytes"
    boundaries = [0, *(meta["splits"][name]["end"] for name in SPLITS)]
    if meta["split_boundaries"] != boundaries:
        return f"split_boundaries is {meta['split_boundaries']}, the splits say {boundaries}"
    if meta["canonical"] != (meta["source"]["sha256"] == ENWIK8_SHA256):
        return (f"canonical is {meta['canonical']}, but the source's sha256 {meta['source']['sha256'][:12]}... "
                f"{'is' if meta['source']['sha256'] == ENWIK8_SHA256 else 'is not'} enwik8's")
    return None


def load_meta(data_dir: Path | str) -> dict[str, Any]:
    """meta.json of a prepared data directory, validated once here for every reader: its schema
    (`meta_problem`), then each split file's size against it."""
    path = Path(data_dir) / META_NAME
    if not path.is_file():
        if any((Path(data_dir) / f"{name}.bin").exists() for name in SPLITS):
            raise DataNotFoundError(
                f"data at {data_dir} is incompletely prepared ({path} is missing; an interrupted prepare?): "
                f"{prepare_hint(data_dir)}"
            )
        raise DataNotFoundError(f"data not found at {path}: {prepare_hint(data_dir)}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {path} ({error}): {prepare_hint(data_dir)}") from None
    except (ValueError, RecursionError) as error:   # RecursionError: nesting deeper than the parser goes
        raise DataError(f"{path} is not valid JSON ({error}; hand-edited?): {prepare_hint(data_dir)}") from None
    problem = meta_problem(meta)
    if problem:
        raise DataError(f"{path} is malformed: {problem} (hand-edited?): {prepare_hint(data_dir)}")
    for split in SPLITS:
        split_path, expected = Path(data_dir) / f"{split}.bin", meta["splits"][split]["size"]
        if not split_path.is_file():
            raise DataNotFoundError(f"data not found at {split_path}: {prepare_hint(data_dir)}")
        if split_path.stat().st_size != expected:
            raise DataError(f"{split_path} is {split_path.stat().st_size:,} bytes but {path} says {expected:,}: "
                            f"{prepare_hint(data_dir)}")
    return meta


@dataclass(frozen=True, eq=False)
class ByteSplit:
    """One split as a read-only uint8 memmap, plus the dataset's meta.json."""

    name: str
    path: Path
    data: np.ndarray
    meta: dict[str, Any]

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"ByteSplit({self.name!r}, {len(self):,} bytes of {self.description})"

    @property
    def description(self) -> str:
        return str(self.meta["description"])

    @property
    def canonical(self) -> bool:
        return bool(self.meta["canonical"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def load_split(data_dir: Path | str, split: str) -> ByteSplit:
    """Memory-map `<data_dir>/<split>.bin`, checking its size and sha256 against meta.json: a split
    overwritten in place (zeros, another file of the same size) would train or score without a word.
    Hashing 90 MB (enwik8's training split) took 0.06 s on this project's 2-core CI machine."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise DataNotFoundError(f"data not found at {path}: {prepare_hint(data_dir)}")
    meta = load_meta(data_dir)   # the split's size checked there
    if meta["splits"][split]["size"] == 0:
        raise DataError(f"{path} is empty: {prepare_hint(data_dir)}")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if hashlib.sha256(data).hexdigest() != meta["splits"][split]["sha256"]:
        raise DataError(f"{path} does not hash to the sha256 in {Path(data_dir) / META_NAME} (changed since it was "
                        f"prepared?): {prepare_hint(data_dir)}, with --force")
    return ByteSplit(split, path, data, meta)


# ----------------------------------------------------------------------------- windows


def as_byte_array(data: ByteSplit | np.ndarray) -> np.ndarray:
    array = data.data if isinstance(data, ByteSplit) else data
    if array.ndim != 1 or array.dtype != np.uint8:
        raise ValueError(f"expected a 1-D uint8 array, got shape {array.shape} dtype {array.dtype}")
    return array


def check_window_fits(length: int, seq_len: int, *, asked: str = "", fix: str = "") -> None:
    """A window of seq_len inputs and their targets fits `length` bytes.  A command that checks its
    longest window up front, before it scores anything, names what `asked` for it and how to `fix` it."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seq_len + 1 > length:
        raise DataError(
            (f"{asked}: " if asked else "")
            + f"seq_len {seq_len:,} needs windows of {seq_len + 1:,} bytes (inputs plus the shifted target), "
            f"but the split has only {length:,} bytes; " + (fix or "pass a smaller --seq-len, or prepare more data")
        )


def gather_windows(windows: np.ndarray, starts: np.ndarray) -> Batch:
    """(x, y) int64 tensors from rows of a sliding-window view: one vectorised gather, no per-byte loop."""
    rows = windows[starts]  # (batch, seq_len + 1) uint8, copied out of the memmap
    x = np.ascontiguousarray(rows[:, :-1], dtype=np.int64)
    y = np.ascontiguousarray(rows[:, 1:], dtype=np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


class RandomWindows:
    """Endless batches of random windows: (x, y) int64 tensors of shape (batch_size, seq_len), y = x shifted by 1.

    Global batch i (batch_size * world_size windows) has start offsets drawn from
    np.random.default_rng([seed, i]); rank r takes rows [r * batch_size, (r + 1) * batch_size). So:
    - ranks draw different windows, and the global stream is the same for any world_size with the same
      batch_size * world_size (a 1-GPU run with batch 64 sees what 2 GPUs with batch 32 see together);
    - the state is just (seed, batches_drawn): resuming costs nothing and continues the stream exactly, and
      every rank's state is identical, so saving rank 0's is enough.
    Window starts are uniform over [0, len - seq_len - 1]; the same window can appear twice.
    """

    def __init__(
        self,
        data: ByteSplit | np.ndarray,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.data = as_byte_array(data)
        check_window_fits(len(self.data), seq_len)
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.batches_drawn = 0
        self._windows = sliding_window_view(self.data, seq_len + 1)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.batches_drawn)
        self.batches_drawn += 1
        return batch

    def window_starts(self, index: int) -> np.ndarray:
        """This rank's window start offsets for global batch `index`."""
        generator = np.random.default_rng([self.seed, index])
        starts = generator.integers(0, len(self._windows), size=self.batch_size * self.world_size)
        return starts[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def batch_at(self, index: int) -> Batch:
        """Batch `index` of the stream, without moving the iterator."""
        return gather_windows(self._windows, self.window_starts(index))

    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "batches_drawn": self.batches_drawn,
            "global_batch_size": self.batch_size * self.world_size,
            "seq_len": self.seq_len,
            "split_size": len(self.data),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream saved in `state`; refuses a state whose continuation would differ."""
        mine = self.state_dict()
        for key in ("global_batch_size", "seq_len", "split_size"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume: saved {key} is {state[key]:,}, this stream's is {mine[key]:,}")
        for key in ("seed", "batches_drawn"):
            if not is_integer(state[key]) or state[key] < 0:
                raise ValueError(f"saved {key} must be an integer >= 0, got {state[key]!r}")
        self.seed, self.batches_drawn = int(state["seed"]), int(state["batches_drawn"])


class SequentialWindows:
    """Non-overlapping windows covering a whole split, in order, for evaluation.

    Window k has inputs data[k*L : k*L + L] and targets data[k*L + 1 : k*L + L + 1] (L = seq_len), so the
    targets are bytes 1 .. n-1 of the split, each exactly once (byte 0 is context only): summing the loss
    over all batches and dividing by `num_targets` gives the exact per-byte loss. Nothing is dropped: full
    windows come batch_size at a time (the last such batch may have fewer rows), and when n - 1 is not a
    multiple of L the remainder is yielded last, alone, as a shorter (1, (n - 1) % L) batch.
    """

    def __init__(self, data: ByteSplit | np.ndarray, batch_size: int, seq_len: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data = as_byte_array(data)
        check_window_fits(len(self.data), seq_len)
        self.batch_size, self.seq_len = batch_size, seq_len
        self.num_targets = len(self.data) - 1
        self.num_full_windows, self.remainder = divmod(self.num_targets, seq_len)
        self._windows = sliding_window_view(self.data, seq_len + 1)

    def __len__(self) -> int:
        full_batches = -(-self.num_full_windows // self.batch_size)
        return full_batches + (1 if self.remainder else 0)

    def __iter__(self) -> Iterator[Batch]:
        for first in range(0, self.num_full_windows, self.batch_size):
            window_indices = np.arange(first, min(first + self.batch_size, self.num_full_windows))
            yield gather_windows(self._windows, window_indices * self.seq_len)
        if self.remainder:
            start = self.num_full_windows * self.seq_len
            tail = np.asarray(self.data[start : start + self.remainder + 1], dtype=np.int64)
            yield torch.from_numpy(tail[None, :-1].copy()), torch.from_numpy(tail[None, 1:].copy())
