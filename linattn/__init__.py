"""linattn: linear attention with pluggable feature maps and RoPE after the feature map."""
from . import functional
from .attention import (BLOCK_OPTIONS, NORMALIZATIONS, ROPE_PLACEMENTS, SOFTMAX_BACKENDS, ConvState, KVCache, LinearAttention,
                        SoftmaxAttention, resolve_backend)
from .checks import is_integer, is_real, set_debug
from .feature_maps import (EluFeatureMap, FavorFeatureMap, FeatureMap, HedgehogFeatureMap, SoftmaxFeatureMap,
                           TaylorFeatureMap, available_feature_maps, check_feature_map, check_option_names,
                           feature_map_class, feature_map_options,
                           make_feature_map, register_feature_map)
from .functional import LinearState, linear_attention, linear_attention_reference, linear_attention_step
from .ops.linear_attention.memory import device_memory
from .rotary import apply_rotary

__version__ = "0.1.0"

__all__ = [
    "BLOCK_OPTIONS", "ConvState", "EluFeatureMap", "FavorFeatureMap", "FeatureMap", "HedgehogFeatureMap", "KVCache", "LinearAttention",
    "LinearState", "NORMALIZATIONS", "ROPE_PLACEMENTS", "SOFTMAX_BACKENDS", "SoftmaxAttention", "SoftmaxFeatureMap",
    "TaylorFeatureMap", "apply_rotary", "available_feature_maps", "check_feature_map", "check_option_names", "device_memory", "feature_map_class", "feature_map_options",
    "functional", "is_integer", "is_real", "linear_attention", "linear_attention_reference", "linear_attention_step",
    "make_feature_map", "register_feature_map", "resolve_backend", "set_debug",
]
