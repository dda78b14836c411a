"""The pointwise formulas in torch, by name: a plain feature map whose features are one of them names it
(`FeatureMap.pointwise`) and computes its forward with it; kernels.py is tested against them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """elu(x) + 1 (Katharopoulos et al., 2020), in x's dtype."""
    return F.elu(x) + 1


POINTWISE = {"elu": elu_plus_one}
