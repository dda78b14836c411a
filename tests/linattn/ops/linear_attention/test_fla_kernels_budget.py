"""The torch-side work of the fla route, counted on CPU (issues 34 and 47).  fla's kernels are replaced
by stand-ins with fla's signatures whose own work is not counted; factor_kernels.py's kernels are not
run (test_fla_kernels.py checks what they compute), each launch counted as one op that moves its
full-size tensor arguments once each (a custom op, as ops/pointwise's, is one op that moves its inputs
and outputs, run in Triton's interpreter); a dispatch mode counts the torch ops on (B, H, N, M)-sized tensors in one forward + backward of each
route: the FAVOR+ `post` block (M = 4 head_dim, as in the benchmark's block, with M > Dv so that only
M-sized tensors count), the bare op on (B, H, N, M) log-feature tensors (not fla's layout), and the
windowed and decayed blocks (FAVOR+ `post` + window, `pre` + decay; elu features, M = head_dim = Dv,
`post` alone, with a window and with a decay).  Tensors count as full-size from (B, H, N - W, M) elements (the
window's linear part), in units of (B, H, N, M) float32.

The budget of each route (`ROUTES`; docs/results/fla-glue.md has the counts):
* no scan along the sequence (cumsum, cummax, logcumsumexp, cumprod) on a full-size tensor;
* no value read on the host;
* no layout copy (clone, contiguous, or a non-contiguous input fla would copy), but for the counted
  clones of the plain-feature window;
* at most `passes` ops (torch ops and kernel launches) that read or write a full-size tensor,
  forward, backward and the factors' recomputation together, moving at most `units` float32
  full-size tensors' worth (each op's full-size inputs and outputs at their dtypes' sizes);
* `fla_calls` calls of fla per forward: one (the numerator; the denominator is factor_kernels.py's,
  for plain features divided into the queries before the call).
Printed by `TRITON_INTERPRET=1 PYTHONPATH=. python tests/linattn/ops/linear_attention/test_fla_kernels_budget.py`."""
import os
import sys
import types
from functools import partial, wraps
from typing import NamedTuple

import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from linattn import LinearAttention
from linattn.functional import linear_attention
from linattn.ops.linear_attention import dispatch, factor_kernels
from linattn.ops.window_decay import band, window

B, N, DIM, HEADS, M = 1, 128, 16, 2, 32   # head_dim 8, M = 32 features (FAVOR+'s 4 head_dim), Dv = 8
WINDOW = 16   # the window's linear part has N - W rows: counted from that size on, in units of (B, H, N, M)
FLA_KERNELS = {"chunk_gla": "fla.ops.gla", "chunk_linear_attn": "fla.ops.linear_attn",
               "chunk_simple_gla": "fla.ops.simple_gla"}
SCANS = {"cumsum", "cummax", "cummin", "logcumsumexp", "_logcumsumexp", "cumprod"}
LAYOUT_COPIES = {"clone", "contiguous"}
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item"}


NOT_PASSES = {"empty_like", "empty", "new_empty", "empty_strided", "_unsafe_view"}   # allocations, views


def real_elements(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.is_complex() else 1)


class CountFullSize(TorchDispatchMode):
    """Counts the ops that read or write a tensor of at least `size` real elements, by name, and the
    bytes of those tensors in float32 tensors of `unit` elements; views, allocations and the stand-ins'
    own work (`paused`) are not counted.  A clone of a tensor with a zero stride (a broadcast made
    whole) is counted as "broadcast", not as a layout copy."""

    def __init__(self, size: int, unit: int):
        super().__init__()
        self.size, self.unit, self.paused, self.ops, self.units, self.fla_calls = size, unit, False, {}, 0.0, 0

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
                              ) / (4 * self.unit)
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
        @wraps(run)
        def call(*args, **kwargs):
            mode.fla_calls += getattr(run, "__name__", "") in FLA_KERNELS
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

    @paused
    def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                         state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        count_copies(q, k, v)
        return PausedStandIn.apply(q, k, v), None

    class PausedStandIn(StandIn):
        @staticmethod
        def backward(ctx, grad):
            return paused(StandIn.backward)(ctx, grad)

    modules = {name: types.ModuleType(name) for name in ("fla", "fla.ops", *FLA_KERNELS.values())}
    for kernel in (chunk_gla, chunk_linear_attn, chunk_simple_gla):
        setattr(modules[FLA_KERNELS[kernel.__name__]], kernel.__name__, kernel)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name, kernel in vars(factor_kernels).items():
        if isinstance(kernel, triton.runtime.KernelInterface) and name.endswith("_kernel"):   # launched, not helpers
            monkeypatch.setattr(factor_kernels, name, _Launcher(kernel, mode))
    resolve = dispatch.resolve
    for module in (dispatch, window):   # the window's linear part resolves its backend as the op does
        monkeypatch.setattr(module, "resolve", lambda backend, *args, **kw: "fla" if backend == "fla"
                            else resolve(backend, *args, **kw))


