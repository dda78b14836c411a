"""python -m benchmarks.gpu_checks {warm,profile} [--check]: two stages of benchmarks/gpu_session.sh.

warm: one forward + backward of every shape the session measures (the block table's linear blocks, plain
or with a window or decay, at a short length; the op and fla's chunk_gla at M = 64 and 256), so that fla
autotunes each key once, into Triton's cache, which the session saves for later runs to carry in.
profile: a torch.profiler summary (CUDA time by kernel) of one FAVOR+ `post` block forward + backward at N = 65536 beside one bare
chunk_gla of the same size.  --check parses the arguments and stops (the session's --dry-run)."""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.methods import build_block
from linattn.functional import linear_attention

WIDTH, HEADS, HEAD_DIM, NUM_FEATURES = 512, 8, 64, 256
# the block table's linear blocks (gpu_session.sh), in two groups that warm side by side
BLOCKS = {"blocks": ("favor-post", "favor-pre", "elu-post"),
          "options": ("favor-post+window=64", "favor-pre+window=64", "favor-pre+decay=retnet")}
FEATURES = (64, 256)


def block(name: str) -> torch.nn.Module:
    return build_block(name, WIDTH, HEADS, NUM_FEATURES).cuda()


def block_step(module: torch.nn.Module, n: int) -> None:
    x = torch.randn(1, n, WIDTH, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        module(x).float().square().mean().backward()


def op_step(m: int, n: int) -> None:
    b, a = (torch.randn(1, HEADS, n, m, device="cuda", requires_grad=True) for _ in range(2))
    v = torch.randn(1, HEADS, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    linear_attention(b, a, v, causal=True, rotary=True, log_space=True, backend="fla").float().sum().backward()


def chunk_gla_step(m: int, n: int) -> None:
    from fla.ops.gla import chunk_gla
    q, k = (torch.randn(1, n, HEADS, m, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (-torch.rand(1, n, HEADS, m, device="cuda")).requires_grad_()
    out, _ = chunk_gla(q, k, v, g, scale=1.0)
    out.float().sum().backward()


def warm(what: str) -> None:
    if what in BLOCKS:
        for name in BLOCKS[what]:
            block_step(block(name), 4096)
    else:
        for m in FEATURES:
            op_step(m, 4096)
            chunk_gla_step(m, 4096)
    torch.cuda.synchronize()
    print(f"warm {what}: done")


def profile(n: int, out: str) -> None:
    from torch.profiler import ProfilerActivity, profile as profiler
    module = block("favor-post-fla")
    block_step(module, n)   # warm
    chunk_gla_step(256, n)
    torch.cuda.synchronize()
    lines = []
    for title, step in ((f"FAVOR+ post block, fwd+bwd, N={n}", lambda: block_step(module, n)),
                        (f"bare chunk_gla (K=256, V={HEAD_DIM}), fwd+bwd, N={n}", lambda: chunk_gla_step(256, n))):
        torch.cuda.reset_peak_memory_stats()
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        lines += [f"## {title}: peak {torch.cuda.max_memory_allocated() / 2 ** 20:.0f} MiB",
                  prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), ""]
    with open(out, "w") as file:
        file.write("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_checks")
    sub = parser.add_subparsers(dest="command", required=True)
    warm_parser = sub.add_parser("warm")
    warm_parser.add_argument("what", choices=(*BLOCKS, "kernels"))
    profile_parser = sub.add_parser("profile")
    profile_parser.add_argument("--length", type=int, default=65536)
    profile_parser.add_argument("--out", required=True)
    for command in (warm_parser, profile_parser):
        command.add_argument("--check", action="store_true", help="parse the arguments and stop")
    args = parser.parse_args(argv)
    if args.check:
        return
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks.gpu_checks needs a CUDA GPU (--check parses the arguments alone)")
    if args.command == "warm":
        warm(args.what)
    else:
        profile(args.length, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
