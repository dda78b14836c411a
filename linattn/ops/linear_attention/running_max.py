"""Scans along the sequence for the fla backend (fla_kernels.py), without a torch scan along N (torch's
cummax along a non-last dimension runs on CUDA as one thread per column walking every row): the running
maximum F of the key log-features and, with it, their log-cumulative-sum-exp L (the denominator's
per-feature sums, log sum_{n<=t} e^(a_n), so that the denominator needs no second call of fla).

Each program takes one chunk of CHUNK tokens and a block of columns, scans it in registers
(`tl.associative_scan`), and starts from the carry of every earlier chunk: a torch cummax (and
logcumsumexp) over the N / CHUNK chunk summaries, which one read of the input writes.  L's backward is
the reverse scan, chunked the same way.  Written for a GPU: int64 offsets, the tensor's own strides,
the launch on the tensor's device, NaN kept (a GPU's tl.maximum drops it by default), the chunks on
the grid's first axis (2^31 - 1 programs; the others allow 65535)."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

CHUNK = 64     # tokens per program (fla's chunk)
COLUMNS = 32   # columns (heads x features) per program


@triton.jit
def _maximum(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rescaled(log_ref, total, log_scale):
    """total e^(log_scale - log_ref), 1 where the two are equal (also both -inf)."""
    return tl.where(log_scale == log_ref, total, total * tl.exp(log_scale - log_ref))


@triton.jit
def _columns(batch, column_block, width, heads, stride_b, stride_h, stride_m, COLUMNS: tl.constexpr):
    """A program's columns: their offsets (int64) under a (B, T, H, M) tensor's strides (the row's
    part aside), their indices in a contiguous (B, T, width) one, and which exist."""
    columns = column_block.to(tl.int64) * COLUMNS + tl.arange(0, COLUMNS)
    features = width // heads
    strided = batch.to(tl.int64) * stride_b + columns // features * stride_h + columns % features * stride_m
    return strided, columns, columns < width


@triton.jit
def _scan_kernel(x_ptr, carry_max_ptr, carry_lse_ptr, max_ptr, lse_ptr, length, width, heads, chunks, stride_b,
                 stride_t, stride_h, stride_m, LOG_SUMS: tl.constexpr, SUMMARY: tl.constexpr,
                 CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    """One chunk's tile, token by token (a row of COLUMNS at a time, which a GPU loads coalesced): the
    running max (and log-sum-exp) from the carry of the chunks before it, every row written; or
    (SUMMARY) the chunk's own maximum (and log-sum-exp) alone, one row per chunk, (B, chunks, width)."""
    chunk, column_block, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    strided, columns, exists = _columns(batch, column_block, width, heads, stride_b, stride_h, stride_m, COLUMNS)
    carry = (batch.to(tl.int64) * chunks + chunk) * width + columns
    if SUMMARY:
        top = tl.full([COLUMNS], float("-inf"), x_ptr.dtype.element_ty)
        log_ref = tl.full([COLUMNS], float("-inf"), lse_ptr.dtype.element_ty)
    else:
        top = tl.load(carry_max_ptr + carry, mask=exists, other=float("-inf"))
        log_ref = tl.load(carry_lse_ptr + carry, mask=exists, other=float("-inf"))
    one = tl.full([COLUMNS], 1.0, lse_ptr.dtype.element_ty)
    sums = one   # the sum of exponentials is sums e^log_ref
    first = chunk.to(tl.int64) * CHUNK
    dense = (batch.to(tl.int64) * length + first) * width + columns
    for i in tl.static_range(CHUNK):
        inside = exists & (first + i < length)
        x = tl.load(x_ptr + strided + (first + i) * stride_t, mask=inside, other=float("-inf"))
        top = _maximum(top, x)
        if not SUMMARY:
            tl.store(max_ptr + dense + i * width, top, mask=inside)
        if LOG_SUMS:
            x = x.to(lse_ptr.dtype.element_ty)
            new_ref = _maximum(log_ref, x)
            sums = _rescaled(new_ref, sums, log_ref) + _rescaled(new_ref, one, x)
            log_ref = new_ref
            if not SUMMARY:
                tl.store(lse_ptr + dense + i * width, log_ref + tl.log(sums), mask=inside)
    if SUMMARY:
        tl.store(max_ptr + carry, top, mask=exists)
        if LOG_SUMS:
            tl.store(lse_ptr + carry, log_ref + tl.log(sums), mask=exists)


