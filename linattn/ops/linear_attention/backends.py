"""What hardware this machine offers linear attention: whether triton is installed (and runs in its
CPU interpreter), whether flash-linear-attention is, and whether the C++ kernel builds here.  dispatch.py chooses from these."""
from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from . import cpp


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def fla_installed() -> bool:
    """flash-linear-attention (fla-core), whose chunk kernels the fla backend calls (CUDA only)."""
    return importlib.util.find_spec("fla") is not None


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors; it must be switched on before the kernel
    module is imported, because @triton.jit reads the variable when it decorates.  Read the way
    triton reads it (TRITON_INTERPRET=false or 2 is off there), so that the two never disagree."""
    if "TRITON_INTERPRET" not in os.environ or not triton_installed():
        return False
    import triton
    return bool(triton.knobs.runtime.interpret)


_warned = False


@torch.compiler.disable   # loading the kernel takes a lock, which dynamo does not trace
def cpp_unavailable() -> str | None:
    """Why the C++ kernel cannot run here, or None (it is built on the first call)."""
    return cpp.unavailable()


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
