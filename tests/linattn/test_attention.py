"""The attention blocks: softmax baseline against a naive reference, strict causality, recurrent
decoding against the parallel forward, relative positions, and bad input."""
import pytest
import torch

from linattn import LinearAttention, SoftmaxAttention
from linattn.functional import softmax_attention_reference
from linattn.rotary import apply_rotary

LINEAR_VARIANTS = [(fm, rope) for fm in ("elu", "favor", "softmax") for rope in ("post", "pre", "none")]


def linear_block(fm, rope, causal=True, dim=32, heads=4):
    options = {"num_features": 16} if fm == "favor" else {}
    return LinearAttention(dim, heads, feature_map=fm, rope=rope, causal=causal,
                           feature_map_options=options, chunk_size=8).double().eval()


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
    lambda: SoftmaxAttention(32, 4, rope=True).double(),
    lambda: SoftmaxAttention(32, 4, rope=False).double(),
], ids=[f"linear-{fm}-{rope}" for fm, rope in LINEAR_VARIANTS] + ["softmax-rope", "softmax"])
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


@pytest.mark.parametrize("fm,rope", LINEAR_VARIANTS)
def test_linear_block_prefill_then_step(fm, rope):
    block = linear_block(fm, rope)
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


def test_pre_and_post_differ():
    torch.manual_seed(1)
    post = linear_block("favor", "post")
    pre = linear_block("favor", "pre")
    pre.load_state_dict(post.state_dict())
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    assert (post(x) - pre(x)).abs().max() > 1e-4


@pytest.mark.parametrize("kwargs, message", [
    (dict(feature_map="nope"), r"registered feature maps: elu, favor, softmax"),
    (dict(rope="after"), r"rope must be one of \('post', 'pre', 'none'\)"),
    (dict(feature_map_options={"num_features": 15}), r"num_features M must be even"),
    (dict(heads=3), r"multiple of heads"),
    (dict(chunk_size=0), r"chunk_size"),
    (dict(chunk_size=2.5), r"chunk_size must be a positive integer number of tokens, got 2.5"),
    (dict(chunk_size=True), r"chunk_size must be a positive integer"),
])
def test_linear_block_bad_arguments(kwargs, message):
    args = dict(dim=32, heads=4) | kwargs
    with pytest.raises(ValueError, match=message):
        LinearAttention(**args)


def test_odd_head_dim_with_pre_rotation_is_refused_but_fine_without():
    with pytest.raises(ValueError, match="head_dim must be even"):
        LinearAttention(30, 2, feature_map="elu", rope="pre")          # head_dim 15
    assert LinearAttention(30, 2, feature_map="elu", rope="none")(torch.randn(1, 4, 30)).shape == (1, 4, 30)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_blocks_reject_wrong_shapes(block):
    with pytest.raises(ValueError, match=r"expects input of shape \(batch, seq_len, dim\) with dim=32"):
        block(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"expects input of shape"):
        block(torch.randn(5, 32))
    with pytest.raises(ValueError, match=r"\(batch, dim\) for one token"):
        block.step(torch.randn(2, 3, 32))


def test_step_needs_causal():
    with pytest.raises(ValueError, match="needs causal=True"):
        LinearAttention(32, 4, causal=False).step(torch.randn(1, 32))


def test_softmax_bad_arguments():
    with pytest.raises(ValueError, match=r"backend must be one of \('sdpa', 'xformers'\)"):
        SoftmaxAttention(32, 4, backend="flash")
    with pytest.raises(ValueError, match="rope must be True or False"):
        SoftmaxAttention(32, 4, rope="post")


def test_xformers_backend_gives_a_clear_error_without_cuda():
    try:
        import xformers.ops  # noqa: F401
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
    torch.testing.assert_close(y.float(), block(x), rtol=0.1, atol=0.05)


@pytest.mark.parametrize("block", [LinearAttention(32, 4), SoftmaxAttention(32, 4)], ids=["linear", "softmax"])
def test_empty_sequence_gives_an_empty_output(block):
    assert block(torch.randn(2, 0, 32)).shape == (2, 0, 32)


def _prefilled(block, batch=2):
    _, state = block.eval()(torch.randn(batch, 3, 32), return_state=True)
    return state


@pytest.mark.parametrize("make_state, message", [
    (lambda block: (torch.zeros(2, 4, 16, 8), torch.zeros(2, 4, 16), 3), "must be the LinearState"),
    (lambda block: _prefilled(block, batch=3), r"state.kv must be a floating tensor of shape \(2, 4, "),
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
    (lambda block: _prefilled(block, batch=1), r"state.k must be a floating tensor of shape \(2, 4, 3, 8\)"),
    (lambda block: _prefilled(SoftmaxAttention(32, 2)), r"state.k must be"),
    (lambda block: _prefilled(block)._replace(v=torch.zeros(2, 4, 5, 8)), r"state.v must be"),
])
def test_softmax_step_refuses_a_mismatched_state(make_state, message):
    block = SoftmaxAttention(32, 4).eval()
    with pytest.raises(ValueError, match=message):
        block.step(torch.randn(2, 32), make_state(block))
