"""Argument checks shared by the public entry points."""
from __future__ import annotations

import math
import numbers
import os
import warnings

import torch

# Data checks (non-negative features, the log-features' range, a decoding state's finiteness) read tensor
# values on the host: a device synchronisation each, so they run only in debug mode.  Without it bad
# values still never pass silently: the rows they reach come out NaN (docs/backends.md).
DEBUG_WORDS = {**dict.fromkeys(("", "0", "false", "no", "off"), False),
               **dict.fromkeys(("1", "true", "yes", "on"), True)}


def debug_from_environment(value: str) -> bool:
    """LINATTN_DEBUG's value read as on or off; another word is taken as off, with a warning (at import,
    where an error would stop every program that imports the library)."""
    word = value.strip().lower()
    if word in DEBUG_WORDS:
        return DEBUG_WORDS[word]
    warnings.warn(f"LINATTN_DEBUG={value!r} is not 1 or 0 (nor true/false, yes/no, on/off): debug mode stays off",
                  stacklevel=2)
    return False


_debug = debug_from_environment(os.environ.get("LINATTN_DEBUG", "0"))


def set_debug(enabled: bool) -> None:
    """Debug mode on or off (its default: the environment variable LINATTN_DEBUG=1).  On, linear
    attention checks its inputs' values (non-negative features, the log-features' range, a decoding
    state's finiteness) and raises a ValueError that names the bad input, at the cost of a host read
    (a GPU synchronisation) per check; off, such values give NaN outputs instead.

    Args:
        enabled: True to check values, False to skip the checks.
    """
    global _debug
    check_flags(enabled=enabled)
    _debug = enabled


def debug_enabled() -> bool:
    """Whether debug mode (`set_debug`) is on, outside torch.compile's tracing: a traced graph cannot
    branch on tensor values, so a compiled block keeps only the checks inside its custom ops (which
    run, untraced, when the graph runs)."""
    return _debug and not torch.compiler.is_compiling()


def is_integer(x) -> bool:
    """An integer of any integral type (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A finite real number of any real type, not a bool (an int too large for a float is not finite)."""
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def check_flags(**flags) -> None:
    """Switches are Python bools: a string such as "no" is truthy, and a table keyed by the flag (the
    dispatch table, torch's custom op) would fail far from the call that passed it."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def check_return_state(return_state: bool, causal: bool) -> None:
    if return_state and not causal:
        raise ValueError("return_state=True needs causal=True: a non-causal pass has no decoding state")


def check_positive_integer(name: str, value) -> int:
    """A size (a count of dimensions, heads, ...) as a plain int: 2.0 would reach torch's layers and
    fail there with a message that names neither the argument nor the fix."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_window(window) -> int:
    """A block's window (0: none) as a plain int."""
    if not is_integer(window) or window < 0:
        raise ValueError(f"window must be a non-negative integer number of tokens (0: no window), got {window!r}")
    return int(window)


def check_real_floating(name: str, t: torch.Tensor) -> None:
    """Attention and rotation compute on real floating-point numbers: outputs come back in the input's
    dtype, so integers would be truncated, and complex numbers are not what the maths takes."""
    if t.is_complex():
        raise ValueError(f"{name} must be a real floating-point tensor, got {t.dtype}; pass real tensors "
                         f"(x.real and x.imag, or torch.view_as_real(x)) in a floating dtype such as float32")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {t.dtype}; integer inputs would give "
                         f"truncated outputs: convert with .float()")


def check_finite_values(name: str, t: torch.Tensor) -> None:
    """No NaN or inf in a block's input: a read of it on the host, for debug mode (callers ask
    `debug_enabled()` first); without it such values give NaN outputs where they reach."""
    if not bool(t.detach().isfinite().all()):
        raise ValueError(f"{name} holds NaN or inf; find where the non-finite values come from (debug mode checks "
                         f"every block's input)")


def check_rope_base(base) -> None:
    """theta_i = base^(-2i/dim) needs a finite base > 0."""
    if not is_real(base) or base <= 0:
        raise ValueError(f"rope_base must be a finite number > 0 (RoFormer uses 10000), got {base!r}")


def check_state_tensors(state, device, shapes: dict, dtype: torch.dtype, dtype_note: str = "") -> None:
    """Each named field of a decoding state must be a floating tensor of the given shape on `device`, in
    the step's compute `dtype` (`dtype_note` says why that dtype)."""
    for name, shape in shapes.items():
        t = getattr(state, name)
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        if got != shape or not t.is_floating_point() or t.device != device:
            where = f" {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else ""
            raise ValueError(
                f"state.{name} must be a floating tensor of shape {shape} on {device} for these inputs, "
                f"got {got}{where}; pass the state returned for the same model and batch (or None to start)")
        if t.dtype != dtype:
            raise ValueError(f"state.{name} is {t.dtype} but this step computes in {dtype}{dtype_note}; continue a "
                             "sequence in the dtype that started it (or pass None to start)")


def check_state_finite(state, names, log_features=()) -> None:
    """The named tensors of a decoding state hold no NaN or inf (-inf allowed in `log_features`: a feature
    that is exactly 0): a read of each on the host, for debug mode (callers ask `debug_enabled()` first)."""
    for name in names:
        t = getattr(state, name)
        finite = ~t.isnan() & (t != float("inf")) if name in log_features else t.isfinite()
        if not bool(finite.all()):
            raise ValueError(f"state.{name} holds NaN or inf; the state is damaged (a non-finite input earlier in "
                             f"the sequence?): start again with state=None")


def check_state_position(state) -> int:
    """A decoding state's position (tokens seen) as a plain int, below 2^63: the next token's position is
    an int64, as forward's offsets are (rotary.check_positions)."""
    if not is_integer(state.position) or not 0 <= state.position < 2 ** 63:
        raise ValueError(f"state.position must be a non-negative integer below 2^63 (tokens seen), "
                         f"got {state.position!r}")
    return int(state.position)


def as_device(device) -> torch.device:
    """`device` as a torch.device: torch's own error for a bad name lists every device type it knows."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a device name such as 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None


def check_state_dtype(dtype) -> None:
    """A state's sums are kept in float32 or float64, the dtypes the passes compute in."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"a state is kept in torch.float32 or torch.float64, got dtype={dtype!r}")
