"""Linear attention with RoPE after the feature map (RoFormer Eq. 19): the public functional API.

* `linear_attention`            - the fast path, O(N) time and memory, on a backend of
                                  docs/backends.md: "torch" (any device), "cpp" (CPU), "fla" (CUDA);
* `linear_attention_reference`  - a plain O(N^2) version of the same maths, for tests;
* `linear_attention_step`       - one token of recurrent decoding with an O(1) state.

With `rotary=True` the numerator uses R_m phi(q_m) and R_n phi(k_n) while the denominator keeps the
unrotated features, so it stays a sum of non-negative terms:

    out_m = sum_n (R_m phi_q_m)^T (R_n phi_k_n) v_n  /  sum_n phi_q_m^T phi_k_n

All sums are accumulated in float32 (float64 stays float64) with autocast turned off, and the
denominator is clamped away from zero only where it underflows.  The implementations live in
`linattn.ops.linear_attention`, each beside the naive reference it is tested against; its
dispatch.py holds the one table that picks the implementation of a call.
"""
from __future__ import annotations

import torch

from .checks import (as_device, check_flags, check_real_floating, check_return_state, check_rope_base,
                     check_state_dtype, debug_enabled, is_integer, is_real)
from .custom_ops import run_linear_attention
from .ops.linear_attention import dispatch
from .ops.linear_attention.common import (DEFAULT_CHUNK_SIZE, LogProjection, check_nonnegative, compute_dtype,
                                          feature_tensors)
from .ops.linear_attention.naive import reference_attention, softmax_attention_reference
from .ops.linear_attention import recurrent
from .ops.linear_attention.recurrent import LinearState, check_state, recurrent_step
from .rotary import DEFAULT_BASE, check_positions, check_rotated_dim

BACKENDS = dispatch.BACKENDS

__all__ = ["BACKENDS", "DEFAULT_CHUNK_SIZE", "LinearState", "LogProjection", "initial_state",
           "linear_attention", "linear_attention_reference", "linear_attention_step",
           "softmax_attention_reference"]


def linear_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     rotary: bool, offset: int = 0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                     rope_base: float = DEFAULT_BASE, return_state: bool = False,
                     backend: str = "auto", log_space: bool = False, nonnegative_features: bool = True,
                     key_offset: int | None = None, return_log_normalizer: bool = False,
                     log_decay: torch.Tensor | None = None):
    """Linear attention of (B, H, N, M) non-negative features and (B, H, N, Dv) values.

    `rotary=True` is Eq. 19 at positions offset..offset+N-1; `causal=True` sums over n <= m only.
    With `return_state=True` (causal only) also returns the `LinearState` after the last token,
    so decoding can continue with `linear_attention_step`.  `backend`: "torch", "cpp" (the C++ kernel
    of causal log-space calls on CPU), "fla" (flash-linear-attention's kernels for causal calls on
    CUDA) or "auto" (fla on CUDA where it is installed, but not for float64; cpp for causal log-space
    calls on CPU where it builds; torch elsewhere); `ops/linear_attention/dispatch.py` has the table of
    what runs, docs/backends.md the story.  Input values are not read on the host unless debug mode is
    on (`linattn.set_debug`): negative features and log-features out of range give NaN rows instead of
    an error.  `log_space=True`:
    phi_q and phi_k hold log-features, and the stabilised algorithm of `ops/linear_attention/stable.py`
    runs, on every backend; each
    may also be a `LogProjection` (inputs @ weight^T + shift), which the torch backend's causal pass
    projects chunk by chunk without holding the (B, H, N, M) log-features.
    `nonnegative_features=False` skips the guard that every feature is >= 0, for features whose
    kernel phi_q . phi_k is positive though single features are not (a map's own guarantee, such
    as taylor's; the denominator must be positive for the output to mean anything).

    Args:
        key_offset: the keys' first position, apart from the queries' `offset` (None: the same).  Query m
            is rotated at offset + m, key n at key_offset + n, and still attends to n <= m: a block that
            reads the keys W tokens late (a window's linear part) gives its queries at offset + W and its
            keys at offset.  The state's position is then the keys' next one.
        return_log_normalizer: also return, as flash attention returns its log-sum-exp, the log of each
            row's denominator, log sum_{n} phi_q_m . phi_k_n over the keys it attends to (with the decay's
            weights, if any), from the same pass and differentiable (to merge this attention with another
            by their weights); for plain features -inf where that sum is exactly 0.
        log_decay: causal only: a per-head decay, an (H,) tensor of log gamma_h <= 0 (None: no decay).
            Query m weights key n by gamma^d more, in numerator and denominator, at the distance
            d = (offset + m) - (key_offset + n) in positions, inside the kernels' chunks: exact at any
            position.  A constant (no gradient flows to it).  Values that are not finite and <= 0 raise on
            CPU and in debug mode; elsewhere (no host read on a GPU) they make their head's outputs NaN.
            Log-features' states continue with `linear_attention_step(..., log_decay=)`; plain features'
            decayed states are for the blocks' own steps.

    Returns:
        the output (B, H, N, Dv) in v's dtype; with return_state also the `LinearState`; with
        return_log_normalizer, last, the log-normalisers (B, H, N) in the compute dtype (float32, or
        float64 for float64 inputs).
    """
    check_flags(causal=causal, rotary=rotary, return_state=return_state, log_space=log_space,
                nonnegative_features=nonnegative_features, return_log_normalizer=return_log_normalizer)
    check_feature_kind(log_space, nonnegative_features)
    if log_space:
        check_log_features(phi_q, phi_k, v)
    else:
        check_not_projection(phi_q, phi_k)
        check_features(phi_q, phi_k, v, rank=4)
    check_device(phi_q, phi_k, v)
    check_dtypes(phi_q, phi_k, v, log_space)
    log_decay = check_log_decay(log_decay, v, causal=causal)
    check_chunk_size(chunk_size)
    check_positions(offset, v.shape[-2])
    if key_offset is not None:
        check_positions(key_offset, v.shape[-2])
    check_rope_base(rope_base)
    if rotary:
        check_rotated_dim(phi_k.shape[-1])
    check_return_state(return_state, causal)
    dispatch.check_backend(backend)
    dispatch.check_output_fits(phi_k.shape[-1], v, compute_dtype(*feature_tensors(phi_q, phi_k), v))
    return run_linear_attention(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=int(offset),
                                chunk_size=chunk_size, rope_base=rope_base, return_state=return_state,
                                backend=backend, log_space=log_space, nonnegative_features=nonnegative_features,
                                key_offset=None if key_offset is None else int(key_offset),
                                return_log_normalizer=return_log_normalizer, log_decay=log_decay)


