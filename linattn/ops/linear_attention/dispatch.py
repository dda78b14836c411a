"""Which implementation runs a linear-attention call: one table, keyed by (numerics, backend, causal),
and `compute_linear_attention`, which runs the call (what `functional.linear_attention` and the custom
op of `custom_ops.py` both call).

* numerics: "plain" (features phi >= 0) or "log" (log-features, the numerics of stable.py);
* backend: "torch" (torch_plain.py, torch_logspace.py: torch ops, any device), "cpp" (cpp_logspace.py:
  the C++ kernel of the causal log-space pass, CPU) or "fla" (fla_kernels.py: flash-linear-attention's
  chunk kernels, causal, CUDA); `resolve` turns "auto" into one of them and says why one asked for
  cannot run;
* causal: a call that the table has no entry for on a backend (the C++ kernel's plain or non-causal
  calls, fla's non-causal ones: torch's matrix products) takes the torch backend's entry, and so does a
  call without rows (no tokens, or an empty batch).

Every entry takes one call shape and returns the output, or (output, LinearState) with return_state:

    implementation(phi_q, phi_k, v, *, causal, rotary, offset, rope_base, chunk_size, return_state)

and three more keywords: key_offset (the keys' first position, apart from the queries' offset),
return_log_normalizer (the rows' log-denominators, after the output and state) and log_decay (None, or
(H,) log gamma <= 0 of causal calls: the pair (m, n) weighted by gamma^(distance in positions)).

The naive references (naive.py) and the recurrent step (recurrent.py) are not in the table: they are
called by name.
"""
from __future__ import annotations

import torch

from . import cpp_logspace, fla_kernels, torch_logspace, torch_plain
from .backends import cpp_runs_here, cpp_unavailable, fla_installed
from .common import compute_dtype, feature_tensors, guard_features
from .memory import check_fits
from .plain_scale import scale_plain_features

BACKENDS = ("auto", "torch", "cpp", "fla")

IMPLEMENTATIONS = {   # (numerics, backend, causal): implementation; only the real ones
    ("plain", "torch", True): torch_plain.plain_attention,
    ("plain", "torch", False): torch_plain.plain_attention,
    ("log", "torch", True): torch_logspace.logspace_attention,
    ("log", "torch", False): torch_logspace.logspace_attention,
    ("log", "cpp", True): cpp_logspace.logspace_attention,
    ("plain", "fla", True): fla_kernels.plain_attention,
    ("log", "fla", True): fla_kernels.logspace_attention,
}

# Implementations that apply common.guard_log_features' guard where their kernels read the log-features
# (no pass of their own over them).
GUARD_THEIR_OWN_LOG_FEATURES = (fla_kernels.logspace_attention,)


def numerics(log_space: bool) -> str:
    return "log" if log_space else "plain"


def has_own_kernel(log_space: bool, backend: str, causal: bool) -> bool:
    """Whether `backend` computes such calls in a kernel of its own rather than with torch's entry."""
    return backend != "torch" and (numerics(log_space), backend, causal) in IMPLEMENTATIONS


def implementation(log_space: bool, backend: str, causal: bool, rows: int):
    """The table's entry for a call of `rows` rows (B x H x N) on a resolved backend; torch's where the
    backend has none, and without rows (no tokens or an empty batch: the kernels want some; torch's gives
    the empty output and the state before any token)."""
    key = numerics(log_space)
    torch_entry = IMPLEMENTATIONS[key, "torch", causal]
    return IMPLEMENTATIONS.get((key, backend, causal), torch_entry) if rows else torch_entry


def check_backend(backend) -> None:
    """A backend's name is one of BACKENDS ("triton", retired, says what replaced it)."""
    if backend == "triton":
        raise ValueError("backend='triton' was retired: the GPU path runs flash-linear-attention's kernels, "
                         "backend='fla' (pip install 'linattn[gpu]'), or 'auto'")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve(backend: str, device: torch.device, float64: bool = False, *, log_space: bool, causal: bool) -> str:
    """The backend that runs on `device` (for float64 inputs if `float64`), or a ValueError that says how to
    get the one asked for.  "auto": fla on CUDA where fla-core imports (not for float64: fla computes in
    float32 at most), the C++ kernel on CPU where the table has one for the call (it is built then), else
    torch.  The name itself is checked where it comes in (check_backend)."""
    if backend == "auto":
        if device.type == "cuda" and fla_installed() and not float64:
            return "fla"
        own_kernel = has_own_kernel(log_space, "cpp", causal)
        return "cpp" if device.type == "cpu" and own_kernel and cpp_runs_here() else "torch"
    if backend == "cpp":
        if device.type != "cpu":
            raise ValueError(f"backend='cpp' runs on CPU tensors, got tensors on {device}; use backend='auto' "
                             "(fla on CUDA) or 'torch'")
        if (reason := cpp_unavailable()) is not None:
            raise ValueError(reason)
    if backend == "fla":
        if not fla_installed():
            raise ValueError("backend='fla' needs flash-linear-attention: pip install 'linattn[gpu]' (CUDA only; "
                             "or use backend='auto')")
        if device.type != "cuda":
            raise ValueError(f"backend='fla' runs on CUDA tensors, got tensors on {device}; move them to a GPU "
                             "or use backend='auto'")
        if float64:
            raise ValueError("backend='fla' computes in float32 at most; for float64 use backend='torch'")
    return backend


