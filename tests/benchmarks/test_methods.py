"""Every method the benchmark times computes what its name says."""
import pytest
import torch

from benchmarks.methods import Shape, build_attention, make_feature_map, make_inputs, method_table, unavailable
from linattn.functional import linear_attention_reference, softmax_attention_reference

SHAPE = Shape(batch=2, heads=2, head_dim=16, num_features=32)
CPU = torch.device("cpu")
METHODS = {m.name: m for m in method_table(("auto", "torch", "fla"))}
# The fla backend's route is tested against the reference in tests/linattn/ops/.
RUNNABLE_ON_CPU = [m for m in METHODS.values() if m.backend != "fla" and unavailable(m, CPU) is None]


def outputs(method, causal: bool, device=CPU, dtype=torch.float32, n: int = 37):
    torch.manual_seed(0)          # linattn maps draw their seed from torch's generator
    attend = build_attention(method, SHAPE, device, causal, chunk_size=8)
    q, k, v, _ = make_inputs(SHAPE, n, device, dtype)
    return attend(q, k, v), (q, k, v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("method", RUNNABLE_ON_CPU, ids=lambda m: m.name)
def test_each_cpu_method_matches_its_definition(method, causal):
    out, (q, k, v) = outputs(method, causal)
    assert out.shape == v.shape and torch.isfinite(out).all()
    if method.family == "softmax":
        expected = softmax_attention_reference(q, k, v, causal=causal)
    elif method.family == "linattn":
        torch.manual_seed(0)
        fm = make_feature_map(method.feature_map, SHAPE)
        expected = linear_attention_reference(fm(q, is_query=True), fm(k, is_query=False), v, causal=causal,
                                              rotary=method.rope == "post",
                                              nonnegative_features=fm.nonnegative_features)
    else:
        return   # performer draws its own projection: shape and finiteness are what can be checked
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_methods_that_cannot_run_here_say_what_they_need(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # the kernel tests switch the interpreter on
    assert "xformers" in unavailable(METHODS["xformers"], CPU)
    assert unavailable(METHODS["sdpa-flash"], CPU) == "runs on CUDA only"
    assert "fla" in unavailable(METHODS["fla-chunk"], CPU) or unavailable(METHODS["fla-chunk"], CPU) == "runs on CUDA only"
    assert "backend='fla'" in unavailable(METHODS["favor-post-fla"], CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa-flash", "xformers", "fla-chunk", "favor-post-fla"])
def test_cuda_peers_match_their_cpu_definition(name, request):
    cuda = torch.device("cuda")
    if name == "fla-chunk":
        request.getfixturevalue("fla_autotuned")
    if unavailable(METHODS[name], cuda):
        pytest.skip(unavailable(METHODS[name], cuda))
    reference = {"sdpa-flash": "sdpa", "xformers": "sdpa", "fla-chunk": "favor-post",
                 "favor-post-fla": "favor-post-torch"}[name]
    dtype = torch.bfloat16 if name == "sdpa-flash" else torch.float32
    out, _ = outputs(METHODS[name], True, cuda, dtype, n=256)
    expected, _ = outputs(METHODS[reference], True, cuda, dtype, n=256)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
