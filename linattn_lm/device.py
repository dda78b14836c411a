"""Devices, precision and memory: the device and autocast dtype a run uses, and how its peak memory is
measured."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys
from pathlib import Path

import torch


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep freed memory there (Linux only).

    PyTorch's CPU allocator is plain malloc/free.  glibc hands blocks over 32 MB to mmap and gives
    them back on free, so each large temporary (67 MB for (8, 8192, 256) float32) page-faults afresh
    on every pass: measured 21 ms just to allocate and fill one.  With mmap off and no trimming,
    freed blocks are reused; the causal favor+post pass at N=8192 went from 1.20 s to 0.90 s.
    The process keeps its peak memory reserved until it exits.  Returns False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4          # mallopt parameters from <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


DEVICE_HINT = "use auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str | None) -> torch.device:
    """'auto' (or None) picks CUDA when available; cpu, cuda[:N] and mps are checked against
    this machine.  An empty name is refused: it is a mistake (an unset shell variable), not a choice."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {name!r} is not a device name; {DEVICE_HINT}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r} requested but MPS is not available; use --device cpu")
    elif device.type != "cpu" or device.index not in (None, 0):
        raise ValueError(f"device {name!r} is not supported; {DEVICE_HINT}")
    return device


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = ("auto", *PRECISIONS)   # the --dtype choices


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype of --dtype `name` on `device`.  auto: bf16 on CUDA, float32 elsewhere (on
    CPU bf16 autocast works but is slower, and it changes results)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return PRECISIONS[name]


def precision_key(dtype: str, device: torch.device) -> str:
    """--dtype `dtype` resolved on `device`, by name: fp32, bf16 or fp16."""
    resolved = resolve_dtype(dtype, device)
    return next(name for name, value in PRECISIONS.items() if value == resolved)


def autocast(device: torch.device, dtype: str = "auto") -> contextlib.AbstractContextManager:
    """Autocast to --dtype's precision (`resolve_dtype`); nothing for fp32.  The attention kernels
    compute in float32 whatever autocast says, and return the input dtype."""
    precision = resolve_dtype(dtype, device)
    if precision == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision)


def precision_name(dtype: str, device: torch.device) -> str:
    """What --dtype means on `device`, for the logs: 'fp32', 'bf16 autocast', 'fp16 autocast + loss scaling'."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + loss scaling"}
    return names[resolve_dtype(dtype, device)]


def gradient_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler:
    """A loss scaler for fp16 (its gradients underflow without one); disabled, a no-op, otherwise."""
    return torch.amp.GradScaler(device.type, enabled=resolve_dtype(dtype, device) == torch.float16)


def release_free_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim), so that the resident set is
    what is in use: after keep_freed_memory() a process keeps every earlier peak reserved, and the
    runs of a grid would each measure what the runs before them left behind."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
