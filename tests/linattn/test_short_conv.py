"""ShortConvolution against an explicit sum over the last K inputs, and decoding equal to the parallel pass."""
from __future__ import annotations

import pytest
import torch

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
