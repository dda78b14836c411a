"""Machine checks before a run starts: the memory an estimate needs, and kernels for the device."""
from __future__ import annotations

from typing import Any

import torch

import linattn


def check_memory(needed: int, what: str, device: torch.device | None = None) -> None:
    """Refuse before allocating when an estimate is beyond the device's memory (the library's
    `device_memory`: a CUDA GPU's, the machine's physical memory on CPU; unknown elsewhere, not checked)."""
    available = linattn.device_memory(device if device is not None else torch.device("cpu"))
    if available is not None and needed > available:
        raise ValueError(f"{what} would need about {needed / 2**30:,.1f} GiB, more than the "
                         f"{available / 2**30:,.1f} GiB this machine has; choose smaller sizes")


def check_backend_runs_on(model: Any, device: torch.device) -> None:
    """The attention kernels asked for exist for the device (each error says what to do instead)."""
    log_space = model.attention == "linear" and linattn.feature_map_class(model.feature_map).log_space
    linattn.resolve_backend(model.block_backend, device, attention=model.attention, log_space=log_space)

