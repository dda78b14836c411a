"""The attention blocks: softmax baseline against a naive reference, strict causality, recurrent
decoding against the parallel forward, relative positions, and bad input."""
import copy
import importlib
import inspect
import warnings

import numpy as np
import pytest
import torch

import torch.nn.functional as F

import linattn
from linattn import LinearAttention, SoftmaxAttention, make_feature_map
from linattn.feature_maps import EluFeatureMap, FavorFeatureMap
from linattn.functional import linear_attention_reference, softmax_attention_reference
from linattn.ops.linear_attention import cpp_logspace
from linattn.rotary import apply_rotary
from tests.conftest import LIBRARY_MAPS

LINEAR_VARIANTS = [(fm, rope) for fm in LIBRARY_MAPS for rope in ("post", "pre", "none")]
OPTIONS = {"favor": {"num_features": 16}, "taylor": {"dim": 4}}   # taylor: M = 1 + 4 + 10, padded to 16


def linear_block(fm, rope, causal=True, dim=32, heads=4, normalization="denominator"):
    return LinearAttention(dim, heads, feature_map=fm, rope=rope, causal=causal, normalization=normalization,
                           feature_map_options=OPTIONS.get(fm, {}), chunk_size=8).double().eval()


@pytest.mark.parametrize("kind, block", [("linear", LinearAttention), ("softmax", SoftmaxAttention)])
def test_block_options_table_names_each_blocks_keywords_that_default_off(kind, block):
    parameters = inspect.signature(block).parameters
    for name in linattn.BLOCK_OPTIONS[kind]:
        assert not parameters[name].default and parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_softmax_block_matches_naive_reference(rope, causal):
    block = SoftmaxAttention(32, 4, rope=rope, causal=causal).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    q, k, v = (t.unflatten(-1, (4, 8)).transpose(1, 2) for t in block.to_qkv(x).chunk(3, -1))
    if rope:
        q, k = apply_rotary(q), apply_rotary(k)
    expected = block.to_out(softmax_attention_reference(q, k, v, causal=causal).transpose(1, 2).flatten(2))
    torch.testing.assert_close(block(x), expected)


@pytest.mark.parametrize("block_factory", [
    *[lambda fm=fm, rope=rope: linear_block(fm, rope) for fm, rope in LINEAR_VARIANTS],
    *[lambda fm=fm, rope=rope: linear_block(fm, rope, normalization="rmsnorm") for fm, rope in LINEAR_VARIANTS],
    lambda: SoftmaxAttention(32, 4, rope=True).double(),
    lambda: SoftmaxAttention(32, 4, rope=False).double(),
], ids=[f"linear-{fm}-{rope}" for fm, rope in LINEAR_VARIANTS]
   + [f"linear-{fm}-{rope}-rmsnorm" for fm, rope in LINEAR_VARIANTS] + ["softmax-rope", "softmax"])
def test_step_matches_forward_and_future_tokens_never_change_the_past(block_factory):
    block = block_factory()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    full = block(x)
    state, steps = None, []
    for t in range(21):
        y, state = block.step(x[:, t], state)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, dim=1), full, rtol=1e-9, atol=1e-10)
    changed = x.clone()
    changed[:, 12:] = torch.randn(2, 9, 32, dtype=torch.float64) * 10
    assert torch.equal(block(changed)[:, :12], full[:, :12])


@pytest.mark.parametrize("normalization", ["denominator", "rmsnorm"])
@pytest.mark.parametrize("fm,rope", LINEAR_VARIANTS)
def test_linear_block_prefill_then_step(fm, rope, normalization):
    block = linear_block(fm, rope, normalization=normalization)
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    full = block(x)
    _, state = block(x[:, :17], return_state=True)
    tail = []
    for t in range(17, 30):
        y, state = block.step(x[:, t], state)
        tail.append(y)
    torch.testing.assert_close(torch.stack(tail, dim=1), full[:, 17:], rtol=1e-9, atol=1e-10)


