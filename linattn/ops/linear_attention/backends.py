"""What this machine offers linear attention: whether flash-linear-attention is installed, and whether
the C++ kernel builds here.  dispatch.py chooses from these."""
from __future__ import annotations

import importlib.util
import warnings

import torch

from . import cpp_logspace


def fla_installed() -> bool:
    """flash-linear-attention (fla-core), whose chunk kernels the fla backend calls (CUDA only)."""
    return importlib.util.find_spec("fla") is not None


def triton_installed() -> bool:
    """triton, in which fla's kernels and the route's own (factor_kernels.py, ops/pointwise) are written."""
    return importlib.util.find_spec("triton") is not None


_warned = False


@torch.compiler.disable   # loading the kernel takes a lock, which dynamo does not trace
def cpp_unavailable() -> str | None:
    """Why the C++ kernel cannot run here, or None (it is built on the first call)."""
    return cpp_logspace.unavailable()


def cpp_runs_here() -> bool:
    """Whether the C++ kernel builds and loads here; "auto" otherwise takes "torch" and says why, once
    per process."""
    global _warned
    reason = cpp_unavailable()
    if reason is not None and not _warned:
        _warned = True
        warnings.warn(f"linattn: the cpp backend is unavailable, so CPU tensors take the slower torch backend: "
                      f"{reason}", RuntimeWarning, stacklevel=3)
    return reason is None
