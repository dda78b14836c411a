"""A sliding window of exact softmax and a per-head decay inside causal linear attention.

For query m and key n <= m at distance d = m - n (docs/gap-closers.md has the derivation):

    out_m = (sum_{d<W} gamma^d e^(s_mn) v_n + g sum_{d>=W} gamma^d nu_mn v_n)
            / (sum_{d<W} gamma^d e^(s_mn)     + g sum_{d>=W} gamma^d kappa_mn)

* the window: band.py, queries in blocks of L >= W rows against their band of L + W - 1 keys (O(N W D)
  work and O(N) memory), with each row's log-normaliser;
* the linear part: linear attention of queries W.. against keys ..N-W-1 (query m reads the state at
  m - W), as a ratio r_m (its nu-weighted mean of values) and a log-weight l_m = log(g gamma^W sum kappa gamma^(d-W)):
  - log-features: one call of the op (`run_linear_attention`: any backend's exact log-space pass), the
    decay inside it (its log_decay: gamma^(m - n) at the positions' distance, in its chunks' factors, exact
    at any position), the queries at their positions m and the keys at theirs (the op's key offset, W
    apart), so that Eq. 19 (`post`) is rotated at each token's true position; the row sums of
    gamma^(m-n) kappa are the op's log-normaliser;
  - plain features: the chunked decayed form (`decayed_chunks`: an intra-chunk decay matrix, the state
    decayed per chunk, as RetNet and fla's simple_gla), which keeps numerator and denominator apart;
    on the fla backend, fla's own kernels (`fla_kernels.decayed_attention`);
* the two merged by their log-normalisers (`band.merge`), L_m = log sum_window e^(s + d log gamma) and l_m,
  with one stabiliser per row, c_m = max(L_m, l_m):
      out_m = (e^(L - c) window_m + e^(l - c) r_m) / (e^(L - c) + e^(l - c)),
  every exponential <= 1 and the largest 1, so nothing overflows and the normaliser is >= 1.

Decoding (`window_decay_step`) carries the last W tokens (rotated keys, values, key features) and the
linear state of the older ones: O(W (D + M) + M Dv) per token.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...checks import check_state_finite, check_state_position, check_state_tensors, debug_enabled
from ...custom_ops import run_linear_attention
from ..linear_attention.common import (LogProjection, compute_dtype, denominator_guard, feature_tensors,
                                      guard_features)
from ..linear_attention.dispatch import resolve
from ..linear_attention.plain_scale import power_of_two_below, query_scale, scale_plain_features
from ..linear_attention.fla_kernels import HALF_DOTS, decayed_attention
from ..linear_attention.recurrent import LinearState, check_state, initial_state, recurrent_step
from .band import band_attention, merge
from ...rotary import rotate

# The log-weight of a row with no linear key: -inf, not a finite floor, since the window's log-normalisers are
# not bounded (scores of -1e36 at inputs of 1e18 lost a row among the first W to a floor of -1e30 beside it).
# `merge` takes its stabiliser from the window's, which is finite or NaN, never -inf (the diagonal is inside).
NO_WEIGHT = float("-inf")


class WindowState(NamedTuple):
    """Decoding state of a block with a window or a decay, after `position` tokens."""
    linear: LinearState | None   # the keys older than the window (None before the first such key)
    keys: torch.Tensor           # (B, H, T, D): the window's keys, as the scores take them, T <= W
    values: torch.Tensor         # (B, H, T, Dv)
    features: torch.Tensor       # (B, H, T, M): their key features (log-features for log-space maps)
    position: int                # the next token's position
    window: int = 0              # what the state was made for (checked by the block's step): the window,
    decay: tuple | None = None   # the decay rates gamma_h,
    feature_map: str = ""        # and the feature map


def retnet_decay(heads: int) -> tuple[float, ...]:
    """RetNet's per-head decay gamma_h = 1 - 2^(-5-h), h = 0..heads-1."""
    return tuple(1 - 2.0 ** (-5 - h) for h in range(heads))


