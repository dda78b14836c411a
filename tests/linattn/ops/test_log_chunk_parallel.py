"""The chunk-parallel log-space Triton kernels (log_chunk_parallel.py, the triton backend's path for
log-features) against the float64 log-space reference: outputs, gradients, returned states, at any
input scale, over rotation, offsets, ragged lengths, chunk boundaries and tiles.

Without a GPU they run in Triton's interpreter (conftest.py), in float32 against float64 references."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn import LinearAttention
from linattn.functional import linear_attention, linear_attention_step
from linattn.ops.linear_attention import log_chunk_parallel
from linattn.ops.linear_attention.naive import log_linear_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One row of programs: the interpreter's time grows with them.  Batches and heads each getting
# their own rows is tested once, below.
B, H = 1, 1
H100_SHARED_MEMORY = 232_448   # bytes per block an H100 (sm_90) can give one kernel


def log_inputs(n, m, dv, *, key_scale=2.0, query_scale=2.0, seed=0, dtype=torch.float32, batch=B, heads=H):
    """Log-features and values that require grad.  Query pairs (2i, 2i+1) are equal, so the
    numerator cap never acts (stable.py) and float64 Eq. 19 is the exact answer."""
    gen = torch.Generator().manual_seed(seed)
    b = (torch.randn(batch, heads, n, m // 2, generator=gen) * query_scale).repeat_interleave(2, dim=-1)
    a = torch.randn(batch, heads, n, m, generator=gen) * key_scale
    v = torch.randn(batch, heads, n, dv, generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (b, a, v)]


def favor_log_features(n, m, *, scale, seed=3):
    """FAVOR+'s log-features at |x| = scale: a = w.x - |x|^2/2 reaches -scale^2/2 (-5000 at 100)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, n, 16, generator=gen)
    x = scale * x / x.norm(dim=-1, keepdim=True)
    return x @ torch.randn(m, 16, generator=gen).T - x.square().sum(-1, keepdim=True) / 2


def kernels(causal, rotary, offset=0, **options):
    return lambda b, a, v: log_chunk_parallel.log_linear_attention(b, a, v, causal=causal, rotary=rotary,
                                                                   offset=offset, **options)


def outputs_and_grads(fn, tensors, weights):
    out = fn(*tensors)
    return (out, *torch.autograd.grad((out * weights).sum(), tensors))


