"""Issue 34 part 3: the torch-side work of the fla route, counted on CPU.  fla's kernels (and the running
maximum's) are replaced by stand-ins with fla's signatures whose own ops are not counted; a dispatch
mode counts the torch ops on (B, H, N, M)-sized tensors in one forward + backward of the FAVOR+ `post`
block (M = 4 head_dim, as in the benchmark's block, with M > Dv so that only M-sized tensors count).

The budget (see docs/backends.md):
* no scan along the sequence (cumsum, cummax, logcumsumexp, cumprod) on a full-size tensor;
* no layout copy (clone, contiguous) of a full-size tensor: fla's (B, N, H, .) layout is the
  projection's, so the transposes are views;
* at most FULL_SIZE_PASSES ops that read or write a full-size tensor (elementwise passes, reductions
  over M, the projection's matmul, casts to bf16 for fla, a pair's scale made whole), forward, backward
  and the factors' recomputation together: about 27 per forward of the factors (twice) and 12 in
  their backward.
The route before issue 34, counted the same way (bf16 autocast, one B x H block), made 90 full-size
ops, 6 of them scans along the sequence (2 cummax, 4 logcumsumexp) and 8 the -inf check's reads."""
import os
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linattn import LinearAttention
from linattn.ops.linear_attention import dispatch, running_max

B, N, DIM, HEADS = 1, 128, 16, 2   # head_dim 8, M = 32 features, Dv = 8
FULL_SIZE_PASSES = 66
SCANS = {"cumsum", "cummax", "cummin", "logcumsumexp", "_logcumsumexp", "cumprod"}
LAYOUT_COPIES = {"clone", "contiguous"}
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item"}


NOT_PASSES = {"empty_like", "empty", "new_empty", "empty_strided", "_unsafe_view"}   # allocations, views


def real_elements(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.is_complex() else 1)


class CountFullSize(TorchDispatchMode):
    """Counts the ops that read or write a tensor of at least `size` real elements, by name; views,
    allocations and the stand-ins' own work (`paused`) are not counted.  A clone of a tensor with a
    zero stride (a broadcast made whole) is counted as "broadcast", not as a layout copy."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.paused, self.ops = size, False, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.paused and name in HOST_READS:
            self.ops["host reads"] = self.ops.get("host reads", 0) + 1
        if self.paused or func.is_view or name in NOT_PASSES:
            return out
        tensors = [t for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else [out]))
                   if isinstance(t, torch.Tensor)]
        if any(real_elements(t) >= self.size for t in tensors):
            if name == "clone" and 0 in args[0].stride():
                name = "broadcast"
            self.ops[name] = self.ops.get(name, 0) + 1
        return out


class StandIn(torch.autograd.Function):
    """fla's kernel: an output shaped like v, gradients shaped like every input."""
    @staticmethod
    def forward(ctx, q, k, v, *gates):
        ctx.shapes = [t for t in (q, k, v, *gates)]
        return v * q[..., :1]

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros_like(t) for t in ctx.shapes)


def stand_in_fla(monkeypatch, mode: CountFullSize):
    def paused(run):
        def call(*args, **kwargs):
            mode.paused = True
            try:
                return run(*args, **kwargs)
            finally:
                mode.paused = False
        return call

    @paused
    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
        return PausedStandIn.apply(q, k, v, g), None

    @paused
    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        return PausedStandIn.apply(q, k, v), None

    class PausedStandIn(StandIn):
        @staticmethod
        def backward(ctx, grad):
            return paused(StandIn.backward)(ctx, grad)

    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops", "fla.ops.gla", "fla.ops.linear_attn")}
    modules["fla.ops.gla"].chunk_gla = chunk_gla
    modules["fla.ops.linear_attn"].chunk_linear_attn = chunk_linear_attn
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    kernel = running_max._running_max_kernel
    monkeypatch.setattr(running_max, "_running_max_kernel", _Launcher(kernel, paused))
    resolve = dispatch.resolve
    monkeypatch.setattr(dispatch, "resolve", lambda backend, *args, **kw: "fla" if backend == "fla"
                        else resolve(backend, *args, **kw))


class _Launcher:
    """kernel[grid](...) with the counting paused (the interpreter's own tensor work is not the route's)."""
    def __init__(self, kernel, paused):
        self.kernel, self.paused = kernel, paused

    def __getitem__(self, grid):
        return self.paused(self.kernel[grid])


@pytest.fixture
def counts(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the route with the running maximum's kernel in Triton's interpreter (CPU)")
    torch.manual_seed(0)
    block = LinearAttention(DIM, HEADS, feature_map="favor", feature_map_options={"num_features": 32},
                            rope="post", backend="fla")
    x = torch.randn(B, N, DIM, requires_grad=True)
    mode = CountFullSize(B * HEADS * N * 32)
    stand_in_fla(monkeypatch, mode)
    with mode, torch.autocast("cpu", dtype=torch.bfloat16):   # the benchmark's setting
        block(x).float().square().sum().backward()
    assert x.grad is not None
    return mode.ops


def test_the_fla_route_scans_nothing_along_the_sequence(counts):
    assert not SCANS & set(counts), counts


def test_the_fla_route_reads_no_value_on_the_host(counts):
    assert "host reads" not in counts, counts


def test_the_fla_route_copies_no_layout(counts):
    assert not LAYOUT_COPIES & set(counts), counts


def test_the_fla_route_makes_a_bounded_number_of_full_size_passes(counts):
    assert sum(n for name, n in counts.items() if name != "host reads") <= FULL_SIZE_PASSES, counts
