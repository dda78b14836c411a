"""The running maximum along the sequence for the fla backend (fla_kernels.py), without a torch scan
along N: torch's cummax along a non-last dimension runs on CUDA as one thread per column walking every
row.  Here each program takes one chunk of CHUNK tokens and a block of columns, scans it in registers
(`tl.associative_scan`), and starts from the carry: the maximum of every earlier chunk, a torch cummax
over the N / CHUNK chunk maxima (a scan of 1/CHUNK of the rows).  Forward only: the running maxima are
scales that cancel in the output, constants to autograd."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64     # tokens per program (fla's chunk)
COLUMNS = 32   # columns (heads x features) per program


@triton.jit
def _maximum(x, y):
    return tl.maximum(x, y)


@triton.jit
def _running_max_kernel(x_ptr, carry_ptr, out_ptr, length, width, chunks,
                        CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    column_block, chunk, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = chunk * CHUNK + tl.arange(0, CHUNK)
    columns = column_block * COLUMNS + tl.arange(0, COLUMNS)
    inside = (rows[:, None] < length) & (columns[None, :] < width)
    where = batch * length * width + rows[:, None] * width + columns[None, :]
    x = tl.load(x_ptr + where, mask=inside, other=float("-inf"))
    carry = tl.load(carry_ptr + (batch * chunks + chunk) * width + columns, mask=columns < width,
                    other=float("-inf"))
    running = tl.maximum(tl.associative_scan(x, 0, _maximum), carry[None, :])
    tl.store(out_ptr + where, running, mask=inside)


def running_max(x: torch.Tensor) -> torch.Tensor:
    """max_{n <= t} x[:, n] for x (B, T, ...) contiguous: F of stable.py in fla's (B, T, H, M) layout.
    CPU tensors outside Triton's interpreter (the fla tests' stand-ins on a GPU machine) take torch's
    cummax: the kernel runs on CUDA, or on CPU under TRITON_INTERPRET=1."""
    if not x.is_cuda and not triton.knobs.runtime.interpret:
        return x.cummax(1).values
    batch, length = x.shape[:2]
    flat = x.view(batch, length, -1)
    chunks = triton.cdiv(length, CHUNK)
    whole = (chunks - 1) * CHUNK   # every chunk but the last: the carries need no more
    before = flat[:, :whole].unflatten(1, (chunks - 1, CHUNK)).amax(2).cummax(1).values
    carry = torch.cat([torch.full_like(flat[:, :1], float("-inf")), before], 1)
    out = torch.empty_like(x)
    grid = (triton.cdiv(flat.shape[-1], COLUMNS), chunks, batch)
    _running_max_kernel[grid](flat, carry, out, length, flat.shape[-1], chunks, CHUNK=CHUNK, COLUMNS=COLUMNS)
    return out
