"""The summed next-byte loss over batches, for validation during training and for eval.py."""
from __future__ import annotations

from typing import Iterable

import torch

from .device import autocast
from .lm import lm_loss


@torch.no_grad()
def summed_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device, dtype: str = "auto") -> tuple[float, int]:
    """(total next-byte loss in nats, number of predicted bytes) over (x, y) batches, in eval mode."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, dtype):
                logits = model(x)
            total += lm_loss(logits, y, reduction="sum").double()
            count += y.numel()
    finally:
        model.train(was_training)
    return total.item(), count