def linear_attention_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                          state: LinearState | None, *, rotary: bool,
                          rope_base: float = DEFAULT_BASE, log_space: bool = False,
                          nonnegative_features: bool = True, log_decay: torch.Tensor | None = None):
    """One token of causal linear attention: (B, H, M) features and (B, H, Dv) values at position
    `state.position`.  O(M * Dv) time and memory, whatever the context length.  With
    `log_space=True`, phi_q and phi_k hold log-features and the state carries their running max.
    `nonnegative_features=False`: single features may be negative (see `linear_attention`).
    `log_decay` (log_space only): (H,) log gamma <= 0, the decay `linear_attention` took."""
    check_flags(rotary=rotary, log_space=log_space, nonnegative_features=nonnegative_features)
    check_features(phi_q, phi_k, v, rank=3)
    check_feature_kind(log_space, nonnegative_features)
    check_device(phi_q, phi_k, v)
    check_dtypes(phi_q, phi_k, v, log_space)
    if log_decay is not None and not log_space:
        raise ValueError("log_decay in a step takes log-features (log_space=True); a plain-feature block "
                         "with a decay continues with its own step")
    log_decay = check_log_decay(log_decay, v, causal=True)
    check_rope_base(rope_base)
    if rotary:
        check_rotated_dim(phi_k.shape[-1])
    if state is not None:
        dtype = compute_dtype(phi_q, phi_k, v)
        state = check_state(state, (*phi_q.shape, v.shape[-1]), v.device, dtype, log_space)
        check_positions(state.position, 1)
    return recurrent_step(phi_q, phi_k, v, state, rotary=rotary, rope_base=rope_base, log_space=log_space,
                          nonnegative_features=nonnegative_features, log_decay=log_decay)


def linear_attention_reference(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *,
                               causal: bool, rotary: bool, offset: int = 0,
                               rope_base: float = DEFAULT_BASE, nonnegative_features: bool = True,
                               numerator_only: bool = False) -> torch.Tensor:
    """The same maths as `linear_attention` with explicit N x N weight matrices, for tests.
    `nonnegative_features=False`: single features may be negative (see `linear_attention`);
    `numerator_only=True`: the numerator alone, undivided (what normalization="rmsnorm" normalises)."""
    check_flags(causal=causal, rotary=rotary, nonnegative_features=nonnegative_features,
                numerator_only=numerator_only)
    check_features(phi_q, phi_k, v, rank=4)
    if nonnegative_features:
        check_nonnegative(phi_q, phi_k)
    check_positions(offset, v.shape[-2])
    check_rope_base(rope_base)
    if rotary:
        check_rotated_dim(phi_k.shape[-1])
    return reference_attention(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=int(offset),
                               rope_base=rope_base, nonnegative_features=nonnegative_features,
                               numerator_only=numerator_only)


