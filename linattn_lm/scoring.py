"""The summed next-byte loss over batches, for validation during training and for eval.py."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .data import RandomWindows
from .device import autocast
from .lm import bits_per_byte, lm_loss
from .process import Distributed
from .settings import TrainConfig


@torch.no_grad()
def summed_over_batches(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        device: torch.device, dtype: str, measure: Callable, start: tuple) -> list:
    """The sums, from `start`, of measure(logits, y) (a tuple) over (x, y) batches, in eval mode."""
    was_training = model.training
    model.eval()
    totals = list(start)
    try:
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, dtype):
                logits = model(x)
            totals = [total + value for total, value in zip(totals, measure(logits, y))]
    finally:
        model.train(was_training)
    return totals


def summed_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device, dtype: str = "auto") -> tuple[float, int]:
    """(total next-byte loss in nats, number of predicted bytes) over (x, y) batches, in eval mode."""
    total, count = summed_over_batches(
        model, batches, device, dtype, lambda logits, y: (lm_loss(logits, y, reduction="sum").double(), y.numel()),
        (torch.zeros((), dtype=torch.float64, device=device), 0))
    return total.item(), count


# The train-split estimate reads batches of the training stream from this index on, which training
# never reaches: fixed windows, the same at every evaluation and on resume, that no step trained on
# as a batch (a window can still overlap ones trained on: that is what passes over the split mean).
TRAIN_ESTIMATE_FIRST_BATCH = 2 ** 40


def evaluate(model: torch.nn.Module, windows: RandomWindows, config: TrainConfig, ctx: Distributed, dtype: str,
             first_batch: int = 0) -> float:
    """bpc on eval_iters fixed batches (from `first_batch` on) in precision `dtype`: the same windows
    at every evaluation and, with the same seed, for every variant.  Each rank takes its share; the
    sums are combined."""
    batches = (windows.batch_at(first_batch + i) for i in range(config.log.eval_iters))
    nats, count = summed_loss(model, batches, ctx.device, dtype)
    totals = ctx.sum(torch.tensor([nats, count], dtype=torch.float64, device=ctx.device))
    return bits_per_byte((totals[0] / totals[1]).item())
