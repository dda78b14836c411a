"""Issue 37 item 5: plain features at any scale.  Eq. 19's output is invariant to positive scalings of
phi(q) or phi(k), so the op computes it wherever the features themselves are representable; beyond
that (features that overflowed, keys lost beside a far larger one) it gives NaN, never a finite wrong
number.  Sizes that cannot fit in memory are refused before allocation."""
import pytest
import torch

from linattn import LinearAttention, SoftmaxAttention
from linattn.functional import linear_attention, linear_attention_reference, linear_attention_step

B, H, N, M, DV = 2, 2, 24, 8, 4
SCALES = [1e-30, 1e-20, 1e-10, 1e-3, 1.0, 1e3, 1e10, 1e20, 1e30]


def inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(B, H, N, M, generator=gen, dtype=dtype) for _ in range(2))
    return q, k, torch.randn(B, H, N, DV, generator=gen, dtype=dtype)


def relative_error(out, ref):
    return ((out.double() - ref).abs().amax() / ref.abs().amax()).item()


@pytest.mark.parametrize("dtype, scales, tolerance", [
    (torch.float32, SCALES, 1e-5),
    (torch.float64, SCALES + [1e-300, 1e300], 1e-12)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [False, True])
def test_output_does_not_depend_on_the_scale_of_the_features(dtype, scales, tolerance, causal, rotary):
    q, k, v = inputs(dtype)
    ref = linear_attention_reference(q.double(), k.double(), v.double(), causal=causal, rotary=rotary)
    for scale in scales:
        for q_scale, k_scale in ((scale, 1.0), (1.0, scale), (scale, scale), (scale, 1 / scale)):
            out = linear_attention(q * q_scale, k * k_scale, v, causal=causal, rotary=rotary)
            assert out.isfinite().all(), (scale, q_scale, k_scale)
            assert relative_error(out, ref) < tolerance, (scale, q_scale, k_scale)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [False, True])
def test_scaling_by_powers_of_two_changes_no_bit(causal, rotary):
    """The scales are powers of two, so the result is the unscaled features' own, bit for bit."""
    q, k, v = inputs()
    out = linear_attention(q, k, v, causal=causal, rotary=rotary)
    for q_power, k_power in ((-100, 0), (0, 100), (60, -60), (-120, 120)):
        scaled = linear_attention(q * 2.0 ** q_power, k * 2.0 ** k_power, v, causal=causal, rotary=rotary)
        assert torch.equal(scaled, out), (q_power, k_power)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
@pytest.mark.parametrize("rotary", [False, True])
def test_gradients_scale_inversely_with_the_features(scale, rotary):
    """d out / d (s phi) = (d out / d phi) / s: the scales are constants whose derivative cancels."""
    q, k, v = inputs()
    weight = torch.randn(B, H, N, DV, generator=torch.Generator().manual_seed(1))

    def gradients(s):
        q_s, k_s = (q * s).requires_grad_(), (k * s).requires_grad_()
        (linear_attention(q_s, k_s, v, causal=True, rotary=rotary) * weight).sum().backward()
        return q_s.grad, k_s.grad

    for got, want in zip(gradients(scale), gradients(1.0)):
        assert got.isfinite().all()
        torch.testing.assert_close(got * scale, want, rtol=1e-4, atol=1e-5 * want.abs().amax().item())


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
@pytest.mark.parametrize("rotary", [False, True])
def test_decoding_from_a_prefill_matches_the_parallel_pass_at_any_scale(scale, rotary):
    q, k, v = inputs()
    q, k = q * scale, k * scale
    whole = linear_attention(q, k, v, causal=True, rotary=rotary)
    prefill, state = linear_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=True, rotary=rotary,
                                      return_state=True)
    steps = []
    for t in range(10, N):
        out, state = linear_attention_step(q[:, :, t], k[:, :, t], v[:, :, t], state, rotary=rotary)
        steps.append(out)
    decoded = torch.cat((prefill, torch.stack(steps, dim=2)), dim=2)
    assert decoded.isfinite().all()
    torch.testing.assert_close(decoded, whole, rtol=1e-5, atol=1e-5)
    _, parallel_state = linear_attention(q, k, v, causal=True, rotary=rotary, return_state=True)
    torch.testing.assert_close(state.k_sum, parallel_state.k_sum, rtol=1e-5, atol=0)   # the features' own scale


@pytest.mark.parametrize("causal", [True, False])
def test_overflowed_features_give_nan_not_finite_values(causal):
    q, k, v = inputs()
    k[:, :, 5, 2] = float("inf")
    out = linear_attention(q, k, v, causal=causal, rotary=False)
    reached = out[:, :, 5:] if causal else out
    assert reached.isnan().all()


