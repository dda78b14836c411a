"""The C++ kernel of the causal log-space pass (cpp_logspace.py, stable_cpu.cpp) against torch_logspace.py's torch
ops and the float64 reference: outputs, states and gradients, irregular chunks between regular
ones, state spacing, threads, input layouts, and what happens where it cannot be built.
(test_stable.py runs its behavioural tests on both backends.)"""
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from linattn import LinearAttention, functional
from linattn.ops.linear_attention import cpp_logspace, dispatch, torch_logspace

from linattn.ops.linear_attention.naive import logspace_attention_reference

pytestmark = pytest.mark.skipif(cpp_logspace.unavailable() is not None,
                                reason=f"cpp backend: {cpp_logspace.unavailable()}")


def log_features(*shape, scale, dtype=torch.float64, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def results(attend, inputs, weights, **kwargs):
    """Output, state and the gradients of (out * weights).sum() for the given leaves."""
    out, state = attend(*inputs, causal=True, log_space=True, return_state=True, **kwargs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return (out, state.kv, state.k_sum, state.log_scale, *torch.autograd.grad((out * weights).sum(), leaves))


@pytest.mark.parametrize("rope", ["post", "none"])
def test_the_favor_block_gives_the_torch_backends_outputs_and_gradients(rope):
    """Float32 at the shapes of training (ragged N, Dv != M): agreement to float32 rounding."""
    torch.manual_seed(0)
    block = LinearAttention(64, 4, rope=rope, chunk_size=16, feature_map_options={"num_features": 32})
    x = torch.randn(2, 150, 64) * 2
    out_grad = torch.randn(2, 150, 64)
    got = {}
    for backend in ("torch", "cpp"):
        block.backend = backend
        leaf = x.clone().requires_grad_()
        y, state = block(leaf, return_state=True)
        params = torch.autograd.grad((y * out_grad).sum(), [leaf, *block.parameters()])
        got[backend] = (y, state.kv, state.k_sum, state.log_scale, *params)
    for cpp_result, torch_result in zip(got["cpp"], got["torch"]):
        torch.testing.assert_close(cpp_result, torch_result, rtol=2e-5, atol=2e-5 * torch_result.abs().max().item())


@pytest.mark.parametrize("rotary", [True, False])
def test_irregular_chunks_between_regular_ones_match_the_reference_in_float32(rotary):
    """Keys jumping by 45 every 37 tokens (exact rows) and a wide pair at the end: torch_logspace.py
    computes those chunks between the kernel's regular ones, and the state flows through both."""
    b = log_features(2, 3, 150, 8, scale=3, seed=3)
    a = log_features(2, 3, 150, 8, scale=3, seed=4)
    a = a + torch.arange(150, dtype=torch.float64).div(37).floor().mul(45).view(1, 1, 150, 1)
    a[:, :, 140:, 1::2] += 25
    v, weights = log_features(2, 3, 150, 5, scale=1, seed=5), log_features(2, 3, 150, 5, scale=1, seed=6)
    ref_inputs = [t.clone().requires_grad_() for t in (b, a, v)]
    ref = logspace_attention_reference(*ref_inputs, causal=True, rotary=rotary, offset=3)
    ref_grads = torch.autograd.grad((ref * weights).sum(), ref_inputs)
    inputs = [t.float().requires_grad_() for t in (b, a, v)]
    out, *_, db, da, dv = results(partial(functional.linear_attention, backend="cpp"), inputs, weights.float(),
                                  rotary=rotary, chunk_size=8, offset=3)
    for got, want in zip((out, db, da, dv), (ref, *ref_grads)):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("state_group", [1, 3, 16])
@pytest.mark.parametrize("jumps", [False, True])
def test_backward_recomputes_states_from_any_spacing_of_saved_ones(state_group, jumps, monkeypatch):
    monkeypatch.setattr(torch_logspace, "STATE_GROUP", state_group)
    b, a = log_features(1, 2, 23, 6, scale=3), log_features(1, 2, 23, 6, scale=3, seed=1)
    if jumps:
        a = a + torch.arange(2, 25, dtype=torch.float64).div(8).floor().mul(40).view(1, 1, 23, 1)
    v, weights = log_features(1, 2, 23, 3, scale=1, seed=2), log_features(1, 2, 23, 3, scale=1, seed=3)
    expected = [t.clone().requires_grad_() for t in (b, a, v)]
    ref = logspace_attention_reference(*expected, causal=True, rotary=True, offset=2)
    inputs = [t.clone().requires_grad_() for t in (b, a, v)]
    out, *_, db, da, dv = results(partial(functional.linear_attention, backend="cpp"), inputs, weights,
                                  rotary=True, chunk_size=4, offset=2)
    for got, want in zip((out, db, da, dv), (ref, *torch.autograd.grad((ref * weights).sum(), expected))):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-9)


def test_threads_split_heads_only_so_every_thread_count_gives_the_same_bits():
    b, a = log_features(3, 5, 90, 16, scale=2, dtype=torch.float32), \
        log_features(3, 5, 90, 16, scale=2, dtype=torch.float32, seed=1)
    v, weights = (log_features(3, 5, 90, 4, scale=1, dtype=torch.float32, seed=s) for s in (2, 3))
    runs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        inputs = [t.clone().requires_grad_() for t in (b, a, v)]
        runs.append(results(partial(functional.linear_attention, backend="cpp"), inputs, weights, rotary=True,
                            chunk_size=16))
    for first, *others in zip(*runs):
        assert all(torch.equal(first, other) for other in others)


@pytest.mark.parametrize("squared", [False, True])
def test_projections_of_strided_inputs_give_the_gradients_of_every_part(squared):
    """Inputs as a view of a wider tensor (as LinearAttention's q, k, v are), a weight and a shift
    (tensor, or a number with a squared norm) that need gradients."""
    wide = log_features(2, 40, 3, 2, 6, scale=1, seed=1).requires_grad_()
    inputs = wide[:, :, 0].transpose(1, 2)                       # (B, H, N, D) with strides
    weight = log_features(12, 6, scale=0.5, seed=2).requires_grad_()
    shift = -0.7 if squared else log_features(2, 2, 40, 1, scale=1, seed=3).requires_grad_()
    projection = functional.LogProjection(inputs, weight, shift, -0.2 if squared else 0.0)
    v = wide[:, :, 1, :, :3].transpose(1, 2)
    keys = log_features(2, 2, 40, 12, scale=1, seed=4)
    weights = log_features(2, 2, 40, 3, scale=1, seed=5)
    leaves = [wide, weight] + ([] if squared else [shift])
    got = {}
    for backend in ("torch", "cpp"):
        out = functional.linear_attention(projection, keys, v, causal=True, rotary=True, log_space=True,
                                          chunk_size=8, backend=backend)
        got[backend] = (out, *torch.autograd.grad((out * weights).sum(), leaves))
    for c, t in zip(got["cpp"], got["torch"]):
        torch.testing.assert_close(c, t, rtol=1e-10, atol=1e-10)


def both_backends(*args, **kwargs):
    """linear_attention's output on the cpp and torch backends, for the same call."""
    return [functional.linear_attention(*args, backend=backend, **kwargs) for backend in ("cpp", "torch")]


def test_rows_in_any_layout_are_read_as_the_torch_backend_reads_them():
    """BLAS takes rows with a stride of at least their length: values expanded along N, a single
    token whose row stride is below its length, and projection inputs expanded along N are copied
    first (they used to give zeros, and BLAS printed an error)."""
    b, a = log_features(1, 2, 16, 8, scale=1), log_features(1, 2, 16, 8, scale=1, seed=1)
    kwargs = dict(causal=True, rotary=False, log_space=True, chunk_size=4)
    expanded = torch.ones(1, 1, 1, 4, dtype=torch.float64).expand(1, 2, 16, 4)
    one_row = log_features(1, 2, 4, 1, scale=1, seed=2).transpose(-1, -2)    # (1, 2, 1, 4), row stride 1
    projection = functional.LogProjection(log_features(1, 2, 1, 6, scale=1, seed=3).expand(1, 2, 16, 6),
                                      log_features(8, 6, scale=1, seed=4), 0.0, -0.1)
    cases = [((b, a, expanded), expanded), ((b[:, :, :1], a[:, :, :1], one_row), one_row),
             ((projection, a, expanded), None)]
    for inputs, expected in cases:
        cpp_out, torch_out = both_backends(*inputs, **kwargs)
        torch.testing.assert_close(cpp_out, torch_out, rtol=1e-12, atol=1e-12)
        if expected is not None:   # each output row is a weighted mean of equal (or single) values
            torch.testing.assert_close(cpp_out, expected, rtol=1e-12, atol=1e-12)


def test_buffers_that_do_not_fit_in_memory_raise_instead_of_aborting():
    b = torch.zeros(1, 1, 200_000, 2)
    with pytest.raises(MemoryError, match="chunk_size"):   # L x L scores per thread at L = 200,000
        functional.linear_attention(b, b, b[..., :1], causal=True, rotary=False, log_space=True,
                                    chunk_size=200_000, backend="cpp")


def test_a_nan_key_poisons_the_running_maximum_as_on_the_torch_backend():
    b, a = log_features(1, 2, 12, 4, scale=1), log_features(1, 2, 12, 4, scale=1, seed=1)
    a[0, 1, 5, 2] = float("nan")
    v = log_features(1, 2, 12, 3, scale=1, seed=2)
    (cpp_out, cpp_state), (torch_out, torch_state) = both_backends(
        b, a, v, causal=True, rotary=True, log_space=True, chunk_size=4, return_state=True)
    assert cpp_state.log_scale.isnan().any() and cpp_out[:, 1, 5:].isnan().any()   # it does poison
    assert torch.equal(cpp_state.log_scale.isnan(), torch_state.log_scale.isnan())
    assert torch.equal(cpp_out.isnan(), torch_out.isnan())


@pytest.mark.parametrize("batch, heads, n, length", [(1, 1, 5, 64), (1, 1, 64, 64), (3, 1, 65, 8), (1, 7, 9, 1)])
def test_odd_shapes(batch, heads, n, length):
    b, a = log_features(batch, heads, n, 4, scale=3), log_features(batch, heads, n, 4, scale=3, seed=1)
    v = log_features(batch, heads, n, 7, scale=1, seed=2)
    out = functional.linear_attention(b, a, v, causal=True, rotary=True, log_space=True, chunk_size=length,
                                      backend="cpp")
    torch.testing.assert_close(out, logspace_attention_reference(b, a, v, causal=True, rotary=True), rtol=1e-9, atol=1e-9)


def test_auto_takes_cpp_for_causal_log_space_cpu_tensors_and_cpp_refuses_other_devices():
    cpu = torch.device("cpu")
    assert dispatch.resolve("auto", cpu, log_space=True, causal=True) == "cpp"
    assert dispatch.resolve("auto", cpu, float64=True, log_space=True, causal=True) == "cpp"
    # the table has no C++ kernel for these calls: torch's runs
    assert dispatch.resolve("auto", cpu, log_space=True, causal=False) == "torch"
    assert dispatch.resolve("auto", cpu, log_space=False, causal=True) == "torch"
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        dispatch.resolve("cpp", torch.device("meta"), log_space=True, causal=True)


def python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_auto_takes_torch_once_warned_and_cpp_says_why(tmp_path):
    """Where the kernel cannot be built, "auto" warns once and runs the torch backend; asking for
    "cpp" is an error that says why and what to use instead."""
    code = """
import warnings, torch
from linattn import functional
b = torch.randn(1, 1, 6, 4)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        out = functional.linear_attention(b, b, b, causal=True, rotary=True, log_space=True)
print(out.grad_fn is None, len(caught), caught[0].message)
try:
    functional.linear_attention(b, b, b, causal=True, rotary=True, log_space=True, backend="cpp")
except ValueError as error:
    print("refused:", error)
"""
    done = python(code, CXX=str(tmp_path / "no-compiler"), LINATTN_CACHE_DIR=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("True 1 linattn: the cpp backend is unavailable") and "no-compiler" in lines[0]
    assert lines[1].startswith("refused: no C++ compiler") and "backend='torch'" in lines[1]


def test_calls_the_kernel_does_not_compute_neither_build_it_nor_warn(tmp_path):
    code = """
import warnings, torch
from linattn import functional
warnings.simplefilter("error")
b = torch.rand(1, 1, 6, 4)
functional.linear_attention(b, b, b, causal=True, rotary=True)                    # plain features
functional.linear_attention(b, b, b, causal=False, rotary=True, log_space=True)   # not causal
print("quiet")
"""
    done = python(code, CXX=str(tmp_path / "no-compiler"), LINATTN_CACHE_DIR=str(tmp_path / "cache"))
    assert done.stdout.strip() == "quiet", done.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("cxx, reason", [(f"{cpp_logspace.compiler()[0]} -Wall", None),
                                         ("true", "gave no loadable library")])
def test_cxx_may_hold_arguments_and_a_build_that_loads_nothing_is_not_kept(tmp_path, cxx, reason):
    done = python("from linattn.ops.linear_attention import cpp_logspace; print(cpp_logspace.unavailable())",
                  CXX=cxx, LINATTN_CACHE_DIR=str(tmp_path))
    assert (done.stdout.strip() == "None") if reason is None else (reason in done.stdout), done.stdout + done.stderr
    assert len(list(tmp_path.glob("*.so"))) == (reason is None) and not list(tmp_path.glob("*.partial"))


def test_a_failed_build_is_one_line_that_names_the_compilers_error(tmp_path):
    done = python("from linattn.ops.linear_attention import cpp_logspace; print(cpp_logspace.unavailable())",
                  CXX=f"{cpp_logspace.compiler()[0]} -include {tmp_path / 'missing.h'}",
                  LINATTN_CACHE_DIR=str(tmp_path))
    reason = done.stdout.strip()
    assert len(reason.splitlines()) == 1 and "missing.h" in reason and "backend='torch'" in reason, reason


def test_without_a_home_directory_the_cache_asks_for_linattn_cache_dir():
    code = """
import pathlib
def no_home(cls):
    raise RuntimeError("Could not determine home directory.")
pathlib.Path.home = classmethod(no_home)
from linattn.ops.linear_attention import cpp_logspace
print(cpp_logspace.unavailable())
"""
    env = {key: value for key, value in os.environ.items() if key not in ("LINATTN_CACHE_DIR", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "set LINATTN_CACHE_DIR" in done.stdout, done.stdout + done.stderr


def test_an_unwritable_cache_is_reported(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    done = python("from linattn.ops.linear_attention import cpp_logspace; print(cpp_logspace.unavailable())",
                  LINATTN_CACHE_DIR=str(blocked / "cache"))
    assert "LINATTN_CACHE_DIR" in done.stdout and "cannot write" in done.stdout


def test_the_build_is_kept_and_reused(tmp_path):
    code = "from linattn.ops.linear_attention import cpp_logspace; print(cpp_logspace._build())"
    first = python(code, LINATTN_CACHE_DIR=str(tmp_path))
    built = first.stdout.strip()
    stamp = os.stat(built).st_mtime_ns
    assert python(code, LINATTN_CACHE_DIR=str(tmp_path)).stdout.strip() == built
    assert os.stat(built).st_mtime_ns == stamp and not list(tmp_path.glob("*.partial"))
