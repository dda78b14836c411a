"""Read-only loader for the byte-level enwik8 splits written by data/enwik8/prepare.py.

    split = load_split("data/enwik8", "train")      # uint8 np.memmap + meta.json, sizes validated
    print(split.description)                          # e.g. "enwik8-head.gz (NON-CANONICAL, 4,154,064 bytes)"
    train = RandomWindows(split, batch_size=32, seq_len=1024, seed=0, rank=rank, world_size=world_size)
    x, y = next(train)                                # int64 (32, 1024) each; y is x shifted by one byte
    state = train.state_dict()                        # resume exactly with train.load_state_dict(state)
    for x, y in SequentialWindows(load_split("data/enwik8", "val"), batch_size=32, seq_len=1024): ...

This module never writes data: run data/enwik8/prepare.py (or call its prepare()) first.
`python -m linattn.data` describes the prepared data; `--bench` measures RandomWindows throughput.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

SPLITS = ("train", "val", "test")
META_NAME = "meta.json"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = REPO_ROOT / "data" / "enwik8"
PREPARE_COMMAND = "python data/enwik8/prepare.py"
OFFLINE_PREPARE_COMMAND = "python data/enwik8/prepare.py --source ../shared/data/enwik8-head.gz --allow-noncanonical"

Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ValueError):
    """The prepared data is missing, incomplete or inconsistent, or a request does not fit it."""


class DataNotFoundError(DataError):
    """No prepared data where it was looked for; the message names the command that prepares it."""


def prepare_hint(data_dir: Path | str) -> str:
    """The command(s) that would (re)prepare `data_dir` (prepare.py itself detects what is wrong)."""
    is_default = Path(data_dir).resolve() == DEFAULT_DATA_DIR
    out_dir = "" if is_default else f" --out-dir {data_dir}"
    return f"run {PREPARE_COMMAND}{out_dir} (or {OFFLINE_PREPARE_COMMAND}{out_dir} offline)"


# ----------------------------------------------------------------------------- prepared splits


def load_meta(data_dir: Path | str = DEFAULT_DATA_DIR) -> dict[str, Any]:
    """meta.json of a prepared data directory."""
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
    except (OSError, ValueError) as error:
        raise DataError(f"unreadable {path} ({error}): {prepare_hint(data_dir)}") from None
    required = ("splits", "description", "canonical", "vocab_size")
    missing = [key for key in required if key not in meta] if isinstance(meta, dict) else list(required)
    if missing:
        raise DataError(f"{path} lacks {', '.join(missing)}: {prepare_hint(data_dir)}")
    return meta


def describe_data(data_dir: Path | str = DEFAULT_DATA_DIR) -> str:
    """Human-readable description of the prepared data, for training logs and eval reports."""
    return str(load_meta(data_dir)["description"])


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


def load_split(data_dir: Path | str = DEFAULT_DATA_DIR, split: str = "train") -> ByteSplit:
    """Memory-map `<data_dir>/<split>.bin`, checking its size against meta.json."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    path = Path(data_dir) / f"{split}.bin"
    if not path.is_file():
        raise DataNotFoundError(f"data not found at {path}: {prepare_hint(data_dir)}")
    meta = load_meta(data_dir)
    expected_size = int(meta["splits"][split]["size"])
    actual_size = path.stat().st_size
    if actual_size != expected_size:
        raise DataError(
            f"{path} is {actual_size:,} bytes but {Path(data_dir) / META_NAME} says {expected_size:,}: "
            f"{prepare_hint(data_dir)}"
        )
    if actual_size == 0:
        raise DataError(f"{path} is empty: {prepare_hint(data_dir)}")
    return ByteSplit(split, path, np.memmap(path, dtype=np.uint8, mode="r"), meta)


# ----------------------------------------------------------------------------- windows


def as_byte_array(data: ByteSplit | np.ndarray) -> np.ndarray:
    array = data.data if isinstance(data, ByteSplit) else data
    if array.ndim != 1 or array.dtype != np.uint8:
        raise ValueError(f"expected a 1-D uint8 array, got shape {array.shape} dtype {array.dtype}")
    return array


def check_window_fits(length: int, seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if seq_len + 1 > length:
        raise DataError(
            f"seq_len {seq_len:,} needs windows of {seq_len + 1:,} bytes (inputs plus the shifted target), "
            f"but the split has only {length:,} bytes"
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
        self.seed = int(state["seed"])
        self.batches_drawn = int(state["batches_drawn"])


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


# ----------------------------------------------------------------------------- CLI


def benchmark(split: ByteSplit, batch_size: int, seq_len: int, seconds: float) -> float:
    """RandomWindows throughput in windows per second (after a short warm-up that pages the data in)."""
    windows = RandomWindows(split, batch_size, seq_len, seed=0)
    for _ in range(20):
        next(windows)
    batches, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        next(windows)
        batches += 1
    return batches * batch_size / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Describe the prepared enwik8 data, or benchmark the loader.")
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                        help="prepared data directory (default: %(default)s)")
    parser.add_argument("--bench", action="store_true", help="measure RandomWindows throughput on a split")
    parser.add_argument("--split", choices=SPLITS, default="train", help="split to benchmark (default: train)")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per batch (default: 32)")
    parser.add_argument("--seq-len", type=int, default=1024, help="bytes per window (default: 1024)")
    parser.add_argument("--seconds", type=float, default=3.0, help="benchmark duration (default: 3)")
    args = parser.parse_args(argv)
    try:
        splits = {name: load_split(args.data_dir, name) for name in SPLITS}
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"data: {splits['train'].description} in {args.data_dir}")
    for name, split in splits.items():
        print(f"  {name:<5} {len(split):>12,} bytes")
    if args.bench:
        rate = benchmark(splits[args.split], args.batch_size, args.seq_len, args.seconds)
        mib_per_s = rate * args.seq_len / 2**20
        print(f"RandomWindows on {args.split}, batch {args.batch_size} x {args.seq_len} bytes: "
              f"{rate:,.0f} windows/s ({rate / args.batch_size:,.0f} batches/s, {mib_per_s:,.0f} MiB/s of input)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