def test_causality_float32_with_large_future_inputs():
    block = LinearAttention(64, 4, feature_map="favor", rope="post")
    x = torch.randn(1, 200, 64)
    changed = x.clone()
    changed[:, 150:] *= 50
    assert torch.equal(block(changed)[:, :150], block(x)[:, :150])


@pytest.mark.parametrize("block", [
    LinearAttention(32, 4, feature_map="favor", rope="post", causal=True),
    LinearAttention(32, 4, feature_map="elu", rope="post", causal=False),
    SoftmaxAttention(32, 4, rope=True),
], ids=["linear-post-causal", "linear-post-noncausal", "softmax-rope"])
def test_rope_outputs_depend_on_relative_positions_only(block):
    block = block.double().eval()
    x = torch.randn(2, 25, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x, offset=0), block(x, offset=999), rtol=1e-8, atol=1e-9)


def reference_features(block, q, k):
    """The block's phi(q), phi(k) as plain features (exponentiated where the map gives logarithms)."""
    phi_q, phi_k = block._features(q, k, 0)
    return (phi_q.exp(), phi_k.exp()) if block.feature_map.log_space else (phi_q, phi_k)


def heads_of(block, x):
    return (t.unflatten(-1, (block.heads, block.head_dim)).transpose(1, 2) for t in block.to_qkv(x).chunk(3, -1))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fm,rope", [(fm, rope) for fm in ("hedgehog", "taylor") for rope in ("post", "pre", "none")])
def test_trainable_maps_match_the_naive_reference(fm, rope, causal):
    """hedgehog through the log-space path, taylor (negative features, positive kernel) through the
    plain path, against explicit N x N weights."""
    torch.manual_seed(0)
    block = linear_block(fm, rope, causal=causal)
    q, k, v = heads_of(block, torch.randn(2, 19, 32, dtype=torch.float64))
    phi_q, phi_k = reference_features(block, q, k)
    expected = linear_attention_reference(phi_q, phi_k, v, causal=causal, rotary=rope == "post",
                                          nonnegative_features=block.feature_map.nonnegative_features)
    torch.testing.assert_close(block.attend(q, k, v), expected, rtol=1e-9, atol=1e-10)
    if fm == "taylor":
        assert phi_q.min() < 0   # the plain path took features that are negative


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("fm,rope", [("hedgehog", "post"), ("hedgehog", "none"), ("taylor", "post"), ("taylor", "pre")])
def test_trainable_map_weights_get_the_reference_gradient(fm, rope, backend):
    """The map's weight gradient through the block's path (log-space, the cpp kernel under auto on
    CPU, for hedgehog; the plain chunked path for taylor) equals the naive reference's."""
    torch.manual_seed(0)
    block = linear_block(fm, rope)
    block.backend = backend
    q, k, v = (t.detach() for t in heads_of(block, torch.randn(2, 21, 32, dtype=torch.float64)))
    weights = torch.randn(2, 4, 21, 8, dtype=torch.float64)
    fast = torch.autograd.grad((block.attend(q, k, v) * weights).sum(), block.feature_map.weight)[0]
    phi_q, phi_k = reference_features(block, q, k)
    expected = linear_attention_reference(phi_q, phi_k, v, causal=True, rotary=rope == "post",
                                          nonnegative_features=block.feature_map.nonnegative_features)
    reference = torch.autograd.grad((expected * weights).sum(), block.feature_map.weight)[0]
    assert reference.abs().max() > 1e-6
    torch.testing.assert_close(fast, reference, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fm,rope", [("favor", "post"), ("favor", "pre"), ("favor", "none"), ("elu", "post"),
                                     ("taylor", "post"), ("hedgehog", "pre")])
