"""Attention blocks with q/k/v/out projections: (B, N, dim) -> (B, N, dim).

Both blocks share one interface: `forward(x, offset=0, return_state=False)` for whole sequences
and `step(x_t, state) -> (y_t, state)` for decoding one token at a time (`state=None` starts).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .checks import (as_device, check_finite_values, check_flags, check_positive_integer, check_real_floating,
                     check_return_state, check_rope_base, check_state_finite, check_state_position,
                     check_state_tensors, check_window, debug_enabled, is_integer, is_real)
from .feature_maps import FeatureMap, check_feature_map, make_feature_map
from .functional import DEFAULT_CHUNK_SIZE, LinearState, check_chunk_size, check_state, run_linear_attention
from .ops.linear_attention import dispatch, fla_kernels
from .ops.linear_attention.backends import triton_installed
from .ops.linear_attention.common import compute_dtype, feature_tensors
from .ops.linear_attention.fla_kernels import HALF_DOTS
from .ops.linear_attention.memory import check_fits
from .ops.linear_attention.recurrent import recurrent_step
from .ops.window_decay import WindowState, retnet_decay, window_decay_attention, window_decay_step
from .ops.window_decay.band import band_attention
from .ops.window_decay.window import check_window_state, guard_window_features
from .rotary import DEFAULT_BASE, check_positions, check_rotated_dim, rotate
from .short_conv import ShortConvolution

ROPE_PLACEMENTS = ("post", "pre", "none")
NORMALIZATIONS = ("denominator", "rmsnorm")
RMSNORM_EPS = 1e-5   # flash-linear-attention's layers' default norm_eps
SOFTMAX_BACKENDS = ("auto", "sdpa", "xformers")   # auto = sdpa
# Each block's options beside attention, every one off by default (0 or None): the one table that callers
# naming blocks by their options read (the harness's variant names, the benchmarks' block names)
BLOCK_OPTIONS = {"linear": ("window", "decay", "short_conv"), "softmax": ("window", "short_conv")}


class KVCache(NamedTuple):
    """Softmax decoding state: rotated keys and values of every token so far, (B, H, T, D), and the
    position of the next token (the prefill's offset plus T)."""
    k: torch.Tensor
    v: torch.Tensor
    position: int
    window: int = 0   # the block's window that made it (0: none; then it holds every token)


class ConvState(NamedTuple):
    """Decoding state of a block with a short convolution: the last K - 1 q/k/v projections, (B, K - 1,
    3 dim), before the convolution, and the mixer's own state (LinearState, WindowState or KVCache)."""
    conv: torch.Tensor
    mixer: Any


def _head_dim(dim: int, heads: int) -> int:
    if dim % heads:
        raise ValueError(f"dim ({dim}) must be a positive multiple of heads ({heads})")
    return dim // heads


class _Projections(nn.Module):
    """q/k/v/out projections and the (B, N, dim) <-> (B, H, N, head_dim) reshapes."""

    def __init__(self, dim: int, heads: int, bias: bool, causal: bool, short_conv: int = 0):
        super().__init__()
        dim, heads = check_positive_integer("dim", dim), check_positive_integer("heads", heads)
        check_flags(bias=bias, causal=causal)
        self.dim, self.heads, self.head_dim = dim, heads, _head_dim(dim, heads)
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.to_out = nn.Linear(dim, dim, bias=bias)
        if not is_integer(short_conv) or short_conv < 0:
            raise ValueError(f"short_conv must be a non-negative integer kernel size (0: none), got {short_conv!r}")
        if short_conv and not causal:
            raise ValueError("short_conv is a causal convolution: pass causal=True (or short_conv=0)")
        # q, k and v each through a depthwise causal convolution of K tokens (H3, Based, fla's layers)
        self.short_conv = ShortConvolution(3 * dim, int(short_conv)) if short_conv else None

    def _qkv(self, x: torch.Tensor, expected_rank: int, conv: torch.Tensor | None = None):
        """q, k, v as (B, H, N, head_dim) and the short convolution's cache after them (None without
        one); `conv`: the cache before x (decoding)."""
        if not isinstance(x, torch.Tensor) or x.dim() != expected_rank or x.shape[-1] != self.dim:
            shape = "(batch, seq_len, dim)" if expected_rank == 3 else "(batch, dim) for one token"
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__} expects input of shape {shape} with "
                             f"dim={self.dim}, got {got}")
        check_real_floating("the input", x)
        if debug_enabled():
            check_finite_values("the input", x)
        weight = self.to_qkv.weight
        if x.device != weight.device or x.device.type == "meta":   # torch's own errors come from deep inside
            raise ValueError(f"{type(self).__name__}'s parameters are on {weight.device} and the input on {x.device}; "
                             f"put both on one device that computes (block.to(device), x.to(device)), not meta")
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):   # x is floating (above)
            raise ValueError(f"{type(self).__name__}'s parameters are {weight.dtype} but the input is {x.dtype}; "
                             f"convert one to the other (block.to(dtype) or x.to(dtype)), or use autocast")
        if expected_rank == 2:
            x = x.unsqueeze(1)
        else:   # before the projection allocates: an expanded view's size would surface as the allocator's error
            check_fits(f"{type(self).__name__}'s projections of an input of shape {tuple(x.shape)}",
                       3 * x.numel() * x.element_size(), x.device, "pass fewer or shorter sequences")
        qkv = self.to_qkv(x)
        if self.short_conv is not None:
            qkv, conv = self.short_conv(qkv, conv)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv.chunk(3, dim=-1))
        return q, k, v, conv

    def _split_state(self, state, x_t: torch.Tensor):
        """(the short convolution's cache, the mixer's state) of a step's state; the cache checked to be
        this block's for the token x_t (B, dim)."""
        if self.short_conv is None or state is None:
            return None, state
        if not isinstance(state, ConvState):
            raise ValueError("this block has short_conv: its state is the ConvState that forward(..., "
                             f"return_state=True) or step() returns, got {type(state).__name__}")
        shape = (x_t.shape[0], self.short_conv.kernel_size - 1, 3 * self.dim)
        # any floating dtype: the convolution computes in the projections' (autocast's, under autocast)
        check_state_tensors(state, x_t.device, {"conv": shape},
                            state.conv.dtype if isinstance(state.conv, torch.Tensor) else x_t.dtype)
        return state.conv, state.mixer

    def _join_state(self, conv: torch.Tensor | None, state):
        """What forward and step return as the state: the mixer's, with the convolution's cache beside it."""
        return state if conv is None else ConvState(conv.detach(), state)

    def _check_heads(self, q, k, v) -> None:
        """attend's inputs: (B, H, N, head_dim) with this block's heads, in one dtype (what the
        projections give; the linear block decides from v's dtype how the op computes)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[1] != self.heads \
                    or t.shape[-1] != self.head_dim:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"attend takes (batch, heads={self.heads}, seq_len, head_dim={self.head_dim}) "
                                 f"queries, keys and values, got {name} of shape {got}")
            check_real_floating(name, t)
            if debug_enabled():
                check_finite_values(name, t)
        if not q.shape == k.shape == v.shape:
            raise ValueError(f"attend takes queries, keys and values of one shape (batch, heads, seq_len, head_dim), "
                             f"got {tuple(q.shape)}, {tuple(k.shape)} and {tuple(v.shape)}")
        if not q.device == k.device == v.device or q.device.type == "meta":
            raise ValueError(f"attend takes queries, keys and values on one device that computes (not meta), got "
                             f"{q.device}, {k.device} and {v.device}; move them with .to(device)")
        if not q.dtype == k.dtype == v.dtype:
            raise ValueError(f"attend takes queries, keys and values of one dtype, got {q.dtype}, {k.dtype} and "
                             f"{v.dtype}; convert them with .to(dtype)")

    def _check_decodable(self) -> None:
        if not self.causal:
            raise ValueError("step() decodes autoregressively and needs causal=True")

    def _check_call(self, offset, return_state: bool, tokens: int) -> int:
        """forward's and attend's options: the offset (as a plain int) and whether to return the state."""
        check_flags(return_state=return_state)
        check_positions(offset, tokens)
        check_return_state(return_state, self.causal)
        return int(offset)

    def _merge(self, out: torch.Tensor) -> torch.Tensor:
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class LinearAttention(_Projections):
    """Linear attention with a registered (or given) feature map and RoPE placement:

    * `post` (RoFormer Eq. 19): rotate phi(q), phi(k) in the numerator only;
    * `pre`: rotate q, k before the feature map (what performer-pytorch does);
    * `none`: no rotation.

    `normalization`: "denominator" (the default) divides the numerator by sum_n phi_q . phi_k;
    "rmsnorm" drops the denominator and applies an RMSNorm over head_dim to each head's output
    before the heads are merged (one learnable gain of size head_dim shared by the heads, as
    flash-linear-attention's GLA layer and TransNormer do).  The denominator is a positive scalar per
    (row, head) and RMSNorm over head_dim is invariant to such a scalar, so RMSNorm(num / den) =
    RMSNorm(num) up to eps (RMSNorm's eps acts on num / den rather than num: the same wherever the
    output's RMS is well above sqrt(eps)).  The block therefore runs the op unchanged and normalises
    its output, which keeps every backend and the log-space path exact (the numerator alone can
    overflow where the ratio does not).
    """

    def __init__(self, dim: int, heads: int, *, feature_map: str | FeatureMap = "favor",
                 rope: str = "post", causal: bool = True, feature_map_options: dict | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, rope_base: float = DEFAULT_BASE,
                 bias: bool = False, backend: str = "auto", normalization: str = "denominator",
                 window: int = 0, decay: str | tuple | list | None = None, short_conv: int = 0):
        super().__init__(dim, heads, bias, causal, short_conv)
        dispatch.check_backend(backend)
        if rope not in ROPE_PLACEMENTS:
            raise ValueError(f"rope must be one of {ROPE_PLACEMENTS}, got {rope!r}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
        check_chunk_size(chunk_size)
        check_rope_base(rope_base)
        self.feature_map = make_feature_map(feature_map, self.head_dim, heads=self.heads,
                                            options=feature_map_options)
        if not isinstance(feature_map, FeatureMap):   # an instance was checked above; a registered map may be the user's
            check_feature_map(self.feature_map, self.head_dim, heads=self.heads)
        self.normalization = normalization
        self.norm = nn.RMSNorm(self.head_dim, eps=RMSNORM_EPS) if normalization == "rmsnorm" else None
        if rope != "none":
            what = "num_features M" if rope == "post" else "head_dim"
            check_rotated_dim(self.feature_map.num_features if rope == "post" else self.head_dim, what,
                              f"an even {what} or rope='none'")
        self.rope, self.causal, self.chunk_size, self.rope_base = rope, causal, chunk_size, rope_base
        self.backend = backend
        self._init_window_decay(window, decay)

    def _init_window_decay(self, window, decay) -> None:
        """`window`: the last W keys take exact softmax weights e^s, older ones the linear weights times a
        learnable per-head gain g_h = e^(window_log_gain_h) (1 at the start; positive, so the normaliser
        stays positive), one normaliser.  `decay`: None, "retnet" or `heads` values gamma_h in (0, 1]
        multiply every weight by gamma_h^(m - n).  docs/gap-closers.md has the definitions."""
        # fixed here: the gain parameter and the decay buffer are made for them (see `window`, `decay`)
        self._window, self._decay = check_window(window), check_decay(decay, self.heads)
        if (self.window or self.decay) and not self.causal:
            raise ValueError("window and decay are defined for causal attention only: pass causal=True "
                             "(or window=0, decay=None)")
        if self.decay:
            self.register_buffer("log_decay", torch.tensor(self.decay, dtype=torch.float64).log(), persistent=False)
        if self.window:
            self.window_log_gain = nn.Parameter(torch.zeros(self.heads))

    @property
    def window(self) -> int:
        return self._window

    @window.setter
    def window(self, value) -> None:
        raise AttributeError(f"a LinearAttention's window is fixed at construction (its gain parameter is made "
                             f"for it): build a new block with window={value!r}")

    @property
    def decay(self) -> tuple[float, ...] | None:
        return self._decay

    @decay.setter
    def decay(self, value) -> None:
        raise AttributeError(f"a LinearAttention's decay is fixed at construction (its buffer is made for it): "
                             f"build a new block with decay={value!r}")

    def _features(self, q, k, offset: int, projected: bool = False, fused: torch.dtype | None = None):
        """phi(q), phi(k); log-features where the map has them (exact at any input scale), as its
        LogProjection where it has one and `projected` (the torch backend's causal op then never
        holds the (B, H, N, M) log-features).  `fused`: the dtype of the fla route's features where a
        pointwise map's are computed with their cast in one kernel (`_fused_dtype`), else None."""
        if self.rope == "pre":
            q = rotate(q, offset=offset, base=self.rope_base)
            k = rotate(k, offset=offset, base=self.rope_base)
        if fused is not None:
            from .ops.pointwise.kernels import pointwise_features   # here: triton, like fla, is a GPU dependency
            formula = self.feature_map.pointwise
            return pointwise_features(q, formula, fused), pointwise_features(k, formula, fused)
        return self._mapped(q, k, projected)

    def _mapped(self, q, k, projected: bool):
        """`_features` of q, k as they are (rotated already where `pre` rotates them)."""
        if not self.feature_map.log_space:
            return self.feature_map(q, is_query=True), self.feature_map(k, is_query=False)
        if projected and (q_proj := self.feature_map.log_projection(q, is_query=True)) is not None:
            return q_proj, self.feature_map.log_projection(k, is_query=False)
        return (self.feature_map.log_features(q, is_query=True),
                self.feature_map.log_features(k, is_query=False))

    def forward(self, x: torch.Tensor, *, offset: int = 0, return_state: bool = False):
        q, k, v, conv = self._qkv(x, 3)
        offset = self._check_call(offset, return_state, q.shape[-2])
        result = self._attend(q, k, v, offset, return_state)
        if return_state:
            return self._merge(result[0]), self._join_state(conv, result[1])
        return self._merge(result)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, offset: int = 0,
               return_state: bool = False):
        """The attention between the projections: (B, H, N, head_dim) queries, keys and values ->
        (B, H, N, head_dim), with this block's map, placement and backend (what forward runs)."""
        self._check_heads(q, k, v)
        offset = self._check_call(offset, return_state, q.shape[-2])
        return self._attend(q, k, v, offset, return_state)

    def _attend(self, q, k, v, offset: int, return_state: bool):
        result = self._weighted_values(q, k, v, offset, return_state)
        # Rounded to v's dtype before the norm, as the op rounds its output under autocast.
        if return_state:
            return self._normalize(result[0].to(v.dtype)), result[1]
        return self._normalize(result.to(v.dtype))

    def weight_sums(self, x: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        """How much weight each query puts on the values in all, sum_n w_mn: (B, N, dim) -> (B, H, N),
        float32 (float64 for a float64 block), without gradients.  The op's output for values that
        are all 1 (in the dtype forward's values have, so the same route runs), before any RMSNorm.
        With `pre` and `none` it is 1 up to rounding (the output is a weighted mean of values).
        Eq. 19 (`post`) rotates the numerator's features but not the denominator's, so
        w_mn = (R_m phi(q_m))^T (R_n phi(k_n)) / sum_n' phi(q_m)^T phi(k_n'): causal, the sum is 1 at
        the first position only.  A diagnostic of why `post` trains worse (docs/results/study.md)."""
        was_training = self.training
        self.eval()   # a map that redraws counts training-mode calls: measuring must not move its schedule
        try:
            with torch.no_grad():
                q, k, v, _ = self._qkv(x, 3)
                offset = self._check_call(offset, False, q.shape[-2])
                sums = self._weighted_values(q, k, torch.ones_like(v), offset, False)[..., 0]
        finally:
            self.train(was_training)
        return sums.to(torch.float64 if sums.dtype == torch.float64 else torch.float32)

    def _weighted_values(self, q, k, v, offset: int, return_state: bool):
        """The op on this block's features: sum_n w_mn v_n (and the state), before the RMSNorm."""
        if self.window or self.decay:
            return self._window_decay_values(q, k, v, offset, return_state)
        features = self._features(q, k, offset, projected=self.causal, fused=self._fused_dtype(v))
        phi_q, phi_k, values = self._op_inputs(*features, v)
        return run_linear_attention(phi_q, phi_k, values, causal=self.causal, rotary=self.rope == "post",
                                    offset=offset, chunk_size=self.chunk_size, rope_base=self.rope_base,
                                    return_state=return_state, backend=self.backend,
                                    log_space=self.feature_map.log_space,
                                    nonnegative_features=self.feature_map.nonnegative_features)

    def _op_inputs(self, phi_q, phi_k, v: torch.Tensor):
        """Features and values in a form the op takes.  Maps compute in float32 (float64 stays), while
        v is in the block's dtype, or autocast's: bf16/fp16.

        * Log-features go as they are, with v in its own dtype: the op takes float32 log-features with
          half values (bf16 would round the exponents), and multiplies the values in their dtype (on
          tensor cores on the fla backend).
        * Plain features on the fla route go to bf16 with bf16 values: the kernels multiply on tensor
          cores (float32 sums) only when every input is bf16, as flash-linear-attention's layers run.
          Not fp16: fla writes the sums in that dtype, and they outgrow fp16's range (`_kernel_route`).
        * Otherwise v goes to the features' dtype: the torch and cpp backends sum in float32 anyway
          (under autocast the op casts v there itself; doing it here lets a bf16/fp16 block run
          without autocast, with the same numbers).
        The caller casts the output back to v's dtype."""
        dtype = feature_tensors(phi_q, phi_k)[0].dtype
        if v.dtype == dtype or self.feature_map.log_space:
            return phi_q, phi_k, v
        if self._kernel_route(v) and v.dtype == HALF_DOTS:
            return phi_q.to(v.dtype), phi_k.to(v.dtype), v
        return phi_q, phi_k, v.to(dtype)

    def _kernel_route(self, v: torch.Tensor) -> bool:
        """Whether the call takes fla's kernels: backend "fla", or "auto" on CUDA, for causal blocks (fla's
        kernels are causal only: a non-causal call takes torch's entry, which sums in float32), decided
        from the names (which torch.compile traces; resolving would ask the machine)."""
        return self.causal and (self.backend == "fla" or (self.backend == "auto" and v.device.type == "cuda"))

    def _fused_dtype(self, v: torch.Tensor) -> torch.dtype | None:
        """The dtype `_op_inputs` hands the fla route a pointwise map's features in (bf16 beside bf16
        values, else the map's float32, float64 for float64), where the route's kernels run (CUDA, or
        Triton's interpreter on CPU): the map's formula and the cast are then one kernel
        (ops/pointwise/kernels.py) instead of the map's forward and a cast.  None elsewhere."""
        fm = self.feature_map
        if fm.log_space or fm.pointwise is None or not self._kernel_route(v):   # log-features go as they are
            return None
        if not triton_installed() or not (v.is_cuda or fla_kernels.kernels_run_on(v)):
            return None
        return v.dtype if v.dtype == HALF_DOTS else compute_dtype(v)

    def _window_decay_values(self, q, k, v, offset: int, return_state: bool):
        """`_weighted_values` with a window or a decay (ops/window_decay), in float32 (float64 stays).
        `post` hands the window q and k as they are, for its band to rotate as it goes (no rotated copy
        kept); `pre` maps the rotated ones, so the band takes those."""
        post = self.rope == "post"
        q_hat, k_hat = (q, k) if post else self._scored(q, k, offset)
        phi_q, phi_k, v = self._window_features(q, k, q_hat, k_hat, v)
        result = window_decay_attention(q_hat, k_hat, phi_q, phi_k, v, **self._window_decay_options(),
                                        offset=offset, rope_base=self.rope_base, chunk_size=self.chunk_size,
                                        backend=self.backend, return_state=return_state, rotate_scores=post)
        return (result[0], result[1]._replace(**self._made_for())) if return_state else result

    def _window_features(self, q, k, q_hat, k_hat, v, materialize: bool = False):
        """The window path's features, guarded as the op guards its own (from the map's projection, where
        it has one, so that FAVOR+'s overflowing |x|^2 is seen; log-features with `materialize`), and v.
        `pre` maps the scores' rotated q_hat, k_hat (one rotation, one copy kept for backward)."""
        fm = self.feature_map
        mapped = self._mapped(*((q_hat, k_hat) if self.rope == "pre" else (q, k)), projected=True)
        return guard_window_features(*mapped, v, log_space=fm.log_space,
                                     nonnegative_features=fm.nonnegative_features, materialize=materialize)

    def _made_for(self) -> dict:
        """What a WindowState records of the block that made it, and a step checks."""
        fm = self.feature_map
        return dict(window=self.window, decay=self.decay, feature_map=f"{type(fm).__name__}(M={fm.num_features})")

    def _scored(self, q, k, position: int):
        """What the window's scores take: q and k, rotated unless rope='none'."""
        if self.rope == "none":
            return q, k
        return (rotate(q, offset=position, base=self.rope_base),
                rotate(k, offset=position, base=self.rope_base))

    def _window_decay_options(self) -> dict:
        return dict(window=self.window, log_decay=self.log_decay if self.decay else None,
                    log_gain=self.window_log_gain if self.window else None, rotary=self.rope == "post",
                    log_space=self.feature_map.log_space)

    def _window_decay_step(self, q, k, v, state):
        position = 0 if state is None else check_window_state(
            state, self._made_for(), (q.shape[0], self.heads), self.head_dim, self.feature_map.num_features,
            v.device, self._step_dtype(q), self.feature_map.log_space)
        q_hat, k_hat = self._scored(q, k, position)
        phi_q, phi_k, v = self._window_features(q, k, q_hat, k_hat, v, materialize=True)
        out, state = window_decay_step(q_hat[:, :, 0], k_hat[:, :, 0], phi_q[:, :, 0], phi_k[:, :, 0], v[:, :, 0],
                                       state, **self._window_decay_options(), rope_base=self.rope_base)
        return out, state._replace(**self._made_for())

    def _normalize(self, out: torch.Tensor) -> torch.Tensor:
        """normalization="rmsnorm": RMSNorm over head_dim of the (B, H, N, head_dim) output."""
        if self.norm is None:
            return out
        # In float32 (float64 stays), like the op's sums, the gain too: the output is bf16/fp16 in a
        # bf16/fp16 block and under autocast, the gain only in the former, and at a mix torch's RMSNorm
        # warns and skips its fused kernel.
        with torch.autocast(out.device.type, enabled=False):
            dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
            weight = self.norm.weight.to(dtype)
            return F.rms_norm(out.to(dtype), self.norm.normalized_shape, weight, self.norm.eps).to(out.dtype)

    def step(self, x_t: torch.Tensor, state: LinearState | WindowState | None = None):
        """Decode one token (B, dim) in O(1) time and memory (O(W) with a window); `state=None` starts a
        sequence.  A block with a window or a decay carries a `WindowState`."""
        self._check_decodable()
        conv, state = self._split_state(state, x_t)
        q, k, v, conv = self._qkv(x_t, 2, conv)
        step = self._window_decay_step if self.window or self.decay else self._linear_step
        out, state = step(q, k, v, state)
        return self._merge(self._normalize(out.unsqueeze(2).to(v.dtype)))[:, 0], self._join_state(conv, state)

    def _linear_step(self, q, k, v, state):
        if state is not None:
            shape = (q.shape[0], self.heads, self.feature_map.num_features, self.head_dim)
            state = check_state(state, shape, v.device, self._step_dtype(q), self.feature_map.log_space)
        phi_q, phi_k = self._features(q, k, 0 if state is None else state.position)
        # The step computes in the features' dtype (float32 for bf16/fp16 blocks, as under autocast).
        values = v[:, :, 0] if self.feature_map.log_space else v[:, :, 0].to(phi_k.dtype)
        out, state = recurrent_step(phi_q[:, :, 0], phi_k[:, :, 0], values, state,
                                    rotary=self.rope == "post", rope_base=self.rope_base,
                                    log_space=self.feature_map.log_space,
                                    nonnegative_features=self.feature_map.nonnegative_features)
        return out, state

    @staticmethod
    def _step_dtype(q: torch.Tensor) -> torch.dtype:
        """What a step computes in: float64 for float64 blocks, else float32 (maps give float32 features)."""
        return torch.float64 if q.dtype == torch.float64 else torch.float32

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, rope={self.rope!r}, causal={self.causal}, "
                f"chunk_size={self.chunk_size}, backend={self.backend!r}, normalization={self.normalization!r}"
                + (f", window={self.window}" if self.window else "") + (f", decay={self.decay}" if self.decay else "")
                + (f", short_conv={self.short_conv.kernel_size}" if self.short_conv is not None else ""))


def check_decay(decay, heads: int) -> tuple[float, ...] | None:
    """The per-head decay rates gamma_h in (0, 1] as floats, or None."""
    if decay is None:
        return None
    if isinstance(decay, str) and decay == "retnet":
        return retnet_decay(heads)
    # a sequence (or an array) of numbers: a set's or a dict's order is not the heads'
    sequence = isinstance(decay, Sequence) or (hasattr(decay, "__array__") and hasattr(decay, "__len__"))
    rates = tuple(decay) if sequence and not isinstance(decay, str) else None
    if rates is None or len(rates) != heads or not all(is_real(r) and 0 < r <= 1 for r in rates):
        raise ValueError(f"decay must be None, 'retnet' or {heads} values in (0, 1] (one per head), got {decay!r}")
    return tuple(float(r) for r in rates)


def resolve_backend(backend: str, device: torch.device | str, *, attention: str = "linear",
                    log_space: bool = True, causal: bool = True) -> str:
    """The backend that runs `attention` ("linear" or "softmax") on `device`, with "auto" resolved
    (linear only), or a ValueError that says how to get the one asked for.  The blocks resolve the
    same way when they run; this asks before any work.  Linear attention: `log_space` and `causal`
    describe the calls (a map's `log_space`), since "auto" takes the C++ kernel on CPU only for the
    causal log-space calls it computes."""
    device = as_device(device)
    check_flags(log_space=log_space, causal=causal)
    if attention == "linear":
        dispatch.check_backend(backend)
        return dispatch.resolve(backend, device, log_space=log_space, causal=causal)
    if attention != "softmax":
        raise ValueError(f"attention must be 'linear' or 'softmax', got {attention!r}")
    backend = softmax_backend(backend)
    if backend == "xformers":
        if device.type != "cuda":
            raise ValueError(f"backend='xformers' runs on CUDA only, got {device}; use backend='sdpa'")
        try:
            _xformers_ops()
        except ImportError as err:
            raise ValueError(str(err)) from None
    return backend


def softmax_backend(backend: str) -> str:
    """A softmax backend's name checked, "auto" resolved (sdpa)."""
    if backend not in SOFTMAX_BACKENDS:
        raise ValueError(f"softmax attention's backend must be one of {SOFTMAX_BACKENDS}, got {backend!r}")
    return "sdpa" if backend == "auto" else backend


def _xformers_ops():
    try:
        import xformers.ops as xops
    except ImportError as err:
        raise ImportError(
            "backend='xformers' needs the xformers package, which runs on CUDA only: "
            "pip install 'linattn[xformers]' on a GPU machine, or use backend='sdpa'") from err
    return xops


class SoftmaxAttention(_Projections):
    """Softmax attention with optional RoPE on q and k (RoFormer Eq. 16).

    backend='sdpa' uses torch's scaled_dot_product_attention (any device); backend='xformers'
    uses xformers' memory_efficient_attention (CUDA only).

    window=W > 0 (causal, sdpa only): query m attends to the keys n with 0 <= m - n < W only (itself
    and the W - 1 before it), a sliding window of exact softmax: the window-only control of the
    linear block's `window`, on the same band code (ops/window_decay/band.py: O(N W) time, no (N, N)
    mask), in float32 (float64 stays).  Decoding keeps the last W keys and values only: O(W) per token."""

    def __init__(self, dim: int, heads: int, *, rope: bool = True, causal: bool = True,
                 backend: str = "sdpa", rope_base: float = DEFAULT_BASE, bias: bool = False, window: int = 0,
                 short_conv: int = 0):
        super().__init__(dim, heads, bias, causal, short_conv)
        backend = softmax_backend(backend)
        if not isinstance(rope, bool):
            raise ValueError(f"rope must be True or False for softmax attention, got {rope!r}")
        if rope:
            check_rotated_dim(self.head_dim, "head_dim", "an even head_dim or rope=False")
        check_rope_base(rope_base)
        self.rope, self.causal, self.backend, self.rope_base = rope, causal, backend, rope_base
        self.window = window
        self._xops = _xformers_ops() if backend == "xformers" else None

    @property
    def window(self) -> int:
        """The window (0: none); one set later is checked as the constructor checks it, and a cache made
        under another window is refused by step()."""
        return self._window

    @window.setter
    def window(self, value) -> None:
        value = check_window(value)
        if value and not self.causal:
            raise ValueError("window is defined for causal attention only: pass causal=True (or window=0)")
        if value and self.backend != "sdpa":
            raise ValueError(f"backend={self.backend!r} does not support window; use backend='sdpa'")
        self._window = value

    def _rotate(self, q, k, offset: int):
        if not self.rope:
            return q, k
        return (rotate(q, offset=offset, base=self.rope_base),
                rotate(k, offset=offset, base=self.rope_base))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
        """The attention between the projections: (B, H, N, head_dim) queries, keys and values ->
        (B, H, N, head_dim), with this block's RoPE, mask and backend (what forward runs)."""
        self._check_heads(q, k, v)
        offset = self._check_call(offset, False, q.shape[-2])
        return self._parallel(q, k, v, offset)

    def _parallel(self, q, k, v, offset: int):
        """The whole-sequence pass on inputs before RoPE: the window's band (which rotates as it goes,
        keeping no rotated copy), else the block's mask on rotated inputs."""
        n = q.shape[-2]
        if 0 < self.window < n:   # a window as long as the sequence is the causal mask
            dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
            with torch.autocast(v.device.type, enabled=False):
                out, _ = band_attention(q.to(dtype), k.to(dtype), v.to(dtype), self.window,
                                        rotary_offset=offset if self.rope else None, rope_base=self.rope_base)
            return out.to(v.dtype)
        q, k = self._rotate(q, k, offset)
        return self._kernel(q, k, v, self.causal)

    def _kernel(self, q, k, v, causal: bool):
        """softmax(q k^T / sqrt(D)) v on rotated inputs, by the block's backend."""
        if self._xops is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if not q.is_cuda:
            raise ValueError("backend='xformers' runs on CUDA tensors only, got a tensor on "
                             f"{q.device}; move the model to a GPU or use backend='sdpa'")
        bias = self._xops.LowerTriangularMask() if causal else None
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))   # xformers wants (B, N, H, D)
        return self._xops.memory_efficient_attention(q, k, v, attn_bias=bias).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, offset: int = 0, return_state: bool = False):
        q, k, v, conv = self._qkv(x, 3)
        offset = self._check_call(offset, return_state, q.shape[-2])
        out = self._merge(self._parallel(q, k, v, offset))
        if not return_state:
            return out
        # Detached as the linear block's state is: a prefill's cache is for decoding, not training.
        k, v = self._last_window(k), self._last_window(v)
        if self.rope:   # the cache holds rotated keys
            k = rotate(k, offset=offset + x.shape[1] - k.shape[-2], base=self.rope_base)
        return out, self._join_state(conv, KVCache(k.detach(), v.detach(), offset + x.shape[1], self.window))

    def _last_window(self, t: torch.Tensor) -> torch.Tensor:
        """The last W tokens of (B, H, T, D) cached keys or values (all of them without a window)."""
        return t[:, :, -self.window:] if self.window else t

    def step(self, x_t: torch.Tensor, state: KVCache | None = None):
        """Decode one token (B, dim) against the KV cache; `state=None` starts a sequence."""
        self._check_decodable()
        conv, state = self._split_state(state, x_t)
        q, k, v, conv = self._qkv(x_t, 2, conv)
        position = 0 if state is None else self._check_state(state, k)
        q, k = self._rotate(q, k, position)
        if state is not None:
            k, v = torch.cat((state.k, k), dim=-2), torch.cat((state.v, v), dim=-2)
            k, v = self._last_window(k), self._last_window(v)
        # The new token sees every cached token (the window's last W with itself), so no mask is needed.
        out = self._merge(self._kernel(q, k, v, causal=False))
        return out[:, 0], self._join_state(conv, KVCache(k, v, position + 1, self.window))

    def _check_state(self, state, k_t: torch.Tensor) -> int:
        """The cache's position, once it is checked to be this block's for the new token's keys k_t
        (B, H, 1, D): the same batch, device and dtype (a float64 cache would fail inside SDPA, an
        fp16 one would be promoted silently)."""
        if not isinstance(state, KVCache):
            raise ValueError(f"state must be the KVCache returned by forward(..., return_state=True) or "
                             f"step(), got {type(state).__name__}")
        if state.window != self.window:
            raise ValueError(f"the cache was made by a block with window={state.window!r}, not this block's "
                             f"window={self.window}; continue a sequence with the block that started it")
        position = check_state_position(state)
        cached = state.k.shape[-2] if isinstance(state.k, torch.Tensor) and state.k.dim() == 4 else 0
        if cached > position or (self.window and cached > self.window):
            cached = min(position, self.window or position)   # the error below names the shape expected
        shape = (k_t.shape[0], self.heads, cached, self.head_dim)
        check_state_tensors(state, k_t.device, {"k": shape, "v": shape}, k_t.dtype)
        if debug_enabled():
            check_state_finite(state, ("k", "v"))
        return position

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, rope={self.rope}, causal={self.causal}, backend={self.backend!r}"
                + (f", window={self.window}" if self.window else "")
                + (f", short_conv={self.short_conv.kernel_size}" if self.short_conv is not None else ""))
