"""linattn: linear attention with pluggable feature maps and RoPE after the feature map."""
from . import functional
from .attention import KVCache, LinearAttention, SoftmaxAttention, ROPE_PLACEMENTS
from .feature_maps import (EluFeatureMap, FavorFeatureMap, FeatureMap, HedgehogFeatureMap, SoftmaxFeatureMap,
                           TaylorFeatureMap, available_feature_maps, make_feature_map, register_feature_map)
from .functional import LinearState, linear_attention, linear_attention_reference, linear_attention_step
from .rotary import apply_rotary

__version__ = "0.1.0"

__all__ = [
    "EluFeatureMap", "FavorFeatureMap", "FeatureMap", "HedgehogFeatureMap", "KVCache", "LinearAttention",
    "LinearState", "ROPE_PLACEMENTS", "SoftmaxAttention", "SoftmaxFeatureMap", "TaylorFeatureMap", "apply_rotary",
    "available_feature_maps", "functional", "linear_attention", "linear_attention_reference",
    "linear_attention_step", "make_feature_map", "register_feature_map",
]