def test_rmsnorm_normalises_the_numerator_alone(fm, rope, causal):
    """normalization="rmsnorm" == RMSNorm over head_dim of the undivided numerator, computed
    explicitly in float64, exactly (to rounding) with eps = 0; with its default eps, RMSNorm of
    num / den (eps acts on the ratio), as documented."""
    torch.manual_seed(0)
    block = linear_block(fm, rope, causal=causal, normalization="rmsnorm")
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
    q, k, v = heads_of(block, torch.randn(2, 19, 32, dtype=torch.float64))
    phi_q, phi_k = reference_features(block, q, k)
    numerator, ratio = (linear_attention_reference(phi_q, phi_k, v, causal=causal, rotary=rope == "post",
                                                   nonnegative_features=False, numerator_only=only)
                        for only in (True, False))
    gain = block.norm.weight
    torch.testing.assert_close(block.attend(q, k, v), F.rms_norm(ratio, (8,), gain, block.norm.eps),
                               rtol=1e-9, atol=1e-10)
    block.norm.eps = 0.0
    torch.testing.assert_close(block.attend(q, k, v), F.rms_norm(numerator, (8,), gain, 0.0),
                               rtol=1e-9, atol=1e-10)
    unnormalised = linear_block(fm, rope, causal=causal)
    unnormalised.load_state_dict(block.state_dict(), strict=False)
    assert (unnormalised.attend(q, k, v) - block.attend(q, k, v)).abs().max() > 1e-3


@pytest.mark.parametrize("normalization", ["denominator", "rmsnorm"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fm,rope", LINEAR_VARIANTS)
def test_weight_sums_are_the_explicit_weights_summed(fm, rope, causal, normalization):
    """weight_sums == sum_n w_mn from explicit N x N weights (the reference's output for values of
    1), before any RMSNorm: 1 for pre and none, and for post 1 at the first position only (causal)."""
    torch.manual_seed(0)
    block = linear_block(fm, rope, causal=causal, normalization=normalization)
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    q, k, v = heads_of(block, x)
    phi_q, phi_k = reference_features(block, q, k)
    ones = torch.ones_like(v[..., :1])
    expected = linear_attention_reference(phi_q, phi_k, ones, causal=causal, rotary=rope == "post",
                                          nonnegative_features=block.feature_map.nonnegative_features)[..., 0]
    sums = block.weight_sums(x)
    assert sums.shape == (2, 4, 19) and sums.dtype == torch.float64 and not sums.requires_grad
    torch.testing.assert_close(sums, expected, rtol=1e-9, atol=1e-10)
    if rope == "post":
        assert (sums - 1).abs().max() > 1e-2
        if causal:
            torch.testing.assert_close(sums[..., 0], torch.ones(2, 4, dtype=torch.float64))
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))


@pytest.mark.parametrize("fm", LIBRARY_MAPS)
def test_weight_sums_of_a_float32_block_are_float32_at_any_offset(fm):
    """The float32 route (the cpp kernel for the log-space maps on CPU) against the float64 block."""
    torch.manual_seed(0)
    block = LinearAttention(32, 4, feature_map=fm, rope="post", feature_map_options=OPTIONS.get(fm, {}), chunk_size=8)
    x = torch.randn(1, 21, 32)
    sums = block.weight_sums(x, offset=5)
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums.double(), block.double().weight_sums(x.double()), rtol=1e-4, atol=1e-5)
    # Eq. 19 weighs by relative position only: the offset changes nothing
    torch.testing.assert_close(sums, block.float().weight_sums(x), rtol=1e-5, atol=1e-6)


def test_weight_sums_leave_a_training_blocks_mode_and_redraw_schedule_alone():
    block = LinearAttention(32, 4, feature_map="favor", feature_map_options={"redraw_interval": 2}).train()
    projection = block.feature_map.projection.clone()
    x = torch.randn(1, 9, 32, requires_grad=True)
    for _ in range(3):
        sums = block.weight_sums(x)
    assert block.training and block.feature_map.training_calls == 0 and not sums.requires_grad
    assert torch.equal(block.feature_map.projection, projection)


