"""Eq. 19 on flash-linear-attention's chunk kernels: the `fla` backend (causal calls on CUDA; `pip
install 'linattn[gpu]'`), the default of backend="auto" on CUDA.  Eq. 19 is one call of fla per forward
(the numerator, its queries divided by the denominator for plain features, with or without a decay;
the denominator from factor_kernels.py's kernels), with glue that scans nothing along the sequence
with torch and reads nothing on the host.

Derivation: docs/derivations.md, "Eq. 19 on fla's kernels (fla_kernels.py)"."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...rotary import rotate_pairs
from .common import (DECAY_FLOOR, LogProjection, chunk_carries, compute_dtype, denominator_guard, divide,
                     feature_tensors, first_derivatives_only, guard_log_features, linear_carries, log_feature_floor,
                     log_feature_limit, log_normalizer, plain_log_normalizer, query_key_phases)
from .recurrent import LinearState
from .stable import numerator_query

TILE = 16   # fla's smallest tile: tl.dot's least width, to which K and V are padded
HALF_DOTS = torch.bfloat16   # the half dtype fla's dots take from the values (not fp16: `dtypes`)


def gated_linear_attention(q, k, v, g, *, return_state: bool):
    """fla's `chunk_gla` on (B, T, H, K) tensors, scale 1: (o, final state or None).  The one place
    that calls it (tests substitute a reference with the same contract)."""
    from fla.ops.gla import chunk_gla   # here: fla is an optional GPU dependency
    return _padded(lambda q, k, v, g: chunk_gla(q, k, v, g, scale=1.0, output_final_state=return_state),
                   q, k, v, g)


def plain_linear_attention(q, k, v, *, return_state: bool):
    """fla's `chunk_linear_attn` (normalize=False, scale 1) on (B, T, H, K) tensors: (o, final state)."""
    from fla.ops.linear_attn import chunk_linear_attn
    return _padded(lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, output_final_state=return_state,
                                                     normalize=False), q, k, v)


def decayed_linear_attention(q, k, v, log_decay, *, return_state: bool):
    """fla's `chunk_simple_gla` with a constant decay per head, g_gamma = log gamma (H,), scale 1, on
    (B, T, H, K) tensors: S_n = gamma S_{n-1} + k_n v_n^T, o_n = q_n^T S_n.  (o, final state or None)."""
    from fla.ops.simple_gla import chunk_simple_gla
    return _padded(lambda q, k, v: chunk_simple_gla(q, k, v, g_gamma=log_decay, scale=1.0,
                                                    output_final_state=return_state), q, k, v)


def _padded(kernel, q, k, v, *gates, multiple: int = TILE):
    """`kernel` with K and V padded with zeros to multiples of 16: tl.dot takes tiles of at least 16, and
    fla's bf16 backward asserts even K and V (chunk_bwd_dv).  A zero feature adds nothing to any product
    (its decay, 0, is a factor of 1 on nothing) and a zero value column gives a zero output column, so
    slicing the padding off leaves the result exact.  A copy only where needed (M, Dv multiples of 16)."""
    def pad(x):
        short = -x.shape[-1] % multiple
        return torch.nn.functional.pad(x, (0, short)) if short else x
    o, state = kernel(*(pad(t) for t in (q, k, v, *gates)))
    first_derivatives_only(o)   # fla's backward is kernels: no graph of the gradient
    m, dv = q.shape[-1], v.shape[-1]
    return o[..., :dv], (state[..., :m, :dv] if state is not None else None)


def dtypes(v: torch.Tensor, *features) -> tuple[torch.dtype, torch.dtype]:
    """(scales and denominator, fla's dots): float32 (float64 stays float64), and bf16 where the values
    are bf16 (under autocast), else the first.  Not fp16: fla writes its sums in the dots' dtype, and
    they outgrow fp16's 65504 (the log-space query factors reach e^30; an elu block 512 wide sums to
    1.75e5 at 2,048 tokens)."""
    work = compute_dtype(*feature_tensors(*features), v)
    return work, (v.dtype if v.dtype == HALF_DOTS else work)


def fla_layout(x: torch.Tensor) -> torch.Tensor:
    """(B, H, N, .) -> fla's (B, N, H, .): a view."""
    return x.transpose(1, 2)