def window_decay_attention(q_hat, k_hat, phi_q, phi_k, v, *, window: int, log_decay, log_gain, rotary: bool,
                           log_space: bool, offset: int, rope_base: float, chunk_size: int, backend: str,
                           return_state: bool, rotate_scores: bool = False):
    """The parallel pass: (B, H, N, D) score inputs q_hat, k_hat (with `rotate_scores`: before RoPE, which
    the window's band applies as it goes, keeping no rotated copy), (B, H, N, M) features (log-features
    if `log_space`, or their `LogProjection`s), (B, H, N, Dv) values -> (B, H, N, Dv) in float32 (float64
    stays), and the `WindowState` with `return_state`.  log_decay (H,) log gamma or None; log_gain (H,) log g or None
    (used only with a window); rotary: Eq. 19's numerator; backend: the block's, for the linear part (the
    window's band runs in torch).  It is resolved here, as the op resolves it: "auto" is fla on CUDA where
    installed.  While torch.compile traces, names decide instead (resolving asks the machine, and fla's
    kernels are no graph ops): the log-space op is a custom op that resolves when it runs, and plain
    features take the torch loop."""
    dtype = compute_dtype(*feature_tensors(phi_q, phi_k), v)
    if torch.compiler.is_compiling():
        backend = backend if log_space else "torch"
    else:
        backend = resolve(backend, v.device, float64=dtype == torch.float64, log_space=log_space, causal=True)
    with torch.autocast(v.device.type, enabled=False):
        values = v
        q_hat, k_hat, v = (t.to(dtype) for t in (q_hat, k_hat, v))
        phi_q, phi_k = (x.to(dtype) for x in (phi_q, phi_k))
        # bf16 values stay bf16 for the linear part on fla's kernels, which multiply them on tensor cores
        linear_values = values if backend == "fla" and values.dtype == HALF_DOTS else v
        rate = None if log_decay is None else log_decay.to(dtype)
        n = v.shape[-2]
        linear_state, lin_log, ratio = None, None, None
        if n == 0:   # no tokens: an empty output (the chunk loops want one)
            empty = WindowState(None, k_hat, v, feature_rows(phi_k, slice(0, 0), materialize=True), offset, window)
            return (v.clone(), empty) if return_state else v.clone()
        if window < n:   # queries W.. against keys ..N-W-1: query m reads the keys n <= m - W
            part = log_linear_part if log_space else plain_linear_part
            lin_log, ratio, linear_state = part(feature_rows(phi_q, slice(window, n)),
                                                feature_rows(phi_k, slice(0, n - window)),
                                                linear_values[..., :n - window, :], window=window, rate=rate,
                                                rotary=rotary, offset=offset, rope_base=rope_base,
                                                chunk_size=chunk_size, backend=backend, return_state=return_state)
            if window:   # rows W.. of the window's (the first W have no linear key); the op's decay has gamma^W
                lin_log = lin_log + linear_log_factor(window, None if log_space else rate, log_gain, dtype)
        rotary_offset = offset if rotate_scores else None
        out = ratio if window == 0 else windowed(q_hat, k_hat, v, window, rate, lin_log, ratio, rotary_offset,
                                                 rope_base)
    if not return_state:
        return out
    kept = min(window, n)
    keys = k_hat[..., n - kept:, :]
    if rotate_scores:   # the cache holds the keys as the scores take them
        keys = rotate(keys, offset=offset + n - kept, base=rope_base)
    features = feature_rows(phi_k, slice(n - kept, n), materialize=True)
    cache = (t.detach() for t in (keys, v[..., n - kept:, :], features))
    return out, WindowState(linear_state, *cache, position=offset + n, window=window)


