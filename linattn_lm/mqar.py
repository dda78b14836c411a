"""Multi-query associative recall (MQAR; Arora et al. 2023, Zoology), the recall task of `train.py --task mqar`.

A sequence opens with D key-value pairs (k_1 v_1 ... k_D v_D), keys drawn without replacement from
[1, V/2) and values from [V/2, V); each key is then queried once, later in the sequence: the model
sees k_i again and must predict v_i.  As in Zoology, the queries sit at gaps drawn with probability
proportional to g^(a-1) (a = 0.01: mostly soon after the pairs), and only the query positions are scored
(loss and accuracy): the rest carry the ignored target.  Every other position holds the filler: a random
token of the whole vocabulary (`random`, the default of Zoology's generator: a filler may repeat a key,
which makes the task harder) or token 0, never a key (`zeros`, what Zoology's published configurations set).
The data is a function of the seed: batch i of a stream is drawn from np.random.default_rng([seed,
stream, i]), so resuming costs nothing and every variant with a seed sees the same sequences.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

from .lm import bits_per_byte, lm_loss
from .process import Distributed
from .scoring import summed_over_batches
from .settings import TrainConfig

POWER_A = 0.01   # Zoology's default exponent of the query gaps' power law
IGNORED = -100   # the target of a position that is no query (F.cross_entropy's ignore_index)
STREAMS = {"train": 0, "val": 1, "test": 2}


def describe(vocab_size: int, seq_len: int, kv_pairs: int, filler: str) -> str:
    filled = "" if filler == "random" else f", {filler} between"
    return f"MQAR (synthetic): {kv_pairs} key-value pairs, vocab {vocab_size}, {seq_len} tokens{filled}"


def draw_batch(rng: np.random.Generator, rows: int, vocab_size: int, seq_len: int,
               kv_pairs: int, filler: str = "random") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 (rows, seq_len): the sequences and their targets, IGNORED except at the queries."""
    half, context = vocab_size // 2, 2 * kv_pairs
    keys = 1 + rng.random((rows, half - 1)).argsort(axis=1)[:, :kv_pairs]        # without replacement
    values = half + rng.random((rows, vocab_size - half)).argsort(axis=1)[:, :kv_pairs]
    space = (seq_len - context) // 2                                              # query slots
    log_p = (POWER_A - 1) * np.log(np.arange(1, space + 1))
    gumbel = -np.log(-np.log(rng.random((rows, space))))
    slots = np.argsort(-(log_p + gumbel), axis=1)[:, :kv_pairs]   # Gumbel top-k: weighted, without replacement
    # drawn last, so that both fillers give the same pairs and queries
    tokens = rng.integers(0, vocab_size, (rows, seq_len)) if filler == "random" else np.zeros((rows, seq_len), np.int64)
    tokens[:, 0:context:2], tokens[:, 1:context:2] = keys, values
    queries = context + 2 * slots
    np.put_along_axis(tokens, queries, keys, axis=1)
    targets = np.full((rows, seq_len), IGNORED)
    np.put_along_axis(targets, queries, values, axis=1)
    return torch.from_numpy(tokens), torch.from_numpy(targets)


POSITION_ONLY_TOKENS = 1_600_000   # tokens drawn to count position_only_accuracy (50,000 rows at seq_len 32)