class _Launcher:
    """kernel[grid](...) counted as one op that moves its full-size tensor arguments once each (what a
    GPU kernel reads or writes), and not run: its outputs keep what they were allocated with, which no
    count depends on (the route reads no value on the host), and the interpreter would take a minute."""
    def __init__(self, kernel, mode: CountFullSize):
        self.kernel, self.mode = kernel, mode

    def __getitem__(self, grid):
        def counted(*args, **kwargs):
            tensors = {t.data_ptr(): t for t in (*args, *kwargs.values())
                       if isinstance(t, torch.Tensor) and real_elements(t) >= self.mode.size}
            if tensors:
                name = f"triton {self.kernel.__name__}"
                self.mode.ops[name] = self.mode.ops.get(name, 0) + 1
                self.mode.units += sum(t.numel() * t.element_size() for t in tensors.values()) / (4 * self.mode.unit)
        return counted


class Budget(NamedTuple):
    """What one forward + backward may do: full-size ops, units moved, fla calls per forward, clones."""
    passes: int
    units: float
    fla_calls: int
    clones: int = 0


def block_forward_backward(feature_map="favor", rope="post", window=0, decay=None):
    """A block as the benchmark runs it (bf16 autocast), M = 32 features: a forward + backward to count."""
    options = {"num_features": M} if feature_map == "favor" else {}
    dim = DIM if feature_map == "favor" else HEADS * M   # plain features: M = head_dim
    block = LinearAttention(dim, HEADS, feature_map=feature_map, feature_map_options=options, rope=rope,
                            window=window, decay=decay, backend="fla")
    x = torch.randn(B, N, dim, requires_grad=True)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = block(x).float().square().sum()
        loss.backward()   # outside autocast, as benchmarks/block.py and training do
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


# The routes counted, with their budgets: issue 47's target of 20 units for the FAVOR+ `post` block and
# the bare op, the others at their counts (docs/results/fla-glue.md has them before and after).
ROUTES = {
    "favor-post-block": (block_forward_backward, Budget(8, 20, 1)),
    "op": (op_forward_backward, Budget(8, 20, 1)),
    "favor-post-window": (partial(block_forward_backward, window=WINDOW), Budget(29, 80, 1)),
    "favor-pre-decay": (partial(block_forward_backward, rope="pre", decay="retnet"), Budget(8, 36, 1)),
    "elu-post-block": (partial(block_forward_backward, "elu"), Budget(39, 55.3, 1)),
    # the decay's block casts its features and values to float32 first (ops/window_decay): 3 copies more
    "elu-post-decay": (partial(block_forward_backward, "elu", decay="retnet"), Budget(52, 94.9, 1)),
    # the plain-feature window's band and scales in torch (issue 45): 8 clones, not yet traced
    "elu-post-window": (partial(block_forward_backward, "elu", window=WINDOW), Budget(116, 239.4, 1, clones=8)),
}


@pytest.fixture(params=list(ROUTES), scope="module")   # one count serves every test of a route's budget
def counted(request) -> tuple[CountFullSize, Budget]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("counts the route on CPU, its pointwise kernels in Triton's interpreter")
    forward_backward, budget = ROUTES[request.param]
    return count(forward_backward), budget


def count(forward_backward) -> CountFullSize:
    """The counts of one forward + backward (`forward_backward()` makes it) with fla stood in."""
    torch.manual_seed(0)
    mode = CountFullSize(B * HEADS * (N - WINDOW) * M, B * HEADS * N * M)
    with pytest.MonkeyPatch.context() as monkeypatch:
        stand_in_fla(monkeypatch, mode)
        monkeypatch.setattr(band, "FLASH_DEVICES", ())   # the window's band as CUDA runs it (products), not CPU's kernel
        run = forward_backward()
        with mode:
            run()
    return mode


def test_the_fla_route_scans_nothing_along_the_sequence(counted):
    counts, _ = counted
    assert not SCANS & set(counts.ops), counts.ops


def test_the_fla_route_reads_no_value_on_the_host(counted):
    counts, _ = counted
    assert "host reads" not in counts.ops, counts.ops


def test_the_fla_route_copies_no_layout(counted):
    """The block's features are views of fla's layout, the op's (B, H, N, M) tensors are read through
    their strides by factor_kernels.py, and nothing reaches fla in another layout (its kernels would
    copy it)."""
    counts, budget = counted
    assert sum(counts.ops.get(name, 0) for name in LAYOUT_COPIES) <= budget.clones, counts.ops


def test_the_fla_route_makes_a_bounded_number_of_full_size_passes(counted):
    counts, budget = counted
    assert sum(n for name, n in counts.ops.items() if name != "host reads") <= budget.passes, counts.ops


def test_the_fla_route_moves_a_bounded_amount_of_full_size_data(counted):
    counts, budget = counted
    assert counts.units <= budget.units, (counts.units, counts.ops)


def test_the_fla_route_calls_fla_once_an_output_a_forward(counted):
    counts, budget = counted
    assert counts.fla_calls == budget.fla_calls, counts.fla_calls


if __name__ == "__main__":   # TRITON_INTERPRET=1 PYTHONPATH=. python tests/linattn/ops/linear_attention/test_fla_kernels_budget.py
    for what, (forward_backward, _) in ROUTES.items():
        counts = count(forward_backward)
        ops = {name: n for name, n in sorted(counts.ops.items()) if name != "host reads"}
        print(f"{what}: {counts.units:.1f} units, {sum(ops.values())} full-size ops, {counts.fla_calls} fla calls, "
              f"{counts.ops.get('host reads', 0)} host reads")
        print(f"  {ops}")