def initial_state(batch: int, heads: int, num_features: int, value_dim: int, *,
                  device=None, dtype=torch.float32, log_space: bool = False) -> LinearState:
    """The state before the first token (what `state=None` starts from).

    Args:
        batch, heads, num_features, value_dim: the sizes of (B, H, M) features and (B, H, Dv) values.
        device, dtype: where and in what the state's sums are kept.
        log_space: a state for log-features.

    Returns:
        the LinearState at position 0.
    """
    sizes = {"batch": batch, "heads": heads, "num_features": num_features, "value_dim": value_dim}
    for name, size in sizes.items():
        if not is_integer(size) or size < 0:
            raise ValueError(f"initial_state's {name} must be a non-negative integer, got {size!r}")
    check_flags(log_space=log_space)
    check_state_dtype(dtype)
    device = None if device is None else as_device(device)
    return recurrent.initial_state(*(int(size) for size in sizes.values()), device=device, dtype=dtype,
                                   log_space=log_space)


# ---- argument checks of the functional calls (the blocks check their own inputs) -------------------

def check_chunk_size(chunk_size) -> None:
    if not is_integer(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer number of tokens, got {chunk_size!r}")


def check_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, rank: int) -> None:
    names = "(B, H, N, M) features and (B, H, N, Dv) values" if rank == 4 else \
        "(B, H, M) features and (B, H, Dv) values for one token"
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_real_floating(name, t)
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}; "
                             f"linear attention takes {names}")
    if phi_q.shape != phi_k.shape:
        raise ValueError(f"phi_q and phi_k must have the same shape, got {tuple(phi_q.shape)} and "
                         f"{tuple(phi_k.shape)}; map queries and keys with the same feature map")
    if phi_q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"features {tuple(phi_q.shape)} and values {tuple(v.shape)} disagree before "
                         f"the last dimension; expected {names}")
    if phi_q.shape[-1] == 0:   # no features: every denominator is 0, so no weighting of the values exists
        raise ValueError(f"features need at least one feature, got shape {tuple(phi_q.shape)} (M = 0)")


def check_log_features(phi_q, phi_k, v: torch.Tensor) -> None:
    """Log-features for log_space=True: each a (B, H, N, M) tensor or a LogProjection of
    (B, H, N, D) inputs, an (M, D) weight and a (B, H, N, 1) shift; M and D at least 1 (a feature
    map gives some features, and a projection reads some inputs)."""
    if not any(isinstance(x, LogProjection) for x in (phi_q, phi_k)):
        check_features(phi_q, phi_k, v, rank=4)
        return
    shapes = []
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k)):
        if not isinstance(x, LogProjection):
            check_features(x, x, v, rank=4)
            shapes.append(tuple(x.shape))
            continue
        inputs, weight, shift, square_scale = x
        check_projection_parts(name, inputs, weight, shift, square_scale)
        shift_shape = tuple(shift.shape) if isinstance(shift, torch.Tensor) else (*inputs.shape[:-1], 1)
        if inputs.dim() != 4 or weight.dim() != 2 or weight.shape[-1] != inputs.shape[-1] \
                or shift_shape != (*inputs.shape[:-1], 1):
            raise ValueError(f"{name}: a LogProjection takes (B, H, N, D) inputs, an (M, D) weight and a "
                             f"(B, H, N, 1) shift (or a number), got {tuple(inputs.shape)}, {tuple(weight.shape)} "
                             f"and {shift_shape}")
        if inputs.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"{name}: inputs {tuple(inputs.shape)} and values {tuple(v.shape)} disagree "
                             f"before the last dimension")
        if 0 in weight.shape:
            raise ValueError(f"{name}: a LogProjection projects D >= 1 inputs onto M >= 1 features, got a weight "
                             f"of shape {tuple(weight.shape)}")
        shapes.append(x.shape)
    if shapes[0] != shapes[1]:
        raise ValueError(f"phi_q and phi_k give log-features of shapes {shapes[0]} and {shapes[1]}; map "
                         f"queries and keys with the same feature map")


