"""Linear attention as torch.library custom ops, for torch.compile.

The backends' computation (`dispatch.compute_linear_attention`: torch ops with custom autograd,
the C++ kernel through ctypes, fla's Triton kernels) takes decisions from the data (exact rows, wide
pairs; the data checks in debug mode) and calls code dynamo cannot trace.  Under torch.compile, the
entry points check their arguments as in eager mode and `run_linear_attention` (below) then calls one
opaque op instead, so the model compiles with fullgraph=True on every backend:

* `linattn::linear_attention` runs the eager computation on the real tensors and returns the output
  and the state's tensors (empty where there is none); its fake gives their shapes and dtypes.
* `linattn::linear_attention_backward` recomputes that forward with autograd and returns the
  gradients the eager backward gives (the same functions run, so the same numbers).  Recomputing
  costs one more forward of the attention in backward, as activation checkpointing does; in exchange
  the op saves only its inputs, whatever the backend.

Eager calls never go through these ops: they keep the backends' own autograd, which saves what its
hand-derived backward needs instead of recomputing.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Optional, Sequence

import torch

from .ops.linear_attention.common import LogProjection, compute_dtype
from .ops.linear_attention.dispatch import compute_linear_attention
from .ops.linear_attention.recurrent import LinearState

# Where the forward op's tensors are among its 23 arguments: q, q_weight, q_shift, k, k_weight, k_shift, v
# (the rest are numbers and flags, which take no gradient, and the decay, a constant).
TENSOR_ARGUMENTS = (0, 1, 2, 5, 6, 7, 10)
ARGUMENTS = 23


def _split(x) -> tuple:
    """(tensor or projection inputs, weight, shift tensor, shift number, square scale) of features
    given as a tensor or a `LogProjection`: the op's schema takes no named tuples."""
    if not isinstance(x, LogProjection):
        return x, None, None, 0.0, 0.0
    shift = x.shift if isinstance(x.shift, torch.Tensor) else None
    shift_value = 0.0 if shift is not None else float(x.shift)
    return x.inputs, x.weight, shift, shift_value, float(x.square_scale)


def _join(inputs, weight, shift, shift_value, square_scale):
    if weight is None:
        return inputs
    return LogProjection(inputs, weight, shift if shift is not None else shift_value, square_scale)


def _compute(q, q_weight, q_shift, q_shift_value, q_square, k, k_weight, k_shift, k_shift_value, k_square, v,
             causal, rotary, offset, chunk_size, rope_base, return_state, backend, log_space,
             nonnegative_features=False, check_range=True, key_offset=None, return_log_normalizer=False,
             log_decay=None):
    return compute_linear_attention(
        _join(q, q_weight, q_shift, q_shift_value, q_square), _join(k, k_weight, k_shift, k_shift_value, k_square),
        v, causal=causal, rotary=rotary, offset=offset, chunk_size=chunk_size, rope_base=rope_base,
        return_state=return_state, backend=backend, log_space=log_space,
        nonnegative_features=nonnegative_features, check_range=check_range, key_offset=key_offset,
        return_log_normalizer=return_log_normalizer, **({"log_decay": log_decay} if log_space else {}))


@torch.library.custom_op("linattn::linear_attention", mutates_args=())
def linear_attention_op(q: torch.Tensor, q_weight: Optional[torch.Tensor], q_shift: Optional[torch.Tensor],
                        q_shift_value: float, q_square: float, k: torch.Tensor, k_weight: Optional[torch.Tensor],
                        k_shift: Optional[torch.Tensor], k_shift_value: float, k_square: float, v: torch.Tensor,
                        causal: bool, rotary: bool, offset: int, chunk_size: int, rope_base: float,
                        return_state: bool, backend: str, log_space: bool, nonnegative_features: bool,
                        key_offset: Optional[int] = None, return_log_normalizer: bool = False,
                        log_decay: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, kv, k_sum, log_scale, log-normaliser): the state's tensors are empty without return_state,
    log_scale is empty from plain features, the log-normaliser without return_log_normalizer.  Outputs
    are made contiguous: the fake promises that, and inductor plans the ops after this one from the
    fake's strides."""
    with torch.no_grad():
        result = _compute(q, q_weight, q_shift, q_shift_value, q_square, k, k_weight, k_shift, k_shift_value,
                          k_square, v, causal, rotary, offset, chunk_size, rope_base, return_state, backend,
                          log_space, nonnegative_features, key_offset=key_offset,
                          return_log_normalizer=return_log_normalizer, log_decay=log_decay)
    result = result if isinstance(result, tuple) else (result,)
    out, state = result[0], (result[1] if return_state else None)
    lse = result[-1].contiguous() if return_log_normalizer else v.new_empty(0)
    if state is None:
        return out.contiguous(), v.new_empty(0), v.new_empty(0), v.new_empty(0), lse
    log_scale = v.new_empty(0) if state.log_scale is None else state.log_scale.contiguous()
    return out.contiguous(), state.kv.contiguous(), state.k_sum.contiguous(), log_scale, lse