FLA_MAX_BATCH_HEADS = 65535   # fla's kernels put B x H on a CUDA grid's second or third axis


def check_fla_grid(batch_heads: int) -> None:
    """fla's launches take at most FLA_MAX_BATCH_HEADS (batch x heads) rows a call; beyond, a clear error
    instead of CUDA's "invalid argument"."""
    if batch_heads > FLA_MAX_BATCH_HEADS:
        raise ValueError(f"backend='fla' takes at most {FLA_MAX_BATCH_HEADS:,} batch x heads in one call (fla's "
                         f"grids), got {batch_heads:,}; split the batch into calls")


def compute_linear_attention(phi_q, phi_k, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int,
                             chunk_size: int, rope_base: float, return_state: bool, backend: str, log_space: bool,
                             nonnegative_features: bool = True, check_range: bool = True,
                             key_offset: int | None = None, return_log_normalizer: bool = False,
                             log_decay: torch.Tensor | None = None):
    """`functional.linear_attention` after its argument checks: the inputs guarded (values out of
    range made NaN, -inf log-features raised to a floor; in debug mode checked, which reads them on
    the host), plain features brought to unit size (plain_scale.py: every backend computes at any
    scale of them, their scales' logs added back to the log-normaliser), then the implementation the
    table holds for the call.  What the custom op `linattn::linear_attention` runs under torch.compile.
    `check_range=False`: the caller's forward checked these very features already (the compiled
    backward, which runs the computation again).  log_decay: checked by the caller."""
    dtype = compute_dtype(*feature_tensors(phi_q, phi_k), v)
    resolved = resolve(backend, v.device, float64=dtype == torch.float64, log_space=log_space, causal=causal)
    tokens, rows = v.shape[-2], v.shape[:-1].numel()
    if resolved == "fla":
        check_fla_grid(v.shape[:-2].numel())
    attend = implementation(log_space, resolved, causal, rows)
    phi_q, phi_k, v = guard_features(phi_q, phi_k, v, dtype, log_space=log_space,
                                     nonnegative_features=nonnegative_features, check_range=check_range,
                                     guard_log=attend not in GUARD_THEIR_OWN_LOG_FEATURES)
    scaled = not log_space and rows
    if scaled:   # plain features at unit size: the output does not depend on their scale
        phi_q, phi_k, query_scale, key_scale = scale_plain_features(phi_q, phi_k, causal=causal)
        # logs added, not scales multiplied (each may be 2^127); the (B, H, N, 1) query scale not kept otherwise
        log_scale = (query_scale.log() + key_scale.log()).squeeze(-1) if return_log_normalizer else None
        del query_scale
        if return_log_normalizer and log_decay is not None and key_offset not in (None, offset):
            # the plain pass weighs by tokens apart; the distance counts positions (the log-space pass's)
            log_scale = log_scale + (offset - key_offset) * log_decay.to(log_scale.dtype)[:, None]
    result = attend(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=offset, rope_base=rope_base,
                    chunk_size=max(1, min(chunk_size, tokens)),   # a short sequence is one chunk, unpadded
                    return_state=return_state, key_offset=key_offset,
                    return_log_normalizer=return_log_normalizer, log_decay=log_decay)
    if not scaled or not (return_state or return_log_normalizer):
        return result
    out, *rest = result
    if return_state:   # the state in the features' own scale, as a step continues it
        state = rest[0]
        rest[0] = state._replace(kv=state.kv * key_scale, k_sum=state.k_sum * key_scale.squeeze(-1))
    if return_log_normalizer:
        rest[-1] = rest[-1] + log_scale
    return out, *rest


def check_output_fits(num_features: int, v: torch.Tensor, dtype: torch.dtype) -> None:
    """The output and the (B, H, N, M) features each backend makes of q and k, in the compute dtype, fit the
    device's memory: inputs that hold their numbers already take that much, so only expanded views of
    a huge N (or B, H) are refused, before any allocation."""
    rows = v.shape[:-1].numel()
    needed = rows * (2 * num_features + v.shape[-1]) * torch.finfo(dtype).bits // 8
    check_fits(f"linear attention over {tuple(v.shape[:-1])} (B, H, N) rows", needed, v.device,
               "attend over fewer tokens at a time (a shorter sequence, or chunks of it carried on with "
               "return_state and linear_attention_step)")
