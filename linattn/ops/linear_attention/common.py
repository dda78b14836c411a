"""What every implementation of linear attention shares: log-features given as a projection, the
debug-mode data checks, compute dtype, the guarded division and the numerator's rotation."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...checks import debug_enabled
from ...rotary import rotary_phases, rotate

DEFAULT_CHUNK_SIZE = 64   # tokens per chunk of the torch backend's causal passes

# The log decays g of fla's route (fla_kernels.py, factor_kernels.py) are bounded below.  A key feature
# of exactly 0 (log -inf, raised to `log_feature_floor`: a masked or left-padded key) before that
# feature's first real key makes one step's decay about the floor, and fla's chunk-local float32 cumsum
# of g then absorbs every later step of the chunk (seen in an emulation of chunk_gla: outputs 19x off).
# A term carried through a step of e^-100 is below e^(30 - 100) of its row's denominator (>= 1), so the
# floor changes no float32 result.
DECAY_FLOOR = -100.0


class LogProjection(NamedTuple):
    """Log-features given as inputs @ weight^T + square_scale |inputs|^2 + shift: (B, H, N, D) inputs,
    an (M, D) weight, a shift that is a number or a (B, H, N, 1) tensor, and a number square_scale
    (FAVOR+: weight w D^(-1/4), square_scale -D^(-1/2) / 2, shift -log(M) / 2).  The causal op then
    computes them chunk by chunk and returns gradients for the inputs, never holding an N x M tensor;
    the squared norm is taken inside it too, so its gradient needs no (B, H, N, D) tensor of its own."""
    inputs: torch.Tensor
    weight: torch.Tensor
    shift: torch.Tensor | float = 0.0
    square_scale: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        """The log-features' shape, (B, H, N, M), as a tensor of them would have it."""
        return (*self.inputs.shape[:-1], self.weight.shape[0])

    def row_shift(self, inputs: torch.Tensor, shift) -> torch.Tensor | float:
        """square_scale |inputs|^2 + shift for some rows of the inputs (and the shift's rows)."""
        if not self.square_scale:
            return shift
        return inputs.square().sum(-1, keepdim=True).mul_(self.square_scale).add_(shift)

    def rows(self, positions: slice) -> torch.Tensor:
        """The log-features (B, H, len, M) of some positions, projected from their inputs alone."""
        x = self.inputs[:, :, positions]
        logits = (x.reshape(-1, x.shape[-1]) @ self.weight.transpose(-1, -2)).view(*x.shape[:-1],
                                                                                    self.weight.shape[0])
        shift = self.shift[:, :, positions] if isinstance(self.shift, torch.Tensor) else self.shift
        row_shift = self.row_shift(x, shift)
        return logits.add_(row_shift) if isinstance(row_shift, torch.Tensor) or row_shift else logits

    def to(self, dtype: torch.dtype) -> LogProjection:
        """The projection with its tensors in `dtype`."""
        shift = self.shift.to(dtype) if isinstance(self.shift, torch.Tensor) else self.shift
        return self._replace(inputs=self.inputs.to(dtype), weight=self.weight.to(dtype), shift=shift)

    def take(self, positions: slice) -> LogProjection:
        """The projection of some positions' rows (views of the inputs and shift)."""
        shift = self.shift[:, :, positions] if isinstance(self.shift, torch.Tensor) else self.shift
        return self._replace(inputs=self.inputs[:, :, positions], shift=shift)

    def materialize(self) -> torch.Tensor:
        """The log-features, in the inputs' dtype whatever autocast says (adding the shift keeps its
        backward a plain sum: sub's would negate the (N, M) gradient first)."""
        with torch.autocast(self.inputs.device.type, enabled=False):
            logits = self.inputs @ self.weight.to(self.inputs.dtype).transpose(-1, -2)
            return logits + self.row_shift(self.inputs, self.shift)


def source_parts(x) -> tuple:
    """A log-feature tensor or a `LogProjection` as an autograd function's arguments (inputs, weight,
    shift, square_scale; weight None for a tensor), which take no named tuples."""
    return tuple(x) if isinstance(x, LogProjection) else (x, None, None, None)


