"""A short depthwise causal convolution over the sequence (H3's and Based's "short convolution"; fla's
layers apply one to q, k and v): each channel's output at m mixes that channel's inputs at m - K + 1 .. m.
It gives a block the token shift (the previous token's key beside this one's) that induction and recall
need, where attention alone must learn it in an earlier layer.

The blocks apply it to their q, k, v projections before the mixer (`short_conv=K`); decoding carries the
last K - 1 projections.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Module):
    """Depthwise causal convolution, kernel K, no bias: (B, N, C) -> (B, N, C).

    Args:
        channels: C.
        kernel_size: K >= 1 (K = 1 scales each channel).
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolution of a whole sequence.

        Args:
            x: (B, N, C).
            cache: (B, K - 1, C), the inputs before x (from a prefill or steps); None: zeros.

        Returns:
            (B, N, C) outputs and the (B, K - 1, C) cache after the last token.
        """
        history = self.empty_cache(x) if cache is None else cache.to(x.dtype)
        padded = torch.cat([history, x], dim=1)   # (B, K - 1 + N, C)
        out = F.conv1d(padded.transpose(1, 2), self.conv.weight.to(x.dtype), groups=x.shape[-1]).transpose(1, 2)
        return out, padded[:, padded.shape[1] - (self.kernel_size - 1):]

    def step(self, x_t: torch.Tensor, cache: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token: (B, C) and the cache -> (B, C) and the cache after it."""
        out, cache = self(x_t.unsqueeze(1), cache)
        return out.squeeze(1), cache

    def empty_cache(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(x.shape[0], self.kernel_size - 1, x.shape[-1])

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"
