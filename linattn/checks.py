"""Argument checks shared by the public entry points."""
from __future__ import annotations

import math
import numbers

import torch


def is_integer(x) -> bool:
    """An integer of any integral type (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite real number of any real type, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_rope_base(base) -> None:
    """theta_i = base^(-2i/dim) needs a finite base > 0."""
    if not is_real(base) or base <= 0:
        raise ValueError(f"rope_base must be a finite number > 0 (RoFormer uses 10000), got {base!r}")


def check_state_tensors(state, device, shapes: dict) -> None:
    """Each named field of a decoding state must be a floating tensor of the given shape on `device`."""
    for name, shape in shapes.items():
        t = getattr(state, name)
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        if got != shape or not t.is_floating_point() or t.device != device:
            where = f" on {t.device}" if isinstance(t, torch.Tensor) else ""
            raise ValueError(
                f"state.{name} must be a floating tensor of shape {shape} on {device} for these inputs, "
                f"got {got}{where}; pass the state returned for the same model and batch (or None to start)")


def check_state_position(state) -> int:
    """A decoding state's position (tokens seen) as a plain int."""
    if not is_integer(state.position) or state.position < 0:
        raise ValueError(f"state.position must be a non-negative integer (tokens seen), got {state.position!r}")
    return int(state.position)
