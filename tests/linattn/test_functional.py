"""The chunked fast path and the recurrent step against the plain O(N^2) reference."""
import pytest
import torch

from linattn import make_feature_map
from linattn.functional import (linear_attention, linear_attention_reference, linear_attention_step)
from linattn.rotary import apply_rotary
from tests.conftest import LIBRARY_MAPS

OPTIONS = {"favor": {"num_features": 16}, "taylor": {"dim": 3}}
PLACEMENTS = ["post", "pre", "none"]
B, H, D, DV = 2, 2, 8, 6


def feature_map(name):
    return make_feature_map(name, D, heads=H, options=OPTIONS.get(name, {})).double()


def features(fm, q, k, rope, offset=0):
    """(phi_q, phi_k, rotary flag) for a placement, the way LinearAttention computes them."""
    if rope == "pre":
        q, k = apply_rotary(q, offset=offset), apply_rotary(k, offset=offset)
    return fm(q, is_query=True), fm(k, is_query=False), rope == "post"


def inputs(n, requires_grad=False):
    return [torch.randn(B, H, n, d, dtype=torch.float64, requires_grad=requires_grad)
            for d in (D, D, DV)]


@pytest.mark.parametrize("name", LIBRARY_MAPS)
@pytest.mark.parametrize("rope", PLACEMENTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,chunk", [(1, 4), (17, 4), (31, 16), (64, 64), (65, 8), (40, 128)])
def test_chunked_matches_reference_values_and_gradients(name, rope, causal, n, chunk):
    q, k, v = inputs(n, requires_grad=True)
    fm, results = feature_map(name), []
    for fast in (True, False):
        phi_q, phi_k, rotary = features(fm, q, k, rope, offset=3)
        sign = dict(nonnegative_features=fm.nonnegative_features)
        if fast:
            out = linear_attention(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=3, chunk_size=chunk, **sign)
        else:
            out = linear_attention_reference(phi_q, phi_k, v, causal=causal, rotary=rotary, offset=3, **sign)
        weights = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        results.append((out, *grads))
    for fast, ref in zip(*results):
        torch.testing.assert_close(fast, ref, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
def test_gradcheck_float64(causal, rotary):
    phi_q, phi_k = (torch.rand(1, 2, 11, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 11, 3, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b, c: linear_attention(a, b, c, causal=causal, rotary=rotary, chunk_size=4)
    assert torch.autograd.gradcheck(fn, (phi_q, phi_k, v))


@pytest.mark.parametrize("rotary", [True, False])
def test_recurrent_step_matches_parallel_outputs_and_state(rotary):
    phi_q, phi_k = (torch.rand(B, H, 23, 10, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, 23, DV, dtype=torch.float64)
    parallel, final = linear_attention(phi_q, phi_k, v, causal=True, rotary=rotary, chunk_size=8,
                                       return_state=True)
    state, steps = None, []
    for t in range(23):
        y, state = linear_attention_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], state, rotary=rotary)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, dim=2), parallel, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(state.kv, final.kv)
    torch.testing.assert_close(state.k_sum, final.k_sum)
    assert state.position == final.position == 23


def test_prefill_state_continues_with_steps():
    """A parallel prefill followed by recurrent steps equals one parallel pass."""
    phi_q, phi_k = (torch.rand(1, 2, 30, 8, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 30, 4, dtype=torch.float64)
    full = linear_attention(phi_q, phi_k, v, causal=True, rotary=True)
    _, state = linear_attention(phi_q[:, :, :20], phi_k[:, :, :20], v[:, :, :20], causal=True,
                                rotary=True, return_state=True)
    tail = []
    for t in range(20, 30):
        y, state = linear_attention_step(phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], state, rotary=True)
        tail.append(y)
    torch.testing.assert_close(torch.stack(tail, dim=2), full[:, :, 20:], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rotary", [True, False])
def test_float32_chunked_close_to_float64_reference(rotary):
    phi_q, phi_k = (torch.rand(1, 4, 300, 32, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 4, 300, 16, dtype=torch.float64)
    ref = linear_attention_reference(phi_q, phi_k, v, causal=True, rotary=rotary)
    fast = linear_attention(phi_q.float(), phi_k.float(), v.float(), causal=True, rotary=rotary)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast.double(), ref, rtol=1e-4, atol=1e-5)


def test_post_rotation_is_relative():
    """Eq. 19: shifting every position by the same offset leaves the output unchanged."""
    phi_q, phi_k = (torch.rand(1, 2, 40, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, 40, 4, dtype=torch.float64)
    for causal in (True, False):
        at_zero = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, offset=0)
        shifted = linear_attention(phi_q, phi_k, v, causal=causal, rotary=True, offset=1234)
        torch.testing.assert_close(at_zero, shifted, rtol=1e-9, atol=1e-10)
    # ...and the rotation really does something
    plain = linear_attention(phi_q, phi_k, v, causal=True, rotary=False)
    assert (plain - at_zero).abs().max() > 1e-3


def test_post_numerator_rotated_denominator_not():
    """Check Eq. 19 term by term on one query: rotated numerator, unrotated denominator."""
    phi_q, phi_k = (torch.rand(1, 1, 5, 4, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 1, 5, 3, dtype=torch.float64)
    theta = torch.tensor([1.0, 1e-2], dtype=torch.float64)     # 10000^(-2i/4), i = 0, 1

    def rotate(x, pos):
        out = x.clone()
        for i, t in enumerate(theta):
            c, s = torch.cos(pos * t), torch.sin(pos * t)
            out[2 * i], out[2 * i + 1] = c * x[2 * i] - s * x[2 * i + 1], s * x[2 * i] + c * x[2 * i + 1]
        return out

    m = 4
    q_m = phi_q[0, 0, m]
    numerator = sum((rotate(q_m, m) @ rotate(phi_k[0, 0, n], n)) * v[0, 0, n] for n in range(m + 1))
    denominator = sum(q_m @ phi_k[0, 0, n] for n in range(m + 1))
    out = linear_attention(phi_q, phi_k, v, causal=True, rotary=True)
    torch.testing.assert_close(out[0, 0, m], numerator / denominator)


@pytest.mark.parametrize("bad, message", [
    (dict(phi_q=torch.rand(2, 8, 4)), "must have 4 dimensions"),
    (dict(v=torch.rand(1, 2, 9, 3)), "disagree"),
    (dict(phi_k=torch.rand(1, 2, 8, 6)), "same shape"),
    (dict(phi_q=torch.rand(1, 2, 8, 0), phi_k=torch.rand(1, 2, 8, 0)), r"at least one feature.*\(M = 0\)"),
    (dict(phi_q=torch.rand(1, 2, 8, 0), phi_k=torch.rand(1, 2, 8, 0), rotary=False), "at least one feature"),
    (dict(phi_q=torch.rand(1, 2, 8, 5), phi_k=torch.rand(1, 2, 8, 5)), "must be even"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "positive integer"),
    (dict(chunk_size=True), "positive integer"),
    (dict(offset=-1), "offset"),
    (dict(offset=2.5), "offset"),
    (dict(phi_q=torch.ones(1, 2, 8, 4, dtype=torch.int64)), "floating point"),
    (dict(v=torch.ones(1, 2, 8, 3, dtype=torch.int32)), "floating point"),
    (dict(rope_base=0.0), "rope_base must be a finite number > 0"),
    (dict(phi_q=torch.rand(1, 2, 8, 5), phi_k=torch.rand(1, 2, 8, 5), causal=False, log_space=True), "must be even"),
    (dict(causal="no"), "causal must be True or False, got 'no'"),
    (dict(causal=None), "causal must be True or False, got None"),
    (dict(rotary="no"), "rotary must be True or False, got 'no'"),
    (dict(return_state=1), "return_state must be True or False, got 1"),
    (dict(log_space="yes"), "log_space must be True or False"),
    (dict(nonnegative_features=0), "nonnegative_features must be True or False"),
    (dict(v=torch.rand(1, 2, 8, 3, dtype=torch.complex64)), "v must be a real floating-point tensor"),
    (dict(phi_q=torch.rand(1, 2, 8, 4, dtype=torch.complex64)), r"phi_q must be a real floating-point tensor"),
    (dict(v=torch.rand(1, 2, 8, 3, device="meta")), r"must be on one device, got tensors on cpu and meta"),
    (dict(phi_q=torch.rand(1, 2, 8, 4, device="meta"), phi_k=torch.rand(1, 2, 8, 4, device="meta"),
          v=torch.rand(1, 2, 8, 3, device="meta")), r"tensors on the meta device hold none"),
])
def test_bad_input_raises_clear_value_error(bad, message):
    args = dict(phi_q=torch.rand(1, 2, 8, 4), phi_k=torch.rand(1, 2, 8, 4), v=torch.rand(1, 2, 8, 3),
                causal=True, rotary=True)
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        linear_attention(**args)


@pytest.mark.parametrize("log_space", [False, True])
@pytest.mark.parametrize("bad_state, message", [
    (lambda state: tuple(state), "must be the LinearState"),
    (lambda state: state._replace(kv=state.kv.expand(3, -1, -1, -1)), r"state.kv must be .*shape \(1, 2, 4, 3\)"),
    (lambda state: state._replace(k_sum=state.k_sum[..., :3]), r"state.k_sum must be"),
    (lambda state: state._replace(position=-1), "state.position must be a non-negative integer"),
])
def test_step_refuses_a_state_that_does_not_fit(log_space, bad_state, message):
    q, k, v = torch.rand(1, 2, 4), torch.rand(1, 2, 4), torch.rand(1, 2, 3)
    _, state = linear_attention_step(q, k, v, None, rotary=True, log_space=log_space)
    with pytest.raises(ValueError, match=message):
        linear_attention_step(q, k, v, bad_state(state), rotary=True, log_space=log_space)


def test_negative_features_are_refused_in_debug_mode_and_give_nan_without_it():
    import linattn
    q, k, v = torch.rand(1, 2, 8, 4), -torch.rand(1, 2, 8, 4), torch.rand(1, 2, 8, 3)
    assert linear_attention(q, k, v, causal=True, rotary=True).isnan().all()
    linattn.set_debug(True)
    try:
        with pytest.raises(ValueError, match="negative entries"):
            linear_attention(q, k, v, causal=True, rotary=True)
        with pytest.raises(ValueError, match="negative entries"):
            linear_attention_step(q[..., 0, :], k[..., 0, :], v[..., 0, :], None, rotary=True)
    finally:
        linattn.set_debug(False)


def test_step_refuses_a_state_of_the_other_kind():
    q, k, v = torch.rand(1, 2, 4), torch.rand(1, 2, 4), torch.rand(1, 2, 3)
    _, plain = linear_attention_step(q, k, v, None, rotary=True)
    with pytest.raises(ValueError, match="plain features but this step has log_space=True"):
        linear_attention_step(q, k, v, plain, rotary=True, log_space=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
def test_log_features_of_exactly_zero_features_give_the_plain_result(causal, rotary):
    """log 0 = -inf (a masked key, a map that gives zeros) once made -inf - (-inf) = NaN rows."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.rand(1, 2, 7, 4, generator=generator), torch.rand(1, 2, 7, 4, generator=generator)
    v = torch.randn(1, 2, 7, 3, generator=generator)
    k[:, :, 1] = 0           # every feature of key 1 is zero
    k[:, :, :, 2] = 0        # feature 2 is zero in every key
    k[:, 1, 4, 0] = 0
    plain = linear_attention(q, k, v, causal=causal, rotary=rotary, chunk_size=2)
    log = linear_attention(q.log(), k.log(), v, causal=causal, rotary=rotary, chunk_size=2, log_space=True)
    torch.testing.assert_close(log, plain)
    if causal:
        state, steps = None, []
        for t in range(7):
            out, state = linear_attention_step(q.log()[:, :, t], k.log()[:, :, t], v[:, :, t], state,
                                               rotary=rotary, log_space=True)
            steps.append(out)
        torch.testing.assert_close(torch.stack(steps, 2), plain)


@pytest.mark.parametrize("bad, message", [
    (dict(rotary="no"), "rotary must be True or False, got 'no'"),
    (dict(log_space=None), "log_space must be True or False, got None"),
    (dict(v=torch.rand(1, 2, 3, device="meta")), "must be on one device"),
    (dict(phi_q=torch.rand(1, 2, 4, dtype=torch.complex64)), "phi_q must be a real floating-point tensor"),
    (dict(phi_q=torch.rand(1, 2, 0), phi_k=torch.rand(1, 2, 0), rotary=False), "at least one feature"),
])
def test_step_bad_arguments_raise_clear_value_errors(bad, message):
    args = dict(phi_q=torch.rand(1, 2, 4), phi_k=torch.rand(1, 2, 4), v=torch.rand(1, 2, 3), state=None,
                rotary=True) | bad
    with pytest.raises(ValueError, match=message):
        linear_attention_step(**args)


@pytest.mark.parametrize("flag", ["causal", "rotary", "nonnegative_features", "numerator_only"])
def test_reference_refuses_switches_that_are_not_bools(flag):
    args = dict(causal=True, rotary=False) | {flag: "no"}
    with pytest.raises(ValueError, match=f"{flag} must be True or False, got 'no'"):
        linear_attention_reference(torch.rand(1, 1, 3, 4), torch.rand(1, 1, 3, 4), torch.rand(1, 1, 3, 2), **args)


def test_step_bad_rank_raises():
    with pytest.raises(ValueError, match="for one token"):
        linear_attention_step(torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1, 4), torch.rand(1, 2, 1, 3),
                              None, rotary=False)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [True, False])
def test_empty_sequence_gives_an_empty_output(causal, rotary):
    phi_q, phi_k, v = (torch.rand(2, 3, 0, d) for d in (4, 4, 5))
    out = linear_attention(phi_q, phi_k, v, causal=causal, rotary=rotary)
    assert out.shape == (2, 3, 0, 5)
    if causal:
        out, state = linear_attention(phi_q, phi_k, v, causal=True, rotary=rotary, offset=7, return_state=True)
        assert state.position == 7 and state.kv.shape == (2, 3, 4, 5) and not state.kv.any()


def test_reference_refuses_negative_features():
    with pytest.raises(ValueError, match="negative entries"):
        linear_attention_reference(-torch.rand(1, 1, 3, 4), torch.rand(1, 1, 3, 4), torch.rand(1, 1, 3, 2),
                                   causal=True, rotary=False)


@pytest.mark.parametrize("sizes, message", [
    ((-1, 2, 4, 4), "batch must be a non-negative integer, got -1"),
    ((1, "2", 4, 4), "heads must be a non-negative integer, got '2'"),
    ((1, 2, 4.0, 4), "num_features must be .*integer, got 4.0"),
])
def test_initial_state_refuses_sizes_that_are_not_counts(sizes, message):
    from linattn.functional import initial_state
    with pytest.raises(ValueError, match=message):
        initial_state(*sizes)
    assert initial_state(0, 2, 4, 3, log_space=True).log_scale.shape == (0, 2, 4)


@pytest.mark.parametrize("options, message", [({"dtype": "float32"}, "dtype"), ({"dtype": torch.int64}, "dtype"),
                                              ({"dtype": torch.float16}, "dtype"), ({"device": "gpu7"}, "device")])
def test_initial_state_refuses_a_dtype_or_device_it_cannot_keep(options, message):
    from linattn.functional import initial_state
    with pytest.raises(ValueError, match=message):
        initial_state(1, 1, 2, 2, **options)
    assert initial_state(1, 1, 2, 2, dtype=torch.float64, device="cpu").kv.dtype == torch.float64


def test_the_fla_route_refuses_more_batch_x_heads_than_its_grids_take(monkeypatch):
    """fla puts B x H on a CUDA grid's second axis (at most 65,535): one line saying to split the batch,
    not CUDA's "invalid argument"."""
    from linattn.ops.linear_attention import dispatch
    monkeypatch.setattr(dispatch, "resolve", lambda *args, **kwargs: "fla")
    q, k = torch.rand(2, 2 ** 15 + 1, 1, 2), torch.rand(2, 2 ** 15 + 1, 1, 2)
    with pytest.raises(ValueError, match="split the batch"):
        linear_attention(q, k, torch.rand(2, 2 ** 15 + 1, 1, 1), causal=True, rotary=False)
