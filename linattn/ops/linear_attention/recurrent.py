"""Recurrent decoding: one token at a time with an O(1) state."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...checks import check_state_position, check_state_tensors, debug_enabled
from ...rotary import rotate
from .common import compute_dtype, divide, guard_features, log_normalizer
from .plain_scale import power_of_two_below, query_scale
from .stable import numerator_query, numerator_scale


class LinearState(NamedTuple):
    """Recurrent state of causal linear attention after `position` tokens.

    From plain features, kv and k_sum are the sums themselves.  From log-features (`log_scale` is
    not None) they are kept scaled by the running maxima F = log_scale of the key log-features
    (see `stable.py`): kv by e^{-P} (P: F's max over each rotation pair when rotary), k_sum by e^{-F}."""
    kv: torch.Tensor       # (B, H, M, Dv): sum_n (R_n phi_k_n) v_n^T  (rotated iff rotary)
    k_sum: torch.Tensor    # (B, H, M): sum_n phi_k_n, never rotated
    position: int
    log_scale: torch.Tensor | None = None   # (B, H, M): max_n log phi_k_n, for log-features (with a decay:
    #   of the keys' log-features as the next position sees them, log phi_k_n + (position - n) log gamma)


def initial_state(batch: int, heads: int, num_features: int, value_dim: int, *,
                  device=None, dtype=torch.float32, log_space: bool = False) -> LinearState:
    """The state before the first token (what `state=None` starts from), for (B, H, M) features and
    (B, H, value_dim) values."""
    zeros = torch.zeros(batch, heads, num_features, value_dim, device=device, dtype=dtype)
    k_sum = zeros.new_zeros(batch, heads, num_features)
    log_scale = torch.full_like(k_sum, float("-inf")) if log_space else None
    return LinearState(zeros, k_sum, 0, log_scale)


def recurrent_step(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, state: LinearState | None, *,
                   rotary: bool, rope_base: float, log_space: bool, nonnegative_features: bool,
                   query_position: int | None = None, return_log_normalizer: bool = False,
                   log_decay: torch.Tensor | None = None):
    """`functional.linear_attention_step` after its argument checks (the state's too).  For log-features
    also what the parallel pass's key_offset, return_log_normalizer and log_decay give: the query rotated
    at `query_position` (None: the key's, state.position), the row's log-normaliser (B, H) last, and the
    decay (H,) log gamma: the key at state.position weighted gamma^(query_position - position) for the
    query, the state decayed by gamma per token (its log_scale lowered by log gamma: no origin needed)."""
    dtype = compute_dtype(phi_q, phi_k, v)
    phi_q, phi_k, v = guard_features(phi_q, phi_k, v, dtype, log_space=log_space,
                                     nonnegative_features=nonnegative_features)
    b, h, m = phi_q.shape
    if state is None:
        state = initial_state(b, h, m, v.shape[-1], device=v.device, dtype=dtype, log_space=log_space)
    with torch.autocast(phi_q.device.type, enabled=False):
        phi_q, phi_k, v_c = phi_q.to(dtype), phi_k.to(dtype), v.to(dtype)
        if log_space:
            out, new, lse = _log_step(phi_q, phi_k, v_c, state, rotary=rotary, rope_base=rope_base, out_dtype=v.dtype,
                                      query_position=state.position if query_position is None else query_position,
                                      log_decay=None if log_decay is None else log_decay.detach().to(dtype))
            return (out, new, lse) if return_log_normalizer else (out, new)
        return _plain_step(phi_q, phi_k, v_c, state, rotary=rotary, rope_base=rope_base, out_dtype=v.dtype)


def _rotate_token(x: torch.Tensor, position: int, base: float) -> torch.Tensor:
    return rotate(x.unsqueeze(-2), offset=position, base=base).squeeze(-2)


def _plain_step(q, k, v, state: LinearState, *, rotary: bool, rope_base: float, out_dtype):
    """The parallel pass's sums one token on, at plain_scale.py's scales: the query row by its own, the
    state and the token's key by one power of two per (batch, head) from both (k_sum bounds the keys
    seen, or for taylor holds their squares), so the output does not depend on the features' scale
    either; the state is kept in the features' own scale.  A state or key that holds inf or NaN (sums
    of keys past the dtype's range) makes the scale inf and the output NaN, never finite and wrong."""
    with torch.no_grad():
        scale = power_of_two_below(torch.cat((state.k_sum, k), dim=-1).abs().amax(-1, keepdim=True))   # (B, H, 1)
    q, k = q / query_scale(q), k / scale
    kv, k_sum = state.kv / scale.unsqueeze(-1), state.k_sum / scale
    q_num, k_num = q, k
    if rotary:
        q_num, k_num = (_rotate_token(t, state.position, rope_base) for t in (q, k))
    kv = kv + k_num.unsqueeze(-1) * v.unsqueeze(-2)
    k_sum = k_sum + k
    numerator = (q_num.unsqueeze(-2) @ kv).squeeze(-2)
    out = divide(numerator, (q * k_sum).sum(-1))
    return out.to(out_dtype), LinearState(kv * scale.unsqueeze(-1), k_sum * scale, state.position + 1)


def _log_step(b, a, v, state: LinearState, *, rotary: bool, rope_base: float, out_dtype, query_position: int,
              log_decay=None):
    """The step of stable.py's recurrence: rescale the state to the new maxima, add the token, read.
    (out, state, log-normaliser).  The state is in the frame of the key's position (the decay's weights as
    a query there sees them): the query reads it with (query_position - position) log gamma, and the next
    state is the same sums with their scales in the next frame, F + log gamma."""
    if log_decay is not None:
        b = b + (query_position - state.position) * log_decay[:, None]
    with torch.no_grad():
        feat_old, feat_new = state.log_scale, torch.maximum(state.log_scale, a)
        pair_old, pair_new = numerator_scale(feat_old, rotary), numerator_scale(feat_new, rotary)
        query_scale = (b + feat_new).amax(-1, keepdim=True)
    key = torch.exp(a - pair_new)
    query = numerator_query(b + pair_new - query_scale)
    if rotary:
        key, query = _rotate_token(key, state.position, rope_base), _rotate_token(query, query_position, rope_base)
    kv = torch.exp(pair_old - pair_new).unsqueeze(-1) * state.kv + key.unsqueeze(-1) * v.unsqueeze(-2)
    k_sum = torch.exp(feat_old - feat_new) * state.k_sum + torch.exp(a - feat_new)
    numerator = (query.unsqueeze(-2) @ kv).squeeze(-2)
    denominator = (torch.exp(b + feat_new - query_scale) * k_sum).sum(-1)
    next_scale = feat_new if log_decay is None else feat_new + log_decay[:, None]
    return (divide(numerator, denominator).to(out_dtype), LinearState(kv, k_sum, state.position + 1, next_scale),
            log_normalizer(denominator, query_scale.squeeze(-1)))


def state_position(state) -> int:
    """The position of a LinearState (tokens seen), as a plain int: what a block needs before it maps
    the token (rope="pre" rotates at it); `check_state` checks the rest."""
    if not isinstance(state, LinearState):
        raise ValueError(f"state must be the LinearState returned by a causal pass with return_state=True "
                         f"or by a step, got {type(state).__name__}")
    return check_state_position(state)


def check_state(state, shape: tuple, device, dtype: torch.dtype, log_space: bool) -> LinearState:
    """A LinearState for (B, H, M, Dv) = `shape` on `device` in the step's compute `dtype`, from the same
    kind of features, returned with its position as a plain int.  In debug mode also with no NaN or inf
    (log_scale is -inf only for features not seen yet): a read of the state on the host."""
    position = state_position(state)
    if (state.log_scale is not None) != log_space:
        raise ValueError(f"the state was made from {'log-' if state.log_scale is not None else 'plain '}"
                         f"features but this step has log_space={log_space}; continue a sequence with "
                         "the kind of features that started it")
    shapes = {"kv": shape, "k_sum": shape[:3]} | ({"log_scale": shape[:3]} if log_space else {})
    check_state_tensors(state, device, shapes, dtype, " (its inputs' dtype; float32 for lower precisions)")
    for name in shapes if debug_enabled() else ():
        t = getattr(state, name)
        finite = (t != float("inf")) & ~t.isnan() if name == "log_scale" else t.isfinite()
        if not bool(finite.all()):
            raise ValueError(f"state.{name} holds NaN or inf; the state is damaged (a non-finite input "
                             f"earlier in the sequence?): start again with state=None")
    return state._replace(position=position)