def source_from_parts(inputs, weight, shift, square_scale):
    """The log-feature tensor (weight None) or the `LogProjection` that `source_parts` gave."""
    return inputs if weight is None else LogProjection(inputs, weight, shift, square_scale)


def log_feature_limit(dtype: torch.dtype) -> float:
    """The largest |log-feature| the log-space path takes: 1/eps (2^23 ~ 8.4e6 in float32, 2^52 ~ 4.5e15
    in float64).  Beyond it the dtype holds a log-feature only to within 1 or worse, so the weights
    e^(a_n - a_n') are wrong by factors of e or more; and two roundings of one token's log-features (a
    chunk's rows projected together or alone) then differ by more than the algorithm's margins
    (JUMP_LIMIT), which gave NaN at float32 inputs of 1e10 (FAVOR+ at input scale 1e5)."""
    return 1 / torch.finfo(dtype).eps


def check_log_feature_range(phi_q, phi_k, dtype: torch.dtype) -> None:
    """Every finite |log-feature| at most `log_feature_limit(dtype)` (-inf, a feature that is exactly 0,
    is allowed).  One read of each tensor; for a LogProjection an upper bound from its parts, one read of
    its inputs: |a| <= |x| max_j |w_j| + |square_scale| |x|^2 + |shift|."""
    limit = log_feature_limit(dtype)
    for name, x in (("phi_q", phi_q), ("phi_k", phi_k)):
        largest = _largest_log_feature(x)
        if not largest <= limit:   # NaN passes: a NaN input gives NaN outputs, as documented
            if largest != largest:
                continue
            reach = f"{largest:.3g}" if largest != float("inf") else "past float range"
            raise ValueError(f"{name}'s log-features reach {reach} in magnitude, beyond {limit:.3g} (1/eps of "
                             f"{str(dtype).removeprefix('torch.')}), where they cannot be held to within 1 and "
                             f"attention weights lose all accuracy; scale the inputs down (for FAVOR+ |x|^2/(2 sqrt(D)) "
                             f"must stay below it) or compute in float64")


def _largest_log_feature(x) -> float:
    """max |log-feature| over finite ones (for a LogProjection, the bound of check_log_feature_range)."""
    with torch.no_grad():
        if isinstance(x, LogProjection):
            if not x.inputs.numel():
                return 0.0
            # norms with no (B, H, N, D) temporary, squared as Python floats (doubles): no overflow
            norm = torch.linalg.vector_norm(x.inputs, dim=-1).amax().item()
            weight = torch.linalg.vector_norm(x.weight, dim=-1).amax().item() if x.weight.numel() else 0.0
            shift = x.shift.abs().amax().item() if isinstance(x.shift, torch.Tensor) else abs(x.shift)
            return norm * weight + abs(x.square_scale) * norm ** 2 + shift
        if not x.numel():
            return 0.0
        low, high = torch.aminmax(x)
        if low.item() == float("-inf"):   # features that are exactly 0 (masked keys) do not count
            low = x.masked_fill(torch.isneginf(x), 0).amin()
        return max(-low.item(), high.item())


def check_nonnegative(phi_q: torch.Tensor, phi_k: torch.Tensor) -> None:
    """The denominator sums phi_q . phi_k and is only safe to divide by when every term is >= 0.
    One min() per tensor: a read of N x M against the op's O(N M (Dv + chunk)) work (measured on
    2 CPU cores at N=8192, M=256: ~13 ms, a few % of the causal forward, ~1% of forward+backward)."""
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k)):
        if t.numel() and (low := t.detach().amin()) < 0:
            raise ValueError(f"{name} has negative entries (min {low.item():.3g}); linear attention needs "
                             f"non-negative features, since the denominator is a sum of phi_q . phi_k: "
                             f"use a feature map such as elu(x)+1 or favor (or, for features whose kernel "
                             f"phi_q . phi_k is positive by construction, pass nonnegative_features=False)")


