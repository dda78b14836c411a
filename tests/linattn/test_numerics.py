"""Issue 24 part 4: finite FAVOR+ for every finite input, backward inside autocast, and the dtype
checks of the functional API and of decoding states."""
import pytest
import torch

import linattn

from linattn.attention import ROPE_PLACEMENTS, LinearAttention
from linattn.feature_maps import available_feature_maps
from linattn.ops.linear_attention import cpp_logspace

CPU_BACKENDS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(
    cpp_logspace.unavailable() is not None, reason=f"cpp backend: {cpp_logspace.unavailable()}"))]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rope", ROPE_PLACEMENTS)
@pytest.mark.parametrize("name", available_feature_maps())
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_backward_inside_bf16_autocast_gives_float32_gradients(name, rope, backend, scale):
    # At 1e3 the log-space maps take the exact-row path, whose backward is autograd through a
    # recomputed chunk: under autocast that recomputation made bf16 products and index_put refused them.
    block = LinearAttention(64, 4, feature_map=name, rope=rope, backend=backend, chunk_size=16)
    x = (torch.randn(2, 48, 64) * scale).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in block.parameters())


def _prefilled_state(block):
    return block.eval()(torch.randn(2, 5, 32), return_state=True)[1]


@pytest.mark.parametrize("name", ["favor", "elu"])
@pytest.mark.parametrize("damage, message", [
    (lambda s: s._replace(kv=s.kv.double(), k_sum=s.k_sum.double(),
                          log_scale=None if s.log_scale is None else s.log_scale.double()),
     "state.kv is torch.float64 but this step computes"),
    (lambda s: s._replace(k_sum=s.k_sum.half()), "state.k_sum is torch.float16 but"),
    (lambda s: s._replace(kv=s.kv.clone().index_fill_(-1, torch.tensor([0]), float("nan"))),
     "state.kv holds NaN or inf"),
    (lambda s: s._replace(k_sum=s.k_sum.clone().fill_(float("inf"))), "state.k_sum holds NaN or inf"),
])
def test_step_refuses_a_state_of_another_dtype_or_not_finite(name, damage, message, debug):
    block = LinearAttention(32, 4, feature_map=name)
    with pytest.raises(ValueError, match=message):
        block.step(torch.randn(2, 32), damage(_prefilled_state(block)))


@pytest.mark.parametrize("log_scale", [float("nan"), float("inf")])
def test_step_refuses_a_log_scale_that_is_nan_or_plus_inf(log_scale, debug):
    block = LinearAttention(32, 4)
    state = _prefilled_state(block)
    with pytest.raises(ValueError, match="state.log_scale holds NaN or inf"):
        block.step(torch.randn(2, 32), state._replace(log_scale=state.log_scale.clone().fill_(log_scale)))


def test_step_continues_from_a_fresh_log_state_whose_scale_is_minus_inf():
    from linattn.functional import initial_state, linear_attention_step
    state = initial_state(2, 4, 8, 8, log_space=True)
    out, state = linear_attention_step(torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), state,
                                       rotary=True, log_space=True)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and state.position == 1


@pytest.mark.parametrize("dtypes, message, log_space", [
    ((torch.float32, torch.float64, torch.float32), "share one dtype, got float32 and float64", False),
    ((torch.float32, torch.float64, torch.float32), "share one dtype, got float32 and float64", True),
    ((torch.float64, torch.float64, torch.float32), "float32 but the features are torch.float64", False),
    ((torch.float64, torch.float64, torch.float32), "float32 but the features are torch.float64", True),
    ((torch.float32, torch.float32, torch.float16), "float16 but the features are torch.float32", False),
    ((torch.float64, torch.float64, torch.bfloat16), "bfloat16 but the features are torch.float64", True),
    ((torch.bfloat16, torch.bfloat16, torch.float32), "float32 but the features are torch.bfloat16", True),
])
def test_linear_attention_refuses_inputs_of_different_dtypes(dtypes, message, log_space):
    from linattn.functional import linear_attention
    q, k, v = (torch.rand(1, 2, 8, 4, dtype=d) for d in dtypes)
    with pytest.raises(ValueError, match=message):
        linear_attention(q, k, v, causal=True, rotary=True, log_space=log_space)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_log_features_take_half_values_as_under_autocast(dtype):
    """The log path's documented form (what a bf16/fp16 block hands it): float32 log-features beside
    half values, with or without autocast, the same numbers, the output in the values' dtype."""
    from linattn.functional import linear_attention, linear_attention_step
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    v = torch.randn(1, 2, 8, 4).to(dtype)
    out = linear_attention(q, k, v, causal=True, rotary=True, log_space=True)
    step, _ = linear_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], None, rotary=True, log_space=True)
    with torch.autocast("cpu", dtype=dtype):
        assert torch.equal(out, linear_attention(q, k, v, causal=True, rotary=True, log_space=True))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(step.float(), out[:, :, 0].float(), atol=1e-2)


def test_step_refuses_inputs_of_different_dtypes():
    from linattn.functional import linear_attention_step
    q, k, v = torch.rand(1, 2, 4), torch.rand(1, 2, 4), torch.rand(1, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="v is torch.float64 but the features are"):
        linear_attention_step(q, k, v, None, rotary=True)