def guard_window_features(phi_q, phi_k, v: torch.Tensor, *, log_space: bool, nonnegative_features: bool,
                          materialize: bool = False):
    """(phi_q, phi_k, v) as the op guards them (`guard_features`: in debug mode checked, which reads them on
    the host; otherwise log-features beyond the dtype's range, or a projection whose bound is, and negative
    plain features made NaN in the rows they reach), once, where the block hands them to this path.  A
    `LogProjection` (FAVOR+'s: its bound sees |x|^2 overflow, which its log-features show as -inf, exactly
    0, for every feature) stays one, so that the op projects the linear part's rows chunk by chunk (no
    (B, H, N, M) log-features are made or kept), unless `materialize` (a step's one token)."""
    dtype = compute_dtype(*feature_tensors(phi_q, phi_k), v)
    phi_q, phi_k, v = guard_features(phi_q, phi_k, v, dtype, log_space=log_space,
                                     nonnegative_features=nonnegative_features)
    if materialize:
        phi_q, phi_k = (x.materialize() if isinstance(x, LogProjection) else x for x in (phi_q, phi_k))
    return phi_q, phi_k, v


def feature_rows(x, positions: slice, materialize: bool = False):
    """Some positions' features (B, H, len, M), of a tensor or a `LogProjection` (a projection of those
    rows, or with `materialize` their log-features)."""
    if not isinstance(x, LogProjection):
        return x[..., positions, :]
    return x.rows(positions) if materialize else x.take(positions)


def linear_log_factor(window: int, rate, log_gain, dtype) -> torch.Tensor | float:
    """log(g gamma^W) per head, (H, 1): what every linear weight shares beyond its decay from m - W."""
    factor = 0.0 if log_gain is None else log_gain.to(dtype)[:, None]
    return factor if rate is None else factor + window * rate[:, None]


