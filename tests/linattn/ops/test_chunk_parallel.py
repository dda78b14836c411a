"""The chunk-parallel Triton kernels (causal, plain features) against the O(N^2) reference: outputs,
returned states and gradients over rotation, offsets, ragged lengths, chunk and tile sizes.

Without a GPU they run in Triton's interpreter (conftest.py), in float32 against float64 references."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn.functional import linear_attention, linear_attention_reference, linear_attention_step
from linattn.ops.linear_attention import chunk_parallel
from linattn.ops.linear_attention.triton_common import launch_fitting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One row of programs: the interpreter's time grows with them.  Batches and heads each getting
# their own rows is tested once, below.
B, H = 1, 1
H100_SHARED_MEMORY = 232_448   # bytes per block an H100 (sm_90) can give one kernel


def inputs(n, m, dv, *, seed=0, dtype=torch.float32, batch=B, heads=H):
    gen = torch.Generator().manual_seed(seed)
    phi_q, phi_k = (torch.rand(batch, heads, n, m, generator=gen) + 0.05 for _ in range(2))
    v = torch.randn(batch, heads, n, dv, generator=gen)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (phi_q, phi_k, v)]


def outputs_and_grads(fn, tensors, weights):
    out = fn(*tensors)
    return (out, *torch.autograd.grad((out * weights).sum(), tensors))


def assert_matches_reference(n, m, dv, *, rotary, offset, chunk, causal=True, rtol=2e-4, atol=2e-5, batch=B,
                             heads=H):
    tensors = inputs(n, m, dv, batch=batch, heads=heads)
    weights = torch.randn(batch, heads, n, dv, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = outputs_and_grads(lambda q, k, v: chunk_parallel.linear_attention(
        q, k, v, causal=causal, rotary=rotary, offset=offset, chunk=chunk), tensors, weights)
    doubles = [t.detach().cpu().double().requires_grad_() for t in tensors]
    want = outputs_and_grads(lambda q, k, v: linear_attention_reference(
        q, k, v, causal=causal, rotary=rotary, offset=offset), doubles, weights.cpu().double())
    for name, g, w in zip(("out", "d phi_q", "d phi_k", "dv"), got, want):
        scale = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g.cpu().double(), w, rtol=rtol, atol=atol * scale, msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
@pytest.mark.parametrize("offset", [0, 100_000])
@pytest.mark.parametrize("n,m,dv,chunk", [(1, 16, 16, 16), (37, 16, 24, 16), (70, 32, 16, 32),
                                          (129, 16, 32, 64), (100, 48, 40, 32)])
def test_values_and_gradients_match_reference(n, m, dv, chunk, rotary, offset, causal):
    """Ragged N (not a multiple of the chunk), M and Dv that are not tile multiples."""
    assert_matches_reference(n, m, dv, rotary=rotary, offset=offset, chunk=chunk, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_several_feature_and_value_tiles_match_reference(rotary, causal, monkeypatch):
    """16-wide tiles, so that M = 48 and Dv = 40 loop over 3 tiles each in every kernel (the loops
    over feature tiles in the output and dv kernels, over value tiles in the dq/dk kernel)."""
    monkeypatch.setattr(chunk_parallel, "_FITTING_LEVEL", {})
    monkeypatch.setattr(chunk_parallel, "TILE_LEVELS", ((16, 16),))
    assert_matches_reference(45, 48, 40, rotary=rotary, offset=7, chunk=16, causal=causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_batches_and_heads_each_read_and_write_their_own_rows(causal):
    assert_matches_reference(20, 16, 16, rotary=True, offset=3, chunk=16, causal=causal, batch=2, heads=2)


@pytest.mark.parametrize("rotary", [True, False], ids=["post", "unrotated"])
def test_returned_state_equals_torch_backend_and_continues_with_step(rotary):
    n, m, dv, offset = 50, 16, 24, 3
    q, k, v = (t.detach() for t in inputs(n + 1, m, dv))
    out, state = chunk_parallel.linear_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True, rotary=rotary,
                                                 offset=offset, return_state=True, chunk=16)
    want_out, want = linear_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], causal=True, rotary=rotary,
                                      offset=offset, return_state=True, backend="torch")
    torch.testing.assert_close(out, want_out, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(state.kv, want.kv, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(state.k_sum, want.k_sum, rtol=2e-4, atol=2e-5)
    assert state.position == want.position == offset + n and state.log_scale is None
    step, _ = linear_attention_step(q[:, :, n], k[:, :, n], v[:, :, n], state, rotary=rotary)
    full = linear_attention_reference(q, k, v, causal=True, rotary=rotary, offset=offset)
    torch.testing.assert_close(step, full[:, :, n], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("offset", [2**40 + 12_345, 2**62])
def test_large_offsets_rotate_as_exactly_as_the_torch_backend(offset):
    q, k, v = (t.detach() for t in inputs(40, 16, 16))
    got = chunk_parallel.linear_attention(q, k, v, causal=True, rotary=True, offset=offset, chunk=16)
    want = linear_attention(q, k, v, causal=True, rotary=True, offset=offset, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_past_outputs_are_bitwise_unchanged_when_future_tokens_change():
    """Masked scores are exact zeros inside a chunk, and earlier chunks never read later ones."""
    q, k, v = (t.detach() for t in inputs(40, 16, 16))
    later = [t.clone() for t in (q, k, v)]
    for t in later:
        t[:, :, 25:] = t[:, :, 25:].flip(-1) * 3
    before = chunk_parallel.linear_attention(q, k, v, causal=True, rotary=True, chunk=16)
    after = chunk_parallel.linear_attention(*later, causal=True, rotary=True, chunk=16)
    assert torch.equal(before[:, :, :25], after[:, :, :25])
    assert not torch.equal(before[:, :, 25:], after[:, :, 25:])


def test_rows_whose_keys_all_underflowed_are_zero_with_finite_gradients():
    """The denominator is clamped as common.divide does: rows before any non-zero key give 0."""
    q, k, v = inputs(30, 16, 16)
    k_zero = k.detach().clone()
    k_zero[:, :, :20] = 0
    k_zero.requires_grad_()
    out = chunk_parallel.linear_attention(q, k_zero, v, causal=True, rotary=True, chunk=16)
    want = linear_attention_reference(q.detach(), k_zero.detach(), v.detach(), causal=True, rotary=True)
    torch.testing.assert_close(out, want, rtol=2e-4, atol=2e-5)
    assert torch.equal(out[:, :, :20], torch.zeros_like(out[:, :, :20]))
    grads = torch.autograd.grad(out.square().sum(), (q, k_zero, v))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_give_their_dtype_and_stay_close_to_float32(dtype):
    tensors = inputs(40, 16, 16, dtype=dtype)
    weights = torch.randn(B, H, 40, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    fn = lambda q, k, v: chunk_parallel.linear_attention(q, k, v, causal=True, rotary=True, offset=9, chunk=16)  # noqa: E731
    got = outputs_and_grads(fn, tensors, weights)
    floats = [t.detach().float().requires_grad_() for t in tensors]
    want = outputs_and_grads(fn, floats, weights)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), w, rtol=3e-2, atol=3e-2 * max(w.abs().max().item(), 1.0))


@pytest.mark.parametrize("chunk", [8, 48, 64.0])
def test_chunks_that_tl_dot_cannot_take_are_refused(chunk):
    q, k, v = (t.detach() for t in inputs(20, 16, 16))
    with pytest.raises(ValueError, match="power of two"):
        chunk_parallel.linear_attention(q, k, v, causal=True, rotary=True, chunk=chunk)


def test_a_pass_that_does_not_fit_takes_the_next_tile_level_and_remembers_it():
    from triton.runtime.errors import OutOfResources
    fitted, tried = {}, []

    def launch(level):
        tried.append(level)
        if level < 2:
            raise OutOfResources(140_000, 101_376, "shared memory")
        return "outputs"

    key = ("forward", True, True, torch.device("cpu"), torch.float32)
    assert launch_fitting(fitted, key, 3, launch, "chunk-parallel") == "outputs" and tried == [0, 1, 2]
    assert launch_fitting(fitted, key, 3, launch, "chunk-parallel") == "outputs" and tried == [0, 1, 2, 2]
    assert fitted == {key: 2}

    def never(level):
        raise OutOfResources(140_000, 1_000, "shared memory")
    with pytest.raises(RuntimeError, match="chunk-parallel kernels do not fit this GPU even with their smallest "
                                           "tiles.*backend='torch'"):
        launch_fitting(fitted, ("backward",) + key[1:], 3, never, "chunk-parallel")


@pytest.mark.parametrize("level", [1, 2])
def test_every_tile_level_matches_reference(level, monkeypatch):
    monkeypatch.setattr(chunk_parallel, "_FITTING_LEVEL", {
        (direction, True, True, torch.device(DEVICE), torch.float32): level for direction in ("forward", "backward")})
    assert_matches_reference(70, 80, 48, rotary=True, offset=3, chunk=32)
    assert set(chunk_parallel._FITTING_LEVEL.values()) == {level}   # no other key was added at level 0


def test_a_non_causal_state_is_refused():
    q, k, v = (t.detach() for t in inputs(20, 16, 16))
    with pytest.raises(ValueError, match="needs causal=True"):
        chunk_parallel.linear_attention(q, k, v, causal=False, rotary=True, return_state=True)


def compile_for(*args):
    """compile_kernels.py's JSON lines for `args`.  The script's folder, not the working directory,
    heads its sys.path: PYTHONPATH names this checkout's package."""
    script = Path(__file__).with_name("compile_kernels.py")
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), "--chunk-parallel", *args], capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_kernels_compile_for_an_h100_within_its_shared_memory():
    """No GPU needed: triton compiles for sm_90 here, every kernel in float32 and bf16, rotated or not,
    causal or not
    (measured: at most 164,864 bytes, float32 causal rotated output and dv; 106,496 in bf16)."""
    compiled = compile_for()
    assert len(compiled) == 5 * 2 * 2 * 2
    for kernel in compiled:
        assert kernel["shared"] <= H100_SHARED_MEMORY, kernel


@pytest.mark.slow
def test_the_next_tile_level_fits_gpus_with_less_shared_memory():
    """An RTX 30xx/40xx, A10 or L4 gives a block 101,376 bytes; level 0 needs more in float32 and
    raises OutOfResources there, so level 1 must fit (measured: at most 57,856 bytes)."""
    compiled = compile_for("--float32", "86:1")
    assert len(compiled) == 5 * 2 * 2
    for kernel in compiled:
        assert kernel["shared"] <= 101_376, kernel
