"""How much weight a trained model's linear-attention queries put on the values: `python eval.py RUN
--weight-sums`.

With the denominator, a query's output is sum_n w_mn v_n.  With `pre` and `none` the weights sum to
1 (a weighted mean of values); Eq. 19 (`post`) rotates the numerator's features and not the
denominator's, so the sum drifts from 1 as keys further back contribute.  The study tests whether
that drift is why `post` trains worse: this measures it, per layer and by query position, on the
windows eval.py scores (LinearAttention.weight_sums on each block's input).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

import linattn
from .data import SequentialWindows
from .lm import ByteLM
from .device import autocast

OFF_BY = 0.1                                # a query counts as off when |sum - 1| exceeds this
POSITION_EDGES = (0, 1, 16, 64, 256, 1024, 4096, 16384, 65536)   # buckets of query positions


def linear_blocks(model: ByteLM) -> list[linattn.LinearAttention]:
    blocks = [module for module in model.modules() if isinstance(module, linattn.LinearAttention)]
    if not blocks:
        raise ValueError(f"{model.config.variant} has no linear-attention layer: softmax weights sum to 1 by "
                         "construction, so --weight-sums applies to linear variants only")
    return blocks


@contextlib.contextmanager
def recorded_sums(blocks: list[linattn.LinearAttention]) -> Iterator[list[list[torch.Tensor]]]:
    """While open, each block's forward also records sum_n w_mn of its input, (B, H, N) per call."""
    sums: list[list[torch.Tensor]] = [[] for _ in blocks]

    def recorder(layer: int):
        def hook(block, args, kwargs):
            sums[layer].append(block.weight_sums(args[0], offset=kwargs.get("offset", 0)).float().cpu())
        return hook

    handles = [block.register_forward_pre_hook(recorder(layer), with_kwargs=True) for layer, block in enumerate(blocks)]
    try:
        yield sums
    finally:
        for handle in handles:
            handle.remove()


def weight_sum_rows(model: ByteLM, data: np.ndarray, seq_len: int, batch_size: int, device: torch.device,
                    dtype: str = "auto") -> list[dict[str, float]]:
    """Per layer: mean, std, 1st and 99th percentile of sum_n w_mn over every query of every head in
    the windows of `data`, the share off by more than OFF_BY, and the mean per position bucket."""
    blocks = linear_blocks(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), recorded_sums(blocks) as sums:
            for x, _ in SequentialWindows(data, batch_size, seq_len):
                with autocast(device, dtype):
                    model(x.to(device))
    finally:
        model.train(was_training)
    return [layer_row(calls, seq_len) for calls in sums]


def layer_row(calls: list[torch.Tensor], seq_len: int) -> dict[str, float]:
    values = torch.cat([call.flatten() for call in calls]).double()
    positions = torch.cat([torch.arange(call.shape[-1]).expand_as(call).flatten() for call in calls])
    row = {"mean": values.mean().item(), "std": values.std().item() if values.numel() > 1 else 0.0,
           "p1": percentile(values, 0.01), "p99": percentile(values, 0.99),
           "off": (values - 1).abs().gt(OFF_BY).double().mean().item()}
    for low, high in position_buckets(seq_len):
        inside = (positions >= low) & (positions < high)
        row[bucket_name(low, high)] = values[inside].mean().item() if inside.any() else float("nan")
    return row


def percentile(values: torch.Tensor, q: float) -> float:
    # torch.quantile takes at most 2**24 values: sort instead
    ordered = values.sort().values
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)].item()


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    edges = [edge for edge in POSITION_EDGES if edge < seq_len] + [seq_len]
    return list(zip(edges[:-1], edges[1:]))


def bucket_name(low: int, high: int) -> str:
    return f"{low}" if high == low + 1 else f"{low}-{high - 1}"


def format_rows(rows: list[dict[str, float]], seq_len: int, normalization: str) -> str:
    buckets = [bucket_name(low, high) for low, high in position_buckets(seq_len)]
    header = f"{'layer':>5}  {'mean':>7}  {'std':>7}  {'p1':>7}  {'p99':>7}  {'off>10%':>7}  " \
             + "  ".join(f"{name:>8}" for name in buckets)
    lines = [f"sum of attention weights per query at seq_len {seq_len} (1 for pre and none); mean by query position "
             "on the right", header]
    if normalization == "rmsnorm":
        lines.insert(1, "(this run has normalization=rmsnorm: it rescales each output to unit RMS instead of "
                        "dividing by the denominator, so these are the weights the denominator would give, "
                        "not ones it applies)")
    for layer, row in enumerate(rows):
        lines.append(f"{layer:>5}  {row['mean']:>7.4f}  {row['std']:>7.4f}  {row['p1']:>7.4f}  {row['p99']:>7.4f}  "
                     f"{row['off']:>7.1%}  " + "  ".join(f"{row[name]:>8.4f}" for name in buckets))
    return "\n".join(lines)