@triton.jit
def _reverse_summary_kernel(grad_ptr, lse_ptr, out_ptr, length, width, chunks, CHUNK: tl.constexpr,
                            COLUMNS: tl.constexpr):
    """Each chunk's sum_m g_m e^(L_s - L_m), s its first token (contiguous (B, T, width) inputs)."""
    chunk, column_block, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _, columns, exists = _columns(batch, column_block, width, 1, 0, 0, 0, COLUMNS)
    rows = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    inside = (rows[:, None] < length) & exists[None, :]
    dense = (batch.to(tl.int64) * length + rows[:, None]) * width + columns[None, :]
    grad = tl.load(grad_ptr + dense, mask=inside, other=0.0)
    log_sums = tl.load(lse_ptr + dense, mask=inside, other=float("inf"))
    first = tl.load(lse_ptr + (batch.to(tl.int64) * length + chunk.to(tl.int64) * CHUNK) * width + columns,
                    mask=exists, other=float("inf"))
    where = (batch.to(tl.int64) * chunks + chunk) * width + columns
    tl.store(out_ptr + where, tl.sum(_rescaled(-first[None, :], grad, -log_sums), 0), mask=exists)


@triton.jit
def _reverse_scan_kernel(grad_ptr, lse_ptr, x_ptr, after_pos_ptr, after_neg_ptr, out_ptr, length, width, heads,
                         chunks, stride_b, stride_t, stride_h, stride_m, CHUNK: tl.constexpr,
                         COLUMNS: tl.constexpr):
    """dL/dx_n = e^(x_n - L_n) sum_{m>=n} g_m e^(L_n - L_m): the chunk's own terms token by token from
    its last, the later chunks' as e^(L_n + after_pos) - e^(L_n + after_neg) (their two signs' parts)."""
    chunk, column_block, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    strided, columns, exists = _columns(batch, column_block, width, heads, stride_b, stride_h, stride_m, COLUMNS)
    carry = (batch.to(tl.int64) * chunks + chunk) * width + columns
    after_pos = tl.load(after_pos_ptr + carry, mask=exists, other=float("-inf"))
    after_neg = tl.load(after_neg_ptr + carry, mask=exists, other=float("-inf"))
    first = chunk.to(tl.int64) * CHUNK
    dense = (batch.to(tl.int64) * length + first) * width + columns
    total = tl.zeros([COLUMNS], lse_ptr.dtype.element_ty)   # sum_{m>=n in the chunk} g_m e^(L_n - L_m)
    later = tl.full([COLUMNS], float("inf"), lse_ptr.dtype.element_ty)   # L_{n+1}
    for j in tl.static_range(CHUNK):
        i = CHUNK - 1 - j
        inside = exists & (first + i < length)
        grad = tl.load(grad_ptr + dense + i * width, mask=inside, other=0.0)
        log_sums = tl.load(lse_ptr + dense + i * width, mask=inside, other=float("inf"))
        total = grad + _rescaled(-log_sums, total, -later)
        later = log_sums
        x = tl.load(x_ptr + strided + (first + i) * stride_t, mask=inside, other=float("-inf")).to(lse_ptr.dtype.element_ty)
        share = tl.where(x == float("-inf"), 0.0, tl.exp(x - log_sums))
        whole = total + tl.exp(log_sums + after_pos) - tl.exp(log_sums + after_neg)
        tl.store(out_ptr + dense + i * width, share * whole, mask=inside)


def _launch(kernel, x: torch.Tensor, *args, **constants):
    """kernel[grid](...) over x's (B, T, width) tiles, on x's device."""
    batch, length, width = x.shape[0], x.shape[1], x[0, 0].numel()
    grid = (triton.cdiv(length, CHUNK), triton.cdiv(width, COLUMNS), batch)
    guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, length, width, *constants.pop("shape", ()), CHUNK=CHUNK, COLUMNS=COLUMNS, **constants)


def _layout(x: torch.Tensor) -> tuple:
    """(heads, chunks, 4 strides) of a (B, T, H, M) tensor, for the kernels."""
    return (x.shape[2], triton.cdiv(x.shape[1], CHUNK), *x.stride())


