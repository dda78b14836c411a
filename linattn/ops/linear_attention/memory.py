"""Sizes that cannot fit: a call whose tensors would exceed the device's memory is refused before
anything is allocated (an expanded view of a few numbers can stand for 2^40 tokens)."""
from __future__ import annotations

import os

import torch


def device_memory(device: torch.device) -> int | None:
    """The device's total memory in bytes (CPU: physical RAM, CUDA: the GPU's), None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, RuntimeError, ValueError):
        pass
    return None


def check_fits(what: str, needed: int, device: torch.device, fix: str) -> None:
    """A one-line ValueError if `needed` bytes exceed the device's memory.  Not while torch.compile
    traces (the eager call checked the same sizes, and the device query is no graph op)."""
    if torch.compiler.is_compiling():
        return
    memory = device_memory(device)
    if memory is not None and needed > memory:
        raise ValueError(f"{what} needs {needed / 2**30:,.0f} GiB, more than the {memory / 2**30:,.0f} GiB of "
                         f"memory of this {device.type} device; {fix}")
