"""The triton backend through `linear_attention` and the blocks, against the O(N^2) reference and the
torch backend: values, gradients, decoding states, dtypes and refusals.  Plain features take
chunk_parallel.py's kernels, log-features log_chunk_parallel.py's (each also tested on its own).

Without a GPU they run in Triton's interpreter (conftest.py), in float32 against float64
references; bf16 dots and TF32 are checked on a GPU only (`gpu` marker): the interpreter's bf16
dot is wrong, so there the kernels multiply bf16 as float32."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn import LinearAttention, SoftmaxAttention
from linattn.functional import linear_attention, linear_attention_reference, linear_attention_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H = 1, 1   # one row of programs (the interpreter is slow); several: test_chunk_parallel.py, the block tests


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


def triton_backend(causal, rotary, offset):
    return lambda q, k, v: linear_attention(q, k, v, causal=causal, rotary=rotary, offset=offset,
                                            backend="triton")


def assert_matches_reference(causal, rotary, n, m, dv, offset, rtol=2e-4, atol=2e-5):
    tensors = inputs(n, m, dv)
    weights = torch.randn(B, H, n, dv, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(triton_backend(causal, rotary, offset), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want = outputs_and_grads(reference(causal, rotary, offset), doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d phi_q", "d phi_k", "dv"), got, want):
        scale = max(w.abs().max().item(), 1.0)   # N=1: out = v exactly, so d phi = 0
        torch.testing.assert_close(g.cpu().double(), w, rtol=rtol, atol=atol * scale, msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("n,m,dv,offset", [(1, 16, 16, 0), (70, 16, 64, 100_000), (129, 64, 16, 0),
                                            (65, 256, 64, 100_000)])
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


@pytest.mark.parametrize("fm, options", [("favor", {"num_features": 32}), ("hedgehog", {}), ("taylor", {"dim": 6})])
@pytest.mark.parametrize("rope", ["post", "pre", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_gives_the_same_result_on_both_backends(rope, causal, fm, options):
    """Every RoPE placement through LinearAttention with FAVOR+, trainable hedgehog (log-features)
    and taylor (plain features that are negative, M = 28): `pre` rotates before the map, so the
    kernel sees unrotated features."""
    torch.manual_seed(0)
    block = LinearAttention(64, 2, feature_map=fm, rope=rope, causal=causal, backend="torch",
                            feature_map_options=options).to(DEVICE)
    x = torch.randn(1, 37, 64, device=DEVICE, requires_grad=True)
    weights = [x, block.to_qkv.weight, *block.feature_map.parameters()]
    results = []
    for backend in ("torch", "triton"):
        block.backend = backend
        y = block(x, offset=11)
        results.append((y, *torch.autograd.grad(y.square().sum(), weights)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_float64_is_refused_with_a_way_out():
    phi_q, phi_k, v = (t.detach().double() for t in inputs(8, 16, 16))
    with pytest.raises(ValueError, match="backend='torch'"):
        linear_attention(phi_q, phi_k, v, causal=True, rotary=True, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error without the interpreter")
@pytest.mark.parametrize("interpret", [None, "false", "2"])
def test_cpu_tensors_outside_the_interpreter_get_a_clear_error(interpret):
    """Whatever value triton reads as off ("false", "2") is off for linattn too."""
    code = ("import torch; from linattn.functional import linear_attention\n"
            "x = torch.rand(1, 1, 4, 16)\n"
            "linear_attention(x, x, x, causal=True, rotary=True, backend='triton')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {} if interpret is None else {"TRITON_INTERPRET": interpret}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "TRITON_INTERPRET=1" in result.stderr and "backend='torch'" in result.stderr


@pytest.mark.parametrize("offset", [10 ** 12, 2 ** 53 + 1, 2 ** 62 + 12345])
def test_large_offsets_rotate_as_exactly_as_the_torch_backend(offset):
    """The offset's turns are reduced exactly on the host (rotary.py); float64 products of the
    whole position lost 0.1-0.2 of a radian at 2^53 and beyond."""
    phi_q, phi_k, v = (t.detach() for t in inputs(70, 16, 8))
    for causal in (True, False):
        want = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, offset=offset, backend="torch")
        got = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, offset=offset, backend="triton")
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_positions_past_int64_are_refused_with_rotation_and_any_offset_works_without():
    phi_q, phi_k, v = (t.detach() for t in inputs(40, 16, 8))
    with pytest.raises(ValueError, match="rotary positions must stay below 2\\^63"):
        linear_attention(phi_q, phi_k, v, causal=True, rotary=True, offset=2 ** 63 - 10, backend="triton")
    out, state = linear_attention(phi_q, phi_k, v, causal=True, rotary=False, offset=2 ** 64, backend="triton",
                                  return_state=True)
    torch.testing.assert_close(out, linear_attention(phi_q, phi_k, v, causal=True, rotary=False, backend="torch"))
    assert state.position == 2 ** 64 + 40


def test_fp16_sums_past_its_range_stay_finite():
    """The state (about N |phi_k| |v|) passes fp16's 65504: the kernels multiply fp16 inputs as
    float32, so the result is the torch backend's (which sums in float32)."""
    gen = torch.Generator().manual_seed(0)
    phi_q, phi_k = (torch.rand(1, 1, 200, 16, generator=gen) + 0.5 for _ in range(2))
    v = torch.rand(1, 1, 200, 8, generator=gen) * 100 + 300
    half = [t.half() for t in (phi_q, phi_k, v)]
    want = linear_attention(*half, causal=True, rotary=False, backend="torch")
    got = linear_attention(*half, causal=True, rotary=False, backend="triton")
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bf16; on a GPU see test_gpu_bf16_*")
def test_bf16_in_the_interpreter_is_right():
    """triton 3.7's interpreted bf16 tl.dot is wrong (off by 1e8 here); the kernels then multiply
    as float32, so bf16 inputs give the float32 result rounded to bf16."""
    phi_q, phi_k, v = (t.detach() for t in inputs(10, 16, 16))
    want = linear_attention(phi_q, phi_k, v, causal=True, rotary=True, backend="torch")
    got = linear_attention(*(t.bfloat16() for t in (phi_q, phi_k, v)), causal=True, rotary=True, backend="triton")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


