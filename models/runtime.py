"""Device, precision, memory and loss-summing helpers shared by train.py, grid.py and eval.py."""
from __future__ import annotations

import contextlib
import resource
import sys
from pathlib import Path
from typing import Iterable

import torch

from .lm import lm_loss


def resolve_device(name: str | None) -> torch.device:
    """'auto' (or None) picks CUDA when available; anything else is passed to torch.device."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; full float32 on CPU (CPU bf16 is slow and changes results)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Writing 5 to clear_refs resets this process's VmHWM (Linux), so each grid variant gets its own peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: the process's peak resident set (VmHWM, else ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024   # bytes on macOS, KiB on Linux


@torch.no_grad()
def summed_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device) -> tuple[float, int]:
    """(total next-byte loss in nats, number of predicted bytes) over (x, y) batches, in eval mode."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device):
                logits = model(x)
            total += lm_loss(logits, y, reduction="sum").double()
            count += y.numel()
    finally:
        model.train(was_training)
    return total.item(), count


def decode_bytes(ids: torch.Tensor) -> str:
    """Byte ids -> text; invalid UTF-8 (a sample cut mid-character) shows as U+FFFD."""
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