def position_only_accuracy(vocab_size: int, seq_len: int, kv_pairs: int) -> float:
    """The accuracy of answering every query by its position alone, never by its key: the value of the
    pair that a query slot most often asks for.  Above 1/kv_pairs, since the gaps' power law gives the
    first slots to the first pairs (Gumbel top-k, as Zoology's draw does); a model must beat it to show
    recall.  Each slot's pair is chosen on one fixed draw of POSITION_ONLY_TOKENS tokens (at least 1,000
    rows) and scored on another, so that the choice is not fitted to the draw it is scored on."""
    rows = max(1_000, POSITION_ONLY_TOKENS // seq_len)
    chosen = slot_pair_counts(np.random.default_rng(0), rows, vocab_size, seq_len, kv_pairs).argmax(axis=1)
    scored = slot_pair_counts(np.random.default_rng(1), rows, vocab_size, seq_len, kv_pairs)
    return float(scored[np.arange(seq_len), chosen].sum() / scored.sum())


def slot_pair_counts(rng: np.random.Generator, rows: int, vocab_size: int, seq_len: int, kv_pairs: int) -> np.ndarray:
    """(seq_len, kv_pairs): how often the query at each position asks for each pair, over `rows` sequences."""
    x, y = (t.numpy() for t in draw_batch(rng, rows, vocab_size, seq_len, kv_pairs))
    row, position = np.nonzero(y != IGNORED)
    pair = (x[row, position][:, None] == x[row, 0:2 * kv_pairs:2]).argmax(axis=1)   # which pair it asks for
    counts = np.zeros((seq_len, kv_pairs))
    np.add.at(counts, (position, pair), 1)
    return counts


class MqarBatches:
    """Endless MQAR batches of one stream (train, val, test), drawn as RandomWindows draws windows:
    global batch i from np.random.default_rng([seed, stream, i]), rank r taking its rows; the state
    is (seed, batches_drawn)."""

    def __init__(self, vocab_size: int, seq_len: int, kv_pairs: int, batch_size: int, *, seed: int,
                 stream: str, filler: str, rank: int = 0, world_size: int = 1) -> None:
        self.vocab_size, self.seq_len, self.kv_pairs, self.batch_size = vocab_size, seq_len, kv_pairs, batch_size
        self.filler = filler   # not in state_dict: the run's config holds it, and --resume checks it there
        self.seed, self.stream, self.rank, self.world_size = seed, STREAMS[stream], rank, world_size
        self.batches_drawn = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.batches_drawn)
        self.batches_drawn += 1
        return batch

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch `index` of the stream (this rank's rows), without moving the iterator."""
        rng = np.random.default_rng([self.seed, self.stream, index])
        x, y = draw_batch(rng, self.batch_size * self.world_size, self.vocab_size, self.seq_len, self.kv_pairs,
                          self.filler)
        rows = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        return x[rows], y[rows]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "batches_drawn": self.batches_drawn, "stream": self.stream,
                "global_batch_size": self.batch_size * self.world_size, "seq_len": self.seq_len,
                "vocab_size": self.vocab_size, "kv_pairs": self.kv_pairs}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the stream saved in `state`; refuses a state of another stream or task."""
        mine = self.state_dict()
        for key in ("stream", "global_batch_size", "seq_len", "vocab_size", "kv_pairs", "seed"):
            if state[key] != mine[key]:
                raise ValueError(f"cannot resume: saved {key} is {state[key]}, this stream's is {mine[key]}")
        if not isinstance(state["batches_drawn"], int) or state["batches_drawn"] < 0:
            raise ValueError(f"saved batches_drawn must be an integer >= 0, got {state['batches_drawn']!r}")
        self.batches_drawn = state["batches_drawn"]


def query_scores(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 dtype: str = "auto") -> tuple[float, int, int]:
    """(loss in nats summed over the query positions, queries answered right by the most likely
    token, query positions) over (x, y) batches, in eval mode."""
    def measure(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        queries = y != IGNORED   # the ignored targets add nothing to the loss
        return (lm_loss(logits, y, reduction="sum").double(), (logits.argmax(dim=-1) == y)[queries].sum(),
                queries.sum())
    zero = torch.zeros((), dtype=torch.int64, device=device)
    nats, correct, count = summed_over_batches(model, batches, device, dtype, measure,
                                               (torch.zeros((), dtype=torch.float64, device=device), zero, zero))
    return nats.item(), int(correct.item()), int(count.item())


HELD_OUT_BATCHES = 64   # batches of each held-out stream a finished run is scored on (grid.py)


def held_out_scores(model: torch.nn.Module, vocab_size: int, seq_len: int, kv_pairs: int, filler: str,
                    batch_size: int, seed: int, device: torch.device,
                    dtype: str = "auto") -> dict[str, dict[str, float]]:
    """A finished run's scores on the first HELD_OUT_BATCHES batches of its val and test streams:
    split -> {bits: per query, accuracy: at the queries}, the whole-split scores of the task."""
    scores = {}
    for split in ("val", "test"):
        stream = MqarBatches(vocab_size, seq_len, kv_pairs, batch_size, seed=seed, stream=split, filler=filler)
        nats, correct, count = query_scores(model, (stream.batch_at(i) for i in range(HELD_OUT_BATCHES)), device,
                                            dtype)
        scores[split] = {"bits": nats / count / np.log(2), "accuracy": correct / count}
    return scores


def held_out_lines(scores: dict[str, dict[str, float]]) -> list[str]:
    """`held_out_scores` as lines of text, one per split (eval.py and grid.py print them)."""
    return [f"{split}: accuracy {score['accuracy']:.1%} at the queries, {score['bits']:.4f} bits per query "
            f"({HELD_OUT_BATCHES} held-out batches)" for split, score in scores.items()]


def evaluate_queries(model: torch.nn.Module, batches: MqarBatches, config: TrainConfig, ctx: Distributed,
                     dtype: str, first_batch: int = 0) -> tuple[float, float]:
    """--task mqar's estimate, as `evaluate`'s: (bits per query, accuracy) at the query positions."""
    stream = (batches.batch_at(first_batch + i) for i in range(config.log.eval_iters))
    totals = ctx.sum(torch.tensor(query_scores(model, stream, ctx.device, dtype), dtype=torch.float64,
                                  device=ctx.device))
    nats, correct, count = totals.tolist()
    return bits_per_byte(nats / count), correct / count

