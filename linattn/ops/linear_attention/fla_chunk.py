"""Eq. 19 on flash-linear-attention's chunk kernels: the `fla` backend (CUDA; `pip install 'linattn[fla]'`).

Why a library's kernels: on one H200, bf16 forward + backward, b=1, h=8, M=Dv=64, N=65,536
(docs/results/bench-gpu-h200/kernels-partial.txt), fla's `chunk_gla` took 5.5 ms where
log_chunk_parallel.py's kernels took 106 ms, and `chunk_linear_attn` 1.7 ms where chunk_parallel.py's
took 18.5 ms.  fla's kernels are chunk-parallel with `tl.dot` on tiles in the input dtype (tensor
cores), and Eq. 19 maps onto them exactly.  fla computes gated linear attention,

    o_m = sum_{n<=m} (q_m * e^{G_m - G_n})^T k_n v_n,   G_m = sum_{t<=m} g_t  (per feature, g <= 0),

and forms only factors e^{G_m - G_n} <= 1 (n <= m) inside its chunks, so nothing it computes overflows.

* Numerator, plain features: q = R_m phi(q_m), k = R_n phi(k_n), no decay (`chunk_linear_attn`).
* Numerator, log-features b = log phi(q), a = log phi(k) (stable.py's numerics and names): with the
  running maxima P (per rotation pair, so that the scale commutes with R) and the row scale Q,
      k_n = R_n e^{a_n - P_n} (<= 1),   g_n = P_{n-1} - P_n (<= 0, g_1 = 0),
      q_m = R_m min(e^{b_m + P_m - Q_m}, e^NUMERATOR_CAP),
  so q_m e^{G_m - G_n} k_n = R_m e^{b_m} R_n e^{a_n} e^{-Q_m}: Eq. 19's terms scaled by e^{-Q_m}, the
  same capped factors as every log-space backend (`chunk_gla`).
* Denominator, never rotated, in float32 by torch: plain, phi(q_m) . cumsum(phi(k))_m; log-features,
  e^{logsumexp_j(b_mj + L_mj) - Q_m} with L = logcumsumexp of a over positions (>= 1: the term that
  reaches Q_m is 1, so no row is zero).
* Output: numerator / denominator, in v's dtype.  The numerator's dots run in v's dtype (bf16 under
  autocast; fp16 for plain features only, since the capped query factors exceed fp16's range), the
  scales and the denominator in float32.  The decays are floored at DECAY_FLOOR (why: below).
* Gradients: fla's backward and autograd through these torch ops.  The scales P and Q are constants
  to autograd: out does not depend on them (they cancel exactly), so only the factors carry gradient.
  The factors and the denominator are recomputed in backward (torch.utils.checkpoint) instead of
  kept, and so are log-features given as a `LogProjection` (FAVOR+'s block): what a layer holds until
  its backward is then the features (for a projection its (B, H, N, D) inputs), what fla keeps, the
  values and fla's half-precision output for the division.  In (B, H, N, M) float32 tensors' worth, at
  M = Dv with a stand-in for fla that keeps its inputs: 5.0 for log-features and 3.0 for plain bf16
  features, against 9.8 and 4.8 when autograd kept everything; 3.0 for a projection with M = 4D
  (7.5 materialised outside).  fla's own kernels (in Triton's interpreter, M = 4D = 4Dv) keep their
  float32 decays and its cumsum beside their inputs: 3.3 for a projection, 5.9 before.  The factors
  are made, and recomputed, in blocks of the B x H rows (FACTOR_BLOCK_ELEMENTS), so that making
  them and their backward hold one block's temporaries, not the whole batch's.
* State (`return_state`): fla's final state is sum_n R_n e^{a_n - P_N} v_n, the kv of `LinearState`
  at the last token's scales (log_scale F_N, the max of a over every key); k_sum is the cumsum's last
  row (e^{L_N - F_N} for log-features).

fla's kernels are causal; a non-causal call takes the torch backend's entry, as the table says
(dispatch.py).  fla computes in float32 at most, so float64 inputs are refused (`resolve`)."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from .common import LogProjection, compute_dtype, divide, feature_tensors, finite_log_features, numerator_feature
from .recurrent import LinearState
from .stable import numerator_query, numerator_scale

# The log decays g are bounded below.  A key feature of exactly 0 (log -inf, raised to a floor near
# -8.5e37: a masked or left-padded key) before that feature's first real key makes one step's decay
# about -8.5e37, and fla's chunk-local float32 cumsum of g then absorbs every later step of the chunk
# (seen in an emulation of chunk_gla: outputs 19x off).  A term carried through a step of e^-100 is
# below e^(30 - 100) of its row's denominator (>= 1), so the floor changes no float32 result.
DECAY_FLOOR = -100.0

# The factors are made in blocks of the B x H rows, each block checkpointed on its own, so that the
# float32 temporaries of making them (the running maxima, L, the exponentials and what autograd
# keeps of them while their backward runs) are a block's, not the whole batch's: autograd runs the
# later block's backward whole before the earlier's (its nodes have the higher sequence numbers).
# A block holds up to this many (B, H, N, M) elements (32 MiB in float32; one row at least); below
# it a call is one block, so small calls launch no more kernels than before.  Measured on CPU with
# tests/linattn/ops/fla_factor_memory.py (N = 16,384, H = 8, M = 256, FAVOR+'s projection; 4 blocks): the peak
# above the inputs went from 5.8 to 3.6 (B, H, N, M) float32 tensors in the forward and from 13.3
# to 5.4 over forward and backward, of which fla's stand-in keeps 3.
FACTOR_BLOCK_ELEMENTS = 2 ** 23


def gated_linear_attention(q, k, v, g, *, return_state: bool):
    """fla's `chunk_gla` on (B, H, N, K) tensors, scale 1: (o, final state or None).  The one place
    that calls fla for log-features (tests substitute a reference with the same contract)."""
    from fla.ops.gla import chunk_gla   # here: fla is an optional GPU dependency
    return _padded(lambda q, k, v, g: chunk_gla(q, k, v, g, scale=1.0, output_final_state=return_state),
                   q, k, v, g)


def plain_linear_attention(q, k, v, *, return_state: bool):
    """fla's `chunk_linear_attn` (normalize=False, scale 1) on (B, H, N, K) tensors: (o, final state)."""
    from fla.ops.linear_attn import chunk_linear_attn
    return _padded(lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, output_final_state=return_state,
                                                     normalize=False), q, k, v)


