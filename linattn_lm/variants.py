"""Variant names, the grid's vocabulary: 'softmax-rope', 'linear-favor-pre-abs',
'linear-favor-post-rmsnorm' (normalization="rmsnorm"), 'linear-favor-post+redraw_interval=250'
(feature-map options after '+'), 'linear-favor-pre+window=64', 'linear-favor-post+decay=retnet',
'linear-favor-pre+softmax_layers=1' (block options after '+', written as config.block_option_parts
writes them), 'softmax-rope+window=64' (the window-only control)."""
from __future__ import annotations

from argparse import ArgumentTypeError
from typing import Any

import linattn
from .flags import option
from .config import BLOCK_OPTIONS, block_option_from_name

SOFTMAX_VARIANTS = {"softmax-rope": ("post", False), "softmax-abs": ("none", True),
                    "softmax-none": ("none", False), "softmax-rope-abs": ("post", True)}


def default_variants() -> list[str]:
    """Every softmax variant with RoPE or learned positions, and every registered map x placement."""
    return ["softmax-rope", "softmax-abs"] + [
        f"linear-{feature_map}-{rope}"
        for feature_map in linattn.available_feature_maps() for rope in linattn.ROPE_PLACEMENTS]


LINEAR_SUFFIXES = ("rmsnorm", "abs")   # after the placement, in this order: normalization, positions


def variant_flags(name: str) -> dict[str, Any]:
    """'linear-favor-pre-rmsnorm-abs+redraw_interval=0' -> {attention: linear, feature_map: favor,
    rope: pre, normalization: rmsnorm, abs_pos: True, feature_map_options: {redraw_interval: 0}}.
    The block options (config.BLOCK_OPTIONS) are settings of their own: 'linear-favor-pre+window=64'
    -> {..., window: 64, feature_map_options: {}}."""
    base, *option_texts = name.split("+")
    try:
        pairs = [option(text) for text in option_texts]
        block = {key: block_option_from_name(key, text.partition("=")[2])
                 for text, (key, _) in zip(option_texts, pairs) if key in BLOCK_OPTIONS}
    except (ArgumentTypeError, ValueError) as error:
        raise ValueError(f"variant {name!r}: {error}") from None
    options = {key: value for key, value in pairs if key not in BLOCK_OPTIONS}
    if len(options) + len(block) != len(pairs):
        raise ValueError(f"variant {name!r} gives an option twice")
    if base in SOFTMAX_VARIANTS and not options:   # a block option other than the window: config's error
        rope, abs_pos = SOFTMAX_VARIANTS[base]
        return dict(attention="softmax", rope=rope, abs_pos=abs_pos, **block)
    parts, suffixes = base.split("-"), set()
    for suffix in reversed(LINEAR_SUFFIXES):
        if len(parts) > 3 and parts[-1] == suffix:
            suffixes.add(parts.pop())
    if parts[0] == "linear" and len(parts) >= 3 and parts[-1] in linattn.ROPE_PLACEMENTS:
        return dict(attention="linear", feature_map="-".join(parts[1:-1]), rope=parts[-1],
                    abs_pos="abs" in suffixes, feature_map_options=options,
                    normalization="rmsnorm" if "rmsnorm" in suffixes else "denominator", **block)
    raise ValueError(f"unknown variant {name!r}: expected one of {', '.join(SOFTMAX_VARIANTS)} [+window=N] or "
                     f"linear-<map>-<post|pre|none>[-rmsnorm][-abs][+KEY=VALUE...] (KEY a feature-map option "
                     f"or one of {', '.join(BLOCK_OPTIONS)}) with a map in "
                     f"{linattn.available_feature_maps()} (--import registers more)")

