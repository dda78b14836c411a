"""The fla route in bf16 against float64 at realistic lengths (GPU only: `gpu` marker, skipped on CPU,
where the interpreter runs fla at N = 70).  The benchmark's blocks (512 wide, 8 heads, `post`): FAVOR+
(M = 256) with inputs at 1x and 4x scale, and elu (M = 64), under bf16 autocast on backend="fla",
against the same block in float64 on backend="torch".  Global error (norm of the difference over the
norm) and worst-row error (the same per token) of the output and of the input's gradient.

The bounds: bf16 keeps 8 bits (relative rounding 2^-9 = 2e-3); the block rounds its projections, the
factors and values fla multiplies and the output, so a few 1e-3 globally; a row whose output is small
beside its terms (cancellation in the numerator) loses more, hence the looser worst-row bound."""
import pytest
import torch

from linattn import LinearAttention

GLOBAL = {"out": 2e-2, "grad": 3e-2}
WORST_ROW = {"out": 1e-1, "grad": 2e-1}
BLOCKS = [("favor", 256, 1.0), ("favor", 256, 4.0), ("elu", None, 1.0)]


def errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(global, worst-row) relative error of (1, N, D) tensors."""
    diff = (got.double() - want).flatten(0, -2).norm(dim=-1)
    rows = want.flatten(0, -2).norm(dim=-1)
    return (diff.norm() / rows.norm()).item(), (diff / rows.clamp_min(1e-30)).max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 65536])
@pytest.mark.parametrize("feature_map,num_features,scale", BLOCKS, ids=["favor-1x", "favor-4x", "elu"])
def test_gpu_block_in_bf16_against_float64(feature_map, num_features, scale, n):
    pytest.importorskip("fla")
    torch.manual_seed(0)
    options = {"num_features": num_features} if num_features else {}
    block = LinearAttention(512, 8, feature_map=feature_map, feature_map_options=options, rope="post",
                            backend="fla").cuda()
    exact = LinearAttention(512, 8, feature_map=feature_map, feature_map_options=options, rope="post",
                            backend="torch").cuda().double()
    exact.load_state_dict(block.state_dict())
    x = torch.randn(1, n, 512, device="cuda") * scale
    weights = torch.randn(1, n, 512, device="cuda")
    x64 = x.double().requires_grad_()
    want = exact(x64)
    want_grad, = torch.autograd.grad((want * weights.double()).sum(), x64)
    x = x.requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = block(x)
    got_grad, = torch.autograd.grad((got.float() * weights).sum(), x)
    found = {"out": errors(got, want.detach()), "grad": errors(got_grad, want_grad)}
    print(f"{feature_map} x{scale} N={n}: " + ", ".join(f"{k} global {g:.2e} worst row {w:.2e}"
                                                          for k, (g, w) in found.items()))
    for name, (global_error, worst_row) in found.items():
        assert global_error <= GLOBAL[name] and worst_row <= WORST_ROW[name], (name, found)