def _exclusive(summary: torch.Tensor, scan) -> torch.Tensor:
    """scan over the chunks (dim 1), shifted by one: what each chunk carries in from those before."""
    return torch.cat([torch.full_like(summary[:, :1], float("-inf")), scan(summary[:, :-1])], 1)


def _sums_dtype(x: torch.Tensor) -> torch.dtype:
    """L's dtype: float32 (float64 stays float64)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scans(x: torch.Tensor, log_sums: bool):
    """(F, L or None) for (B, T, H, M) x, both contiguous."""
    batch, length, heads = x.shape[:3]
    chunks = triton.cdiv(length, CHUNK)
    top = x.new_empty(batch, chunks, x[0, 0].numel())
    lse = torch.empty_like(top, dtype=_sums_dtype(x)) if log_sums else top
    _launch(_scan_kernel, x, x, top, lse, top, lse, shape=_layout(x), LOG_SUMS=log_sums, SUMMARY=True)
    carry_max = _exclusive(top, lambda t: t.cummax(1).values)
    carry_lse = _exclusive(lse, lambda t: t.logcumsumexp(1)) if log_sums else carry_max
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    sums = torch.empty(x.shape, dtype=_sums_dtype(x), device=x.device) if log_sums else out
    _launch(_scan_kernel, x, x, carry_max, carry_lse, out, sums, shape=_layout(x), LOG_SUMS=log_sums,
            SUMMARY=False)
    return out, (sums if log_sums else None)


def _interpreted_or_cuda(x: torch.Tensor) -> bool:
    """The kernels run on CUDA, or on CPU under TRITON_INTERPRET=1; CPU tensors outside the interpreter
    (the fla tests' stand-ins on a GPU machine) take torch's scans."""
    return x.is_cuda or triton.knobs.runtime.interpret


def _check(x: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"running_max takes (B, T, H, M) tensors, got {x.dim()} dimensions")


def running_max(x: torch.Tensor) -> torch.Tensor:
    """max_{n <= t} x[:, n] for x (B, T, H, M), any strides: F of stable.py in fla's layout, contiguous.
    Forward only: the running maxima are scales that cancel in the output, constants to autograd."""
    _check(x)
    if not _interpreted_or_cuda(x):
        return x.cummax(1).values.contiguous()
    return _scans(x.detach(), log_sums=False)[0]


def running_max_and_log_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(F, L) for x (B, T, H, M), any strides: F = max_{n <= t} x_n (no gradient) and
    L = log sum_{n <= t} e^(x_n) in float32 or float64 (gradient to x), both contiguous."""
    _check(x)
    if not _interpreted_or_cuda(x):
        return x.detach().cummax(1).values.contiguous(), x.to(_sums_dtype(x)).logcumsumexp(1).contiguous()
    return LogSums.apply(x)


class LogSums(torch.autograd.Function):
    """(F, L) by the chunked scans; L's backward by the reverse scan."""

    @staticmethod
    def forward(ctx, x):
        feature_scale, log_sums = _scans(x.detach(), log_sums=True)
        ctx.save_for_backward(x, log_sums)
        ctx.mark_non_differentiable(feature_scale)
        return feature_scale, log_sums

    @staticmethod
    def backward(ctx, _, grad):
        x, log_sums = ctx.saved_tensors
        grad = grad.to(log_sums.dtype).contiguous()
        batch, length = x.shape[:2]
        chunks = triton.cdiv(length, CHUNK)
        chunk_sums = grad.new_empty(batch, chunks, x[0, 0].numel())
        _launch(_reverse_summary_kernel, x, grad, log_sums, chunk_sums, shape=(chunks,))
        # each chunk's terms taken to a common reference (e^-L at its first token), by sign; the
        # later chunks' sums, as logs: a scan of the N / CHUNK summaries
        first = log_sums[:, ::CHUNK].flatten(2)
        after = [_exclusive((part.log() - first).flip(1), lambda t: t.logcumsumexp(1)).flip(1)
                 for part in (chunk_sums.clamp_min(0), (-chunk_sums).clamp_min(0))]
        out = torch.empty(x.shape, dtype=log_sums.dtype, device=x.device)
        _launch(_reverse_scan_kernel, x, grad, log_sums, x, *after, out, shape=_layout(x))
        return out.to(x.dtype)