def test_rmsnorm_has_one_gain_shared_by_the_heads_and_merges_after_it():
    block = LinearAttention(32, 4, normalization="rmsnorm")
    assert dict(block.norm.named_parameters())["weight"].shape == (8,)
    assert "normalization='rmsnorm'" in repr(block)
    assert LinearAttention(32, 4).norm is None


def test_maps_with_weights_per_head_get_the_blocks_head_count():
    block = LinearAttention(32, 4, feature_map="hedgehog")
    assert block.feature_map.weight.shape == (4, 8, 8) and block.feature_map.heads == 4
    assert LinearAttention(32, 2, feature_map="taylor").feature_map.weight.shape == (2, 16, 16)
    with pytest.raises(ValueError, match="weights for 2 heads but this block has 4"):
        LinearAttention(32, 4, feature_map=make_feature_map("hedgehog", 8, heads=2))


def test_pre_and_post_differ():
    torch.manual_seed(1)
    post = linear_block("favor", "post")
    pre = linear_block("favor", "pre")
    pre.load_state_dict(post.state_dict())
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    assert (post(x) - pre(x)).abs().max() > 1e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(feature_map="nope"), r"registered feature maps: elu, favor"),
    (dict(normalization="layernorm"), r"one of \('denominator', 'rmsnorm'\)"),
    (dict(rope="after"), r"rope must be one of \('post', 'pre', 'none'\)"),
    (dict(feature_map_options={"num_features": 15}), r"num_features M must be even"),
    (dict(heads=3), r"multiple of heads"),
    (dict(chunk_size=0), r"chunk_size"),
    (dict(chunk_size=2.5), "chunk_size must be a positive integer"),
    (dict(chunk_size=True), r"chunk_size must be a positive integer"),
    (dict(rope_base=0), r"rope_base must be a finite number > 0"),
    (dict(rope_base=-1.0), r"rope_base must be"),
    (dict(rope_base=float("nan")), r"rope_base must be"),
    (dict(feature_map_options={"num_features": 8.0}), r"num_features must be a positive integer, got 8.0"),
    (dict(feature_map_options={"redraw_interval": 2.5}), r"redraw_interval must be an integer >= 0"),
    (dict(feature_map_options={"redraw_interval": True}), r"redraw_interval must be an integer"),
    (dict(feature_map=FavorFeatureMap(4)), "made for head_dim 4"),
    (dict(feature_map=EluFeatureMap(4)), r"made for head_dim 4"),
])
def test_linear_block_bad_arguments(kwargs, message):
    args = dict(dim=32, heads=4) | kwargs
    with pytest.raises(ValueError, match=message):
        LinearAttention(**args)


@pytest.mark.parametrize("block_class", [LinearAttention, SoftmaxAttention])
@pytest.mark.parametrize("kwargs, message", [
    (dict(causal="yes"), r"causal must be True or False, got 'yes'"),
    (dict(causal=None), r"causal must be True or False, got None"),
    (dict(causal=1), r"causal must be True or False, got 1"),
    (dict(bias="no"), r"bias must be True or False, got 'no'"),
    (dict(heads=2.0), r"heads must be a positive integer, got 2.0"),
    (dict(dim=32.0), r"dim must be a positive integer, got 32.0"),
    (dict(heads=0), r"heads must be a positive integer, got 0"),
    (dict(dim=True), r"dim must be a positive integer, got True"),
])
def test_blocks_refuse_switches_that_are_not_bools_and_sizes_that_are_not_integers(block_class, kwargs, message):
    """At the constructor, naming the argument: `causal="yes"` used to build and fail at the first
    call with a KeyError, and heads=2.0 was blamed on a feature-map option nobody gave."""
    with pytest.raises(ValueError, match=message):
        block_class(**(dict(dim=32, heads=4) | kwargs))


def test_blocks_take_numpy_integer_sizes_as_plain_ints():
    block = LinearAttention(np.int64(32), np.int64(4))
    assert type(block.dim) is int and type(block.heads) is int and block(torch.randn(1, 3, 32)).shape == (1, 3, 32)


