"""The fused Triton kernels against the O(N^2) reference: values, gradients and decoding states.

Without a GPU they run in Triton's interpreter (conftest.py), in float32 against float64
references; bf16 and TF32 are checked on a GPU only (`gpu` marker), since the interpreter's bf16
dot is not the hardware's."""
import os
import subprocess
import sys

import pytest
import torch

from linattn import LinearAttention, SoftmaxAttention
from linattn.functional import linear_attention, linear_attention_reference, linear_attention_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H = 1, 2


def inputs(n, m, dv, *, seed=0, device=DEVICE, dtype=torch.float32):
    """Non-negative features and values that require grad."""
    gen = torch.Generator().manual_seed(seed)
    phi_q, phi_k = (torch.rand(B, H, n, m, generator=gen) + 0.05 for _ in range(2))
    v = torch.randn(B, H, n, dv, generator=gen)
    return [t.to(device, dtype).requires_grad_() for t in (phi_q, phi_k, v)]


def outputs_and_grads(fn, tensors, weights):
    out = fn(*tensors)
    return (out, *torch.autograd.grad((out * weights).sum(), tensors))


def reference(causal, rotary, offset):
    return lambda q, k, v: linear_attention_reference(q, k, v, causal=causal, rotary=rotary, offset=offset)


def fused(causal, rotary, offset):
    return lambda q, k, v: linear_attention(q, k, v, causal=causal, rotary=rotary, offset=offset,
                                            backend="triton")