def _padded(kernel, q, k, v, *gates, multiple: int = 16):
    """`kernel` on fla's (B, T, H, .) layout with K and V padded with zeros to multiples of 16: tl.dot
    takes tiles of at least 16, and fla's bf16 backward asserts even K and V (chunk_bwd_dv).  A zero
    feature adds nothing to any product (its decay, 0, is a factor of 1 on nothing) and a zero value
    column gives a zero output column, so slicing the padding off leaves the result exact."""
    def pad(x):   # a copy only where needed (M = 64 or 256 and Dv = 64 need none)
        short = -x.shape[-1] % multiple
        return torch.nn.functional.pad(x, (0, short)) if short else x
    o, state = kernel(*(pad(t).transpose(1, 2) for t in (q, k, v, *gates)))
    m, dv = q.shape[-1], v.shape[-1]
    return o.transpose(1, 2)[..., :dv], (state[..., :m, :dv] if state is not None else None)


def dtypes(v: torch.Tensor, *features, halves=(torch.bfloat16, torch.float16)) -> tuple[torch.dtype, torch.dtype]:
    """(scales and denominator, fla's dots): float32 (float64 stays float64, for the reference tests:
    `resolve` gives fla no float64 call), and the values' dtype where it is one of `halves` (bf16 under
    autocast), else the first."""
    work = compute_dtype(*feature_tensors(*features), v)
    return work, (v.dtype if v.dtype in halves else work)


