"""Reference lines: smoothed byte n-gram count models, the bpc a model must beat to be using context.

    lines = reference_bpc(data_dir, "val")      # {0: 5.05, 1: 3.95, 2: 3.31, ...}, cached in <data_dir>/ngram.json
    print(format_reference(lines))

The order-k model predicts each byte from the k bytes before it with additive smoothing,
p(b | c) = (n(c, b) + alpha) / (n(c) + 256 alpha), counts taken on train.bin.  alpha is chosen per
order on train alone, by leave-one-out likelihood over ALPHAS (each train byte scored by the counts
of all the others), so the scored split plays no part in any choice.  Like eval.py, the split's
bytes 1 .. n-1 are scored; byte i < k has only i bytes before it and is scored by the order-i model.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .data import VOCAB_SIZE, load_split
from .files import write_atomically

MAX_ORDER = 4
ALPHAS = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003, 0.001)
CACHE_NAME = "ngram.json"
CACHE_VERSION = 1


def joint_ids(data: np.ndarray, order: int) -> np.ndarray:
    """For positions order .. n-1: the k bytes before each and the byte itself, packed as base-256 int64."""
    count = max(0, len(data) - order)
    ids = np.zeros(count, dtype=np.int64)
    for offset in range(order + 1):
        ids = ids * VOCAB_SIZE + data[offset : offset + count]
    return ids


def leave_one_out_alpha(joint_counts: np.ndarray, context_counts: np.ndarray) -> float:
    """The alpha in ALPHAS under which train predicts itself best, each byte left out of its own counts."""
    def log_likelihood(alpha: float) -> float:
        return float(np.sum(joint_counts * np.log(
            (joint_counts - 1 + alpha) / (context_counts - 1 + VOCAB_SIZE * alpha))))
    return max(ALPHAS, key=log_likelihood)


def order_log2_probs(train: np.ndarray, data: np.ndarray, order: int) -> tuple[np.ndarray, float]:
    """(log2 p of data[order:], alpha) under the order-`order` model counted on `train`."""
    joints, joint_counts = np.unique(joint_ids(train, order), return_counts=True)
    contexts, inverse = np.unique(joints // VOCAB_SIZE, return_inverse=True)
    context_counts = np.bincount(inverse, weights=joint_counts)
    alpha = leave_one_out_alpha(joint_counts, context_counts[inverse])
    queries = joint_ids(data, order)
    return np.log2((lookup(joints, joint_counts, queries) + alpha)
                   / (lookup(contexts, context_counts, queries // VOCAB_SIZE) + VOCAB_SIZE * alpha)), alpha


def lookup(keys: np.ndarray, counts: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """counts[keys == query] for each query, 0 where the key was never seen (keys sorted)."""
    where = np.minimum(np.searchsorted(keys, queries), len(keys) - 1)
    return np.where(keys[where] == queries, counts[where], 0)


def ngram_bpc(train: np.ndarray, data: np.ndarray, max_order: int = MAX_ORDER) -> dict[int, dict[str, float]]:
    """{order: {"bpc", "alpha"}} for orders 0 .. max_order, scoring data[1:] (see the module docstring)."""
    if len(data) < 2 or len(train) <= max_order:
        raise ValueError(f"n-gram lines need a split of 2+ bytes and train longer than {max_order} bytes")
    log2_probs, alphas = zip(*(order_log2_probs(train, data, order) for order in range(max_order + 1)))
    lines = {}
    for order in range(max_order + 1):
        first = [log2_probs[i][0] for i in range(1, min(order, len(data)))]   # byte i from its i bytes
        total = np.sum(log2_probs[order][max(0, 1 - order):]) + np.sum(first)
        lines[order] = {"bpc": float(-total / (len(data) - 1)), "alpha": alphas[order]}
    return lines


def reference_bpc(data_dir: Path | str, split: str, max_order: int = MAX_ORDER,
                  max_bytes: int | None = None) -> dict[int, float]:
    """{order: bpc} on `split` (its first max_bytes bytes), from <data_dir>/ngram.json when computed before."""
    scored, train = load_split(data_dir, split), load_split(data_dir, "train")
    data = np.asarray(scored.data[:max_bytes] if max_bytes else scored.data)
    key = (f"v{CACHE_VERSION} train {scored.meta['splits']['train']['sha256']} {split} "
           f"{scored.meta['splits'][split]['sha256']} bytes {len(data)} orders 0-{max_order}")
    path = Path(data_dir) / CACHE_NAME
    cache = read_cache(path)
    if not valid_entry(cache.get(key), max_order):
        cache[key] = {str(k): v for k, v in ngram_bpc(np.asarray(train.data), data, max_order).items()}
        try:
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(cache, indent=1) + "\n"))
        except OSError:
            pass   # a read-only data directory: the lines are still right, only not kept
    return {order: cache[key][str(order)]["bpc"] for order in range(max_order + 1)}


def read_cache(path: Path) -> dict:
    """The cache, or {} when absent or unreadable: it is recomputed then."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):   # RecursionError: nesting deeper than the parser goes
        return {}
    return cache if isinstance(cache, dict) else {}


def valid_entry(entry: object, max_order: int) -> bool:
    """A cached entry as reference_bpc writes it (a hand-edited or damaged one is recomputed)."""
    return isinstance(entry, dict) and sorted(entry) == sorted(str(k) for k in range(max_order + 1)) and all(
        isinstance(line, dict) and isinstance(line.get("bpc"), float) for line in entry.values())


def format_reference(lines: dict[int, float]) -> str:
    return "n-gram reference (bpc): " + ", ".join(f"order {k} {bpc:.4f}" for k, bpc in lines.items())
