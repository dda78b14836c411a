"""Choosing the backend of a linear-attention call: "torch", "triton", "cpp" or "auto"."""
from __future__ import annotations

import importlib.util
import os
import warnings

import torch

BACKENDS = ("auto", "torch", "triton", "cpp")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Triton's interpreter runs kernels on CPU tensors; it must be switched on before the kernel
    module is imported, because @triton.jit reads the variable when it decorates.  Read the way
    triton reads it (TRITON_INTERPRET=false or 2 is off there), so that the two never disagree."""
    if "TRITON_INTERPRET" not in os.environ or not triton_installed():
        return False
    import triton
    return bool(triton.knobs.runtime.interpret)


def resolve(backend: str, device: torch.device, float64: bool = False, cpp_kernel_runs: bool = True) -> str:
    """The backend that runs on `device` (for float64 inputs if `float64`: "auto" then takes torch
    rather than triton, whose kernels compute in float32), or a ValueError that says how to get the one
    asked for.  `cpp_kernel_runs`: the call is one the C++ kernel computes (log-space, causal); for
    others "auto" takes torch on CPU without building the kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cuda" and triton_installed() and not float64:
            return "triton"
        return "cpp" if device.type == "cpu" and cpp_kernel_runs and cpp_runs_here() else "torch"
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"backend='cpp' runs on CPU tensors, got tensors on {device}; use backend='auto' "
                             "(triton on CUDA) or 'torch'")
        if (reason := cpp_unavailable()) is not None:
            raise ValueError(reason)
    if backend == "triton":
        if not triton_installed():
            raise ValueError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                             "(or use backend='torch')")
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"backend='triton' runs on CUDA tensors, got tensors on {device}; move them "
                             "to a GPU, set TRITON_INTERPRET=1 before importing linattn to run the kernels "
                             "in Triton's CPU interpreter, or use backend='torch'")
    return backend


_warned = False


@torch.compiler.disable   # loading the kernel takes a lock, which dynamo does not trace
def cpp_unavailable() -> str | None:
    """Why the C++ kernel cannot run here, or None (it is built on the first call)."""
    from . import cpp
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
