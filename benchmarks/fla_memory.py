"""How much memory the fla backend's log-feature route needs above its inputs, on a GPU: the peak of
torch's CUDA allocator during linear_attention(backend="fla")'s forward, and over forward + backward, in
units of one (B, H, N, M) float32 tensor, for FAVOR+'s block inputs (a LogProjection, M = 4 head_dim,
bf16 values).  What counts is fla's kernels with linattn's part around them: the factors, the decays
and the two calls' outputs (docs/backends.md, "fla").

    python -m benchmarks.fla_memory [--n 16384] [--heads 8] [--features 256] [--head-dim 64]

Needs CUDA and fla-core (pip install 'linattn[gpu]')."""
import argparse
import math
import sys

import torch

from linattn import resolve_backend
from linattn.functional import LogProjection, linear_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.fla_memory: needs a CUDA GPU (the fla backend's kernels run on CUDA only)")
    try:
        resolve_backend("fla", "cuda")
    except ValueError as error:
        sys.exit(f"benchmarks.fla_memory: {error}")
    n, h, m, d = args.n, args.heads, args.features, args.head_dim
    unit = h * n * m * 4
    gen = torch.Generator("cuda").manual_seed(0)
    xq, xk = (torch.randn(1, h, n, d, generator=gen, device="cuda").requires_grad_() for _ in range(2))
    weight = torch.randn(m, d, generator=gen, device="cuda") * d ** -0.25
    v = torch.randn(1, h, n, d, generator=gen, device="cuda").bfloat16().requires_grad_()
    b, a = (LogProjection(x, weight, -0.5 * math.log(m), -0.5 * d ** -0.5) for x in (xq, xk))
    call = dict(causal=True, rotary=True, log_space=True, backend="fla")
    linear_attention(b, a, v, **call).float().sum().backward()   # fla autotunes on its first calls
    xq.grad = xk.grad = v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = linear_attention(b, a, v, **call)
    forward = torch.cuda.max_memory_allocated()
    out.float().sum().backward()
    both = torch.cuda.max_memory_allocated()
    print(f"N={n}, heads={h}, M={m}, head_dim={d}: peak above the inputs {(forward - base) / unit:.1f} units in "
          f"the forward, {(both - base) / unit:.1f} over forward and backward (1 unit = {unit / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