def check_projection_parts(name: str, inputs, weight, shift, square_scale) -> None:
    """Each part of a LogProjection has its type; the error names the part that has not."""
    def kind(x):
        return f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else f"{x!r}"
    for part, t in (("inputs", inputs), ("weight", weight)):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            raise ValueError(f"{name}: a LogProjection's {part} must be a floating-point tensor, got {kind(t)}")
    if not (isinstance(shift, torch.Tensor) and shift.is_floating_point() or is_real(shift)):
        raise ValueError(f"{name}: a LogProjection's shift must be a floating-point tensor or a finite number, "
                         f"got {kind(shift)}")
    if not is_real(square_scale):
        raise ValueError(f"{name}: a LogProjection's square_scale must be a finite number, got {kind(square_scale)}")


def check_dtypes(phi_q, phi_k, v: torch.Tensor, log_space: bool = False) -> None:
    """Queries' and keys' features (every tensor of a LogProjection too) share one dtype, and v has it,
    so that no input is silently promoted or rounded.  Two mixes are the documented forms:
    * under autocast v may be in the autocast dtype: the block's q, k, v come out in it together, and
      feature maps compute in float32;
    * float32 log-features with bf16/fp16 values, autocast or not: log-features are kept in float32
      (in half precision their exponents would round), and the values multiply in their own dtype
      (on tensor cores on the fla backend)."""
    features = feature_tensors(phi_q, phi_k)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in features})
    if len(dtypes) > 1:
        raise ValueError(f"phi_q and phi_k must share one dtype, got {' and '.join(dtypes)}; convert them "
                         f"with .to(dtype)")
    dtype = features[0].dtype
    autocast = torch.is_autocast_enabled(v.device.type) and v.dtype == torch.get_autocast_dtype(v.device.type)
    half_values = log_space and dtype == torch.float32 and v.dtype in (torch.bfloat16, torch.float16)
    if v.dtype != dtype and not (autocast or half_values):
        raise ValueError(f"v is {v.dtype} but the features are {dtype}; convert one to the other with "
                         f".to(dtype), or run under autocast")


def check_device(phi_q, phi_k, v: torch.Tensor) -> None:
    """Every input on one device, and one that holds data: a meta tensor has none to attend over, and
    torch would only say that autocast does not know its device type."""
    devices = sorted({str(t.device) for t in (*feature_tensors(phi_q, phi_k), v)})
    if len(devices) > 1:
        raise ValueError(f"phi_q, phi_k and v must be on one device, got tensors on {' and '.join(devices)}; "
                         f"move them with .to(device)")
    if v.device.type == "meta":
        raise ValueError("linear attention computes on data, and tensors on the meta device hold none; "
                         "pass CPU or CUDA tensors")


def check_not_projection(phi_q, phi_k) -> None:
    if any(isinstance(x, LogProjection) for x in (phi_q, phi_k)):
        raise ValueError("a LogProjection holds log-features: pass log_space=True")


def check_log_decay(log_decay, v: torch.Tensor, *, causal: bool):
    """log_decay: None, or an (H,) real floating tensor on v's device of finite log gamma <= 0, for causal
    calls; returned as the computation takes it.  Its values are read on the host (H numbers) on
    CPU and in debug mode; elsewhere (a GPU, no synchronisation) a bad one is made NaN, so its head's
    outputs are NaN rather than finite and wrong."""
    if log_decay is None:
        return None
    if not causal:
        raise ValueError("log_decay weighs keys by their distance before the query: pass causal=True "
                         "(or log_decay=None)")
    heads = v.shape[1]
    if not isinstance(log_decay, torch.Tensor) or not log_decay.is_floating_point() or log_decay.is_complex():
        raise ValueError(f"log_decay must be a real floating-point tensor of log gamma per head, got "
                         f"{type(log_decay).__name__ if not isinstance(log_decay, torch.Tensor) else log_decay.dtype}")
    if tuple(log_decay.shape) != (heads,):
        raise ValueError(f"log_decay must have shape ({heads},), one log gamma per head, got {tuple(log_decay.shape)}")
    if log_decay.device != v.device:
        raise ValueError(f"log_decay is on {log_decay.device} but the values on {v.device}; put them on one device")
    valid = torch.isfinite(log_decay) & (log_decay <= 0)
    if torch.compiler.is_compiling() or not (debug_enabled() or log_decay.device.type == "cpu"):
        return torch.where(valid, log_decay, float("nan"))
    if heads and not bool(valid.all()):
        raise ValueError(f"log_decay must be finite and <= 0 (log gamma of a decay 0 < gamma <= 1), got "
                         f"{log_decay.tolist()}")
    return log_decay


def check_feature_kind(log_space: bool, nonnegative_features: bool) -> None:
    """Log-features are logarithms of positive features: they cannot be features that may be negative."""
    if log_space and not nonnegative_features:
        raise ValueError("log_space=True takes log-features, the logarithms of positive features, so "
                         "nonnegative_features=False (features that may be negative) does not apply: pass one")
