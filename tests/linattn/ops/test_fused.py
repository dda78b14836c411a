"""The fused Triton kernels against the O(N^2) reference: values, gradients and decoding states.

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
from linattn.ops.linear_attention import fused as fused_module

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
    x = torch.randn(2, 67, 64, device=DEVICE, requires_grad=True)
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
@pytest.mark.parametrize("interpret", [None, "0", "false", "2"])
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


# ---- log-features (stable.py's algorithm in the kernels) -----------------------------------------

def log_inputs(n, m, dv, *, key_scale=1.0, query_scale=1.0, seed=0):
    """Log-features and values that require grad.  Query pairs (2i, 2i+1) are equal, so the
    numerator cap never acts (stable.py) and float64 Eq. 19 is the exact answer."""
    gen = torch.Generator().manual_seed(seed)
    b = (torch.randn(B, H, n, m // 2, generator=gen) * query_scale).repeat_interleave(2, dim=-1)
    a = torch.randn(B, H, n, m, generator=gen) * key_scale
    v = torch.randn(B, H, n, dv, generator=gen)
    return [t.to(DEVICE).requires_grad_() for t in (b, a, v)]


def log_fused(causal, rotary, offset=0):
    return lambda b, a, v: linear_attention(b, a, v, causal=causal, rotary=rotary, offset=offset,
                                            backend="triton", log_space=True)


def assert_log_space_matches_reference(tensors, causal, rotary, offset=0, rtol=2e-4, atol=2e-5):
    weights = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(log_fused(causal, rotary, offset), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    exact = lambda b, a, v: linear_attention_reference(b.exp(), a.exp(), v, causal=causal, rotary=rotary,
                                                       offset=offset)
    want = outputs_and_grads(exact, doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d log phi_q", "d log phi_k", "dv"), got, want):
        torch.testing.assert_close(g.cpu().double(), w, rtol=rtol, atol=atol * max(w.abs().max().item(), 1.0),
                                   msg=name)


def exact_rows(a, causal=True):
    """The rows the kernels compute token by token (their running max jumped within the chunk)."""
    from linattn.ops.linear_attention.fused import _log_scales
    return _log_scales(a.detach(), a.detach(), causal)[2].bool()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("n,m,dv,offset", [(1, 16, 16, 0), (70, 16, 64, 100_000), (129, 64, 16, 0),
                                           (65, 256, 64, 3)])
def test_log_space_values_and_gradients_match_reference(causal, rotary, n, m, dv, offset):
    tensors = log_inputs(n, m, dv, key_scale=2.0, query_scale=2.0)
    assert not exact_rows(tensors[1]).any()
    assert_log_space_matches_reference(tensors, causal, rotary, offset)


@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_log_space_rows_computed_token_by_token_match_reference(rotary):
    """Keys spread over +-150 make running maxima jump by more than JUMP_LIMIT inside chunks:
    those rows (and the state a chunk holding them hands on) take the token pass, forward and
    backward, and the other rows of such a chunk the chunk form."""
    tensors = log_inputs(75, 16, 16, key_scale=50.0)
    exact = exact_rows(tensors[1])
    assert exact.any() and not exact.all()
    assert not exact[..., 64:].all()          # the second chunk too starts with rows of the chunk form
    assert_log_space_matches_reference(tensors, True, rotary, offset=5)


def test_log_space_large_logits_give_no_empty_rows_and_finite_gradients():
    """FAVOR+-like log-features at |x| = 100: a = w.x - |x|^2/2 reaches -5000.  Plain features would
    underflow to all-zero rows; the log-space kernels give the torch backend's answer."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, 40, 16, generator=gen)
    x = 100 * x / x.norm(dim=-1, keepdim=True)
    w = torch.randn(32, 16, generator=gen)
    log_phi = x @ w.T - x.square().sum(-1, keepdim=True) / 2
    v = torch.randn(B, H, 40, 16, generator=gen)
    b, a, v = (t.to(DEVICE).requires_grad_() for t in (log_phi.clone(), log_phi.clone(), v))
    got = linear_attention(b, a, v, causal=True, rotary=False, backend="triton", log_space=True)
    want = linear_attention(b.detach().cpu(), a.detach().cpu(), v.detach().cpu(), causal=True, rotary=False,
                            backend="torch", log_space=True)
    assert exact_rows(a).any() and (got.abs().amax(-1) > 0).all()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (b, a, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_log_space_cap_acts_where_the_recurrent_step_caps():
    """Query pairs spread by ~100: Eq. 19 is beyond e^NUMERATOR_CAP, where stable.py saturates.
    The kernels measure the cap against each row's own scales, as the step does, so they agree
    with decoding token by token even there."""
    v = inputs(40, 16, 16)[2].detach()
    gen = torch.Generator().manual_seed(2)
    b, a = (30 * torch.randn(B, H, 40, 16, generator=gen).to(DEVICE) for _ in range(2))
    got = linear_attention(b, a, v, causal=True, rotary=True, backend="triton", log_space=True)
    state, steps = None, []
    for i in range(40):
        y, state = linear_attention_step(b[:, :, i], a[:, :, i], v[:, :, i], state, rotary=True,
                                         log_space=True)
        steps.append(y)
    want = torch.stack(steps, 2)
    assert want.abs().max() > 1e6
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("rotary", [True, False])
def test_log_space_state_equals_torch_backend_and_continues_with_step(rotary):
    n, extra = 70, 4
    b, a, v = (t.detach() for t in log_inputs(n + extra, 16, 16, key_scale=50.0))
    prefix = [t[:, :, :n] for t in (b, a, v)]
    out, state = linear_attention(*prefix, causal=True, rotary=rotary, offset=7, return_state=True,
                                  backend="triton", log_space=True)
    _, torch_state = linear_attention(*(t.cpu() for t in prefix), causal=True, rotary=rotary, offset=7,
                                      return_state=True, backend="torch", log_space=True)
    for name in ("kv", "k_sum", "log_scale"):
        torch.testing.assert_close(getattr(state, name).cpu(), getattr(torch_state, name), rtol=1e-5,
                                   atol=1e-6, msg=name)
    assert state.position == torch_state.position == n + 7
    steps = []
    for i in range(n, n + extra):
        y, state = linear_attention_step(b[:, :, i], a[:, :, i], v[:, :, i], state, rotary=rotary,
                                         log_space=True)
        steps.append(y)
    whole = linear_attention_reference(b.double().exp().cpu(), a.double().exp().cpu(), v.double().cpu(),
                                       causal=True, rotary=rotary, offset=7)
    torch.testing.assert_close(torch.cat([out, torch.stack(steps, 2)], 2).cpu().double(), whole,
                               rtol=1e-4, atol=1e-5)


def test_log_space_past_outputs_are_bitwise_unchanged_by_the_future():
    """Later tokens that jump (so their chunk takes the token pass) or change values must not move
    a single bit of the outputs before them."""
    b, a, v = (t.detach() for t in log_inputs(60, 16, 16, key_scale=2.0))
    before = log_fused(True, True)(b, a, v)
    a2, v2 = a.clone(), v.clone()
    a2[:, :, 40:] += 80.0
    v2[:, :, 40:] = torch.randn_like(v2[:, :, 40:])
    assert exact_rows(a2)[:, :, 40:].all() and not exact_rows(a)[:, :, 40:].any()
    after = log_fused(True, True)(b, a2, v2)
    assert torch.equal(after[:, :, :40], before[:, :, :40])


def test_log_space_float64_is_refused_with_a_way_out():
    b, a, v = (t.detach().double() for t in log_inputs(8, 16, 16))
    with pytest.raises(ValueError, match="backend='torch'"):
        linear_attention(b, a, v, causal=True, rotary=True, backend="triton", log_space=True)


@pytest.mark.parametrize("scale", [30.0, 100.0])
@pytest.mark.parametrize("rope", ["post", "pre", "none"])
def test_favor_block_at_large_inputs_on_triton(rope, scale):
    """FAVOR+ takes the log-space kernels on backend='triton': no row is empty and gradients stay
    finite at |x| = 30 and 100.  Without rope='post' (whose exact output is beyond the cap there)
    it agrees with the torch backend."""
    torch.manual_seed(0)
    block = LinearAttention(32, 2, feature_map="favor", rope=rope, backend="triton",
                            feature_map_options={"num_features": 16}).to(DEVICE)
    x = torch.randn(1, 40, 32, device=DEVICE)
    x = (scale * x / x.norm(dim=-1, keepdim=True)).requires_grad_()
    y = block(x)
    assert torch.isfinite(y).all() and (y.abs().amax(-1) > 0).all()
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(y.square().sum(), (x, block.to_qkv.weight)))
    if rope != "post":
        block.backend = "torch"
        torch.testing.assert_close(y, block(x), rtol=1e-4, atol=1e-5)