def test_a_projection_of_another_dtype_than_its_partner_is_refused():
    from linattn.functional import LogProjection, linear_attention
    x, weight, v = torch.randn(1, 2, 8, 4), torch.randn(6, 4), torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="phi_q and phi_k must share one dtype"):
        linear_attention(LogProjection(x, weight), LogProjection(x, weight.double()), v, causal=True,
                         rotary=True, log_space=True)


@pytest.mark.parametrize("name", available_feature_maps())
def test_step_runs_under_bf16_autocast_after_the_checks(name):
    block = LinearAttention(32, 4, feature_map=name).eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, state = block(torch.randn(2, 5, 32), return_state=True)
        y, state = block.step(torch.randn(2, 32), state)
    assert y.dtype == torch.bfloat16 and state.kv.dtype == torch.float32 and torch.isfinite(y).all()


def _finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


@pytest.fixture
def debug():
    """Debug mode: out-of-range values raise (without it they come out NaN: test_host_reads.py)."""
    linattn.set_debug(True)
    yield
    linattn.set_debug(False)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rope", ROPE_PLACEMENTS)
def test_favor_block_is_finite_up_to_the_bound_and_refuses_beyond_it(rope, backend, debug):
    # FAVOR+ log-features reach about |x|^2 / (2 sqrt(D)) ~ 1.9 s^2 here: 1.9e6 at s = 1e3, 7.6e6 at 2e3,
    # under float32's 1/eps (8.4e6); at s = 1e5 they were NaN (two roundings of a chunk's first key
    # differed by ~1e3), at 1e19 |x|^2 overflowed.
    block = LinearAttention(64, 4, feature_map="favor", rope=rope, backend=backend)
    for scale in (30.0, 300.0, 1e3, 2e3):
        x = (torch.randn(2, 128, 64) * scale).requires_grad_()
        y = block(x)
        y.sum().backward()
        assert _finite(y, x.grad, *(p.grad for p in block.parameters())), scale
        block.zero_grad()
    for scale in (3e3, 1e5, 1e10, 1e19, 1e30):
        with pytest.raises(ValueError, match=r"beyond 8.39e\+06 \(1/eps of float32\)"):
            block(torch.randn(2, 128, 64) * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("rotary", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_log_features_anywhere_within_the_bound_give_finite_outputs_and_gradients(causal, rotary, backend, dtype,
                                                                                   debug):
    from linattn.functional import linear_attention
    from linattn.ops.linear_attention.common import log_feature_limit
    limit = log_feature_limit(dtype)
    b, a = ((torch.rand(2, 2, 100, 16, dtype=dtype) * 2 - 1).mul_(limit).requires_grad_() for _ in range(2))
    v = torch.randn(2, 2, 100, 8, dtype=dtype, requires_grad=True)
    out = linear_attention(b, a, v, causal=causal, rotary=rotary, log_space=True, backend=backend, chunk_size=16)
    out.sum().backward()
    assert _finite(out, b.grad, a.grad, v.grad)
    with pytest.raises(ValueError, match="phi_k's log-features reach"):
        linear_attention(b.detach(), a.detach() * 1.01, v, causal=causal, rotary=rotary, log_space=True,
                         backend=backend)


def test_minus_inf_log_features_do_not_count_against_the_bound():
    from linattn.functional import linear_attention
    b, a, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    a[..., 3, :] = float("-inf")      # a masked key: its features are exactly 0
    out = linear_attention(b, a, v, causal=True, rotary=True, log_space=True, backend="torch")
    assert _finite(out)


def test_a_projection_is_checked_by_the_bound_of_its_parts(debug):
    from linattn.functional import LogProjection, linear_attention
    x, weight, v = torch.randn(1, 2, 8, 4), torch.randn(6, 4), torch.randn(1, 2, 8, 4)
    x[0, 1, 5, 0] = 1e4               # |x|^2 / 8 = 1.25e7 > 8.4e6 (|x| |w| adds ~1e4)
    with pytest.raises(ValueError, match=r"phi_k's log-features reach 1.25e\+07"):
        linear_attention(LogProjection(x.clamp(-1, 1), weight), LogProjection(x, weight, 0.0, -1 / 8), v,
                         causal=True, rotary=True, log_space=True)


def test_step_refuses_log_features_beyond_the_bound(debug):
    block = LinearAttention(32, 4).eval()
    with pytest.raises(ValueError, match="log-features reach"):
        block.step(torch.randn(2, 32) * 1e4)


@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), ("On", True), ("0", False), ("", False),
                                            ("false", False), ("off", False)])
def test_the_debug_environment_variable_reads_on_and_off_words(value, enabled):
    from linattn.checks import debug_from_environment
    assert debug_from_environment(value) is enabled


def test_another_debug_word_is_off_with_a_warning():
    from linattn.checks import debug_from_environment
    with pytest.warns(UserWarning, match="LINATTN_DEBUG"):
        assert debug_from_environment("banana") is False