def test_softmax_forward_refuses_a_return_state_that_is_not_a_bool():
    with pytest.raises(ValueError, match="return_state must be True or False, got 'no'"):
        SoftmaxAttention(32, 4)(torch.randn(1, 3, 32), return_state="no")


def test_attend_refuses_queries_keys_and_values_of_several_dtypes():
    """The linear block decides from v's dtype how the op computes (a bf16 block's v goes to float32)."""
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="queries, keys and values of one dtype"):
        LinearAttention(32, 4).attend(q, q, q.bfloat16())


def test_odd_head_dim_with_pre_rotation_is_refused_but_fine_without():
    with pytest.raises(ValueError, match="head_dim must be even"):
        LinearAttention(30, 2, feature_map="elu", rope="pre")          # head_dim 15
    assert LinearAttention(30, 2, feature_map="elu", rope="none")(torch.randn(1, 4, 30)).shape == (1, 4, 30)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_blocks_reject_wrong_shapes(block):
    with pytest.raises(ValueError, match=r"input of shape \(batch, seq_len, dim\)"):
        block(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"expects input of shape"):
        block(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"\(batch, dim\) for one token"):
        block.step(torch.randn(2, 3, 32))


def test_step_needs_causal():
    with pytest.raises(ValueError, match="needs causal=True"):
        LinearAttention(32, 4, causal=False).step(torch.randn(1, 32))


def test_softmax_bad_arguments():
    with pytest.raises(ValueError, match="backend must be one of"):
        SoftmaxAttention(32, 4, backend="flash")
    with pytest.raises(ValueError, match="rope must be True or False"):
        SoftmaxAttention(32, 4, rope="post")
    with pytest.raises(ValueError, match="rope_base must be a finite number > 0"):
        SoftmaxAttention(32, 4, rope_base=-1.0)
    with pytest.raises(ValueError, match="offset must be a non-negative integer"):
        SoftmaxAttention(32, 4, rope=False)(torch.randn(1, 3, 32), offset=-2)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4, rope=True)], ids=["linear", "softmax"])