def rotated(x: torch.Tensor, phases: torch.Tensor | None) -> torch.Tensor:
    """R_n x_n for x in fla's layout (phases (N, M/2)): one pass, no layout copy."""
    return x if phases is None else rotate_pairs(x, phases.unsqueeze(1))


def step_decays(scale: torch.Tensor, log_decay: torch.Tensor | None = None) -> torch.Tensor:
    """g_n = (scale_{n-1} - scale_n) + log gamma (g_1 = 0), floored at DECAY_FLOOR, for a (decayed) running
    maximum (B, T, H, ...) and log_decay (H,) or None; the difference first, exact for close scales."""
    decay = torch.empty_like(scale)
    decay[:, :1] = 0
    torch.sub(scale[:, :-1], scale[:, 1:], out=decay[:, 1:])
    if log_decay is not None:
        decay[:, 1:] += log_decay.view(-1, *(1,) * (scale.dim() - 3))
    return decay.clamp_min_(DECAY_FLOOR)


def finish(out, v, *, kv, sums, work: torch.dtype, position: int, log_scale=None):
    """The output (fla's layout) in v's dtype, as a (B, H, N, Dv) view; with the final states kv and sums
    (return_state), also the LinearState in `work`."""
    out = fla_layout(out.to(v.dtype))
    if kv is None:
        return out
    return out, LinearState(kv.detach().to(work), sums.detach().to(work), position, log_scale)


def plain_attention(phi_q, phi_k, v, *, causal: bool, rotary: bool, offset: int, rope_base: float,
                    chunk_size: int, return_state: bool, key_offset: int | None = None,
                    return_log_normalizer: bool = False, log_decay: torch.Tensor | None = None):
    """Plain features (dispatch.py's call shape; causal, N >= 1: the table routes the rest): queries rotated
    at offset.., keys at key_offset.. (None: offset); with return_log_normalizer the rows' log-denominators
    last, (B, H, N) in the work dtype.  One call of fla: the denominator from the keys' running sums
    (`plain_factors`), the queries divided by it before the call.  log_decay (H,) log gamma: the sums
    decayed, and fla's constant gates (`chunk_simple_gla`) for the numerator."""
    del causal, chunk_size   # causal by the table; fla picks its own chunks
    n, m = phi_q.shape[-2:]
    key_offset = int(offset) if key_offset is None else int(key_offset)
    work, dot = dtypes(v, phi_q, phi_k)
    # fla takes its gate in float32: the denominator's sums take that very gamma, so both weigh alike
    gate = None if log_decay is None else log_decay.detach().float()
    rate = None if gate is None else gate.to(work)
    with torch.autocast(v.device.type, enabled=False):
        phases = query_key_phases(n, m, offset=int(offset), key_offset=key_offset, base=rope_base, device=v.device,
                                  dtype=work) if rotary else None
        values = fla_layout(v).to(dot)
        q, k = fla_layout(phi_q), fla_layout(phi_k)
        if kernels_run_on(v):
            from .factor_kernels import plain_factors as kernel_plain_factors
            factors = kernel_plain_factors(q, k, phases, dot=dot, guard=denominator_guard(work), log_decay=rate)
        else:   # torch's glue (CPU outside Triton's interpreter): the factors recomputed for backward
            factors = checkpoint(plain_factors, q, k, phases, work=work, dot=dot, log_decay=rate, use_reentrant=False,
                                 preserve_rng_state=False)
        q_num, k_num, denominator, sums = factors
        if gate is None:
            out, kv = plain_linear_attention(q_num, k_num, values, return_state=return_state)
        else:
            out, kv = decayed_linear_attention(q_num, k_num, values, gate, return_state=return_state)
    result = finish(out, v, kv=kv, sums=sums, work=work, position=key_offset + n)
    return with_log_normalizer(result, denominator, work) if return_log_normalizer else result


def with_log_normalizer(result, denominator, work: torch.dtype):
    """A plain pass's result with the rows' log-denominators last, (B, H, N) from the (B, T, H) denominator."""
    lse = plain_log_normalizer(denominator.to(work)).transpose(1, 2)
    return (*result, lse) if isinstance(result, tuple) else (result, lse)


