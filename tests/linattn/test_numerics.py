"""Issue 24 part 4: finite FAVOR+ for every finite input, backward inside autocast, and the dtype
checks of the functional API and of decoding states."""
import pytest
import torch

from linattn.attention import ROPE_PLACEMENTS, LinearAttention
from linattn.feature_maps import available_feature_maps
from linattn.ops.linear_attention import cpp

CPU_BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(
    cpp.unavailable() is not None, reason=f"cpp backend: {cpp.unavailable()}"))]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rope", ROPE_PLACEMENTS)
@pytest.mark.parametrize("name", available_feature_maps())
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_backward_inside_bf16_autocast_gives_float32_gradients(name, rope, backend, scale):
    # At 1e4 the log-space maps take the exact-row path, whose backward is autograd through a
    # recomputed chunk: under autocast that recomputation made bf16 products and index_put refused them.
    block = LinearAttention(64, 4, feature_map=name, rope=rope, backend=backend, chunk_size=16)
    x = (torch.randn(2, 48, 64) * scale).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())