def test_keys_lost_beside_a_far_larger_later_key_give_nan_rows_not_zeros():
    """float32 keys of 1e-30 and then of 1e30: once scaled by the largest, the early keys underflow, and
    the rows that see only them would read 0 / 0 = 0.  They are NaN; the rows after it are right."""
    q, k, v = inputs()
    k[:, :, :8] *= 1e-30
    k[:, :, 8:] *= 1e30
    out = linear_attention(q, k, v, causal=True, rotary=False)
    assert out[:, :, :8].isnan().all()
    ref = linear_attention_reference(q.double(), k.double(), v.double(), causal=True, rotary=False)
    assert relative_error(out[:, :, 8:], ref[:, :, 8:]) < 1e-5


def test_rows_whose_keys_are_all_zero_still_give_zero():
    """Keys whose features are exactly 0 (masked or padding) are not an underflow: rows that see only
    them give 0, as before."""
    q, k, v = inputs()
    k[:, :, :3] = 0
    out = linear_attention(q, k, v, causal=True, rotary=False)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert out[:, :, 3:].isfinite().all()


@pytest.mark.parametrize("feature_map, finite_scales, overflow_scales", [
    ("elu", [1e8, 1e20, 1e30], []),
    ("taylor", [1e8, 1e16], [1e20, 1e30])])
@pytest.mark.parametrize("rope", ["post", "none"])
def test_plain_maps_at_extreme_inputs_are_right_or_nan(feature_map, finite_scales, overflow_scales, rope):
    """elu and taylor blocks on x * s: right (against the block in float64) while the features are
    representable, NaN where taylor's quadratic features overflow float32 (|x'| past ~1.8e19); never
    finite and wrong.  Before: taylor at s = 1e8 gave 906 NaN of 1024 outputs and 86 inf."""
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    block = LinearAttention(32, heads=2, feature_map=feature_map, rope=rope)
    block64 = LinearAttention(32, heads=2, feature_map=feature_map, rope=rope).double()
    block64.load_state_dict(block.state_dict())
    for scale in finite_scales + overflow_scales:
        out = block(x * scale)
        if scale in overflow_scales:
            assert out.isnan().all(), scale
            continue
        ref = block64((x * scale).double())
        assert out.isfinite().all(), scale
        assert relative_error(out, ref) < 1e-4, scale


def test_an_absurd_sequence_length_is_refused_before_allocation():
    q = torch.rand(1, 1, 1, M).expand(1, 1, 2 ** 40, M)
    v = torch.rand(1, 1, 1, DV).expand(1, 1, 2 ** 40, DV)
    with pytest.raises(ValueError, match="memory"):
        linear_attention(q, q, v, causal=True, rotary=False)
    with pytest.raises(ValueError, match="memory"):
        linear_attention(q, q, v, causal=False, rotary=True)


@pytest.mark.parametrize("block", [lambda: LinearAttention(16, 2), lambda: SoftmaxAttention(16, 2)],
                         ids=["linear", "softmax"])
def test_a_block_refuses_an_absurd_sequence_length_before_its_projection(block):
    x = torch.rand(1, 1, 16).expand(1, 2 ** 40, 16)
    with pytest.raises(ValueError, match="memory"):
        block()(x)


def test_the_reference_refuses_n_whose_n_by_n_matrices_cannot_fit():
    q = torch.rand(1, 1, 1, M, dtype=torch.float64).expand(1, 1, 2 ** 21, M)
    v = torch.rand(1, 1, 1, DV, dtype=torch.float64).expand(1, 1, 2 ** 21, DV)
    with pytest.raises(ValueError, match="memory"):
        linear_attention_reference(q, q, v, causal=True, rotary=False)


def test_decoding_past_the_range_of_the_key_sums_gives_nan_not_finite_values():
    """The state holds sum_n phi(k_n) in the features' own scale: float32 keys near its largest number
    overflow that sum, and every output from then on is NaN (before: some rows finite and wrong)."""
    q, k, v = inputs()
    state, outs = None, []
    for t in range(N):
        out, state = linear_attention_step(q[:, :, t], k[:, :, t] * 1e38, v[:, :, t], state, rotary=False)
        outs.append(out)
    out = torch.stack(outs, dim=2).double()
    ref = linear_attention_reference(q.double(), k.double(), v.double(), causal=True, rotary=False)
    finite = out.isfinite().all(-1)
    assert finite[:, :, 0].all() and not finite[:, :, -1].any()
    assert ((out - ref).abs().amax(-1)[finite] < 1e-5 * ref.abs().amax()).all()