def _state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The state's dtype: float32, or float64 where an input is (every backend's rule; fla's kernels
    refuse float64)."""
    return compute_dtype(*(t for t in tensors if t is not None))


@linear_attention_op.register_fake
def _(q, q_weight, q_shift, q_shift_value, q_square, k, k_weight, k_shift, k_shift_value, k_square, v,
      causal, rotary, offset, chunk_size, rope_base, return_state, backend, log_space, nonnegative_features,
      key_offset=None, return_log_normalizer=False, log_decay=None):
    out = v.new_empty(v.shape)
    dtype = _state_dtype(q, q_weight, q_shift, k, k_weight, k_shift, v)
    lse = v.new_empty(v.shape[:-1], dtype=dtype) if return_log_normalizer else v.new_empty(0)
    if not return_state:
        return out, v.new_empty(0), v.new_empty(0), v.new_empty(0), lse
    b, h, _, dv = v.shape
    m = k_weight.shape[0] if k_weight is not None else k.shape[-1]
    kv, k_sum = v.new_empty(b, h, m, dv, dtype=dtype), v.new_empty(b, h, m, dtype=dtype)
    return out, kv, k_sum, (v.new_empty(b, h, m, dtype=dtype) if log_space else v.new_empty(0)), lse


@torch.library.custom_op("linattn::linear_attention_backward", mutates_args=())
def linear_attention_backward_op(grad: torch.Tensor, q: torch.Tensor, q_weight: Optional[torch.Tensor],
                                 q_shift: Optional[torch.Tensor], q_shift_value: float, q_square: float,
                                 k: torch.Tensor, k_weight: Optional[torch.Tensor], k_shift: Optional[torch.Tensor],
                                 k_shift_value: float, k_square: float, v: torch.Tensor, causal: bool, rotary: bool,
                                 offset: int, chunk_size: int, rope_base: float, backend: str, log_space: bool,
                                 needs: Sequence[bool], key_offset: Optional[int] = None,
                                 grad_lse: Optional[torch.Tensor] = None,
                                 log_decay: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """d loss / d (q, q_weight, q_shift, k, k_weight, k_shift, v) given d loss / d out (and d loss / d the
    log-normaliser, or None), by autograd through the eager computation (the backends' own backward); an
    empty tensor where `needs` is False."""
    given = (q, q_weight, q_shift, k, k_weight, k_shift, v)
    leaves = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip(given, needs)]
    lq, lqw, lqs, lk, lkw, lks, lv = leaves
    wanted = [t for t, need in zip(leaves, needs) if need]

    def gradients():
        with torch.enable_grad():   # the forward already checked the features' signs and log range
            result = _compute(lq, lqw, lqs, q_shift_value, q_square, lk, lkw, lks, k_shift_value, k_square, lv,
                              causal, rotary, offset, chunk_size, rope_base, False, backend, log_space,
                              check_range=False, key_offset=key_offset, return_log_normalizer=grad_lse is not None,
                              log_decay=log_decay)
            outputs, given = (result, (grad, grad_lse)) if grad_lse is not None else (result, grad)
            return torch.autograd.grad(outputs, wanted, given, allow_unused=True) if wanted else ()

    grads = iter(_with_autograd(gradients, grad.device))
    result = []
    for t, need in zip(leaves, needs):
        g = next(grads) if need else None
        result.append(v.new_empty(0) if not need else torch.zeros_like(t) if g is None else _laid_out_as(g, t))
    return result


def _laid_out_as(g: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """g in the layout empty_like(t) has, the one the fake promises: inductor plans the ops after
    the op (an elementwise backward, a view) from the fake's strides."""
    like = torch.empty_like(t)
    return g if g.stride() == like.stride() else like.copy_(g)


def _with_autograd(compute, device: torch.device):
    """compute() on a thread of its own.  An op's body runs with autograd's dispatch keys excluded, so
    the ATen ops between the backends' autograd Functions (a copy to contiguous, a projection) would
    record no graph and their inputs would get no gradient; that exclusion is thread-local, and a new
    thread starts without it.  The CUDA current device and stream are thread-local too: the thread
    takes the caller's, so kernels launch on the rank's own GPU and stream (DDP, side streams)."""
    outcome = {}
    on_cuda = device.type == "cuda"
    stream = torch.cuda.current_stream(device) if on_cuda else None

    def run():
        try:
            with torch.cuda.device(device) if on_cuda else nullcontext(), \
                    torch.cuda.stream(stream) if on_cuda else nullcontext():
                outcome["value"] = compute()
        except BaseException as error:   # re-raised on the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="linattn-backward")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@linear_attention_backward_op.register_fake
def _(grad, q, q_weight, q_shift, q_shift_value, q_square, k, k_weight, k_shift, k_shift_value, k_square, v,
      causal, rotary, offset, chunk_size, rope_base, backend, log_space, needs, key_offset=None, grad_lse=None,
      log_decay=None):
    given = (q, q_weight, q_shift, k, k_weight, k_shift, v)
    return [torch.empty_like(t) if need else v.new_empty(0)
            for t, need in zip(given, needs)]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*(inputs[i] for i in TENSOR_ARGUMENTS), inputs[22] if len(inputs) > 22 else None)
    ctx.numbers = (inputs[3], inputs[4], inputs[8], inputs[9])
    ctx.options = inputs[11:16] + inputs[17:19]   # causal, rotary, offset, chunk_size, rope_base, backend, log_space
    ctx.key_offset = inputs[20] if len(inputs) > 20 else None
    ctx.return_log_normalizer = len(inputs) > 21 and inputs[21]


