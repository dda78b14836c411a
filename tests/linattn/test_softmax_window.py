"""SoftmaxAttention(window=W), the window-only control: against explicit float64 masked softmax
weights, decoding against the parallel pass (past W tokens too), window=0 as today's block, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import SoftmaxAttention
from linattn.rotary import apply_rotary

N = 19


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def projections(block: SoftmaxAttention, x: torch.Tensor):
    return (t.unflatten(-1, (block.heads, block.head_dim)).transpose(1, 2) for t in block.to_qkv(x).chunk(3, -1))


def windowed_reference(block: SoftmaxAttention, x: torch.Tensor, window: int, offset: int = 0) -> torch.Tensor:
    """out_m = sum_{0 <= m-n < W} e^(s_mn) v_n / sum_{0 <= m-n < W} e^(s_mn), written out in float64."""
    q, k, v = projections(block, x)
    if block.rope:
        q, k = apply_rotary(q, offset=offset), apply_rotary(k, offset=offset)
    scores = q @ k.transpose(-1, -2) / block.head_dim ** 0.5
    m, n = torch.arange(x.shape[1])[:, None], torch.arange(x.shape[1])
    inside = (m - n >= 0) & (m - n < window)
    weights = torch.where(inside, scores.exp(), torch.zeros((), dtype=scores.dtype))
    out = (weights / weights.sum(-1, keepdim=True)) @ v
    return block.to_out(out.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("window", [1, 8, N, 64])
@pytest.mark.parametrize("rope, offset", [(True, 0), (True, 5), (False, 0)])
def test_window_matches_explicit_float64_weights(window: int, rope: bool, offset: int) -> None:
    torch.manual_seed(window)
    block = SoftmaxAttention(32, 4, rope=rope, window=window).double()
    x = torch.randn(2, N, 32, dtype=torch.float64)
    torch.testing.assert_close(block(x, offset=offset), windowed_reference(block, x, window, offset))


def test_window_one_is_the_value_of_the_token_itself() -> None:
    block = SoftmaxAttention(32, 4, window=1).double()
    x = torch.randn(2, N, 32, dtype=torch.float64)
    _, _, v = projections(block, x)
    torch.testing.assert_close(block(x), block.to_out(v.transpose(1, 2).flatten(2)))


def test_a_window_shorter_than_the_sequence_forgets_older_tokens() -> None:
    block = SoftmaxAttention(32, 4, window=4).double()
    x = torch.randn(1, N, 32, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5] += 1.0   # tokens 5..8 see token 5; from token 9 on it is outside the window
    difference = (block(x) - block(changed)).abs().amax(-1)[0]
    assert (difference[5:9] > 1e-6).all() and (difference[9:] == 0).all() and (difference[:5] == 0).all()


def test_window_gradients_by_gradcheck() -> None:
    block = SoftmaxAttention(8, 2, window=3).double()
    x = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: block(t, offset=2), (x,))


@pytest.mark.parametrize("window", [1, 4, 8, 64])
@pytest.mark.parametrize("prefill", [0, 3, 11])
def test_decoding_matches_the_parallel_pass(window: int, prefill: int) -> None:
    torch.manual_seed(prefill)
    block = SoftmaxAttention(32, 4, window=window).double().eval()
    x = torch.randn(2, N, 32, dtype=torch.float64)
    full = block(x)
    state, outputs = None, []
    if prefill:
        out, state = block(x[:, :prefill], return_state=True)
        outputs.append(out)
        assert state.k.shape[-2] == min(prefill, window) and state.position == prefill
    for position in range(prefill, N):
        out, state = block.step(x[:, position], state)
        outputs.append(out[:, None])
        assert state.k.shape[-2] == state.v.shape[-2] == min(position + 1, window)   # O(W) per token
    assert state.position == N
    torch.testing.assert_close(torch.cat(outputs, dim=1), full)


def test_window_zero_is_todays_block_bitwise() -> None:
    torch.manual_seed(0)
    today = SoftmaxAttention(32, 4)
    zero = SoftmaxAttention(32, 4, window=0)
    zero.load_state_dict(today.state_dict())
    x = torch.randn(2, N, 32)
    assert torch.equal(zero(x), today(x)) and zero.window == 0 and "window" not in repr(zero)
    q, k, v = projections(today, x)
    expected = F.scaled_dot_product_attention(apply_rotary(q), apply_rotary(k), v, is_causal=True)
    assert torch.equal(zero.attend(q, k, v), expected)
    out, state = zero(x, return_state=True)
    assert state.k.shape[-2] == N   # the whole cache, as before


def test_attend_takes_the_window() -> None:
    block = SoftmaxAttention(32, 4, window=4).double()
    x = torch.randn(2, N, 32, dtype=torch.float64)
    q, k, v = projections(block, x)
    torch.testing.assert_close(block.to_out(block.attend(q, k, v, offset=2).transpose(1, 2).flatten(2)),
                               block(x, offset=2))
    assert "window=4" in repr(block)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window=-1), "window"),
    (dict(window=2.0), "window"),
    (dict(window=True), "window"),
    (dict(window="8"), "window"),
    (dict(window=None), "window"),
    (dict(window=4, causal=False), "causal"),
    (dict(window=4, backend="xformers"), "window"),
])
def test_bad_windows_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SoftmaxAttention(32, 4, **kwargs)


@pytest.mark.parametrize("made, taking", [(3, 0), (0, 3), (3, 5)])
def test_step_refuses_a_cache_of_another_window(made: int, taking: int) -> None:
    """Issue 49: a window-3 cache into a full block once attended over 3 keys only, silently."""
    x = torch.randn(1, 8, 32)
    _, cache = SoftmaxAttention(32, 4, window=made)(x, return_state=True)
    with pytest.raises(ValueError, match="window="):
        SoftmaxAttention(32, 4, window=taking).step(x[:, 0], cache)


def test_step_refuses_a_cache_longer_than_the_window() -> None:
    x = torch.randn(1, 8, 32)
    block = SoftmaxAttention(32, 4, window=3)
    _, cache = SoftmaxAttention(32, 4)(x, return_state=True)
    with pytest.raises(ValueError, match="state.k"):
        block.step(x[:, 0], cache._replace(window=3))


@pytest.mark.parametrize("value, message", [(-1, "window"), (2.5, "window")])
def test_a_window_set_later_is_checked(value, message: str) -> None:
    block = SoftmaxAttention(32, 4)
    with pytest.raises(ValueError, match=message):
        block.window = value
    with pytest.raises(ValueError, match="causal"):
        SoftmaxAttention(32, 4, causal=False).window = 4


@pytest.mark.parametrize("field", ["k", "v"])
def test_debug_mode_flags_nan_in_a_cache(field: str) -> None:
    block, x = SoftmaxAttention(32, 4, window=3), torch.randn(1, 8, 32)
    _, cache = block(x, return_state=True)
    damaged = cache._replace(**{field: torch.full_like(getattr(cache, field), float("nan"))})
    linattn.set_debug(True)
    try:
        with pytest.raises(ValueError, match=f"state.{field}"):
            block.step(x[:, 0], damaged)
    finally:
        linattn.set_debug(False)
