"""How much memory the fla backend's log-feature route needs above its inputs, on CPU: the peak resident
memory (ru_maxrss) of fla_kernels.logspace_attention's forward, and of forward + backward, in units of
one (B, H, N, M) float32 tensor, for FAVOR+'s block inputs (a LogProjection, M = 4 head_dim).  fla's
kernel is replaced by a stand-in that keeps what chunk_gla keeps for backward (q, k, v, g and a cumsum
of g) and computes nothing, and the running maximum's kernel by a copy (the one tensor it writes), so
what is measured is linattn's part: the factors and the decays of the numerator's and the denominator's
calls.  The torch ops are the ones a GPU runs, so the counts carry over; the caching allocator may round
them up there.

    python -m benchmarks.fla_memory [--n 16384] [--heads 8] [--features 256] [--head-dim 64]

Run it alone on an idle machine: resident memory counts the whole process.  It runs itself again
with glibc's mmap threshold fixed at 1 MiB: the default threshold grows to the largest block freed,
after which freed tensors stay resident and the peak depends on the order of earlier frees."""
import argparse
import math
import os
import resource
import sys

import torch

from linattn.functional import LogProjection
from linattn.ops.linear_attention import fla_kernels, running_max


class KeepsWhatChunkGlaKeeps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g):
        ctx.save_for_backward(q, k, v, g, g.cumsum(1))
        return torch.zeros(v.shape, dtype=v.dtype)

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros_like(t) for t in ctx.saved_tensors[:4])


def stand_in(q, k, v, g, *, return_state):
    """fla_kernels.gated_linear_attention's contract on (B, N, H, .) tensors: (output, state)."""
    return KeepsWhatChunkGlaKeeps.apply(q, k, v, g), None


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.fla_memory", *sys.argv[1:]],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)})
    torch.set_num_threads(1)
    fla_kernels.gated_linear_attention = stand_in
    running_max.running_max = torch.clone
    n, h, m, d = args.n, args.heads, args.features, args.head_dim
    unit = h * n * m * 4
    gen = torch.Generator().manual_seed(0)
    xq, xk = (torch.randn(1, h, n, d, generator=gen).requires_grad_() for _ in range(2))
    weight = torch.randn(m, d, generator=gen) * d ** -0.25
    v = torch.randn(1, h, n, d, generator=gen).bfloat16().requires_grad_()
    base = peak_bytes()
    b, a = (LogProjection(x, weight, -0.5 * math.log(m), -0.5 * d ** -0.5) for x in (xq, xk))
    out = fla_kernels.logspace_attention(b, a, v, causal=True, rotary=True, offset=0, rope_base=1e4, chunk_size=64,
                                         return_state=False)
    forward = peak_bytes()
    out.float().sum().backward()
    both = peak_bytes()
    print(f"N={n}, heads={h}, M={m}, head_dim={d}: peak above the inputs {(forward - base) / unit:.1f} units in "
          f"the forward, {(both - base) / unit:.1f} over forward and backward (1 unit = {unit / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