def plain_factors(q, k, phases, *, work: torch.dtype, dot: torch.dtype, log_decay: torch.Tensor | None = None):
    """fla's inputs for Eq. 19 in one call from plain features in fla's layout (B, T, H, M): q = R phi_q /
    den and k = R phi_k in `dot` (phases: the queries' and keys' rotations (2, T, M/2), or None), the
    denominator den = phi_q . S (B, T, H) in `work`, and S at the last token, S_t = sum_{n<=t} phi_k_n, or
    with log_decay (H,) log gamma (a constant) gamma S_{t-1} + phi_k_t (`decayed_sums`).  Torch's glue: the
    reference of factor_kernels.plain_factors, and the route on CPU outside Triton's interpreter."""
    q, k = q.to(work), k.to(work)
    sums = k.cumsum(1) if log_decay is None else decayed_sums(k, log_decay)
    denominator = (q * sums).sum(-1)
    q = divide(q, denominator)
    if phases is not None:
        q, k = rotated(q, phases[0]), rotated(k, phases[1])
    return q.to(dot), k.to(dot), denominator, sums[:, -1].detach()


def logspace_attention(b, a, v, *, causal: bool, rotary: bool, offset: int, rope_base: float,
                       chunk_size: int, return_state: bool, key_offset: int | None = None,
                       return_log_normalizer: bool = False, log_decay: torch.Tensor | None = None):
    """Log-features b, a (tensors or `LogProjection`s, guarded here: dispatch.GUARD_THEIR_OWN_LOG_FEATURES);
    see docs/derivations.md.  One call of fla, for the numerator; the denominator from the keys' log-sums
    (factor_kernels.py's kernels, or torch's glue `log_factors`).  Queries rotated at offset.., keys at
    key_offset.. (None: offset); with return_log_normalizer the rows' log sum phi_q . phi_k last,
    (B, H, N) in the work dtype.  log_decay (H,) log gamma: in fla's gates and the denominator's sums
    (`key_scales`), the queries' lead offset - key_offset only in the log-normaliser (a constant per head,
    which q and the denominator do not see); the state returned in the frame of the keys' next position
    as the other backends return it."""
    del causal, chunk_size
    n, m = v.shape[-2], a.shape[-1]
    key_offset = int(offset) if key_offset is None else int(key_offset)
    work, dot = dtypes(v, b, a)
    rate = None if log_decay is None else log_decay.detach().to(work)
    with torch.autocast(v.device.type, enabled=False):
        phases = query_key_phases(n, m, offset=int(offset), key_offset=key_offset, base=rope_base,
                                  device=v.device, dtype=work) if rotary else None
        if kernels_run_on(v):
            factors = fused_log_factors(b, a, phases, work=work, dot=dot, guard=True, log_decay=rate)
        else:   # torch's glue (CPU outside Triton's interpreter): the factors recomputed for backward
            b, a = guard_log_features(b, work), guard_log_features(a, work)
            factors = checkpoint(log_factors, b, a, phases, work=work, dot=dot, log_decay=rate, use_reentrant=False,
                                 preserve_rng_state=False)
        q_num, k_num, decay, denominator, row_scale, last_scale, last_log_sums = factors
        numerator, kv = gated_linear_attention(q_num, k_num, fla_layout(v).to(dot), decay, return_state=return_state)
    sums = torch.exp(last_log_sums.detach() - last_scale).to(work) if return_state else None
    if rate is not None and return_state:   # from the last key's frame to the next position's
        last_scale = last_scale + rate[:, None]
    result = finish(divide(numerator, denominator), v, kv=kv, sums=sums, work=work, position=key_offset + n,
                    log_scale=last_scale.detach() if return_state else None)
    if not return_log_normalizer:
        return result
    query_scale = row_scale.squeeze(-1) if rate is None else row_scale.squeeze(-1) + (int(offset) - key_offset) * rate
    lse = log_normalizer(denominator, query_scale).transpose(1, 2)
    return (*result, lse) if return_state else (result, lse)


def kernels_run_on(x: torch.Tensor) -> bool:
    """Triton's kernels run on CUDA, or on CPU under TRITON_INTERPRET=1; CPU tensors outside the
    interpreter (the fla tests' stand-ins on a GPU machine) take torch's glue."""
    import triton   # here: triton, like fla, is a GPU dependency
    return x.is_cuda or triton.knobs.runtime.interpret


