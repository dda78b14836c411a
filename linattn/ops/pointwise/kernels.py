"""A pointwise feature map (naive.py's formulas) and the cast of its features to fla's dtype in one Triton
kernel per direction (issue 47): the fla route's plain features.  In torch the map and the cast are four
passes forward (a float32 copy of the input, the formula's two ops, the cast) and as many backward;
here one each way, as custom ops (`pointwise_features`, with `pointwise_features_backward` as its
gradient), so that torch.compile keeps each as one node.

Values as naive.py's up to rounding: computed in float32 (float64 where the input or the output is
float64) and rounded once to the output's dtype.  elu + 1 is e^x for x <= 0, where torch computes
expm1(x) + 1 (which rounds to 0 below x = -17.3 in float32; e^x does not).  The gradient is torch's:
the slope at the input (e^x for x <= 0, else 1, so a NaN input passes the gradient as torch's does).

Written for a GPU as factor_kernels.py is: int64 offsets, the tensors' own strides (the block's q and k
are views of its projection), the launch on the input's device, NaN kept (tl.where, no maximum)."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .naive import POINTWISE

FORMULAS = tuple(POINTWISE)   # the kernels' FORMULA is an index into this: a name without a branch fails to compile
BLOCK = 4096          # elements per program: BLOCK // BLOCK_COLS rows of the last dimension
DIMS = 4              # the input's dimensions at most: (B, H, N, M) features, or fewer


@triton.jit
def _features(x, FORMULA: tl.constexpr):
    """The formula at x (FORMULA 0: elu(x) + 1)."""
    tl.static_assert(FORMULA == 0)
    return tl.where(x <= 0, tl.exp(x), x + 1)


@triton.jit
def _slope(x, grad, FORMULA: tl.constexpr):
    """grad times the formula's derivative at x, as torch's backward has it (NaN x: grad)."""
    tl.static_assert(FORMULA == 0)
    return tl.where(x <= 0, grad * tl.exp(x), grad)


@triton.jit
def _tile(rows, width, size1, size2, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """A program's tile of the (rows, width) elements (rows: the first three dimensions, size1 x size2 of
    them below the first) as int64 indices (outer, middle, inner, column), and its mask."""
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    col = tl.program_id(1).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS).to(tl.int64)
    return row // size2 // size1, (row // size2) % size1, row % size2, col, (row < rows)[:, None] & (col < width)[None, :]


@triton.jit
def _offsets(outer, middle, inner, col, s0, s1, s2, s3):
    """A tile's offsets in a tensor of strides s0..s3."""
    return (outer * s0 + middle * s1 + inner * s2)[:, None] + col[None, :] * s3


@triton.jit
def _pointwise_kernel(x_ptr, out_ptr, rows, width, size1, size2, sx0, sx1, sx2, sx3, so0, so1, so2, so3,
                      FORMULA: tl.constexpr, CT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """out = formula(x) in out's dtype."""
    outer, middle, inner, col, mask = _tile(rows, width, size1, size2, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(x_ptr + _offsets(outer, middle, inner, col, sx0, sx1, sx2, sx3), mask=mask, other=0.0).to(CT)
    tl.store(out_ptr + _offsets(outer, middle, inner, col, so0, so1, so2, so3),
             _features(x, FORMULA).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pointwise_grad_kernel(x_ptr, grad_ptr, out_ptr, rows, width, size1, size2, sx0, sx1, sx2, sx3, sg0, sg1, sg2,
                           sg3, so0, so1, so2, so3, FORMULA: tl.constexpr, CT: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """out = d loss / d x in out's dtype, from grad = d loss / d formula(x)."""
    outer, middle, inner, col, mask = _tile(rows, width, size1, size2, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(x_ptr + _offsets(outer, middle, inner, col, sx0, sx1, sx2, sx3), mask=mask, other=0.0).to(CT)
    grad = tl.load(grad_ptr + _offsets(outer, middle, inner, col, sg0, sg1, sg2, sg3), mask=mask, other=0.0).to(CT)
    tl.store(out_ptr + _offsets(outer, middle, inner, col, so0, so1, so2, so3),
             _slope(x, grad, FORMULA).to(out_ptr.dtype.element_ty), mask=mask)


def _four_dims(x: torch.Tensor) -> torch.Tensor:
    """x as a view of DIMS dimensions (leading ones added)."""
    if x.dim() > DIMS:
        raise ValueError(f"pointwise_features takes tensors of at most {DIMS} dimensions, got {x.dim()}")
    return x[(None,) * (DIMS - x.dim())]


def _launch(kernel, out: torch.Tensor, formula: str, *inputs: torch.Tensor):
    """kernel[grid](*inputs, out, ...) over out's elements (the inputs of its shape; all through their
    strides), on out's device, computing in float64 where an input or out is float64, else float32."""
    if not out.numel():
        return
    shape = _four_dims(out).shape
    width = shape[-1]
    rows = out.numel() // width
    block_cols = min(triton.next_power_of_2(width), BLOCK)
    grid = (triton.cdiv(rows, BLOCK // block_cols), triton.cdiv(width, block_cols))
    double = any(t.dtype == torch.float64 for t in (out, *inputs))
    strides = [stride for t in (*inputs, out) for stride in _four_dims(t).stride()]
    with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
        kernel[grid](*inputs, out, rows, width, shape[1], shape[2], *strides, FORMULA=FORMULAS.index(formula),
                     CT=tl.float64 if double else tl.float32, BLOCK_ROWS=BLOCK // block_cols, BLOCK_COLS=block_cols)


@torch.library.custom_op("linattn::pointwise_features", mutates_args=())
def pointwise_features(x: torch.Tensor, formula: str, dtype: torch.dtype) -> torch.Tensor:
    """The features naive.POINTWISE[formula] gives of x (at most 4 dimensions, any strides, on CUDA or in
    Triton's interpreter), in `dtype`: one kernel forward, one backward (to x's dtype).  Laid out as
    torch's pointwise ops lay theirs out (empty_like): the block's q (B, H, N, D), a view of its
    (B, N, H D) projection, gives features in fla's layout, and gradients that go back through the
    heads' reshape as views."""
    out = torch.empty_like(x, dtype=dtype)
    _launch(_pointwise_kernel, out, formula, x)
    return out


@pointwise_features.register_fake
def _(x, formula, dtype):
    _four_dims(x)
    return torch.empty_like(x, dtype=dtype)


@torch.library.custom_op("linattn::pointwise_features_backward", mutates_args=())
def pointwise_features_backward(grad: torch.Tensor, x: torch.Tensor, formula: str) -> torch.Tensor:
    """d loss / d x of `pointwise_features` (x's dtype, laid out as x's empty_like) from grad = d loss / d its output."""
    out = torch.empty_like(x)
    _launch(_pointwise_grad_kernel, out, formula, x, grad)
    return out


@pointwise_features_backward.register_fake
def _(grad, x, formula):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, formula, _ = inputs
    ctx.save_for_backward(x)   # the input: torch's slope at it, for any formula
    ctx.formula = formula


def _backward(ctx, grad):
    x, = ctx.saved_tensors
    return pointwise_features_backward(grad, x, ctx.formula), None, None


pointwise_features.register_autograd(_backward, setup_context=_setup_context)