def test_a_prefill_state_carries_no_gradient_and_a_step_is_differentiable_in_its_input(block):
    x = torch.randn(1, 5, 32, requires_grad=True)
    _, state = block(x[:, :4], return_state=True)
    tensors = [t for t in state if isinstance(t, torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)
    y, _ = block.step(x[:, 4], state)
    y.sum().backward()
    assert x.grad[:, 4].abs().sum() > 0 and (x.grad[:, :4] == 0).all()


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_decoding_continues_at_the_prefill_offset_of_any_integer_type(block):
    block.eval()
    x = torch.randn(2, 6, 32)
    for offset in (5, np.int64(5)):
        _, state = block(x[:, :4], offset=offset, return_state=True)
        assert type(state.position) is int and state.position == 9
        y, state = block.step(x[:, 4], state)
        y_next, state = block.step(x[:, 5], state)
        torch.testing.assert_close(torch.stack([y, y_next], 1), block(x, offset=5)[:, 4:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_an_input_of_another_dtype_than_the_block_is_refused_clearly(block):
    with pytest.raises(ValueError, match="torch.float32 but the input is torch.float64"):
        block(torch.randn(1, 3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be floating point, got torch.int64"):
        block(torch.ones(1, 3, 32, dtype=torch.int64))


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4, rope=True)], ids=["linear", "softmax"])
def test_an_input_on_another_device_or_on_meta_is_refused_clearly(block):
    """torch's own errors here came from inside autocast and meta registrations."""
    x = torch.randn(1, 3, 32, device="meta")
    with pytest.raises(ValueError, match="on cpu and the input on meta"):
        block(x)
    with pytest.raises(ValueError, match=r"parameters are on cpu and the input on meta"):
        block.step(x[:, 0])
    with pytest.raises(ValueError, match=r"parameters are on meta and the input on meta"):
        copy.deepcopy(block).to("meta")(x)


def test_attend_refuses_tensors_that_are_not_this_blocks_heads():
    block = LinearAttention(32, 4)
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="got k of shape"):
        block.attend(q, torch.randn(1, 4, 5, 6), q)
    with pytest.raises(ValueError, match=r"got q of shape \(4, 5, 8\)"):
        block.attend(q[0], q, q)


def test_redrawing_keeps_the_projection_a_pending_backward_holds():
    """Two training calls before one backward (weight sharing, summed micro-batches) with a redraw
    between them: the first call's graph keeps the projection it used."""
    block = LinearAttention(16, 2, feature_map_options={"redraw_interval": 1}).train()
    x = torch.randn(1, 5, 16, requires_grad=True)
    outputs, projections = [], []
    for _ in range(2):   # each training call redraws first, then uses the projection it drew
        outputs.append(block(x))
        projections.append(block.feature_map.projection.clone())
    sum(outputs).sum().backward()
    assert block.feature_map.draws == 2 and not torch.equal(*projections)
    want = torch.zeros_like(x)
    for projection in projections:   # each call's gradient, by a copy that holds only its projection
        alone = copy.deepcopy(block).eval()
        alone.feature_map.projection = projection
        x_alone = x.detach().requires_grad_()
        alone(x_alone).sum().backward()
        want += x_alone.grad
    torch.testing.assert_close(x.grad, want)


def test_xformers_backend_gives_a_clear_error_without_cuda():
    try:
        importlib.import_module("xformers.ops")
    except ImportError:
        with pytest.raises(ImportError, match=r"needs the xformers package.*backend='sdpa'"):
            SoftmaxAttention(32, 4, backend="xformers")
        return
    block = SoftmaxAttention(32, 4, backend="xformers")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA tensors only"):
            block(torch.randn(1, 8, 32))


@pytest.mark.parametrize("block", [
    LinearAttention(64, 4, feature_map="favor", rope="post"),
    SoftmaxAttention(64, 4, rope=True),
], ids=["linear", "softmax"])
def test_bf16_autocast_runs_and_stays_close_to_fp32(block):
    x = torch.randn(2, 40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), block(x), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_empty_sequence_gives_an_empty_output(block):
    assert block(torch.randn(2, 0, 32)).shape == (2, 0, 32)


def _prefilled(block, batch=2):
    _, state = block.eval()(torch.randn(batch, 3, 32), return_state=True)
    return state


@pytest.mark.parametrize("make_state, message", [
    (lambda block: (torch.zeros(2, 4, 16, 8), torch.zeros(2, 4, 16), 3), "must be the LinearState"),
    (lambda block: _prefilled(block, batch=3), "state.kv must be a floating tensor of shape"),
    (lambda block: _prefilled(LinearAttention(32, 2, feature_map="elu")), r"state.kv must be"),
    (lambda block: _prefilled(block)._replace(position=2.0), "state.position must be a non-negative int"),
    (lambda block: _prefilled(block)._replace(k_sum=None), r"state.k_sum must be a floating tensor"),
])
def test_linear_step_refuses_a_mismatched_state(make_state, message):
    block = LinearAttention(32, 4, feature_map="elu").eval()
    with pytest.raises(ValueError, match=message):
        block.step(torch.randn(2, 32), make_state(block))


@pytest.mark.parametrize("make_state, message", [
    (lambda block: _prefilled(LinearAttention(32, 4)), "must be the KVCache"),
    (lambda block: _prefilled(block, batch=1), r"state.k must be .*shape \(2, 4, 3, 8\)"),
    (lambda block: _prefilled(SoftmaxAttention(32, 2)), r"state.k must be"),
    (lambda block: _prefilled(block)._replace(v=torch.zeros(2, 4, 5, 8)), r"state.v must be"),
])
def test_softmax_step_refuses_a_mismatched_state(make_state, message):
    block = SoftmaxAttention(32, 4).eval()
    with pytest.raises(ValueError, match=message):
        block.step(torch.randn(2, 32), make_state(block))


@pytest.mark.slow
def test_the_favor_block_compiles_with_a_ragged_last_chunk():
    """torch.compile runs the log-space op eagerly (inductor failed on N = 70 with chunks of 64)."""
    block = LinearAttention(32, 2)
    x = torch.randn(2, 70, 32, requires_grad=True)
    compiled = torch.compile(block)(x)
    compiled.square().sum().backward()
    grad, x.grad = x.grad, None
    eager = block(x)
    eager.square().sum().backward()
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(grad, x.grad)


def test_softmax_attend_is_what_forward_runs_between_the_projections():
    block = SoftmaxAttention(32, 4, rope=True, causal=True).eval()
    x = torch.randn(2, 6, 32)
    q, k, v = (t.reshape(2, 6, 4, 8).transpose(1, 2) for t in block.to_qkv(x).chunk(3, dim=-1))
    out = block.attend(q, k, v, offset=3)
    torch.testing.assert_close(block.to_out(out.transpose(1, 2).reshape(2, 6, 32)), block(x, offset=3))
    with pytest.raises(ValueError, match="got v of shape"):
        block.attend(q, k, v[:, :2])


def test_resolve_backend_says_what_runs_where():
    cpu = torch.device("cpu")
    assert linattn.resolve_backend("torch", cpu) == "torch"
    assert linattn.resolve_backend("auto", "cpu", log_space=False) == "torch"   # the C++ kernel is log-space only
    assert linattn.resolve_backend("sdpa", cpu, attention="softmax") == "sdpa"
    with pytest.raises(ValueError, match="runs on CPU tensors, got tensors on meta"):
        linattn.resolve_backend("cpp", "meta")
    with pytest.raises(ValueError, match=r"one of \('auto', 'torch', 'cpp', 'fla'\)"):
        linattn.resolve_backend("sdpa", cpu)
    with pytest.raises(ValueError, match="softmax attention's backend must be one of"):
        linattn.resolve_backend("flash", cpu, attention="softmax")
    assert linattn.resolve_backend("auto", cpu, attention="softmax") == "sdpa"   # as the harness's auto
    assert SoftmaxAttention(32, 4, backend="auto").backend == "sdpa"
    with pytest.raises(ValueError, match="runs on CUDA only, got cpu"):
        linattn.resolve_backend("xformers", cpu, attention="softmax")
    with pytest.raises(ValueError, match="attention must be 'linear' or 'softmax'"):
        linattn.resolve_backend("auto", cpu, attention="performer")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", None])
def test_resolve_backend_refuses_a_device_torch_does_not_know_in_one_line(device):
    with pytest.raises(ValueError, match=r"^device must be a torch.device[^\n]*$"):
        linattn.resolve_backend("auto", device)


def test_rmsnorm_under_autocast_normalises_in_float32_without_a_warning() -> None:
    torch.manual_seed(0)
    block = LinearAttention(32, 2, feature_map="elu", normalization="rmsnorm")
    x = torch.randn(2, 8, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), block(x), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("block", [LinearAttention(32, 4, feature_map="elu"), SoftmaxAttention(32, 4)],
                         ids=["linear", "softmax"])
@pytest.mark.parametrize("change, message", [
    (lambda t: t.long(), r"q must be floating point, got torch.int64"),
    (lambda t: t.bool(), r"q must be floating point, got torch.bool"),
    (lambda t: t.to(torch.complex64), r"q must be a real floating-point tensor"),
    (lambda t: t[:1], r"got \(1, 4, 5, 8\), \(2, 4, 5, 8\)"),
    (lambda t: t[:, :, :3], r"one shape .*got \(2, 4, 3, 8\), \(2, 4, 5, 8\)"),
    (lambda t: t.to("meta"), "got meta, cpu and cpu"),
])
def test_attend_refuses_queries_that_do_not_match_the_keys_and_values(block, change, message):
    """elu's attend returned int64 (truncated) or bool outputs for such inputs, and softmax's broadcast
    a batch of 1 and masked a shorter query top-left, silently."""
    q, k, v = torch.randn(3, 2, 4, 5, 8).unbind(0)
    with pytest.raises(ValueError, match=message):
        block.attend(change(q), k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_softmax_step_refuses_a_cache_of_another_precision(dtype):
    block = SoftmaxAttention(32, 4).eval()
    _, cache = block(torch.randn(1, 3, 32), return_state=True)
    cache = cache._replace(k=cache.k.to(dtype))
    with pytest.raises(ValueError, match=rf"state.k is {dtype} but this step computes"):
        block.step(torch.randn(1, 32), cache)


def test_a_non_causal_softmax_block_refuses_return_state_as_the_linear_one_does():
    for block in (SoftmaxAttention(32, 4, causal=False), LinearAttention(32, 4, causal=False)):
        with pytest.raises(ValueError, match=r"return_state=True needs causal=True"):
            block(torch.randn(1, 3, 32), return_state=True)


def test_resolve_backend_refuses_switches_that_are_not_bools():
    with pytest.raises(ValueError, match=r"causal must be True or False, got None"):
        linattn.resolve_backend("auto", "cpu", causal=None)
    with pytest.raises(ValueError, match=r"log_space must be True or False, got 'no'"):
        linattn.resolve_backend("auto", "cpu", log_space="no")


def test_a_rope_base_too_large_for_a_float_is_refused_as_a_value_error():
    with pytest.raises(ValueError, match=r"rope_base must be a finite number > 0"):
        LinearAttention(32, 4, rope_base=10 ** 400)



def small_block(fm, rope, window=0, decay=None, backend="auto"):
    return LinearAttention(8, 2, feature_map=fm, rope=rope, window=window, decay=decay, backend=backend,
                           feature_map_options={"favor": {"num_features": 8}, "taylor": {"dim": 2}}.get(fm, {}),
                           chunk_size=4).double()


HAND_WRITTEN_BACKWARD = [(fm, rope, window, decay) for rope in ("post", "pre", "none")
                         for fm, window, decay in (("favor", 0, None), ("favor", 3, None), ("favor", 0, "retnet"),
                                                   ("taylor", 0, None), ("elu", 0, None), ("taylor", 3, None),
                                                   ("elu", 0, "retnet"), ("elu", 2, (0.9, 0.6)))]


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpp", marks=pytest.mark.skipif(
    cpp_logspace.unavailable() is not None, reason="the C++ kernel does not build here"))])