def assert_matches_reference(tensors, *, causal, rotary, offset=0, rtol=2e-4, atol=2e-5):
    """Outputs and the gradients of b, a, v against log_linear_attention_reference in float64, whose
    autograd differentiates through its max shift too (zero in exact arithmetic, as the kernels take it)."""
    weights = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(kernels(causal, rotary, offset), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want = outputs_and_grads(lambda b, a, v: log_linear_attention_reference(
        b, a, v, causal=causal, rotary=rotary, offset=offset), doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d b", "d a", "dv"), got, want):
        torch.testing.assert_close(g.cpu().double(), w, rtol=rtol, atol=atol * max(w.abs().max().item(), 1.0),
                                   msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("n,m,dv,offset", [(1, 16, 16, 0), (37, 16, 24, 100_000), (70, 32, 16, 3)])
def test_values_and_gradients_match_reference(n, m, dv, offset, rotary, causal):
    """Ragged N: one row; sub-chunks of 16 with a ragged last one; a second chunk of 64 (its state
    read and its gradient carried back)."""
    assert_matches_reference(log_inputs(n, m, dv), causal=causal, rotary=rotary, offset=offset)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_batches_and_heads_each_read_and_write_their_own_rows(causal):
    assert_matches_reference(log_inputs(20, 16, 16, batch=2, heads=2), causal=causal, rotary=True, offset=3)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,m,dv", [(129, 64, 16), (65, 128, 64)])
def test_linear_attention_with_log_space_on_triton_matches_reference(n, m, dv, causal):
    """Through the public call (functional.py sends log-space triton calls here): three chunks of
    M = 64, and M = 128 in two feature tiles with a full value tile."""
    tensors = log_inputs(n, m, dv)
    weights = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(lambda b, a, v: linear_attention(b, a, v, causal=causal, rotary=True, offset=3,
                                                             backend="triton", log_space=True), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want = outputs_and_grads(lambda b, a, v: log_linear_attention_reference(b, a, v, causal=causal, rotary=True,
                                                                            offset=3), doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d b", "d a", "dv"), got, want):
        torch.testing.assert_close(g.cpu().double(), w, rtol=2e-4, atol=2e-5 * max(w.abs().max().item(), 1.0),
                                   msg=name)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_every_tile_level_matches_reference(level, monkeypatch):
    """Level 2's 16-wide tiles make M = 48 and Dv = 40 three tiles each in every kernel (the loops over
    feature tiles in the output and dv kernels, over value tiles in dq and dk); level 1 two."""
    monkeypatch.setattr(log_chunk_parallel, "_FITTING_LEVEL", {
        (direction, True, causal, torch.device(DEVICE), torch.float32): level
        for direction in ("forward", "backward") for causal in (True, False)})
    for causal in (True, False) if level == 1 else (True,):   # non-causal once: the interpreter is slow
        assert_matches_reference(log_inputs(21, 48, 40), causal=causal, rotary=True, offset=7)
    assert set(log_chunk_parallel._FITTING_LEVEL.values()) == {level}   # no key was added at another level


@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_running_maxima_that_jump_inside_chunks_match_reference(rotary):
    """Keys spread over +-150: running maxima jump by far more than e^30 inside sub-chunks and chunks
    (where the earlier scanning kernels needed a token-by-token pass); every factor stays <= 1 in its frame."""
    tensors = log_inputs(75, 16, 16, key_scale=50.0, query_scale=2.0)
    jumps = tensors[1].detach().cummax(-2).values.diff(dim=-2).amax(-1)
    assert (jumps > 30).any()
    assert_matches_reference(tensors, causal=True, rotary=rotary, offset=5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_favor_log_features_at_scale_100_give_no_empty_row_and_finite_gradients(rotary, causal):
    """a, b reach -5000: plain features would underflow to all-zero rows.  Query pairs differ here,
    so with rotation the exact output passes the cap; without, it is float64 Eq. 19's (closer than
    the torch backend's non-causal pass, which rounds b + F at |F| = 5000 and is off by 5e-4 here)."""
    log_phi = favor_log_features(40, 32, scale=100.0)
    b, a = (log_phi.clone().to(DEVICE).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE).requires_grad_()
    got = kernels(causal, rotary)(b, a, v)
    assert torch.isfinite(got).all() and (got.abs().amax(-1) > 0).all()
    grads = torch.autograd.grad(got.square().sum(), (b, a, v))
    assert all(torch.isfinite(g).all() for g in grads)
    if not rotary:
        want = log_linear_attention_reference(b.detach().cpu(), a.detach().cpu(), v.detach().cpu(), causal=causal,
                                              rotary=False)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_the_cap_acts_where_the_recurrent_step_caps():
    """Query pairs spread by ~100: Eq. 19 is beyond e^NUMERATOR_CAP, where stable.py saturates.  The
    kernels measure the cap against each row's own pair scale, as the step does, so they agree with
    decoding token by token even there."""
    v = log_inputs(40, 16, 16)[2].detach()
    gen = torch.Generator().manual_seed(2)
    b, a = (30 * torch.randn(B, H, 40, 16, generator=gen).to(DEVICE) for _ in range(2))
    got = kernels(True, True)(b, a, v)
    state, steps = None, []
    for i in range(40):
        y, state = linear_attention_step(b[:, :, i], a[:, :, i], v[:, :, i], state, rotary=True, log_space=True)
        steps.append(y)
    want = torch.stack(steps, 2)
    assert want.abs().max() > 1e6
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_returned_state_equals_torch_backend_and_continues_with_step(rotary):
    n, extra = 70, 4
    b, a, v = (t.detach() for t in log_inputs(n + extra, 16, 16, key_scale=50.0))
    prefix = [t[:, :, :n] for t in (b, a, v)]
    out, state = kernels(True, rotary, 7, return_state=True)(*prefix)
    _, want = linear_attention(*(t.cpu() for t in prefix), causal=True, rotary=rotary, offset=7,
                               return_state=True, backend="torch", log_space=True)
    for name in ("kv", "k_sum", "log_scale"):
        torch.testing.assert_close(getattr(state, name).cpu(), getattr(want, name), rtol=1e-5, atol=1e-6, msg=name)
    assert state.position == want.position == n + 7
    steps = []
    for i in range(n, n + extra):
        y, state = linear_attention_step(b[:, :, i], a[:, :, i], v[:, :, i], state, rotary=rotary, log_space=True)
        steps.append(y)
    whole = log_linear_attention_reference(b.cpu(), a.cpu(), v.cpu(), causal=True, rotary=rotary, offset=7)
    torch.testing.assert_close(torch.cat([out, torch.stack(steps, 2)], 2).cpu().double(), whole,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("offset", [2**40 + 12_345, 2**62])
def test_large_offsets_rotate_as_exactly_as_the_torch_backend(offset):
    b, a, v = (t.detach() for t in log_inputs(40, 16, 16))
    for causal in (True, False):
        got = kernels(causal, True, offset)(b, a, v)
        want = linear_attention(b, a, v, causal=causal, rotary=True, offset=offset, backend="torch", log_space=True)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_past_outputs_are_bitwise_unchanged_when_future_tokens_change():
    """Later keys that jump by 80, later queries and values: not one bit of an earlier output moves
    (masked terms are exact zeros, frames and states are at or before each row)."""
    b, a, v = (t.detach() for t in log_inputs(90, 16, 16))
    later = [t.clone() for t in (b, a, v)]
    later[1][:, :, 40:] += 80.0
    for t in (later[0], later[2]):
        t[:, :, 40:] = t[:, :, 40:].flip(-1) * 3
    before, after = kernels(True, True)(b, a, v), kernels(True, True)(*later)
    assert torch.equal(before[:, :, :40], after[:, :, :40])
    assert not torch.equal(before[:, :, 40:], after[:, :, 40:])


@pytest.mark.parametrize("broken, name", [(0, "query"), (1, "key")])
def test_a_later_nan_in_its_own_sub_chunk_leaves_earlier_rows_alone(broken, name):
    """A NaN key or query log-feature at row 43 (sub-chunk 32..47): the outputs before it, and the
    gradients of their queries under a loss on them alone, are the bits they were (masked terms are
    dropped, not multiplied by zero; before, rows 32..42 turned NaN).  Earlier keys' and values'
    gradients do take NaN, through 0 x NaN in the sums over later rows, on the torch backend too."""
    b, a, v = (t.detach() for t in log_inputs(48, 16, 16))
    later = [t.clone().requires_grad_() for t in (b, a, v)]
    with torch.no_grad():
        later[broken][:, :, 43, 1] = float("nan")
    clean = [t.clone().requires_grad_() for t in (b, a, v)]
    outs = [kernels(True, True)(*inputs) for inputs in (clean, later)]
    assert torch.equal(outs[0][:, :, :43], outs[1][:, :, :43]), name
    d_b = [torch.autograd.grad(out[:, :, :43].sum(), inputs[0])[0] for out, inputs in zip(outs, (clean, later))]
    assert torch.equal(d_b[0][:, :, :43], d_b[1][:, :, :43]), name


def test_bf16_gradients_are_as_close_to_float32_as_the_torch_backends():
    """The output kept for backward is float32 (gd = -(g . out) / den): saved in bf16, d a was 4e-2
    off where the torch backend is 2e-3."""
    tensors = log_inputs(40, 16, 16, dtype=torch.bfloat16)
    weights = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want = outputs_and_grads(lambda b, a, v: linear_attention(b, a, v, causal=True, rotary=True, backend="torch",
                                                              log_space=True),
                             [t.detach().float().requires_grad_() for t in tensors], weights)
    got = outputs_and_grads(kernels(True, True), tensors, weights)
    for name, g, w in zip(("out", "d b", "d a", "dv"), got, want):
        error = ((g.float() - w).norm() / w.norm()).item()
        assert error < 1e-2, (name, error)


def test_a_direct_call_raises_exact_zeros_to_a_floor_as_the_public_call_does():
    b, a, v = (t.detach() for t in log_inputs(20, 16, 8))
    a[:, :, 3:7, 4] = float("-inf")
    direct = kernels(True, True)(b, a, v)
    assert torch.isfinite(direct).all()
    assert torch.equal(direct, linear_attention(b, a, v, causal=True, rotary=True, backend="triton", log_space=True))


@pytest.mark.parametrize("n, m, dv, message", [
    (1_048_561, 16, 16, "at most 1,048,560 tokens"),     # 65,535 blocks of 16 rows on the grid's y axis
    (300_000, 8192, 64, "at most 262,080 tokens"),       # one head's per-chunk states, 32-bit offsets
])
def test_calls_the_grid_or_32_bit_offsets_cannot_address_are_refused(n, m, dv, message):
    from linattn.ops.linear_attention.triton_common import check_grid
    with pytest.raises(ValueError, match=message):
        check_grid(1, 1, n, m, dv, rows_per_program=16, chunk=64)
    check_grid(1, 1, 1_048_560, 16, 16, rows_per_program=16, chunk=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_their_dtype_and_stay_close_to_float32(dtype):
    """Log-features are read as float32 whatever their dtype; values and outputs keep theirs."""
    tensors = log_inputs(40, 16, 16, dtype=dtype)
    weights = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    fn = kernels(True, True, 9)
    got = outputs_and_grads(fn, tensors, weights)
    want = outputs_and_grads(fn, [t.detach().float().requires_grad_() for t in tensors], weights)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, rtol=3e-2, atol=3e-2 * max(w.abs().max().item(), 1.0))


def test_float64_is_refused_with_a_way_out():
    b, a, v = (t.detach().double() for t in log_inputs(8, 16, 16))
    with pytest.raises(ValueError, match="backend='torch'"):
        linear_attention(b, a, v, causal=True, rotary=True, backend="triton", log_space=True)


def test_a_non_causal_state_is_refused():
    b, a, v = (t.detach() for t in log_inputs(20, 16, 16))
    with pytest.raises(ValueError, match="needs causal=True"):
        kernels(False, True, return_state=True)(b, a, v)


def test_functional_sends_log_space_triton_calls_here(monkeypatch):
    calls = []
    original = log_chunk_parallel.log_linear_attention
    monkeypatch.setattr(log_chunk_parallel, "log_linear_attention", lambda *args, **kw: calls.append(kw) or
                        original(*args, **kw))
    b, a, v = (t.detach() for t in log_inputs(20, 16, 16))
    linear_attention(b, a, v, causal=True, rotary=True, backend="triton", log_space=True)
    assert len(calls) == 1 and calls[0]["causal"] and calls[0]["rotary"]


@pytest.mark.parametrize("scale", [30.0, 100.0])
@pytest.mark.parametrize("rope", ["post", "none"])
def test_favor_block_at_large_inputs_on_triton(rope, scale):
    """FAVOR+ takes these kernels on backend='triton': no row is empty and gradients stay finite at
    |x| = 30 and 100.  Without rope='post' (whose exact output is beyond the cap there) it agrees
    with the torch backend."""
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


def compile_for(*args):
    """compile_kernels.py's JSON lines for `args` (see test_chunk_parallel.compile_for)."""
    script = Path(__file__).with_name("compile_kernels.py")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), "--log-chunk-parallel", *args], capture_output=True,
                            text=True, timeout=1800, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_kernels_compile_for_an_h100_within_its_shared_memory():
    """No GPU needed: triton compiles for sm_90 here, every kernel in float32 and bf16, rotated or not,
    causal or not."""
    compiled = compile_for()
    assert len(compiled) == 6 * 2 * 2 * 2
    for kernel in compiled:
        assert kernel["shared"] <= H100_SHARED_MEMORY, kernel


@pytest.mark.slow
def test_the_next_tile_level_fits_gpus_with_less_shared_memory():
    """An RTX 30xx/40xx, A10 or L4 gives a block 101,376 bytes: level 1 must fit there in float32."""
    compiled = compile_for("--float32", "86:1")
    assert len(compiled) == 6 * 2 * 2
    for kernel in compiled:
        assert kernel["shared"] <= 101_376, kernel


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_bf16_factors_on_tensor_cores_stay_close_to_float32(causal):
    """On a GPU bf16 inputs multiply their factors (<= 1) in bf16; log-features stay float32."""
    b, a, v = (t.detach() for t in log_inputs(2048, 128, 64, key_scale=3.0, query_scale=3.0))
    want = linear_attention(b, a, v, causal=causal, rotary=True, backend="torch", log_space=True)
    got = kernels(causal, True)(*(t.bfloat16() for t in (b, a, v)))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