def _backward(ctx, grad, _kv_grad, _k_sum_grad, _log_scale_grad, lse_grad=None):
    needs = [ctx.needs_input_grad[i] for i in TENSOR_ARGUMENTS]
    lse_grad = lse_grad if ctx.return_log_normalizer else None   # else the empty placeholder's (zeros)
    if grad is None and lse_grad is None or not any(needs):
        return (None,) * ARGUMENTS
    q, q_weight, q_shift, k, k_weight, k_shift, v, log_decay = ctx.saved_tensors
    q_shift_value, q_square, k_shift_value, k_square = ctx.numbers
    causal, rotary, offset, chunk_size, rope_base, backend, log_space = ctx.options
    grad = torch.zeros(v.shape, dtype=v.dtype, device=v.device) if grad is None else grad
    grads = linear_attention_backward_op(grad, q, q_weight, q_shift, q_shift_value, q_square, k, k_weight, k_shift,
                                         k_shift_value, k_square, v, causal, rotary, offset, chunk_size, rope_base,
                                         backend, log_space, needs, ctx.key_offset, lse_grad, log_decay)
    by_argument = [None] * ARGUMENTS
    for i, g, need in zip(TENSOR_ARGUMENTS, grads, needs):
        by_argument[i] = g if need else None
    return tuple(by_argument)


linear_attention_op.register_autograd(_backward, setup_context=_setup_context)


def linear_attention(phi_q, phi_k, v: torch.Tensor, *, causal: bool, rotary: bool, offset: int, chunk_size: int,
                     rope_base: float, return_state: bool, backend: str, log_space: bool,
                     nonnegative_features: bool, key_offset: int | None = None, return_log_normalizer: bool = False,
                     log_decay: torch.Tensor | None = None):
    """`functional.linear_attention`'s computation through the custom op (its arguments checked):
    the output, with return_state the `LinearState` rebuilt from the op's tensors, with
    return_log_normalizer the rows' log-normalisers."""
    out, kv, k_sum, log_scale, lse = linear_attention_op(
        *_split(phi_q), *_split(phi_k), v, causal, rotary, offset, chunk_size, float(rope_base), return_state,
        backend, log_space, nonnegative_features, key_offset, return_log_normalizer, log_decay)
    result = (out,)
    if return_state:
        # The state carries no gradient, as in eager (decoding is for inference): detached, so a loss on it
        # raises instead of getting zeros from the op's autograd formula.
        kv, k_sum, log_scale = kv.detach(), k_sum.detach(), log_scale.detach()
        position = (offset if key_offset is None else key_offset) + v.shape[-2]
        result += (LinearState(kv, k_sum, position, log_scale if log_space else None),)
    result += (lse,) if return_log_normalizer else ()
    return result if len(result) > 1 else out


__all__ = ["linear_attention", "linear_attention_backward_op", "linear_attention_op"]


def run_linear_attention(phi_q, phi_k, v: torch.Tensor, **options):
    """`functional.linear_attention` for callers that checked its arguments (the blocks, the window's linear
    part); `options` are its keywords, all given, offset a plain int.  Under torch.compile, one opaque op."""
    if torch.compiler.is_compiling():   # one opaque op: the computation below branches on the data
        return linear_attention(phi_q, phi_k, v, **options)
    return compute_linear_attention(phi_q, phi_k, v, **options)
