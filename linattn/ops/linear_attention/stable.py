"""The log-space numerics of linear attention: exact Eq. 19 from log-features at any input scale,
still strictly causal (log-features up to 1/eps of the dtype in magnitude: beyond, common's guard
makes them NaN, or in debug mode common.check_log_feature_range refuses them).  Every log-space
implementation shares what is here: the chunked torch algorithm (torch_logspace.py), its C++ kernel
(cpp_logspace.py), the mapping onto fla's gated linear attention (fla_kernels.py) and the recurrent
step (recurrent.py); dispatch.py picks one.

Derivation: docs/derivations.md, "The log-space numerics (stable.py)"."""
from __future__ import annotations

import torch

# The margins of every log-space implementation (the C++ kernel reads them from here).
JUMP_LIMIT = 30.0      # a row whose running max grew more than this within its chunk is computed exactly
NUMERATOR_CAP = 30.0   # numerator query factors are capped at e^30 (saturation beyond float32: docs/derivations.md)
PAIR_SPREAD = 20.0     # pairs whose key scales differ by more take their own numerator exponential


def pair_max(x: torch.Tensor) -> torch.Tensor:
    """max over each rotation pair (2i, 2i+1), written back to both coordinates."""
    return x.unflatten(-1, (-1, 2)).amax(-1).repeat_interleave(2, dim=-1)


def numerator_scale(feature_scale: torch.Tensor, rotary: bool) -> torch.Tensor:
    """P from F: the pair's max where the numerator is rotated, else F itself."""
    return pair_max(feature_scale) if rotary else feature_scale


def numerator_query(log_factor: torch.Tensor) -> torch.Tensor:
    """e^(b + P - Q), capped at e^NUMERATOR_CAP."""
    return torch.exp(log_factor.clamp_max(NUMERATOR_CAP))