def guard_log_features(x, dtype: torch.dtype):
    """Log-features as every backend takes them, made without reading a value on the host: -inf (a
    feature that is exactly 0, such as a masked key's) raised to a finite floor far below any real one
    (stable.py's running maxima are then finite, so no -inf - (-inf) makes a NaN, and e^(floor - F) is
    still exactly 0 beside any real feature; a value at the floor counts as -inf, so that guarding twice
    changes nothing), and every row that holds a log-feature beyond
    `log_feature_limit(dtype)` (or +inf) made NaN, so that it gives NaN outputs rather than finite and
    wrong ones (debug mode raises instead: `check_log_feature_range`).  A `LogProjection` is judged by
    the bound of its parts and carries the NaN in its shift, so nothing (B, H, N, M) is made."""
    limit = log_feature_limit(dtype)
    with torch.no_grad():
        if isinstance(x, LogProjection):
            norm = torch.linalg.vector_norm(x.inputs, dim=-1, keepdim=True)
            weight = torch.linalg.vector_norm(x.weight, dim=-1).amax().to(norm.dtype)
            shift = x.shift.abs() if isinstance(x.shift, torch.Tensor) else abs(x.shift)
            largest = norm * weight + abs(x.square_scale) * norm.square() + shift
        else:   # -inf and the floor (log-features guarded before) are features of 0; NaN rows stay NaN
            largest = torch.where(x <= log_feature_floor(x.dtype), 0.0, x).abs_().amax(-1, keepdim=True)
        poison = torch.where(largest <= limit, 0.0, float("nan")).to(feature_tensors(x)[0].dtype)
    if isinstance(x, LogProjection):
        return x._replace(shift=x.shift + poison)
    # clamp_min as a where: its backward keeps a mask of the raised entries, not a copy of the log-features
    floor = log_feature_floor(x.dtype)
    return torch.where(x < floor, floor, x).add_(poison)


def log_feature_floor(dtype: torch.dtype) -> float:
    """Where `guard_log_features` raises -inf log-features to: finite, far below any real one."""
    return torch.finfo(dtype).min / 4


