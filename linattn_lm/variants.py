"""Variant names, the grid's vocabulary, built (`variant_name`) and parsed (`variant_flags`) here only:
'softmax-rope', 'linear-favor-pre-abs', 'linear-favor-post-rmsnorm' (normalization="rmsnorm"),
'linear-favor-post-M64' (built with num_features), 'linear-favor-post+redraw_interval=250'
(feature-map options after '+'), and the block options after '+': 'linear-favor-pre+window=64',
'linear-favor-post+decay=retnet', 'linear-favor-pre+softmax_layers=1_3', 'softmax-rope+window=64' (the
window-only control; softmax takes the window and short_conv only), 'linear-favor-post+short_conv=3'."""
from __future__ import annotations

import argparse
import ast
from argparse import ArgumentTypeError
from typing import Any

import linattn

SOFTMAX_VARIANTS = {"softmax-rope": ("post", False), "softmax-abs": ("none", True),
                    "softmax-none": ("none", False), "softmax-rope-abs": ("post", True)}
LINEAR_SUFFIXES = ("rmsnorm", "abs")   # after the placement, in this order: normalization, positions
# The blocks' options (linattn.BLOCK_OPTIONS) and the LM's softmax_layers, named after '+' in this order
# (a name is a run's directory, so the order stays); each one's default is falsy (0, '') and left out of
# names.  A list's commas would split grid.py's --variants, so a name joins its items with '_'.
BLOCK_OPTIONS = ("window", "decay", "softmax_layers", "short_conv")
SOFTMAX_BLOCK_OPTIONS = linattn.BLOCK_OPTIONS["softmax"]
COUNT_BLOCK_OPTIONS = ("window", "short_conv")   # whole numbers; the others are text
LINEAR_BLOCK_OPTIONS = tuple(name for name in BLOCK_OPTIONS if name not in SOFTMAX_BLOCK_OPTIONS)
NAME_LIST_SEPARATOR = "_"


def option(text: str) -> tuple[str, Any]:
    """KEY=VALUE; VALUE is a Python literal (64, 0.5, True, None, 'text') or else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = raw
    return key, value


def default_variants() -> list[str]:
    """Every softmax variant with RoPE or learned positions, and every registered map x placement."""
    return ["softmax-rope", "softmax-abs"] + [
        f"linear-{feature_map}-{rope}"
        for feature_map in linattn.available_feature_maps() for rope in linattn.ROPE_PLACEMENTS]


def variant_name(model: Any) -> str:
    """A ModelConfig's variant, e.g. softmax-rope, softmax-rope+window=64, linear-favor-post-M256,
    linear-favor-post-rmsnorm-M64."""
    block = [f"{name}={str(getattr(model, name)).replace(',', NAME_LIST_SEPARATOR)}" for name in BLOCK_OPTIONS
             if getattr(model, name)]
    if model.attention == "softmax":
        parts = ["rope"] * (model.rope == "post") + ["abs"] * model.abs_pos
        return "+".join(["-".join(["softmax", *(parts or ["none"])]), *block])
    name = f"linear-{model.feature_map}-{model.rope}"
    if model.normalization != "denominator":
        name += f"-{model.normalization}"
    if "num_features" in model.feature_map_options:
        name += f"-M{model.feature_map_options['num_features']}"
    return "+".join([name + ("-abs" if model.abs_pos else ""), *block])


def block_option_from_name(name: str, text: str) -> int | str:
    """A block option's value from its text in a variant name; a default value is refused, since the
    name without it says the same."""
    value: int | str = text.replace(NAME_LIST_SEPARATOR, ",")
    if name in COUNT_BLOCK_OPTIONS:
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{name}={text} is not a whole number") from None
        if text != str(value):   # one spelling per value: the name is the run's directory
            raise ValueError(f"{name}={text} must be spelled {name}={value}")
    if not value:
        raise ValueError(f"{name}={text} is the default: leave it out of the name")
    return value


def variant_flags(name: str) -> dict[str, Any]:
    """'linear-favor-pre-rmsnorm-abs+redraw_interval=0' -> {attention: linear, feature_map: favor,
    rope: pre, normalization: rmsnorm, abs_pos: True, feature_map_options: {redraw_interval: 0}}.
    The block options are settings of their own: 'linear-favor-pre+window=64' -> {..., window: 64,
    feature_map_options: {}}."""
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
    raise ValueError(f"unknown variant {name!r}: expected one of {', '.join(SOFTMAX_VARIANTS)} [+window=N] "
                     f"[+short_conv=K] or "
                     f"linear-<map>-<post|pre|none>[-rmsnorm][-abs][+KEY=VALUE...] (KEY a feature-map option "
                     f"or one of {', '.join(BLOCK_OPTIONS)}) with a map in "
                     f"{linattn.available_feature_maps()} (--import registers more)")