@pytest.mark.parametrize("fm, rope, window, decay", HAND_WRITTEN_BACKWARD)
@pytest.mark.parametrize("loss", [torch.sum, lambda y: y.square().sum()], ids=["linear", "square"])
def test_second_derivatives_through_a_hand_written_backward_are_refused(fm, rope, window, decay, backend, loss):
    """The op's causal passes (every map, with or without a window or decay) have a backward that
    gives first derivatives: one that builds a graph of them stops, where it used to differentiate
    the rest of the model and silently treat attention as constant."""
    block = small_block(fm, rope, window, decay, backend)
    x = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="first derivatives"):
        torch.autograd.grad(loss(block(x)), x, create_graph=True)
    (grad,) = torch.autograd.grad(loss(block(x)), x)   # first derivatives as before
    assert grad.isfinite().all()


@pytest.mark.parametrize("fm", ["favor", "taylor"])
def test_second_derivatives_of_non_causal_attention_and_of_a_step_are_exact(fm):
    block = small_block(fm, "post")
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    non_causal = LinearAttention(8, 2, feature_map=block.feature_map, causal=False).double()
    assert torch.autograd.gradgradcheck(lambda x: non_causal(x), (x,))
    _, state = block(x.detach(), return_state=True)
    assert torch.autograd.gradgradcheck(lambda x: block.step(x[:, 0], state)[0], (x,))