def nan_where_negative(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """v with NaN in each row whose query or key features hold a negative entry, read on the device only:
    the outputs that row reaches come out NaN, rather than finite and wrong (debug mode raises instead:
    `check_nonnegative`)."""
    with torch.no_grad():
        low = torch.minimum(phi_q.amin(-1, keepdim=True), phi_k.amin(-1, keepdim=True))
        poison = torch.where(low < 0, float("nan"), 0.0).to(v.dtype)
    return v + poison


def guard_features(phi_q, phi_k, v: torch.Tensor, dtype: torch.dtype, *, log_space: bool,
                   nonnegative_features: bool, check_range: bool = True, guard_log: bool = True):
    """(phi_q, phi_k, v) as the computation takes them: log-features raised to their floor (the range
    checked first in debug mode), or for non-negative plain features a negative one made NaN in the
    values it reaches (checked in debug mode), so that bad features never give a finite wrong output.
    `guard_log=False`: the implementation guards log-features itself (`guard_log_features`' work done
    where its kernels read them); the debug check still runs here."""
    if log_space:   # the bound first: -inf (a feature that is exactly 0) is raised to a floor below it
        if check_range and debug_enabled():
            check_log_feature_range(phi_q, phi_k, dtype)
        if not guard_log:
            return phi_q, phi_k, v
        return guard_log_features(phi_q, dtype), guard_log_features(phi_k, dtype), v
    if nonnegative_features:
        if debug_enabled():
            check_nonnegative(phi_q, phi_k)
        v = nan_where_negative(phi_q, phi_k, v)
    return phi_q, phi_k, v


def feature_tensors(*features) -> list[torch.Tensor]:
    """The tensors behind features given as tensors or `LogProjection`s."""
    return [t for x in features for t in (x if isinstance(x, LogProjection) else (x,)) if isinstance(t, torch.Tensor)]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def denominator_guard(dtype: torch.dtype) -> float:
    """The least denominator divided by.  Features are non-negative, so a denominator is >= 0; it is
    clamped only where (nearly) every key feature underflowed; sqrt(tiny) keeps 1/den^2 finite in the
    backward pass."""
    return torch.finfo(dtype).tiny ** 0.5


def divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return numerator / denominator.clamp_min(denominator_guard(denominator.dtype)).unsqueeze(-1)


def output_gradients(grad: torch.Tensor, out: torch.Tensor, denominator: torch.Tensor):
    """d loss / d numerator and d loss / d denominator of out = `divide`(numerator, denominator),
    given g = d loss / d out: g / den and -(g . out) / den, none where the denominator was clamped."""
    guard = denominator_guard(denominator.dtype)
    clamped, denominator = denominator < guard, denominator.clamp_min(guard)
    g_num = grad / denominator.unsqueeze(-1)
    g_den = (-(grad * out).sum(-1) / denominator).masked_fill_(clamped, 0)
    return g_num, g_den


def numerator_features(phi_q, phi_k, *, rotary: bool, offset: int, base: float, key_offset: int | None = None):
    """Eq. 19's rotated features, the queries at offset.., the keys at key_offset.. (None: offset too)."""
    return (numerator_feature(phi_q, rotary=rotary, offset=offset, base=base),
            numerator_feature(phi_k, rotary=rotary, offset=offset if key_offset is None else key_offset, base=base))


def query_key_phases(n: int, m: int, *, offset: int, key_offset: int, base: float, device,
                     dtype: torch.dtype) -> torch.Tensor:
    """The rotations of the log-space passes, (2, N, M/2) complex: [0] the queries' at offset..offset+N-1,
    [1] the keys' at key_offset..; where both start at one position, one tensor expanded (no copy)."""
    keys = rotary_phases(n, m, offset=key_offset, base=base, device=device, dtype=dtype)
    if key_offset == offset:
        return keys.unsqueeze(0).expand(2, -1, -1)
    return torch.stack((rotary_phases(n, m, offset=offset, base=base, device=device, dtype=dtype), keys))


def chunk_carries(summary: torch.Tensor, scan, log_decay: torch.Tensor | None = None, chunk: int = 1,
                  reverse: bool = False) -> torch.Tensor:
    """What each chunk carries in from the chunks before it (after it, `reverse`): `scan` (a cummax or
    logcumsumexp along dim 1) over the chunks' summaries (B, K, H, M) but its own, -inf where none.  With a
    decay (H,) log gamma, summary k stands at its chunk's last token (first, `reverse`) and carry k at the
    token just before chunk k (just after it): each chunk between adds `chunk` log gamma.  The frames
    k chunk log gamma grow with k: that sum is taken in float64, where they stay exact."""
    if reverse:
        return chunk_carries(summary.flip(1), scan, log_decay, chunk).flip(1)
    if log_decay is None:
        before = scan(summary[:, :-1])
    else:
        step = log_decay.double()[:, None] * chunk   # (H, 1)
        frame = torch.arange(summary.shape[1] - 1, device=summary.device, dtype=torch.float64)[:, None, None] * step
        before = (scan(summary[:, :-1].double() - frame) + frame).to(summary.dtype)
    return torch.cat([torch.full_like(summary[:, :1], float("-inf")), before], 1)


def linear_carries(summary: torch.Tensor, log_decay: torch.Tensor | None = None, chunk: int = 1,
                   reverse: bool = False) -> torch.Tensor:
    """What each chunk carries in of a running sum from the chunks before it (after it, `reverse`): the
    sum of the chunks' summaries (B, K, H, M) but its own, 0 where none.  With a decay (H,) log gamma,
    each summary weighted by gamma to the tokens between, as `chunk_carries` frames them: the positive
    and the negative parts each carried as log-sums in float64 (no power of gamma formed, so nothing
    under- or overflows however many chunks), their difference in the summaries' dtype.  Differentiable:
    its gradient is the carries of the other direction."""
    if log_decay is None:
        total = (summary.flip(1) if reverse else summary).cumsum(1)
        before = torch.cat([torch.zeros_like(total[:, :1]), total[:, :-1]], 1)
        return before.flip(1) if reverse else before
    return _LinearCarries.apply(summary, log_decay, chunk, reverse)


class _LinearCarries(torch.autograd.Function):
    """`linear_carries` with a decay: a linear map whose transpose is the reverse direction's carries."""

    @staticmethod
    def forward(ctx, summary, log_decay, chunk, reverse):
        ctx.other_way = (log_decay, chunk, not reverse)
        return _decayed_carries(summary, log_decay, chunk, reverse)

    @staticmethod
    def backward(ctx, grad):
        return _decayed_carries(grad, *ctx.other_way), None, None, None


def _decayed_carries(summary, log_decay, chunk: int, reverse: bool) -> torch.Tensor:
    def carried(part):
        return chunk_carries(part.log(), lambda t: t.logcumsumexp(1), log_decay, chunk, reverse).exp()
    parts = summary.detach().double()
    return (carried(parts.clamp_min(0)) - carried((-parts).clamp_min(0))).to(summary.dtype)


def same_rotation(phases: torch.Tensor) -> bool:
    """Whether `query_key_phases` (or a slice of it) rotates queries and keys at the same positions."""
    return phases.stride(0) == 0


def log_normalizer(denominator: torch.Tensor, query_scale: torch.Tensor) -> torch.Tensor:
    """log sum_{n} phi_q . phi_k per row from a log-space pass's scaled denominator (sum e^(b + a - Q))
    and its Q: log(den) + Q, with `divide`'s guard (no gradient where the denominator was clamped)."""
    return denominator.clamp_min(denominator_guard(denominator.dtype)).log() + query_scale


def plain_log_normalizer(denominator: torch.Tensor) -> torch.Tensor:
    """log sum_n phi_q . phi_k per row from a plain pass's denominator: log of it with `divide`'s guard,
    and -inf (no weight, no gradient) where it is 0, a row with no key to weigh.  Not a finite floor: what
    it is merged with may be weighed by unbounded log-normalisers (a window's scores of -1e36 at inputs of
    1e18 lost a row to a floor of -1e30 beside it)."""
    guarded = denominator.clamp_min(denominator_guard(denominator.dtype)).log()
    return torch.where(denominator > 0, guarded, float("-inf"))


def numerator_feature(phi, *, rotary: bool, offset: int, base: float):
    """Eq. 19's R_n phi_n (phi itself when unrotated): one side of `numerator_features`."""
    return rotate(phi, offset=offset, base=base) if rotary else phi


def without_autocast(backward):
    """A custom function's backward run with autocast off: forward ran without it (in float32 or
    float64), and a backward called inside an autocast region would otherwise run its products in
    bf16/fp16 and write them into float32 buffers (index_put refuses the mismatch outright)."""
    @functools.wraps(backward)
    def run(ctx, grad, *grads):   # grads of unused outputs may be None (set_materialize_grads(False))
        device = next((g.device.type for g in (grad, *grads) if g is not None), "cpu")
        with torch.autocast(device, enabled=False):
            return backward(ctx, grad, *grads)
    return run


def first_derivatives_only(out: torch.Tensor) -> torch.Tensor:
    """`out` of a computation whose backward gives first derivatives only (a hand-written backward, a
    kernel's): a backward through it that builds a graph (create_graph=True) stops with an error.
    Such a backward would otherwise differentiate the rest of the model and treat this part as
    constant, silently: once_differentiable's error node is pruned when autograd.grad asks only for
    inputs it does not lead to."""
    if out.requires_grad:
        out.register_hook(_refuse_graph_of_gradient)
    return out


def _refuse_graph_of_gradient(grad: torch.Tensor) -> None:
    if torch.is_grad_enabled():   # the engine enables grad mode in backward for create_graph=True only
        raise RuntimeError("linear attention gives first derivatives only: a backward with create_graph=True "
                           "(double backward, a gradient penalty, Hessian products) is not supported")
