"""The torch-side work of the fla route, counted on CPU (issues 34 and 47).  fla's kernels (and
running_max.py's) are replaced by stand-ins with fla's signatures whose own work is not counted; a
dispatch mode counts the torch ops on (B, H, N, M)-sized tensors in one forward + backward of the
FAVOR+ `post` block (M = 4 head_dim, as in the benchmark's block, with M > Dv so that only M-sized
tensors count), and of the bare op on (B, H, N, M) log-feature tensors (not fla's layout).

The budget (see docs/backends.md):
* no scan along the sequence (cumsum, cummax, logcumsumexp, cumprod) on a full-size tensor;
* no layout copy (clone, contiguous, or a non-contiguous input fla would copy) but the op's inputs';
* at most FULL_SIZE_PASSES ops that read or write a full-size tensor, forward, backward and the
  factors' recomputation together, moving at most TRAFFIC_UNITS float32 full-size tensors' worth
  (each op's full-size inputs and outputs at their dtypes' sizes);
* FLA_CALLS calls of fla per forward (the numerator: the denominator is running_max.py's scans).
Issue 47's counts (units, full-size ops, fla calls): block 122.0, 66, 2 before, 105.0, 58, 1 after;
op 137.5, 70, 2 before, 120.5, 62, 1 after.  The route before issue 34 made 90 full-size ops, 6 of
them scans along the sequence."""
import os
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linattn import LinearAttention
from linattn.functional import linear_attention
from linattn.ops.linear_attention import dispatch, running_max

B, N, DIM, HEADS, M = 1, 128, 16, 2, 32   # head_dim 8, M = 32 features, Dv = 8
FULL_SIZE_PASSES = 62
TRAFFIC_UNITS = 121
FLA_CALLS = 1
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
        self.size, self.paused, self.ops, self.units, self.fla_calls = size, False, {}, 0.0, 0

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
            self.units += sum(t.numel() * t.element_size() for t in tensors if real_elements(t) >= self.size
                              ) / (4 * self.size)
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
            mode.fla_calls += getattr(run, "__name__", "") in ("chunk_gla", "chunk_linear_attn")
            mode.paused = True
            try:
                return run(*args, **kwargs)
            finally:
                mode.paused = False
        return call

    def count_copies(*inputs):   # fla's input_guard makes its inputs contiguous: a layout copy each
        copies = sum(not t.is_contiguous() and real_elements(t) >= mode.size for t in inputs)
        if copies:
            mode.ops["contiguous"] = mode.ops.get("contiguous", 0) + copies

    @paused
    def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
        count_copies(q, k, v, g)
        return PausedStandIn.apply(q, k, v, g), None

    @paused
    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        count_copies(q, k, v)
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
    for name in ("_scan_kernel", "_reverse_summary_kernel", "_reverse_scan_kernel"):
        monkeypatch.setattr(running_max, name, _Launcher(getattr(running_max, name), paused))
    resolve = dispatch.resolve
    monkeypatch.setattr(dispatch, "resolve", lambda backend, *args, **kw: "fla" if backend == "fla"
                        else resolve(backend, *args, **kw))


class _Launcher:
    """kernel[grid](...) with the counting paused (the interpreter's own tensor work is not the route's)."""
    def __init__(self, kernel, paused):
        self.kernel, self.paused = kernel, paused

    def __getitem__(self, grid):
        return self.paused(self.kernel[grid])


def block_forward_backward():
    """The FAVOR+ `post` block, as the benchmark runs it (bf16 autocast): a forward + backward to count."""
    block = LinearAttention(DIM, HEADS, feature_map="favor", feature_map_options={"num_features": M},
                            rope="post", backend="fla")
    x = torch.randn(B, N, DIM, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            block(x).float().square().sum().backward()
        assert x.grad is not None
    return run


def op_forward_backward():
    """The bare op on log-feature tensors in the (B, H, N, M) layout (not fla's), bf16 values."""
    b, a = (torch.randn(B, HEADS, N, M, requires_grad=True) for _ in range(2))
    v = torch.randn(B, HEADS, N, DIM // HEADS, dtype=torch.bfloat16, requires_grad=True)

    def run():
        out = linear_attention(b, a, v, causal=True, rotary=True, log_space=True, backend="fla")
        torch.autograd.grad(out.float().square().sum(), (b, a, v))   # the op's work, not a leaf's layout copy
    return run


@pytest.fixture(params=[block_forward_backward, op_forward_backward], ids=["favor-post-block", "op"])
def counted(request, monkeypatch) -> CountFullSize:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the route with the running maximum's kernel in Triton's interpreter (CPU)")
    torch.manual_seed(0)
    mode = CountFullSize(B * HEADS * N * M)
    stand_in_fla(monkeypatch, mode)
    run = request.param()
    with mode:
        run()
    return mode


def test_the_fla_route_scans_nothing_along_the_sequence(counted):
    assert not SCANS & set(counted.ops), counted.ops


def test_the_fla_route_reads_no_value_on_the_host(counted):
    assert "host reads" not in counted.ops, counted.ops


def test_the_fla_route_copies_no_layout_but_inputs_not_in_flas(request, counted):
    """The block's features are views of fla's layout; the op's (B, H, N, M) tensors are copied to it
    once each, in the forward and in the factors' recomputation (pass fla-layout views to avoid that),
    and nothing reaches fla in another layout (its kernels would copy it)."""
    copies = sum(counted.ops.get(name, 0) for name in LAYOUT_COPIES)
    assert copies == (4 if "op" in request.node.callspec.id else 0), counted.ops


def test_the_fla_route_makes_a_bounded_number_of_full_size_passes(counted):
    assert sum(n for name, n in counted.ops.items() if name != "host reads") <= FULL_SIZE_PASSES, counted.ops


def test_the_fla_route_moves_a_bounded_amount_of_full_size_data(counted):
    assert counted.units <= TRAFFIC_UNITS, (counted.units, counted.ops)


def test_the_fla_route_calls_fla_once_a_forward(counted):
    assert counted.fla_calls == FLA_CALLS, counted.fla_calls