def linear_attention(phi_q, phi_k, v, *, causal: bool, rotary: bool, offset: int, rope_base: float,
                     chunk_size: int, return_state: bool):
    """Plain features (dispatch.py's call shape; causal, N >= 1: the table routes the rest)."""
    del causal, chunk_size   # causal by the table; fla picks its own chunks
    n, (work, dot) = v.shape[-2], dtypes(v, phi_q, phi_k)
    with torch.autocast(v.device.type, enabled=False):
        # recomputed in backward, as log_linear_attention's factors (the float32 copies and sums)
        q_num, k_num, denominator, last_key_sum = blocked_factors(
            plain_factors, phi_q, phi_k, rotary=rotary, offset=offset, rope_base=rope_base, work=work, dot=dot)
        numerator, kv = plain_linear_attention(q_num, k_num, v.to(dot), return_state=return_state)
        out = divide(numerator, denominator).to(v.dtype)   # in float32 by promotion; keeps the half numerator
    if not return_state:
        return out
    return out, LinearState(kv.detach().to(work), last_key_sum, int(offset) + n)


def blocked_factors(make, phi_q, phi_k, **options) -> tuple[torch.Tensor, ...]:
    """make(phi_q, phi_k, **options) (plain_factors or log_factors) on blocks of the B x H rows, each
    recomputed in backward (torch.utils.checkpoint; the factors draw no random numbers), the outputs
    written block by block into (B, H, ...) tensors (a torch.cat of the parts would hold them twice).
    A block is a range of batch entries with every head, or of one entry's heads: slices of the
    (B, H, N, .) tensors as they come, views whatever their strides (q and k are views of the
    layer's fused projection), so nothing is copied."""
    batch, heads, length, features = phi_q.shape
    blocks = row_blocks(batch, heads, per_row=features * length)
    joined = None
    for block in blocks:
        part = checkpoint(make, *(row_slice(x, block) for x in (phi_q, phi_k)), use_reentrant=False,
                          preserve_rng_state=False, **options)
        if len(blocks) == 1:
            return part
        if joined is None:
            joined = [t.new_empty(batch, heads, *t.shape[2:]) for t in part]
        joined = [WriteBlock.apply(whole, piece, block) for whole, piece in zip(joined, part)]
        del part
    return tuple(joined)


class WriteBlock(torch.autograd.Function):
    """whole[block] = piece, in place.  Backward hands whole's gradient on as it is and its block to
    the piece: the blocks do not overlap and `whole` starts as new_empty (no gradient), so the part
    of the gradient an earlier version of `whole` receives for this block reaches nothing.  (Slice
    assignment's own backward copies and zeroes the whole gradient once per block.)"""

    @staticmethod
    def forward(ctx, whole, piece, block):
        whole[block] = piece
        ctx.mark_dirty(whole)
        ctx.block = block
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[ctx.block], None