def test_more_batch_x_heads_than_a_cuda_grid_holds_is_refused():
    x = torch.rand(2, 32768, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 65,535 batch x heads per call.*2 x 32768.*backend='torch'"):
        linear_attention(x, x, x, causal=True, rotary=False, backend="triton")


def test_auto_takes_torch_for_float64_on_cuda():
    """The kernels compute in float32: `auto` does not send float64 to them (asking for triton is an error)."""
    from linattn.ops.linear_attention.dispatch import resolve
    cuda = torch.device("cuda")
    assert resolve("auto", cuda, log_space=True, causal=True) == "triton"
    assert resolve("auto", cuda, float64=True, log_space=True, causal=True) == "torch"


def log_inputs(n, m, dv, *, key_scale=1.0, query_scale=1.0, seed=0):
    """Log-features (query pairs equal, so the numerator cap never acts) and values that require grad."""
    gen = torch.Generator().manual_seed(seed)
    b = (torch.randn(B, H, n, m // 2, generator=gen) * query_scale).repeat_interleave(2, dim=-1)
    a = torch.randn(B, H, n, m, generator=gen) * key_scale
    v = torch.randn(B, H, n, dv, generator=gen)
    return [t.to(DEVICE).requires_grad_() for t in (b, a, v)]


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
def test_gpu_log_space_long_sequence_matches_torch_backend():
    """The FAVOR+ block's default path on a GPU: log-features through the kernels, 4096 tokens."""
    b, a, v = log_inputs(4096, 128, 64, key_scale=3.0, query_scale=3.0)
    weights = torch.randn_like(v)
    runs = [outputs_and_grads(lambda *t: linear_attention(*t, causal=True, rotary=True, backend=backend,
                                                          log_space=True), [b, a, v], weights)
            for backend in ("torch", "triton")]
    for want, got in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
def test_gpu_heads_past_element_2_31_are_read_where_they_are():
    """B*H*N*M >= 2^31: the last heads of phi_q start past element 2^31, so their offsets in the
    kernels must be int64 (int32 would wrap to another head's memory or outside the tensor)."""
    heads, n, m, dv = 136, 65536, 256, 16          # head 135 starts at element 135 * 2^24 > 2^31
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2 ** 30:
        pytest.skip("needs a GPU with 40 GiB for two 9 GiB feature tensors")
    gen = torch.Generator("cuda").manual_seed(0)
    phi_q, phi_k = (torch.rand(1, heads, n, m, device="cuda", generator=gen) + 0.05 for _ in range(2))
    v = torch.randn(1, heads, n, dv, device="cuda", generator=gen)
    last = slice(heads - 2, heads)
    with torch.no_grad():
        got = linear_attention(phi_q, phi_k, v, causal=True, rotary=True, backend="triton")[:, last]
        want = linear_attention(phi_q[:, last], phi_k[:, last], v[:, last], causal=True, rotary=True,
                                backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


@pytest.mark.gpu
def test_gpu_auto_backend_is_triton_on_cuda():
    from linattn.ops.linear_attention.dispatch import resolve
    assert resolve("auto", torch.device("cuda"), log_space=False, causal=True) == "triton"


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