def fused_log_factors(b, a, phases, *, work: torch.dtype, dot: torch.dtype, guard: bool = False,
                      log_decay: torch.Tensor | None = None):
    """`log_factors` by factor_kernels.py's fused kernels, reading the log-features where they are (a
    `LogProjection` as its logits in fla's layout, its row shift added in the kernels).  `guard`:
    common.guard_log_features' guard too (in the kernels for tensors; a projection's is on its parts)."""
    from .factor_kernels import log_factors as kernel_log_factors
    if guard:
        b, a = (guard_log_features(x, work) if isinstance(x, LogProjection) else x for x in (b, a))
    tensors = [x for x in (b, a) if not isinstance(x, LogProjection)]
    parts = [part for x in (b, a) for part in kernel_inputs(x, work)]
    q_num, k_num, decay, denominator, row_scale, *last = kernel_log_factors(
        *parts, phases, dot=dot, guard=guard and bool(tensors), limit=log_feature_limit(work),
        floor=log_feature_floor(tensors[0].dtype if tensors else work), log_decay=log_decay)
    return q_num, k_num, decay, denominator, row_scale.unsqueeze(-1), *last


def kernel_inputs(x, work: torch.dtype) -> tuple:
    """(log-features or logits in fla's layout, row shift (B, T, H) or None) of a tensor or `LogProjection`."""
    if not isinstance(x, LogProjection):
        return fla_layout(x), None
    inputs = fla_layout(x.inputs).to(work)
    logits = inputs @ x.weight.to(work).transpose(-1, -2)
    shift = x.row_shift(inputs, fla_layout(x.shift).to(work) if isinstance(x.shift, torch.Tensor) else x.shift)
    if isinstance(shift, torch.Tensor):
        return logits, shift.expand(*logits.shape[:-1], 1).squeeze(-1)
    return logits, (torch.full(logits.shape[:-1], shift, dtype=work, device=logits.device) if shift else None)


def log_features(x, work: torch.dtype) -> torch.Tensor:
    """Log-features in fla's layout and `work` dtype, contiguous (the factors computed from them are
    then in fla's layout, which its kernels would otherwise copy them to); a `LogProjection` is projected
    in that layout, so its (B, N, H, D) inputs give them directly."""
    if not isinstance(x, LogProjection):
        return fla_layout(x).to(work).contiguous()
    inputs = fla_layout(x.inputs).to(work)
    shift = fla_layout(x.shift).to(work) if isinstance(x.shift, torch.Tensor) else x.shift
    logits = inputs @ x.weight.to(work).transpose(-1, -2)
    row_shift = x.row_shift(inputs, shift)
    return logits + row_shift if isinstance(row_shift, torch.Tensor) or row_shift else logits


GLUE_CHUNK = 16   # torch glue's chunks for a decay: a (chunk x chunk) table of lags per chunk


