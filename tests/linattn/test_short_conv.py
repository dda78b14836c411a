"""ShortConvolution against an explicit sum over the last K inputs, and decoding equal to the parallel pass."""
from __future__ import annotations

import pytest
import torch

from linattn import ConvState, LinearAttention, SoftmaxAttention
from linattn.short_conv import ShortConvolution


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out[b, m, c] = sum_{j<K} w[c, K-1-j] x[b, m-j, c], zero before the first token."""
    kernel = weight.shape[-1]
    out = torch.zeros_like(x)
    for m in range(x.shape[1]):
        for j in range(min(kernel, m + 1)):
            out[:, m] += weight[:, 0, kernel - 1 - j] * x[:, m - j]
    return out


@pytest.mark.parametrize("kernel", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 7])
def test_matches_the_explicit_sum(kernel: int, length: int) -> None:
    torch.manual_seed(kernel)
    conv = ShortConvolution(5, kernel).double()
    x = torch.randn(2, length, 5, dtype=torch.float64)
    out, cache = conv(x)
    torch.testing.assert_close(out, reference(x, conv.conv.weight))
    assert cache.shape == (2, kernel - 1, 5)


@pytest.mark.parametrize("kernel", [1, 3])
def test_prefill_then_steps_equal_the_whole_sequence(kernel: int) -> None:
    torch.manual_seed(0)
    conv = ShortConvolution(4, kernel).double()
    x = torch.randn(3, 9, 4, dtype=torch.float64)
    whole, _ = conv(x)
    out, cache = conv(x[:, :1])   # a prefill shorter than the kernel
    outs = [out]
    for t in range(1, 9):
        y, cache = conv.step(x[:, t], cache)
        outs.append(y.unsqueeze(1))
    torch.testing.assert_close(torch.cat(outs, dim=1), whole)


def test_gradients_match_the_reference() -> None:
    torch.manual_seed(1)
    conv = ShortConvolution(3, 3).double()
    x = torch.randn(1, 6, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: conv(t)[0], (x,))


BLOCKS = {
    "favor-post": lambda **kw: LinearAttention(16, 2, feature_map="favor", rope="post", **kw),
    "elu-pre+window": lambda **kw: LinearAttention(16, 2, feature_map="elu", rope="pre", window=3, **kw),
    "favor-post+decay": lambda **kw: LinearAttention(16, 2, feature_map="favor", rope="post", decay="retnet", **kw),
    "softmax": lambda **kw: SoftmaxAttention(16, 2, **kw),
    "softmax+window": lambda **kw: SoftmaxAttention(16, 2, window=3, **kw),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_a_block_convolves_its_projections_before_the_mixer(name: str) -> None:
    """short_conv=K: the block equals the same block fed the convolved projections (attend after the
    convolution), and decoding equals the parallel pass."""
    torch.manual_seed(0)
    block = BLOCKS[name](short_conv=3).double().eval()
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    qkv, _ = block.short_conv(block.to_qkv(x))
    q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    torch.testing.assert_close(block(x), block.to_out(block.attend(q, k, v).transpose(1, 2).flatten(2)))
    out, state = block(x[:, :4], return_state=True)
    assert isinstance(state, ConvState) and state.conv.shape == (2, 2, 48)
    steps = [out]
    for t in range(4, 11):
        y, state = block.step(x[:, t], state)
        steps.append(y.unsqueeze(1))
    torch.testing.assert_close(torch.cat(steps, dim=1), block(x))


def test_the_convolution_learns_and_shifts_tokens() -> None:
    """A gradient reaches the kernel, and a kernel that picks the previous token gives each query the
    previous token's projection: the token shift the option is for."""
    block = LinearAttention(8, 1, feature_map="elu", rope="none", short_conv=2).double()
    block(torch.randn(1, 5, 8, dtype=torch.float64)).sum().backward()
    assert block.short_conv.conv.weight.grad.abs().sum() > 0
    with torch.no_grad():
        block.short_conv.conv.weight.zero_()[:, 0, 0] = 1   # tap K-1 back: the previous token
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    shifted, _ = block.short_conv(block.to_qkv(x))
    torch.testing.assert_close(shifted[:, 1:], block.to_qkv(x)[:, :-1])


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_short_conv_takes_a_kernel_size(value) -> None:
    with pytest.raises(ValueError, match="short_conv"):
        LinearAttention(8, 2, short_conv=value)


def test_short_conv_needs_causal_and_its_own_state() -> None:
    with pytest.raises(ValueError, match="causal"):
        SoftmaxAttention(8, 2, causal=False, short_conv=3)
    block = LinearAttention(8, 2, short_conv=3).eval()
    _, state = LinearAttention(8, 2).eval()(torch.randn(1, 3, 8), return_state=True)
    with pytest.raises(ValueError, match="ConvState"):
        block.step(torch.randn(1, 8), state)
    _, state = block(torch.randn(1, 3, 8), return_state=True)
    with pytest.raises(ValueError, match="state.conv"):
        block.step(torch.randn(2, 8), state)   # another batch