def row_blocks(batch: int, heads: int, per_row: int, most: int = None) -> list[tuple[slice, slice]]:
    """(batch slice, head slice) blocks covering B x H rows of `per_row` elements each, every block
    at most `most` elements (FACTOR_BLOCK_ELEMENTS) and at least one row: whole batch entries while
    one entry fits, else ranges of one entry's heads; the blocks as even as they can be."""
    most = FACTOR_BLOCK_ELEMENTS if most is None else most
    rows_per_block = max(1, most // per_row)
    if rows_per_block >= heads or batch == 0:   # whole entries: ranges of the batch (one empty one for B = 0)
        return [(entries, slice(None)) for entries in even_ranges(batch, max(1, rows_per_block // heads))]
    return [(slice(entry, entry + 1), head_range) for entry in range(batch)
            for head_range in even_ranges(heads, rows_per_block)]


def even_ranges(count: int, most: int) -> list[slice]:
    """count items in as few ranges of at most `most` as can hold them, of near-equal length (one
    empty range when count is 0)."""
    pieces = max(1, -(-count // most))
    bounds = [count * i // pieces for i in range(pieces + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


def row_slice(x, block: tuple[slice, slice]):
    """The block's rows of features or of a LogProjection (its inputs and shift; the weight is shared)."""
    if isinstance(x, LogProjection):
        shift = x.shift[block] if isinstance(x.shift, torch.Tensor) else x.shift
        return x._replace(inputs=x.inputs[block], shift=shift)
    return x[block]


def plain_factors(phi_q, phi_k, *, rotary: bool, offset: int, rope_base: float, work: torch.dtype,
                  dot: torch.dtype):
    """fla's inputs (rotated features in `dot`), the denominator and the state's k_sum, in an order
    that keeps few (B, H, N, M) float32 tensors alive at once (each side rotated and cast in turn)."""
    phi_q, phi_k = phi_q.to(work), phi_k.to(work)
    key_sums = phi_k.cumsum(-2)
    denominator = (phi_q * key_sums).sum(-1)
    last_key_sum = key_sums[..., -1, :].detach().clone()
    del key_sums
    k_num = numerator_feature(phi_k, rotary=rotary, offset=offset, base=rope_base).to(dot)
    del phi_k
    q_num = numerator_feature(phi_q, rotary=rotary, offset=offset, base=rope_base).to(dot)
    return q_num, k_num, denominator, last_key_sum


def log_linear_attention(b, a, v, *, causal: bool, rotary: bool, offset: int, rope_base: float,
                         chunk_size: int, return_state: bool):
    """Log-features b, a (tensors or `LogProjection`s, materialised); see the module docstring."""
    del causal, chunk_size
    # fp16 would overflow: query factors reach e^NUMERATOR_CAP = e^30 (fp16's largest is e^11)
    n, (work, dot) = v.shape[-2], dtypes(v, b, a, halves=(torch.bfloat16,))
    with torch.autocast(v.device.type, enabled=False):
        # Recomputed in backward rather than kept: kept, the factors, L and b + L hold about five
        # (B, H, N, M) float32 tensors per layer until backward reaches it (about 2.7 GB per layer at
        # N = 65,536, h = 8, M = 256); recomputing them is elementwise work beside fla's.  A
        # `LogProjection` (FAVOR+'s block) is materialised inside too, so that what is kept is its
        # (B, H, N, D) inputs, not b and a (M = 4D in the benchmark's FAVOR+ block).
        q_num, k_num, decay, denominator, last_scale, last_key_sum = blocked_factors(
            log_factors, b, a, rotary=rotary, offset=offset, rope_base=rope_base, work=work, dot=dot)
        numerator, kv = gated_linear_attention(q_num, k_num, v.to(dot), decay, return_state=return_state)
        out = divide(numerator, denominator).to(v.dtype)
    if not return_state:
        return out
    return out, LinearState(kv.detach().to(work), last_key_sum, int(offset) + n, last_scale)


def log_factors(b, a, *, rotary: bool, offset: int, rope_base: float, work: torch.dtype, dot: torch.dtype):
    """fla's inputs and the denominator from log-features (tensors or `LogProjection`s): (q, k in
    `dot`, the decay g, the denominator scaled by e^{-Q}, and the state's F_N and e^{L_N - F_N}).
    Ordered so that few (B, H, N, M) float32 tensors are alive at once: F is dropped once P and Q are
    taken, L once the denominator is, and each side's factor is rotated and cast before the next is
    made (the forward's peak at M = 4D went from 10 such tensors to 6, measured on CPU)."""
    b, a = (finite_log_features(x.materialize() if isinstance(x, LogProjection) else x).to(work) for x in (b, a))
    with torch.no_grad():   # the scales cancel exactly: constants to autograd
        feature_scale = a.cummax(-2).values                       # F
        row_scale = (b + feature_scale).amax(-1, keepdim=True)    # Q
        last_scale = feature_scale[..., -1, :].clone()
        pair_scale = numerator_scale(feature_scale, rotary)       # P
        del feature_scale
    key_sums = a.logcumsumexp(-2)                                 # L
    last_key_sum = torch.exp(key_sums[..., -1, :].detach() - last_scale)
    denominator = torch.exp((b + key_sums).logsumexp(-1) - row_scale.squeeze(-1))
    del key_sums
    k_num = numerator_feature(torch.exp(a - pair_scale), rotary=rotary, offset=offset, base=rope_base).to(dot)
    del a
    q_num = numerator_feature(numerator_query(b + pair_scale - row_scale), rotary=rotary, offset=offset,
                              base=rope_base).to(dot)
    del b
    with torch.no_grad():   # g_n = P_{n-1} - P_n (g_1 = 0), written into one tensor
        decay = torch.zeros_like(pair_scale)
        torch.sub(pair_scale[..., :-1, :], pair_scale[..., 1:, :], out=decay[..., 1:, :])
        decay.clamp_min_(DECAY_FLOOR)
    return q_num, k_num, decay, denominator, last_scale, last_key_sum