def guarded_log(den: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log den, den clamped for dividing): NO_WEIGHT where den is 0 (a row with no linear key)."""
    safe = den.clamp_min(denominator_guard(den.dtype))
    return torch.where(den > 0, safe.log(), NO_WEIGHT), safe


# ---- the linear part ---------------------------------------------------------------------------

def plain_linear_part(phi_q, phi_k, v, *, window, rate, rotary, offset, rope_base, chunk_size, backend,
                      return_state):
    """(log sum_n gamma^(j-n) kappa_jn, the nu-weighted mean of values, the state) of queries at positions
    offset + W + j against keys at offset + n, n <= j, from plain features, brought to unit size first as
    the op brings them (plain_scale.py: NaN where keys are lost to underflow), their scales' logs added
    back to the log-weight: the window is weighed against the linear part at any scale of the features."""
    log_q_scale = query_scale(phi_q).log()   # logs added, not scales multiplied: each may be 2^127
    phi_q, phi_k, k_scale = scale_plain_features(phi_q, phi_k, causal=True)
    log_scale = (log_q_scale + k_scale.log()).squeeze(-1)
    q_num, k_num = phi_q, phi_k
    if rotary:
        q_num = rotate(phi_q, offset=offset + window, base=rope_base)
        k_num = rotate(phi_k, offset=offset, base=rope_base)
    if backend == "fla":   # fla's chunk kernels: no loop over chunks
        num, den, kv, k_sum = decayed_attention(q_num, k_num, phi_q, phi_k, v, rate, return_state=return_state)
    else:
        num, den, kv, k_sum = decayed_chunks(q_num, k_num, phi_q, phi_k, v, rate, chunk_size)
    log_den, safe = guarded_log(den)
    state = None
    if return_state:   # in the features' own scale, as the step continues it
        state = LinearState((kv * k_scale).detach(), (k_sum * k_scale.squeeze(-1)).detach(), offset + v.shape[-2])
    return log_den + log_scale, num / safe.unsqueeze(-1), state


def decayed_chunks(q_num, k_num, q_den, k_den, v, rate, chunk: int):
    """sum_{n<=m} gamma^(m-n) (q_num_m . k_num_n) v_n and sum_{n<=m} gamma^(m-n) q_den_m . k_den_n, with the
    states (kv, k_sum) after the last token.  Chunks of L tokens (padded at the front, so that the last
    chunk ends at the last token): inside a chunk the decay matrix gamma^(r-c) (r >= c), across chunks
    the state before the chunk read with gamma^(r+1) and carried with gamma^L."""
    b, h, n, m = q_num.shape
    chunk = max(1, min(chunk, n))
    pad = -n % chunk
    q_num, k_num, q_den, k_den, v = (F.pad(t, (0, 0, pad, 0)).unflatten(-2, (-1, chunk))
                                     for t in (q_num, k_num, q_den, k_den, v))
    rate = q_num.new_zeros(h) if rate is None else rate
    steps = torch.arange(chunk, device=v.device, dtype=v.dtype)
    distance = steps[:, None] - steps[None, :]
    inside = torch.exp(distance.clamp_min(0) * rate[:, None, None]) * (distance >= 0)   # (H, L, L)
    inside = inside[None, :, None]
    query_decay = torch.exp((steps + 1) * rate[:, None])[None, :, None, :, None]       # (1, H, 1, L, 1)
    key_decay = torch.exp((chunk - 1 - steps) * rate[:, None])[None, :, None, :, None]
    chunk_decay = torch.exp(chunk * rate)[None, :, None]                                 # (1, H, 1)
    num = ((q_num @ k_num.transpose(-1, -2)) * inside) @ v
    den = ((q_den @ k_den.transpose(-1, -2)) * inside).sum(-1)
    kv_updates = (k_num * key_decay).transpose(-1, -2) @ v     # (B, H, K, M, Dv)
    sum_updates = (k_den * key_decay).sum(-2)                  # (B, H, K, M)
    kv, k_sum = kv_updates.new_zeros(b, h, m, v.shape[-1]), sum_updates.new_zeros(b, h, m)
    kvs, sums = [], []
    for c in range(kv_updates.shape[2]):
        kvs.append(kv)
        sums.append(k_sum)
        kv = chunk_decay[..., None] * kv + kv_updates[:, :, c]
        k_sum = chunk_decay * k_sum + sum_updates[:, :, c]
    num = num + (q_num * query_decay) @ torch.stack(kvs, 2)
    den = den + ((q_den * query_decay) * torch.stack(sums, 2).unsqueeze(-2)).sum(-1)
    return num.flatten(2, 3)[:, :, pad:], den.flatten(2, 3)[:, :, pad:], kv, k_sum


def log_linear_part(b, a, v, *, window, rate, rotary, offset, rope_base, chunk_size, backend, return_state):
    """`plain_linear_part` from log-features b = log phi_q, a = log phi_k (tensors or `LogProjection`s): one
    call of the op's exact log-space pass, query j at offset + W + j and key n at offset + n (its key offset),
    with the decay inside it (its log_decay, at the distance in positions j - n + W), whose log-normaliser is
    the row's log sum gamma^(j-n+W) kappa: unlike `plain_linear_part`'s, with gamma^W in it."""
    dtype = feature_tensors(b)[0].dtype   # the compute dtype (v may be bf16 for fla's kernels)
    result = run_linear_attention(b, a, v, causal=True, rotary=rotary, offset=offset + window, key_offset=offset,
                                  chunk_size=chunk_size, rope_base=rope_base, backend=backend, log_space=True,
                                  return_state=return_state, nonnegative_features=True,
                                  return_log_normalizer=bool(window), log_decay=rate)
    ratio, *rest = result if isinstance(result, tuple) else (result,)
    state = rest.pop(0) if return_state else None
    lin_log = rest[0].to(dtype) if window else None
    return lin_log, ratio.to(dtype), state


# ---- the window and the combination -------------------------------------------------------------

def windowed(q_hat, k_hat, v, window: int, rate, lin_log, ratio, rotary_offset: int | None,
             rope_base: float) -> torch.Tensor:
    """The window's exact softmax terms (band.py: O(N W)) merged with the linear part (lin_log, ratio of the
    rows W..; None when no key is older than the window) by their log-normalisers, in the band's one pass;
    q_hat, k_hat rotated there at positions rotary_offset.. unless it is None."""
    return band_attention(q_hat, k_hat, v, window, rate, rotary_offset=rotary_offset, rope_base=rope_base,
                          other=ratio, other_lse=lin_log)[0]


# ---- decoding -------------------------------------------------------------------------------------

def check_window_state(state, made_for: dict, batch_heads: tuple, head_dim: int, num_features: int, device,
                       dtype: torch.dtype, log_space: bool) -> int:
    """A WindowState for a block's step (checked there, once): made for the block described by `made_for`
    (window, decay, feature_map, as the state records them), (B, H) = `batch_heads`, keys and values of
    head_dim, key features of num_features, on `device` in the step's `dtype`, a cache and a linear state
    that fit its position (at most min(W, position) cached tokens, and a linear state of the older ones, of
    the same kind of features, `log_space`, and sizes, only beside a full cache of W).  Returns its position
    as a plain int."""
    if not isinstance(state, WindowState):
        raise ValueError(f"state must be the WindowState returned by forward(..., return_state=True) or step() "
                         f"of a block with a window or decay, got {type(state).__name__}")
    recorded = {name: getattr(state, name) for name in made_for}
    if recorded != made_for:
        raise ValueError(f"the state was made for a block with {describe(recorded)}, not this block's "
                         f"{describe(made_for)}; continue a sequence with the block that started it (or pass None)")
    position = check_state_position(state)
    window = made_for["window"]
    # the cache's length as the keys hold it (a pass from an offset caches fewer than min(W, position) tokens);
    # one out of range is refused with the shape that would fit
    held = state.keys.shape[-2] if isinstance(state.keys, torch.Tensor) and state.keys.dim() == 4 else -1
    cached = held if 0 <= held <= min(window, position) else min(window, position)
    shapes = {name: (*batch_heads, cached, width) for name, width in
              (("keys", head_dim), ("values", head_dim), ("features", num_features))}
    check_state_tensors(state, device, shapes, dtype)
    if state.linear is not None and cached < window:
        raise ValueError(f"the state has a linear state beside {cached} cached tokens with a window of {window} "
                         f"(tokens leave the window's cache for the linear state only once it is full); pass the "
                         f"state as returned (or None to start)")
    if state.linear is not None:   # the linear attention's own state, checked as its step checks it
        linear = check_state(state.linear, (*batch_heads, num_features, head_dim), device, dtype, log_space)
        if linear.position != position - made_for["window"]:
            raise ValueError(f"state.linear is at position {linear.position}, not {position - made_for['window']} "
                             f"(the state's position less the window); pass the state as returned")
    if debug_enabled():
        check_state_finite(state, shapes, log_features=("features",) if log_space else ())
    return position


def describe(options: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())


def window_decay_step(q_hat, k_hat, phi_q, phi_k, v, state: WindowState | None, *, window: int, log_decay,
                      log_gain, rotary: bool, log_space: bool, rope_base: float):
    """One token: (B, H, D) score inputs, (B, H, M) features, (B, H, Dv) values at `state.position`
    (state None: position 0) -> ((B, H, Dv) in float32 or float64, the next WindowState).  The token
    joins the cached window; the token W positions back leaves it for the linear state."""
    dtype = torch.float64 if v.dtype == torch.float64 or phi_q.dtype == torch.float64 else torch.float32
    q_hat, k_hat, phi_q, phi_k, v = (t.to(dtype) for t in (q_hat, k_hat, phi_q, phi_k, v))
    if state is None:
        empty = v.new_zeros(*v.shape[:2], 0, 1)
        state = WindowState(None, empty.expand(-1, -1, -1, k_hat.shape[-1]), empty.expand(-1, -1, -1, v.shape[-1]),
                            empty.expand(-1, -1, -1, phi_k.shape[-1]), 0, window)
    position = int(state.position)
    keys, values, features = (torch.cat((cache, t.unsqueeze(-2)), -2) for cache, t in
                              ((state.keys, k_hat), (state.values, v), (state.features, phi_k)))
    rate = None if log_decay is None else log_decay.to(dtype)
    linear, lin_log, ratio = state.linear, None, None
    with torch.autocast(v.device.type, enabled=False):
        if keys.shape[-2] > window:   # the token W positions back leaves the window
            leaving = (features[..., 0, :], values[..., 0, :])
            keys, values, features = keys[..., 1:, :], values[..., 1:, :], features[..., 1:, :]
            step = log_linear_step if log_space else plain_linear_step
            lin_log, ratio, linear = step(phi_q, *leaving, linear, position=position, window=window, rate=rate,
                                          rotary=rotary, rope_base=rope_base)
            if window:   # the op's decay has gamma^W in it (log_linear_part)
                lin_log = lin_log + linear_log_factor(window, None if log_space else rate, log_gain, dtype)[:, 0]
        if window == 0:
            out = ratio
        else:
            scores = (keys @ q_hat.unsqueeze(-1)).squeeze(-1) * q_hat.shape[-1] ** -0.5   # (B, H, T)
            if rate is not None:
                distance = torch.arange(keys.shape[-2] - 1, -1, -1, device=v.device, dtype=dtype)
                scores = scores + distance * rate[:, None]
            lse = torch.logsumexp(scores, -1)
            out = (torch.exp(scores - lse.unsqueeze(-1)).unsqueeze(-2) @ values).squeeze(-2)
            out = merge(out, lse, ratio, lin_log)
    return out, state._replace(linear=linear, keys=keys, values=values, features=features, position=position + 1)


def plain_linear_step(phi_q, phi_k, v, linear, *, position, window, rate, rotary, rope_base):
    """Add the key that left the window (position - W) to the decayed state and read it with the query, at
    the op's step's scales (recurrent.py's `_plain_step`): the query by its own power of two, the state and
    the key by one from both, their logs added back to the log-weight; the state kept in its own scale."""
    shape = (*v.shape[:2], phi_k.shape[-1], v.shape[-1])
    if linear is None:
        linear = LinearState(v.new_zeros(shape), v.new_zeros(shape[:3]), position - window)
    kv, k_sum = linear.kv, linear.k_sum
    if rate is not None:
        decay = torch.exp(rate)[:, None]   # (H, 1)
        kv, k_sum = decay.unsqueeze(-1) * kv, decay * k_sum
    with torch.no_grad():
        scale = power_of_two_below(torch.cat((k_sum, phi_k), -1).abs().amax(-1, keepdim=True))   # (B, H, 1)
        q_scale = query_scale(phi_q)
    phi_q, phi_k, kv, k_sum = phi_q / q_scale, phi_k / scale, kv / scale.unsqueeze(-1), k_sum / scale
    q_num, k_num = phi_q, phi_k
    if rotary:
        q_num = rotate(phi_q.unsqueeze(-2), offset=position, base=rope_base).squeeze(-2)
        k_num = rotate(phi_k.unsqueeze(-2), offset=position - window, base=rope_base).squeeze(-2)
    kv = kv + k_num.unsqueeze(-1) * v.unsqueeze(-2)
    k_sum = k_sum + phi_k
    num = (q_num.unsqueeze(-2) @ kv).squeeze(-2)
    log_den, safe = guarded_log((phi_q * k_sum).sum(-1))
    log_den = log_den + (q_scale.log() + scale.log()).squeeze(-1)
    state = LinearState(kv * scale.unsqueeze(-1), k_sum * scale, position - window + 1)
    return log_den, num / safe.unsqueeze(-1), state


def log_linear_step(b, a, v, linear, *, position, window, rate, rotary, rope_base):
    """`plain_linear_step` from log-features, through the op's exact recurrence (`recurrent_step`): the
    leaving key at position - W, the query at its own position, as the parallel pass's key offset puts them,
    with the op's decay (its state decays by gamma per token; the query reads it W later, gamma^W)."""
    if linear is None:   # the op's state starts at the leaving key's position
        linear = initial_state(*v.shape[:2], a.shape[-1], v.shape[-1], device=v.device, dtype=v.dtype,
                               log_space=True)._replace(position=position - window)
    ratio, new, lin_log = recurrent_step(b, a, v, linear, rotary=rotary, rope_base=rope_base, log_space=True,
                                         nonnegative_features=True, query_position=position,
                                         return_log_normalizer=True, log_decay=rate)
    return lin_log, ratio, new