def key_scales(a: torch.Tensor, log_decay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """F (a constant to autograd) and L of the keys' log-features a (B, T, H, M) in fla's layout, decayed by
    log_decay (H,) log gamma: F_t = max_{n<=t} a_n + (t - n) log gamma, L_t = log sum_{n<=t} gamma^(t-n)
    e^(a_n).  A decay's terms within chunks of GLUE_CHUNK tokens from a table of lags (no term grows with
    the index), across them by `chunk_carries`."""
    if log_decay is None:
        return a.detach().cummax(1).values, a.logcumsumexp(1)
    chunks, steps, ahead = glue_chunks(a, log_decay, float("-inf"))
    terms = chunks.unsqueeze(2) + steps[..., None]   # (B, K, t, n, H, M)
    inside_max, inside_sums = terms.detach().amax(3), terms.logsumexp(3)
    carry_max, carry_sums = (chunk_carries(x[:, :, -1], scan, log_decay, GLUE_CHUNK)[:, :, None]
                             for x, scan in ((inside_max, lambda t: t.cummax(1).values),
                                             (inside_sums, lambda t: t.logcumsumexp(1))))
    scale = torch.maximum(carry_max + ahead[..., None], inside_max)
    sums = torch.logaddexp(carry_sums + ahead[..., None], inside_sums)
    return scale.flatten(1, 2)[:, :a.shape[1]], sums.flatten(1, 2)[:, :a.shape[1]]


def decayed_sums(k: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """S_t = gamma S_{t-1} + k_t (S_0 = k_0) of plain features k (B, T, H, M) in fla's layout, log_decay (H,)
    log gamma: within chunks of GLUE_CHUNK tokens from a table of gamma^(t - n), across them by
    common.linear_carries (no power of gamma beyond a chunk's is formed)."""
    chunks, steps, ahead = glue_chunks(k, log_decay, 0.0)
    inside = torch.einsum("tnh,bknhm->bkthm", steps.exp(), chunks)
    carry = linear_carries(inside[:, :, -1], log_decay, GLUE_CHUNK)[:, :, None]   # S before each chunk
    return (inside + carry * ahead.exp()[..., None]).flatten(1, 2)[:, :k.shape[1]]


def glue_chunks(x: torch.Tensor, log_decay: torch.Tensor, fill: float):
    """x (B, T, H, M) in chunks of GLUE_CHUNK tokens, (B, K, GLUE_CHUNK, H, M), the last padded with `fill`;
    the decay's log-weights within a chunk, (t - n) log gamma (t, n, H) (-inf for n > t); and each row's
    from the token before its chunk, (t + 1) log gamma (t, H)."""
    size = GLUE_CHUNK
    padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, -x.shape[1] % size), value=fill)
    rows = torch.arange(size, device=x.device)
    lags = (rows[:, None] - rows).to(x.dtype)[..., None]   # (t, n, 1) within a chunk
    steps = torch.where(lags >= 0, lags.clamp_min(0) * log_decay, float("-inf"))
    return padded.unflatten(1, (-1, size)), steps, (rows + 1).to(x.dtype)[:, None] * log_decay


def log_factors(b, a, phases, *, work: torch.dtype, dot: torch.dtype, log_decay: torch.Tensor | None = None):
    """fla's inputs from log-features (tensors or `LogProjection`s), in its layout: the numerator's
    q, k (in `dot`) and decays (in `work`); the denominator sum_j e^(b_j + L_j - Q) (B, T, H) with
    L = log sum_{n<=m} gamma^(m-n) e^(a_n), and Q (B, T, H, 1); and F and L at the last token.  phases:
    the queries' and keys' rotations (2, T, M/2) or None; log_decay (H,) log gamma or None (`key_scales`),
    a constant.  Torch's glue: the reference of factor_kernels.py's kernels, and the route on CPU
    outside Triton's interpreter."""
    b, a = log_features(b, work), log_features(a, work)
    feature_scale, log_sums = key_scales(a, log_decay)   # F (a constant to autograd), L
    with torch.no_grad():   # the scales cancel exactly: constants to autograd
        row_scale = (b + feature_scale).amax(-1, keepdim=True)         # Q
    denominator = torch.exp(b + log_sums.to(work) - row_scale).sum(-1)
    last = feature_scale[:, -1], log_sums[:, -1]
    if phases is None:   # P = F: no cap acts below 1
        with torch.no_grad():
            decay = step_decays(feature_scale, log_decay)
        q_num = torch.exp(b + feature_scale - row_scale).to(dot)          # e^(b + F - Q) <= 1
        return q_num, torch.exp(a - feature_scale).to(dot), decay, denominator, row_scale, *last
    with torch.no_grad():   # P, kept per pair (M / 2): broadcast over the pair where it is used
        pair_scale = feature_scale.unflatten(-1, (-1, 2)).amax(-1, keepdim=True)
        decay = step_decays(pair_scale, log_decay).expand(*pair_scale.shape[:-1], 2).flatten(-2)
        pair_shift = pair_scale - row_scale.unsqueeze(-1)                # P - Q
    k_num = rotated(torch.exp(per_pair(a, torch.sub, pair_scale)), phases[1]).to(dot)
    q_num = rotated(numerator_query(per_pair(b, torch.add, pair_shift)), phases[0]).to(dot)
    return q_num, k_num, decay, denominator, row_scale, *last


def per_pair(x: torch.Tensor, op, pair_values: torch.Tensor) -> torch.Tensor:
    """op(x, value of x's pair) for x (..., M) and pair values (..., M / 2, 1): one pass."""
    return op(x.unflatten(-1, (-1, 2)), pair_values).flatten(-2)