H100_SHARED_MEMORY = 232_448   # bytes per block (227 KB)


@pytest.mark.slow
def test_log_space_kernels_compile_for_an_h100_within_its_shared_memory():
    """No GPU needed: triton compiles for sm_90 here.  With triton's default 3 pipelining stages the
    causal log-space backward needed over 248 KB; it launches with LOG_BACKWARD_STAGES (2)."""
    script = Path(__file__).with_name("compile_kernels.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == 6
    for kernel in compiled:
        assert kernel["shared"] <= H100_SHARED_MEMORY, kernel


SHARED_MEMORY_PER_BLOCK = {86: 101_376, 75: 65_536}   # sm_86 (RTX 30xx, A10; sm_89 the same), sm_75 (T4)


@pytest.mark.slow
def test_smaller_tile_levels_fit_gpus_with_less_shared_memory():
    """Level 0 needs 140 KB on sm_86; a launch there raises OutOfResources and `_launch_fitting`
    moves on: level 1 must fit sm_86 and level 2 sm_75, in the causal log-space backward, which needs
    the most."""
    script = Path(__file__).with_name("compile_kernels.py")
    result = subprocess.run([sys.executable, str(script), "--causal-log", "--backward", "86:1", "75:2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == 2
    for kernel in compiled:
        assert kernel["shared"] <= SHARED_MEMORY_PER_BLOCK[kernel["arch"]], kernel


def test_a_launch_that_does_not_fit_takes_the_next_tile_level_and_remembers_it(monkeypatch):
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(fused_module, "_FITTING_LEVEL", {})
    tried = []

    def launch(level):
        tried.append(level)
        if level < 2:
            raise OutOfResources(140_000, 101_376, "shared memory")
        return "outputs"

    q = torch.zeros(1)
    forward = ("forward", True, True, True)
    assert fused_module._launch_fitting(forward, q, launch) == "outputs" and tried == [0, 1, 2]
    assert fused_module._launch_fitting(forward, q, launch) == "outputs" and tried == [0, 1, 2, 2]

    def never(level):
        raise OutOfResources(140_000, 1_000, "shared memory")
    with pytest.raises(RuntimeError, match="backward kernels do not fit this GPU even with their smallest tiles.*backend='torch'"):
        fused_module._launch_fitting(("backward", True, True, True), q, never)


def test_every_tile_level_gives_the_same_results(monkeypatch):
    """The levels change tiles and pipelining only: each matches the reference (in log space, the
    path that takes these kernels; plain features take chunk_parallel.py's)."""
    for level in range(len(fused_module.TILE_LEVELS)):
        monkeypatch.setattr(fused_module, "_FITTING_LEVEL", {
            ((kernel, True, True, True), torch.device(DEVICE), torch.float32): level
            for kernel in ("forward", "backward")})
        assert_log_space_matches_reference(log_inputs(70, 64, 40, key_scale=2.0, query_scale=2.0), True, True, 3)
        assert set(fused_module._FITTING_LEVEL.values()) == {level}


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
    from linattn.ops.linear_attention.backends import resolve
    cuda = torch.device("cuda")
    assert resolve("auto", cuda) == "triton" and resolve("auto", cuda, float64=True) == "torch"


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
