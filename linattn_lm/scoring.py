"""The summed next-byte loss over batches, for validation during training and for eval.py."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .device import autocast
from .lm import lm_loss


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