def assert_matches_reference(causal, rotary, n, m, dv, offset, rtol=2e-4, atol=2e-5):
    tensors = inputs(n, m, dv)
    weights = torch.randn(B, H, n, dv, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(fused(causal, rotary, offset), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want = outputs_and_grads(reference(causal, rotary, offset), doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d phi_q", "d phi_k", "dv"), got, want):
        scale = max(w.abs().max().item(), 1.0)   # N=1: out = v exactly, so d phi = 0
        torch.testing.assert_close(g.cpu().double(), w, rtol=rtol, atol=atol * scale, msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("n,m,dv", [(1, 16, 16), (70, 16, 64), (129, 64, 16), (65, 256, 64)])
@pytest.mark.parametrize("offset", [0, 100_000])
def test_values_and_gradients_match_reference(causal, rotary, n, m, dv, offset):
    assert_matches_reference(causal, rotary, n, m, dv, offset)


@pytest.mark.parametrize("m,dv", [(20, 24), (6, 10)])
def test_dimensions_that_are_not_tile_multiples(m, dv):
    assert_matches_reference(True, True, 37, m, dv, offset=3)


def test_rotation_stays_accurate_at_offset_1e9():
    """Causal Eq. 19 depends on relative positions only, so shifting every position by 10^9 must
    not change the output: it does by ~1 radian per pair if angles were formed in float32."""
    phi_q, phi_k, v = (t.detach() for t in inputs(50, 64, 16))
    at_zero = linear_attention(phi_q, phi_k, v, causal=True, rotary=True, offset=0, backend="triton")
    far = linear_attention(phi_q, phi_k, v, causal=True, rotary=True, offset=10**9, backend="triton")
    torch.testing.assert_close(far, at_zero, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rotary", [True, False])
def test_returned_state_equals_torch_backend_and_continues_with_step(rotary):
    n, extra, m, dv = 45, 4, 32, 16
    phi_q, phi_k, v = (t.detach() for t in inputs(n + extra, m, dv))
    prefix = [t[:, :, :n] for t in (phi_q, phi_k, v)]
    out, state = linear_attention(*prefix, causal=True, rotary=rotary, offset=7, return_state=True,
                                  backend="triton")
    _, torch_state = linear_attention(*(t.cpu() for t in prefix), causal=True, rotary=rotary,
                                      offset=7, return_state=True, backend="torch")
    torch.testing.assert_close(state.kv.cpu(), torch_state.kv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.k_sum.cpu(), torch_state.k_sum, rtol=1e-5, atol=1e-5)
    assert state.position == torch_state.position == n + 7
    steps = []
    for i in range(n, n + extra):
        y, state = linear_attention_step(phi_q[:, :, i], phi_k[:, :, i], v[:, :, i], state, rotary=rotary)
        steps.append(y)
    whole = linear_attention_reference(phi_q.double().cpu(), phi_k.double().cpu(), v.double().cpu(),
                                       causal=True, rotary=rotary, offset=7)
    torch.testing.assert_close(torch.cat([out, torch.stack(steps, 2)], 2).cpu().double(), whole,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rope", ["post", "pre", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_gives_the_same_result_on_both_backends(rope, causal):
    """Every RoPE placement through LinearAttention with FAVOR+: `pre` rotates before the map,
    so the kernel sees unrotated features."""
    torch.manual_seed(0)
    block = LinearAttention(64, 2, feature_map="favor", rope=rope, causal=causal, backend="torch",
                            feature_map_options={"num_features": 32}).to(DEVICE)
    x = torch.randn(2, 67, 64, device=DEVICE, requires_grad=True)
    results = []
    for backend in ("torch", "triton"):
        block.backend = backend
        y = block(x, offset=11)
        results.append((y, *torch.autograd.grad(y.square().sum(), (x, block.to_qkv.weight))))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_float64_is_refused_with_a_way_out():
    phi_q, phi_k, v = (t.detach().double() for t in inputs(8, 16, 16))
    with pytest.raises(ValueError, match="backend='torch'"):
        linear_attention(phi_q, phi_k, v, causal=True, rotary=True, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error without the interpreter")
def test_cpu_tensors_outside_the_interpreter_get_a_clear_error():
    code = ("import torch; from linattn.functional import linear_attention\n"
            "x = torch.rand(1, 1, 4, 16)\n"
            "linear_attention(x, x, x, causal=True, rotary=True, backend='triton')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr and "backend='torch'" in result.stderr


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bf16_is_close_to_float32(causal):
    phi_q, phi_k, v = (t.detach() for t in inputs(1000, 256, 64))
    want = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, backend="torch")
    got = linear_attention(*(t.bfloat16() for t in (phi_q, phi_k, v)), causal=causal, rotary=True,
                           backend="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_gpu_long_sequence_matches_torch_backend():
    """float32 runs as 3xTF32 on tensor cores: about float32 accuracy over 4096 tokens."""
    phi_q, phi_k, v = inputs(4096, 128, 64)
    weights = torch.randn_like(v)
    runs = [outputs_and_grads(lambda *t: linear_attention(*t, causal=True, rotary=True, backend=backend),
                              [phi_q, phi_k, v], weights) for backend in ("torch", "triton")]
    for want, got in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton_on_cuda():
    from linattn.ops.linear_attention.backends import resolve
    assert resolve("auto", torch.device("cuda")) == "triton"


@pytest.mark.gpu
def test_gpu_xformers_backend_equals_sdpa():
    xops = pytest.importorskip("xformers.ops", reason="the xformers extra is not installed")
    probe = torch.zeros(1, 16, 1, 32, device="cuda", dtype=torch.bfloat16)
    try:
        xops.memory_efficient_attention(probe, probe, probe)
    except NotImplementedError as err:   # a wheel built for another torch has no CUDA kernels
        pytest.skip(f"this xformers build has no CUDA kernels here: {str(err).splitlines()[0]}")
    torch.manual_seed(0)
    sdpa = SoftmaxAttention(128, 4, rope=True, causal=True, backend="sdpa").cuda()
    xf = SoftmaxAttention(128, 4, rope=True, causal=True, backend="xformers").cuda()
    xf.load_state_dict(sdpa.state_dict())
    x = torch.randn(2, 300, 128, device="cuda")
    torch.testing.assert_close(xf(x), sdpa(x), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_bf16_autocast_training_step_lowers_the_loss():
    torch.manual_seed(0)
    block = LinearAttention(128, 4, feature_map="favor", rope="post", backend="triton").cuda()
    head = torch.nn.Linear(128, 128).cuda()
    params = [*block.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    x = torch.randn(4, 512, 128, device="cuda")
    target = x.roll(1, dims=1)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(head(block(x)).float(), target)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in params)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
