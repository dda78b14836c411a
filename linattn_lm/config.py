"""Training settings, declared once: one dataclass per concern, presets as data layered over the
defaults, and the one validation every config goes through (from flags, presets or a checkpoint).

Flags are generated from these fields (`linattn_lm.cli`); a field's metadata holds its help text,
whether it may change on --resume and whether it picks the attention variant.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

import linattn

from .data import default_data_dir
from .flags import add_flags, flag_name, option
from .variants import LINEAR_BLOCK_OPTIONS, variant_name
from .map_check import checked_feature_map
from .device import DTYPES, resolve_device, resolve_dtype

ATTENTIONS = ("softmax", "linear")
SOFTMAX_ROPE = ("post", "none")     # softmax has no feature map: "post" = RoPE on q and k
SOFTMAX_BACKENDS = linattn.SOFTMAX_BACKENDS   # the library's: auto (= sdpa), sdpa, xformers
ATTENTION_BACKENDS = {"linear": linattn.functional.BACKENDS, "softmax": SOFTMAX_BACKENDS}
PLAIN_OPTION_TYPES = (bool, int, float, str, type(None))


# A preset lists only the settings it changes from the defaults (the dataclass fields'); a dict
# value (feature_map_options) replaces the default's whole.
PRESETS: dict[str, dict[str, Any]] = {
    # CI smoke test: seconds on one CPU core.
    "tiny": dict(n_layer=2, d_model=64, n_head=2, seq_len=64, batch_size=8, warmup=5, steps=30,
                 feature_map_options=dict(num_features=32, redraw_interval=1000), chunk_size=32,
                 eval_interval=10, eval_iters=2, log_interval=5, ckpt_interval=10, sample_interval=30),
    # The defaults, and the budget of the RoPE-placement study (docs/results/study.md): about 6-8
    # (softmax) and 8-12 (FAVOR+) minutes of training per run on 2 CPU cores; softmax and FAVOR+ with
    # RoPE beat the order-2 n-gram line (3.31 val bpc) clearly, FAVOR+ without RoPE does not (3.50);
    # FAVOR+ post (the quick start) measured 3.02-3.04 at step 1200 on the torch backend, 3.06 on the cpp
    # backend (the same maths to float rounding: a different trajectory, like another seed).
    # No redraws: a redraw late in a short run costs more than it brings (the study measures it).
    "cpu": {},
    # EleutherAI rotary-embedding blog, Performer on enwik8: 8 layers, 512 wide, 8 heads, 1024 context.
    # No redraws here either: at the cpu preset redraws every 500 steps cost 0.22 val bpc [0.16, 0.28]
    # over 3 seeds, each redraw throwing the model back (docs/results/study.md); the map's default.
    "eleuther": dict(n_layer=8, d_model=512, n_head=8, dropout=0.1, seq_len=1024, batch_size=32, lr=6e-4,
                     min_lr=6e-5, warmup=1000, steps=20000, feature_map_options=dict(num_features=256, redraw_interval=0),
                     eval_interval=1000, eval_iters=50, log_interval=50, ckpt_interval=1000, sample_interval=2000),
    # RoFormer section 4.4: 12 layers, 768 wide, 12 heads, 1024 context, batch 128, lr 1e-4.  No
    # redraws, as in eleuther (the study's measurement above).
    "paper": dict(n_layer=12, d_model=768, n_head=12, dropout=0.1, seq_len=1024, batch_size=128, lr=1e-4,
                  min_lr=1e-5, warmup=2000, steps=100000, feature_map_options=dict(num_features=256, redraw_interval=0),
                  eval_interval=2000, eval_iters=50, log_interval=100, ckpt_interval=2000, sample_interval=5000),
}
# Long context at the cpu preset's tokens per step (4 x 1024 = 16 x 256) and steps: the study's third
# part, where far bytes can matter (docs/results/study.md).
PRESETS["long"] = dict(seq_len=1024, batch_size=4)
# MQAR-lite (Zoology's recall task, linattn_lm/mqar.py): 2 layers, 64 wide, 2 heads of 32, 32 tokens
# holding 4 key-value pairs and their 4 queries, vocab 256; 4,096 tokens a step, as the cpu preset.
# The smallest setting where softmax + RoPE learns recall within a 10-minute CPU run (90% at step 1500);
# at 8 pairs in 64 tokens every model stayed at 1/8, copying any of the pairs' values (docs/gap-closers.md).
PRESETS["mqar"] = dict(n_layer=2, d_model=64, n_head=2, seq_len=32, batch_size=128, steps=1500, eval_iters=8,
                       ckpt_interval=500, sample_interval=0, task="mqar", mqar_kv_pairs=4)
# CI smoke test of the task: seconds on one CPU core.
PRESETS["mqar-tiny"] = {**PRESETS["mqar"], "d_model": 32, "batch_size": 8, "warmup": 5, "steps": 20,
                        "feature_map_options": dict(num_features=16, redraw_interval=0), "chunk_size": 16,
                        "eval_interval": 10, "eval_iters": 2, "log_interval": 5, "ckpt_interval": 10}


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


FLAG_PARSERS = {bool: (bool, None), int: (integer, "N"), float: (finite_float, "X"), str: (str, None)}


def setting(default: Any = dataclasses.MISSING, help: str = "", *, resumable: bool = False,
            variant: bool = False, flag: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A config field with its flag (linattn_lm.flags): help text, a parser by the default's type,
    `flag` for argparse keywords of its own.  `resumable`: may change on --resume (it never changes
    what the optimiser computes); `variant`: picks the attention variant (grid.py sets it)."""
    metadata = {"help": help, "resumable": resumable, "variant": variant, "flag": flag or {}}
    if type(default) in FLAG_PARSERS:
        metadata["parse"], metadata["metavar"] = FLAG_PARSERS[type(default)]
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_finite(config: Any) -> None:
    """Every float field of a config is finite, and within float32's range, where torch uses it
    (nan and inf pass range checks silently)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
            raise ValueError(f"{f.name} must be a finite number within float32's range "
                             f"(|x| <= {FLOAT32_MAX:.3g}), got {value}")


def check_types(config: Any) -> None:
    """Every field holds its declared type (a checkpoint or a preset may hold anything)."""
    for f in dataclasses.fields(config):
        value, expected = getattr(config, f.name), FIELD_TYPES[f.type]
        ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
        elif not ok:
            raise ValueError(f"{f.name} must be {expected.__name__}, got {value!r}")


FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict[str, Any]": dict, "list[str]": list}


@dataclass
class ModelConfig:
    """Everything needed to rebuild a model, as plain values (feature_map_options too), so
    checkpoints load with `torch.load(weights_only=True)`.  Defaults are the cpu preset's."""

    vocab_size: int = setting(256, "vocabulary size: at least 256 for enwik8 (one id per byte); any that its "
                                   "key-value pairs fit for mqar")
    n_layer: int = setting(4, "number of Transformer blocks")
    d_model: int = setting(128, "model width")
    n_head: int = setting(4, "attention heads (must divide d-model)")
    mlp_ratio: float = setting(4.0, "MLP hidden width / d-model")
    dropout: float = setting(0.0, "residual and embedding dropout probability")
    seq_len: int = setting(256, "training context length in bytes (learned positions cover exactly this)")
    attention: str = setting("linear", "attention type: softmax or linear", variant=True)
    feature_map: str = setting("favor", "linear attention feature map: a registered name, including "
                                        "maps registered by --import (linear only)", variant=True)
    feature_map_options: dict[str, Any] = setting(
        {"num_features": 64, "redraw_interval": 0},
        "an option of the feature map, KEY=VALUE with VALUE a Python literal (repeatable; linear only); "
        "a preset's options apply to its own map only", variant=True,
        flag=dict(name="--feature-map-option", metavar="KEY=VALUE", type=option, action="append"))
    rope: str = setting("post", "linear: RoPE after the map (post), before it (pre) or none; "
                                "softmax: post = RoPE on q,k, none = no RoPE", variant=True)
    abs_pos: bool = setting(False, "add learned absolute position embeddings", variant=True)
    normalization: str = setting("denominator", "linear attention's normalisation: denominator (divide by "
                                                "sum phi(q).phi(k)) or rmsnorm (a per-head RMSNorm of the "
                                                "output instead; linear only)", variant=True)
    window: int = setting(0, "linear: keys fewer than N positions back get the exact softmax weight e^s, older ones "
                             "the feature map's, under one normaliser; softmax: attend to those keys only (the "
                             "window-only control); 0 = no window", variant=True)
    decay: str = setting("", "linear: every attention weight times gamma_h^(distance): retnet (gamma_h = "
                             "1 - 2^(-5-h)) or one value in (0, 1] per head, separated by commas ('' = none)",
                         variant=True)
    softmax_layers: str = setting("", "linear: these layers are softmax + RoPE blocks instead (a hybrid): 0-based "
                                      "layer indices in increasing order separated by commas, e.g. 1 or 1,3 "
                                      "('' = none)", variant=True)
    chunk_size: int = setting(64, "causal linear attention block size (speed only; linear only)")
    backend: str = setting("auto", "attention kernels (speed only): linear auto, torch, cpp or fla (auto = "
                                   "fla on CUDA when installed, cpp on CPU where it builds); softmax auto "
                                   "(= sdpa), sdpa or xformers",
                           resumable=True)
    seed: int = setting(0, "seed for init, data order and feature-map draws")

    def validate(self) -> None:
        """The field checks, then the parameter memory, then the feature map (`check_map`)."""
        self.check_fields()
        check_memory(self.parameter_bytes(), "the model's parameters and buffers")
        self.check_map()

    def check_map(self) -> None:
        """Layer 0's feature map, built by `build_feature_map` as the model builds its maps (so bad
        option names, types and values get the map's own message) and run on a probe input (so a
        broken map is refused before any work), then RoPE's pairs.  Needs `check_fields` first."""
        num_features = 0
        if self.attention == "linear":
            num_features = checked_feature_map(self.feature_map, lambda: self.build_feature_map(0)).num_features
        self._validate_rope_pairs(num_features)

    def check_fields(self) -> None:
        """Checks that allocate nothing."""
        check_types(self)
        check_finite(self)
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "seq_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0 (0 = no window), got {self.window}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.mlp_ratio <= 0 or self.mlp_hidden < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an MLP {self.mlp_hidden} wide for "
                             f"d_model {self.d_model}; use mlp_ratio >= {1 / self.d_model:.3g}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention == "softmax":
            self._validate_softmax()
        elif self.attention == "linear":
            self._validate_linear()
        else:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")

    def _validate_softmax(self) -> None:
        if self.normalization != "denominator":
            raise ValueError(f"normalization={self.normalization!r} applies to linear attention only; softmax "
                             "attention normalises its weights itself: leave it 'denominator'")
        if self.rope not in SOFTMAX_ROPE:
            raise ValueError(f"softmax attention has no feature map, so rope is 'post' (RoPE on q and k) "
                             f"or 'none', got {self.rope!r}; 'pre' applies to linear attention only")
        if self.feature_map or self.feature_map_options:
            raise ValueError("softmax attention takes no feature map: feature_map must be '' and "
                             "feature_map_options empty")
        for name in LINEAR_BLOCK_OPTIONS:
            if getattr(self, name) != field_default(name):
                raise ValueError(f"{name} applies to linear attention only (softmax attends to every key "
                                 f"exactly), got {getattr(self, name)!r}; leave it {field_default(name)!r}")
        if self.backend not in SOFTMAX_BACKENDS:
            raise ValueError(f"softmax attention's backend must be one of {SOFTMAX_BACKENDS}, "
                             f"got {self.backend!r}")

    def _validate_linear(self) -> None:
        if self.rope not in linattn.ROPE_PLACEMENTS:
            raise ValueError(f"rope must be one of {linattn.ROPE_PLACEMENTS}, got {self.rope!r}")
        if self.backend not in linattn.functional.BACKENDS:
            raise ValueError(f"linear attention's backend must be one of {linattn.functional.BACKENDS}, "
                             f"got {self.backend!r}")
        if self.normalization not in linattn.NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {linattn.NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        for key, value in self.feature_map_options.items():
            if not isinstance(key, str) or not isinstance(value, PLAIN_OPTION_TYPES):
                raise ValueError(f"feature-map option {key}={value!r} is not a plain value: options are "
                                 "str, int, float, bool or None")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"feature-map option {key} must be finite, got {value}")
        linattn.feature_map_class(self.feature_map)   # an unknown name: the error lists the maps
        self.decay_option, self.softmax_layer_indices   # each parses its text, or says what is wrong

    def _validate_rope_pairs(self, num_features: int) -> None:
        """RoPE rotates coordinate pairs: after the feature map it rotates its M features,
        otherwise the head_dim coordinates of q and k."""
        if self.rope == "none":
            return
        post_map = self.attention == "linear" and self.rope == "post"
        size, name = (num_features, "the feature map's num_features") if post_map else (self.head_dim, "head_dim")
        if size % 2:
            raise ValueError(f"rope={self.rope!r} rotates pairs of coordinates, so {name} must be even, "
                             f"got {size}; pick an even value or rope='none'")

    def build_feature_map(self, layer: int) -> linattn.FeatureMap:
        """Layer `layer`'s map: the one way from the feature-map settings to a map (validation and the
        model both build with it).  A map that takes a `seed` gets one per layer unless the options fix
        it, a map with weights per head gets n_head."""
        options = dict(self.feature_map_options)
        if "seed" in linattn.feature_map_options(self.feature_map):
            options.setdefault("seed", layer_seed(self.seed, layer))
        return linattn.make_feature_map(self.feature_map, self.head_dim, heads=self.n_head, options=options)

    @property
    def decay_option(self) -> str | tuple[float, ...] | None:
        """LinearAttention's decay: None, "retnet" or one factor per head."""
        if self.decay in ("", "retnet"):
            return self.decay or None
        try:   # no spaces: the text goes into the run's name as it is
            factors = () if any(char.isspace() for char in self.decay) else tuple(map(float, self.decay.split(",")))
        except ValueError:
            factors = ()
        if len(factors) != self.n_head or not all(0 < factor <= 1 for factor in factors):
            raise ValueError(f"decay must be retnet or {self.n_head} numbers in (0, 1] separated by commas (one per "
                             f"head), got {self.decay!r}")
        return factors

    @property
    def softmax_layer_indices(self) -> tuple[int, ...]:
        """The layers that are softmax + RoPE blocks (a linear model's hybrid layers)."""
        if not self.softmax_layers:
            return ()
        try:
            layers = tuple(int(item) for item in self.softmax_layers.split(","))
        except ValueError:
            layers = ()
        if ",".join(map(str, layers)) != self.softmax_layers or list(layers) != sorted(set(layers)) or not all(
                0 <= layer < self.n_layer for layer in layers):
            raise ValueError(f"softmax_layers must list 0-based layer indices below n_layer {self.n_layer} in "
                             f"increasing order, each once, separated by commas (e.g. 1 or 1,3), got "
                             f"{self.softmax_layers!r}")
        return layers

    @property
    def block_options(self) -> dict[str, Any]:
        """The attention block's window and decay keywords, those that are not the default only (so a
        default config builds the same block as before the options existed); softmax takes the window
        only (validation refuses a decay there)."""
        options = {"window": self.window, "decay": self.decay_option}
        return {key: value for key, value in options.items() if value not in (0, None)}

    @property
    def block_backend(self) -> str:
        """The backend the attention block takes: softmax's "auto" is sdpa."""
        return "sdpa" if self.attention == "softmax" and self.backend == "auto" else self.backend

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)

    @property
    def num_features(self) -> int:
        """M of the feature map as its class gives it for these options, before anything is built
        (memory estimates).  Options the map refuses give head_dim: building the map then says what
        was wrong."""
        try:
            value = linattn.feature_map_class(self.feature_map).num_features_for(self.head_dim,
                                                                                self.feature_map_options)
        except Exception:   # a map registered by --import is user code: it may raise anything
            return self.head_dim
        return value if linattn.is_integer(value) and value >= 1 else self.head_dim

    def parameter_bytes(self) -> int:
        """float32 parameters and feature-map buffers (an M x head_dim projection per layer)."""
        d, hidden = self.d_model, self.mlp_hidden
        per_layer = 4 * d * d + 2 * d * hidden + hidden + d + 4 * d
        if self.attention == "linear":
            per_layer += self.num_features * self.head_dim
        count = 2 * self.vocab_size * d + self.n_layer * per_layer + 2 * d + self.abs_pos * self.seq_len * d
        return 4 * count

    def activation_bytes(self, batch_size: int) -> int:
        """A rough float32 estimate of what one training step keeps for backward."""
        tokens, d, heads = batch_size * self.seq_len, self.d_model, self.n_head
        per_token = 10 * d + 2 * self.mlp_hidden + 3 * self.vocab_size
        if self.attention == "softmax":
            per_token += heads * self.seq_len                       # the weights of the math kernel
        else:
            chunk = self.chunk_size
            padded = -(-self.seq_len // chunk) * chunk
            per_token += 4 * heads * self.num_features             # phi(q), phi(k), rotated copies
            per_token += heads * chunk * padded // self.seq_len    # masked chunk scores
            per_token += heads * self.num_features * self.head_dim * padded // (chunk * self.seq_len)
        return 4 * tokens * per_token * self.n_layer

    @property
    def variant(self) -> str:
        """Short name of the attention variant (linattn_lm.variants builds and parses them)."""
        return variant_name(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """The config of a plain dict, checked; unknown keys are errors (a typo is never ignored)."""
        return from_plain_dict(cls, values, "model")


def check_setting_names(cls: type, values: Any, section: str) -> None:
    if not isinstance(values, dict):
        raise ValueError(f"the {section} settings must be a dict, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} setting(s) {unknown}; known: {sorted(known)}")


def from_plain_dict(cls: type, values: Any, section: str) -> Any:
    check_setting_names(cls, values, section)
    config = cls(**values)
    check_types(config)
    return config



def available_memory_bytes(device: torch.device | None = None) -> int:
    """The device's total memory: a CUDA GPU's, else the machine's physical memory."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(needed: int, what: str, device: torch.device | None = None) -> None:
    """Refuse before allocating when an estimate is beyond the device's memory."""
    available = available_memory_bytes(device)
    if needed > available:
        raise ValueError(f"{what} would need about {needed / 2**30:,.1f} GiB, more than the "
                         f"{available / 2**30:,.1f} GiB this machine has; choose smaller sizes")


def layer_seed(run_seed: int, layer: int) -> int:
    """Distinct, reproducible feature-map seed per layer: layers differ, every DDP rank agrees."""
    return run_seed * 1_000_003 + layer


MAX_STEPS = 2**63   # steps are logged as int64, like the seeds' range [0, 2**63)
MAX_EVAL_ITERS = 10_000   # batches per val estimate, scored inside a training step (a whole split: eval.py)


@dataclass
class OptimConfig:
    """Optimisation and schedule: AdamW, linear warmup, cosine decay to min_lr."""

    batch_size: int = setting(16, "global batch size (split across DDP ranks)")
    lr: float = setting(3e-3, "peak learning rate (AdamW)")
    min_lr: float = setting(3e-4, "learning rate at the end of the cosine decay")
    warmup: int = setting(50, "linear warmup steps")
    steps: int = setting(1200, "training steps", resumable=True)
    decay_steps: int = setting(0, "step at which the cosine decay reaches min-lr (0: --steps); set it to stop "
                                  "early and later --resume with more --steps exactly")
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices")
    grad_clip: float = setting(1.0, "clip the global gradient norm (0 = off)")

    def validate(self) -> None:
        check_types(self)
        check_finite(self)
        for name in ("batch_size", "steps", "decay_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        for name in ("steps", "decay_steps", "warmup"):
            if getattr(self, name) >= MAX_STEPS:
                raise ValueError(f"{name} must be below 2**63 (TensorBoard and the checkpoint count steps in "
                                 f"int64, as seeds are), got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr or self.lr <= 0:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got {self.weight_decay} and "
                             f"{self.grad_clip}")
        if self.lr * self.weight_decay >= 1:   # AdamW multiplies weights by 1 - lr * weight_decay
            raise ValueError(f"lr * weight_decay must be below 1 (AdamW scales the weights by 1 - lr * weight_decay "
                             f"each step), got {self.lr} * {self.weight_decay}; lower --weight-decay")


@dataclass
class LogConfig:
    """What is measured and saved, and how often."""

    eval_interval: int = setting(100, "steps between validation estimates", resumable=True)
    eval_iters: int = setting(16, "fixed validation batches per estimate", resumable=True)
    log_interval: int = setting(10, "steps between train scalars", resumable=True)
    ckpt_interval: int = setting(200, "steps between checkpoints (0 = at the end and on Ctrl-C only)",
                                 resumable=True)
    sample_interval: int = setting(200, "steps between text samples (0 = never)", resumable=True)

    def validate(self) -> None:
        check_types(self)
        for name in ("eval_interval", "eval_iters", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_iters > MAX_EVAL_ITERS:   # each estimate scores them all, in the training step
            raise ValueError(f"eval_iters must be at most {MAX_EVAL_ITERS:,} batches per estimate, got "
                             f"{self.eval_iters:,}; eval.py scores a whole split")
        for name in ("ckpt_interval", "sample_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class RunConfig:
    """Where data and outputs live, the device, and the user code the run needs."""

    preset: str = setting("cpu", "sizes and schedule", resumable=True, flag=dict(choices=list(PRESETS)))
    data_dir: str = setting("", "prepared enwik8 directory (default: the repository's data/enwik8)",
                            resumable=True)
    out_dir: str = setting("runs", "parent directory of run directories", resumable=True)
    run_name: str = setting("", "run directory under --out-dir (default: the variant, e.g. "
                                "linear-favor-post-M64; grid.py: grid-<preset>)", resumable=True)
    device: str = setting("auto", "auto (CUDA if available), cpu, cuda, cuda:1, mps", resumable=True)
    compile: bool = setting(False, "torch.compile the model", resumable=True)
    dtype: str = setting("auto", "compute precision: bf16 or fp16 autocast (fp16 with a gradient scaler) or fp32; "
                                 "auto: bf16 on CUDA, fp32 elsewhere", flag=dict(choices=list(DTYPES)))
    threads: int = setting(0, "torch CPU threads (0 = torch default)", resumable=True)
    imports: list[str] = setting([], "a module name or a .py file to import first, e.g. one that registers a "
                                     "feature map (repeatable); recorded in the checkpoint", resumable=True,
                                 flag=dict(name="--import", metavar="MODULE_OR_FILE", action="append"))

    def __post_init__(self) -> None:
        # Recorded absolute, so eval.py and --resume find the data from any working directory.
        if isinstance(self.data_dir, str) and self.data_dir:
            self.data_dir = os.path.abspath(self.data_dir)

    @property
    def data_path(self) -> Path:
        """The prepared data directory: --data-dir, else the repository's data/enwik8."""
        return Path(self.data_dir) if self.data_dir else default_data_dir()

    @property
    def run_dir(self) -> Path:
        """Where the run's checkpoint and logs live: <out-dir>/<run-name>."""
        return Path(self.out_dir) / self.run_name

    def validate(self) -> None:
        self.check_fields()
        resolve_dtype(self.dtype, resolve_device(self.device))

    def check_fields(self) -> None:
        """The checks that hold on any machine (the device and its dtypes are this machine's)."""
        check_types(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if not self.out_dir:
            raise ValueError("out_dir must name a directory, got ''; pass --out-dir . for the current directory")
        check_utf8("out_dir", self.out_dir)
        check_run_name(self.run_name)
        if not 0 <= self.threads <= 4096:
            raise ValueError(f"threads must be in [0, 4096], got {self.threads}")
        if not all(isinstance(name, str) and name for name in self.imports):
            raise ValueError(f"imports must be module names or file paths, got {self.imports!r}")


def check_backend_runs_on(model: ModelConfig, device: torch.device) -> None:
    """The attention kernels asked for exist for the device (each error says what to do instead)."""
    log_space = model.attention == "linear" and linattn.feature_map_class(model.feature_map).log_space
    linattn.resolve_backend(model.block_backend, device, attention=model.attention, log_space=log_space)


NAME_MAX = 255   # bytes in one file name (Linux, macOS and Windows file systems)


def check_utf8(name: str, path: str) -> None:
    """A path the logs can name: bytes that are not UTF-8 reach Python as surrogates, which
    TensorBoard's writer and the JSON records cannot encode."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid UTF-8 text, got {path!r}; rename it") from None


def check_run_name(name: str) -> None:
    """A directory inside --out-dir named by its parts, nested or not (grid.py's runs are
    <grid>/<variant>/seed-<s>).  A part that names no new directory ('', '.': the run would write
    into its parent) or leaves it ('..'), or has spaces around it (invisible in listings), is refused."""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") or part != part.strip() for part in parts):
        raise ValueError(f"run_name must be a relative name inside --out-dir, such as favor or study/favor/seed-0, "
                         f"whose parts are not empty, '.' or '..' and have no spaces around them; got {name!r}")
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        raise ValueError(f"run_name must not hold control characters (a newline, a tab), got {name!r}")
    check_utf8("run_name", name)
    long = [part for part in parts if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX]
    if long:
        raise ValueError(f"run_name's parts must be at most {NAME_MAX} bytes (a file name's limit), got one of "
                         f"{len(long[0].encode('utf-8', 'surrogateescape'))}; choose a shorter --run-name")


TASKS = ("enwik8", "mqar")


def check_mqar_settings(vocab_size: int, seq_len: int, kv_pairs: int) -> None:
    """D pairs need D distinct keys in [1, V/2), D distinct values in [V/2, V), and room for the pairs
    and D queries in seq_len."""
    if kv_pairs < 1 or kv_pairs > vocab_size // 2 - 1:
        raise ValueError(f"mqar_kv_pairs must be in [1, {vocab_size // 2 - 1}] (distinct keys below vocab_size / 2), "
                         f"got {kv_pairs}")
    if seq_len < 4 * kv_pairs:
        raise ValueError(f"mqar needs seq_len >= 4 x mqar_kv_pairs ({4 * kv_pairs}: the pairs, then a query and its "
                         f"answer per key), got seq_len {seq_len}")


@dataclass
class TaskConfig:
    """What the model learns: enwik8's next byte, or multi-query associative recall (linattn_lm/mqar.py)."""

    task: str = setting("enwik8", "enwik8 (next-byte prediction) or mqar (multi-query associative recall, "
                                  "Zoology's synthetic task, scored at the query positions; presets mqar and "
                                  "mqar-tiny, the default preset with --task mqar)")
    mqar_kv_pairs: int = setting(8, "mqar: key-value pairs per sequence, each queried once; its vocabulary is "
                                    "--vocab-size, its length --seq-len")

    def validate(self) -> None:
        check_types(self)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")


SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "log": LogConfig, "run": RunConfig, "task": TaskConfig}


@dataclass
class TrainConfig:
    """One run's settings, a section per concern; `asdict` gives the plain nested dict that goes
    into checkpoints."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)

    def validate(self, *, probe_map: bool = True) -> None:
        """Every section's checks, then the memory a training step needs, estimated before
        anything is allocated; the feature map is built (once, to check its options) last.
        `probe_map=False`: a resumed run's map, probed when its record was read."""
        self.optim.validate()
        self.log.validate()
        self.run.validate()
        self.task.validate()
        if self.task.task == "mqar":
            check_mqar_settings(self.model.vocab_size, self.model.seq_len, self.task.mqar_kv_pairs)
        elif self.model.vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256 for enwik8 (one id per byte), got {self.model.vocab_size}")
        device = resolve_device(self.run.device)
        self.model.check_fields()
        needed = 4 * self.model.parameter_bytes() + self.model.activation_bytes(self.optim.batch_size)
        check_memory(needed, f"a training step with batch_size {self.optim.batch_size}, seq_len "
                             f"{self.model.seq_len} and these sizes (layers, width, feature-map num_features, "
                             "chunk_size)", device)
        if probe_map:
            self.model.check_map()
        check_backend_runs_on(self.model, device)

    def flat(self) -> dict[str, Any]:
        """Every setting by its (unique) field name."""
        return {key: value for section in asdict(self).values() for key, value in section.items()}

    @classmethod
    def parsed(cls, values: Any) -> "TrainConfig":
        """A checkpoint's config as sections, the one way every command reads one (--resume, eval.py and
        grid.py through `from_record`): unknown sections and settings are errors, each setting has its
        type, and a section or setting it lacks (written before that setting existed) takes the
        default.  Not validated: settings of the machine it ran on (device, paths) may not fit this one."""
        return cls(**{name: cls.saved_section(values, name) for name in SECTIONS})

    @staticmethod
    def saved_section(values: Any, name: str) -> Any:
        """One section of a checkpoint's config, read as `parsed` reads it, for commands that need
        only that section (eval.py: the model).  Every section's names are checked, unknown ones
        refused; only this one's values are typed (the run section's paths and device name another
        machine's, and eval.py takes its own)."""
        if not isinstance(values, dict):
            raise ValueError(f"the config must be a dict of sections, got {type(values).__name__}")
        unknown = sorted(set(values) - set(SECTIONS), key=str)
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; known: {sorted(SECTIONS)}")
        for section, cls in SECTIONS.items():
            check_setting_names(cls, values.get(section, {}), section)
        return from_plain_dict(SECTIONS[name], values.get(name, {}), name)

    @classmethod
    def from_record(cls, values: Any) -> "TrainConfig":
        """A checkpoint's config as every command that reads one takes it (eval.py, --resume, grid.py):
        `parsed` with every section present, then every check that holds on any machine (this
        machine's device, memory and kernels are the command's to check)."""
        missing = [name for name in SECTIONS if isinstance(values, dict) and name not in values]
        if missing:
            raise ValueError(f"the config lacks section(s) {missing}")
        if isinstance(values, dict) and isinstance(values["model"], dict) and values["model"].get("backend") == "triton":
            # the retired Triton kernels: a speed-only setting, so a run saved with it goes on with auto's choice
            values = {**values, "model": {**values["model"], "backend": "auto"}}
        config = cls.parsed(values)
        config.optim.validate()
        config.log.validate()
        config.run.check_fields()
        config.model.validate()
        return config


FIELDS = {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
def add_config_flags(parser: Any, *, skip: set[str] = frozenset()) -> None:
    """One flag per config field, grouped by section.  Every flag defaults to None, so only flags
    given explicitly override the preset."""
    add_flags(parser, (field for _, field in FIELDS.values()), skip=skip,
              group=lambda field: f"{FIELDS[field.name][0]} settings", default=lambda field: None,
              note=lambda field: "" if field.default in ("", dataclasses.MISSING) else f" (default {field.default})")


def config_from_argv(parser: Any, argv: list[str] | None, imports: list[str] = (), *,
                     resolve: Callable[[dict[str, Any], Any], Any] | None = None,
                     resume: Callable[[dict[str, Any]], "TrainConfig"] | None = None) -> tuple[Any, Any]:
    """A command's flags, parsed, and the settings they give: explicit flags over the preset over the
    defaults (`config_from_flags`, validated); with --resume, `resume(given)` (the run's record);
    `resolve(given, args)` instead, where a command makes something else of them (grid.py's grid).

    Args: parser: one with add_config_flags' flags; argv: the arguments (None: sys.argv's);
        imports: the --import values already imported (recorded in the config).
    Returns: (argparse's namespace, the settings)."""
    args = parser.parse_args(argv)
    given = given_settings(args)
    if imports:
        given["imports"] = imports
    if resolve is not None:
        return args, resolve(given, args)
    if resume is not None and args.resume:
        return args, resume(given)
    return args, config_from_flags(given)


def given_settings(args: Any) -> dict[str, Any]:
    """The config fields given explicitly (an argparse Namespace's), options as a dict."""
    given = {key: value for key, value in vars(args).items() if key in FIELDS and value is not None}
    if "feature_map_options" in given:
        given["feature_map_options"] = dict(given["feature_map_options"])
    return given


def variant_skip() -> set[str]:
    """The flags grid.py leaves out: the variant comes from --variants."""
    return set(VARIANT) - {"feature_map_options"}


RESUMABLE = {name for name, (_, f) in FIELDS.items() if f.metadata["resumable"]}
VARIANT = {name for name, (_, f) in FIELDS.items() if f.metadata["variant"]}

DEFAULT_PRESET = "cpu"
TASK_PRESETS = {"enwik8": DEFAULT_PRESET, "mqar": "mqar"}   # the preset a task defaults to
LINEAR_ONLY = ("feature_map", "feature_map_options", "chunk_size", *LINEAR_BLOCK_OPTIONS)


def preset_settings(name: str) -> dict[str, Any]:
    """Every setting a preset gives (its changes over the defaults), by field name.

    Args: name: a key of PRESETS.
    Returns: a fresh dict, safe to change."""
    defaults = {key: field_default(key) for key in FIELDS}
    return copy.deepcopy({**defaults, **PRESETS[name]})


def resolve_variant(given: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """The attention fields from explicit flags.  A preset's feature-map options belong to the
    preset's map; flags that do not apply to the variant are errors."""
    attention = given.get("attention", "linear")
    if attention == "softmax":
        for name in LINEAR_ONLY:
            if name in given:
                flag = "--feature-map-option" if name == "feature_map_options" else f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} applies to linear attention only, not --attention softmax")
        if given.get("rope") == "pre":
            raise ValueError("--rope pre rotates q, k before a feature map, which softmax attention "
                             "lacks: use --rope post (RoPE on q, k) or --rope none")
        return dict(attention=attention, feature_map="", feature_map_options={})
    feature_map = given.get("feature_map", preset["feature_map"])
    options = dict(preset["feature_map_options"]) if feature_map == preset["feature_map"] else {}
    return dict(attention=attention, feature_map=feature_map,
                feature_map_options={**options, **given.get("feature_map_options", {})})


def config_from_flags(given: dict[str, Any]) -> TrainConfig:
    """Merge: dataclass defaults < preset < explicit flags (by field name); validated."""
    config = merged_flags(given)
    config.validate()
    return config


def merged_flags(given: dict[str, Any]) -> TrainConfig:
    """`config_from_flags` before its validation (--resume takes only the run's name from it)."""
    given = {key: value for key, value in given.items() if value is not None}
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}")
    if given.get("data_dir") == "":   # '' is what the default is stored as: given, it is a mistake (an unset variable)
        raise ValueError("data_dir must name a directory, got ''; leave --data-dir out for the repository's "
                         "data/enwik8")
    preset_name = given.get("preset", TASK_PRESETS.get(given.get("task"), DEFAULT_PRESET))
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    preset = preset_settings(preset_name)
    values = {**preset, **given, **resolve_variant(given, preset), "preset": preset_name}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        sections[FIELDS[key][0]][key] = value
    config = TrainConfig(**{name: SECTIONS[name](**fields) for name, fields in sections.items()})
    config.optim.decay_steps = config.optim.decay_steps or config.optim.steps
    if "run_name" not in given:   # an explicit --run-name "" is refused by validate(), not replaced
        config.run.run_name = config.model.variant
    return config


ABSENT = "<absent>"


def field_default(key: str) -> Any:
    """A setting's default (ABSENT for a name that is no setting)."""
    if key not in FIELDS:
        return ABSENT
    field = FIELDS[key][1]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def config_differences(saved: dict[str, Any], current: dict[str, Any], saved_as: str = "checkpoint") -> list[str]:
    """'key: checkpoint A, now B' for every differing setting that may not change on --resume.  A
    setting absent from a config was added after it was written, and it ran with the setting's
    default (normalization, say): checkpoints and results from before still match."""
    keys = sorted((set(saved) | set(current)) - RESUMABLE)
    differing = [(key, saved.get(key, field_default(key)), current.get(key, field_default(key))) for key in keys]
    return [f"{key}: {saved_as} {before!r}, now {now!r}" for key, before, now in differing if before != now]


def contradictions(recorded: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(flag, recorded value, given value) for every setting given on a resume that may not change
    (not RESUMABLE, or the preset, whose values the record already holds) and differs from the
    record (flat settings); feature-map options one by one.  Values compare as JSON writes them (a
    tuple given against the list a JSON record holds is the same value)."""
    def same(a: Any, b: Any) -> bool:
        return json.loads(json.dumps(a, default=repr)) == json.loads(json.dumps(b, default=repr))

    options = recorded.get("feature_map_options", {})
    found = [(flag_name(key), recorded.get(key, ABSENT), value) for key, value in given.items()
             if key != "feature_map_options" and (key not in RESUMABLE or key == "preset")
             and not same(recorded.get(key, ABSENT), value)]
    return found + [(f"--feature-map-option {key}", options.get(key, ABSENT), value)
                    for key, value in given.get("feature_map_options", {}).items()
                    if not same(options.get(key, ABSENT), value)]


def config_from_record(saved: TrainConfig, given: dict[str, Any]) -> TrainConfig:
    """--resume's settings: the checkpoint's record, with the flags given on resume.  A flag that may
    change on --resume (RESUMABLE: steps, intervals, paths, device, ...) replaces the recorded value;
    any other must repeat it, and one that contradicts the record is refused, every difference named
    (--preset too: the record holds what the preset gave).  Validated like flags, on this machine."""
    given = {key: value for key, value in given.items() if value is not None}
    recorded = saved.flat()
    contradicting = contradictions(recorded, given)
    if contradicting:
        listed = "; ".join(f"{key}: checkpoint {before!r}, given {now!r}" for key, before, now in contradicting)
        raise ValueError(f"--resume continues the run as its checkpoint records it, and these flags contradict the "
                         f"record: {listed}; drop them (the record gives them), or start a new run elsewhere")
    values = {**recorded, **{key: value for key, value in given.items() if key in RESUMABLE}}
    config = TrainConfig(**{name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
                            for name, cls in SECTIONS.items()})
    config.validate(probe_map=False)
    return config
