"""ops/pointwise/kernels.py, the fla route's plain features: a map's pointwise formula and the cast to fla's
dtype in one Triton kernel each way, against the map's forward and the cast in torch (the route before it,
and the CPU path): outputs, gradients and layouts over dtypes and strided inputs, NaN and far-negative
inputs included; the custom ops under opcheck; and the elu block's route taking them, compiled too.
In Triton's interpreter on CPU (its bf16 cast truncates where a GPU's rounds to nearest: bf16 results are
held to one bf16 step), or on CUDA."""
import os

import pytest
import torch

from linattn import LinearAttention
from linattn.feature_maps import EluFeatureMap
from linattn.ops.linear_attention import fla_kernels

kernels = pytest.importorskip("linattn.ops.pointwise.kernels")   # triton's
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and DEVICE == "cpu",
                                reason="the kernels run on CUDA, or in Triton's interpreter on CPU")
TOLERANCES = {torch.bfloat16: dict(rtol=2 ** -7, atol=1e-6), torch.float32: dict(rtol=2e-6, atol=1e-7),
              torch.float64: dict(rtol=1e-12, atol=1e-14)}


def block_queries(dtype, batch=2, tokens=37, heads=3, head_dim=10, nan=float("nan")):
    """Queries as the block hands them: a (B, H, N, D) view of its (B, N, 3 H D) projection, holding a NaN,
    0 and far-negative entries (e^x below float32's expm1(x) + 1, which rounds to 0)."""
    qkv = torch.randn(batch, tokens, 3 * heads * head_dim, dtype=torch.float64) * 3
    qkv[0, 5, :4] = torch.tensor([nan, 0.0, -30.0, -17.5])
    return qkv.to(DEVICE, dtype)[..., :heads * head_dim].unflatten(-1, (heads, head_dim)).transpose(1, 2)


CASES = {   # input, output dtype
    "block-bf16": (lambda: block_queries(torch.bfloat16), torch.bfloat16),
    "block-float32": (lambda: block_queries(torch.float32), torch.float32),
    "float32-to-bf16-2d": (lambda: block_queries(torch.float32)[0, 0].T, torch.bfloat16),   # ragged width 37
    "float64-3d": (lambda: block_queries(torch.float64)[0], torch.float64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_gives_the_maps_features_cast_and_their_gradient(case):
    make, dtype = CASES[case]
    x = make().requires_grad_()
    reference = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()   # the same layout
    want = EluFeatureMap(x.shape[-1])(reference, is_query=True).to(dtype)   # the torch route: map, then cast
    got = kernels.pointwise_features(x, "elu", dtype)
    assert got.dtype == dtype and got.stride() == want.stride()
    torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCES[dtype])
    weights = torch.randn(got.shape, dtype=torch.float64).to(DEVICE, dtype)
    grad, = torch.autograd.grad((got * weights).sum(), x)
    want_grad, = torch.autograd.grad((want * weights).sum(), reference)
    assert grad.dtype == x.dtype and grad.stride() == torch.empty_like(x).stride()   # back through views
    torch.testing.assert_close(grad, want_grad, equal_nan=True, **TOLERANCES[x.dtype])
    assert got.isnan().sum() == x.isnan().sum() > 0   # NaN kept, nowhere else


def test_the_custom_ops_pass_opcheck():
    """Schema, fake (shapes, dtypes, strides), autograd registration and AOT dispatch of both ops (which
    compares without NaN)."""
    x = block_queries(torch.float32, batch=1, tokens=9, nan=1.0).requires_grad_()
    torch.library.opcheck(kernels.pointwise_features, (x, "elu", torch.bfloat16))
    grad = torch.randn(x.shape, device=DEVICE)
    torch.library.opcheck(kernels.pointwise_features_backward, (grad, x.detach(), "elu"))


def test_the_elu_block_compiles_fullgraph_with_one_op_each_way(monkeypatch):
    """torch.compile(fullgraph=True) of the elu block on the fla route under bf16 autocast, the attention
    stood in by a function of the features (fla's route is one custom op under compile, tested apart):
    dynamo traces the route's choice, the kernels' import and one op per features tensor (their fakes
    and autograd formula), and gives eager's outputs and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend
    import linattn.attention as attention
    monkeypatch.setattr(attention, "run_linear_attention",
                        lambda phi_q, phi_k, v, **kw: v * (phi_q * phi_k).sum(-1, keepdim=True))
    monkeypatch.setattr(fla_kernels, "kernels_run_on", lambda v: True)   # as on CUDA
    block = LinearAttention(30, heads=3, feature_map="elu", rope="post", backend="fla").to(DEVICE)
    x = torch.randn(2, 37, 30, device=DEVICE)
    compiler = CompileCounterWithBackend("aot_eager")
    torch.compiler.reset()
    runs = []
    for model in (block, torch.compile(block, fullgraph=True, backend=compiler)):
        inputs = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = model(inputs)
        runs.append((out, *torch.autograd.grad(out.float().square().sum(), (inputs, block.to_qkv.weight))))
    torch.compiler.reset()
    targets = [str(node.target) for node in compiler.graphs[0].graph.nodes]
    assert targets.count("linattn.pointwise_features.default") == 2 and "aten.elu" not in " ".join(targets)
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_elu_blocks_fla_route_takes_the_kernels_features(monkeypatch, dtype):
    """The block hands the fla route the kernel's features, in the dtype it handed the map's (bf16 beside
    bf16 values under autocast, float32 otherwise), equal to them up to rounding; without the map's
    formula's name, the block hands its forward.  The op is recorded, not run."""
    import linattn.attention as attention
    seen = []
    monkeypatch.setattr(attention, "run_linear_attention",
                        lambda phi_q, phi_k, v, **kw: seen.append((phi_q, phi_k, v)) or v)
    block = LinearAttention(30, heads=3, feature_map="elu", rope="post", backend="fla")
    x = torch.randn(2, 37, 30, device=DEVICE)
    monkeypatch.setattr(fla_kernels, "kernels_run_on", lambda v: True)   # as on CUDA
    for formula in ("elu", None):
        block.feature_map.pointwise = formula
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            block(x)
    (fused_q, fused_k, fused_v), (mapped_q, mapped_k, mapped_v) = seen
    assert "pointwise_features" in fused_q.grad_fn.name() and "pointwise" not in mapped_q.grad_fn.name()
    assert fused_q.dtype == mapped_q.dtype == fused_v.dtype == dtype and torch.equal(fused_v, mapped_v)
    for got, want in ((fused_q, mapped_q), (fused_k, mapped_k)):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.gpu
def test_gpu_the_kernel_offsets_past_two_to_the_31():
    """B H N M = 2^31 + 2^24 bf16 elements, a strided view: int32 offsets would wrap (the interpreter's, in
    numpy, do not).  The last batch against the map and its cast on it alone, and its gradient."""
    qkv = torch.randn(17, 65536, 8 * 256 * 2, device="cuda", dtype=torch.bfloat16)
    x = qkv[..., :8 * 256].unflatten(-1, (8, 256)).transpose(1, 2)
    got = kernels.pointwise_features(x, "elu", torch.bfloat16)
    want = EluFeatureMap(256)(x[-1:], is_query=True).bfloat16()
    torch.testing.assert_close(got[-1:], want, **TOLERANCES[torch.bfloat16])
    grad = kernels.pointwise_features_backward(got, x, "elu")
    torch.testing.assert_close(grad[-1:], got[-1:] * torch.where(x[-1:] > 0, 1.0, want), **TOLERANCES[torch.bfloat16])
