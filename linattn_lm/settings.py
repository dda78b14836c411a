"""Training settings, declared once: one dataclass per concern and the one validation every config goes
through (from flags, presets or a checkpoint).

Flags are generated from these fields (`linattn_lm.flags`); a field's metadata holds its help text,
whether it may change on --resume and whether it picks the attention variant.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any

import torch

import linattn

from .data import default_data_dir
from .files import check_run_name, check_utf8
from .presets import MODELS_DIR, PRESET_SUFFIX, PRESETS, is_preset_file
from .preflight import activation_bytes, check_backend_runs_on, check_memory, parameter_bytes
from .variants import LINEAR_BLOCK_OPTIONS, option, variant_name
from .map_check import checked_feature_map
from .device import DTYPES, resolve_device, resolve_dtype

ATTENTIONS = ("softmax", "linear")
SOFTMAX_ROPE = ("post", "none")     # softmax has no feature map: "post" = RoPE on q and k
SOFTMAX_BACKENDS = linattn.SOFTMAX_BACKENDS   # the library's: auto (= sdpa), sdpa, xformers
ATTENTION_BACKENDS = {"linear": linattn.functional.BACKENDS, "softmax": SOFTMAX_BACKENDS}
PLAIN_OPTION_TYPES = (bool, int, float, str, type(None))


def setting(default: Any = dataclasses.MISSING, help: str = "", *, resumable: bool = False,
            variant: bool = False, flag: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A config field with its flag (linattn_lm.flags, which parses it by the default's type): help
    text, `flag` for argparse keywords of its own.  `resumable`: may change on --resume (it never changes
    what the optimiser computes); `variant`: picks the attention variant (grid.py sets it)."""
    metadata = {"help": help, "resumable": resumable, "variant": variant, "flag": flag or {}}
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
    short_conv: int = setting(0, "a depthwise causal convolution of K tokens on q, k and v before the attention "
                                 "(H3's and Based's short convolution; linear and softmax); 0 = none", variant=True)
    chunk_size: int = setting(64, "causal linear attention block size (speed only; linear only)")
    backend: str = setting("auto", "attention kernels (speed only): linear auto, torch, cpp or fla (auto = "
                                   "fla on CUDA when installed, cpp on CPU where it builds); softmax auto "
                                   "(= sdpa), sdpa or xformers",
                           resumable=True)
    seed: int = setting(0, "seed for init, data order and feature-map draws")

    def validate(self) -> None:
        """The field checks, then the parameter memory, then the feature map (`check_map`)."""
        self.check_fields()
        check_memory(parameter_bytes(self), "the model's parameters and buffers")
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
        for name in ("window", "short_conv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = none), got {getattr(self, name)}")
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
        # One spelling per value: the text names the run (and a grid's variant), so 1,0.5 and 1.0,0.50 would be
        # two runs of one model; and a factor 1 for every head is no decay, the default, named without it.
        canonical = ",".join(map(str, factors))
        if all(factor == 1 for factor in factors):
            raise ValueError(f"decay {self.decay!r} is 1 for every head, which is no decay: leave --decay out")
        if self.decay != canonical:
            raise ValueError(f"decay {self.decay!r} must be spelled as Python writes its numbers: {canonical!r}")
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
        if len(layers) == self.n_layer:   # no linear layer is left: a softmax model, not a linear hybrid
            raise ValueError(f"softmax_layers {self.softmax_layers!r} makes every layer softmax: that is a softmax "
                             "model, so use --attention softmax instead")
        return layers

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

    @property
    def variant(self) -> str:
        """Short name of the attention variant (linattn_lm.variants builds and parses them)."""
        return variant_name(self)


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

    preset: str = setting("cpu", f"sizes and schedule: a preset of {MODELS_DIR.parent.name}/{MODELS_DIR.name}/ "
                                 f"({', '.join(PRESETS)}) or a {PRESET_SUFFIX} file of that form", resumable=True,
                          flag=dict(metavar="NAME_OR_FILE"))
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
        if self.preset not in PRESETS and not is_preset_file(self.preset):
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}, or a {PRESET_SUFFIX} file")
        if not self.out_dir:
            raise ValueError("out_dir must name a directory, got ''; pass --out-dir . for the current directory")
        check_utf8("out_dir", self.out_dir)
        check_run_name(self.run_name)
        if not 0 <= self.threads <= 4096:
            raise ValueError(f"threads must be in [0, 4096], got {self.threads}")
        if not all(isinstance(name, str) and name for name in self.imports):
            raise ValueError(f"imports must be module names or file paths, got {self.imports!r}")



TASKS = ("enwik8", "mqar")


def check_mqar_settings(vocab_size: int, seq_len: int, kv_pairs: int) -> None:
    """D pairs need D distinct keys in [1, V/2), D distinct values in [V/2, V), and room for the pairs
    and D queries in seq_len."""
    if kv_pairs < 1:
        raise ValueError(f"mqar_kv_pairs must be at least 1, got {kv_pairs}")
    if kv_pairs > vocab_size // 2 - 1:   # the bound named as a vocabulary, which a small one makes < 1
        raise ValueError(f"mqar_kv_pairs {kv_pairs} needs vocab_size >= {2 * (kv_pairs + 1)} (distinct keys in "
                         f"[1, vocab_size / 2)), got vocab_size {vocab_size}; raise --vocab-size or lower "
                         "--mqar-kv-pairs")
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
        needed = 4 * parameter_bytes(self.model) + activation_bytes(self.model, self.optim.batch_size)
        check_memory(needed, f"a training step with batch_size {self.optim.batch_size}, seq_len "
                             f"{self.model.seq_len} and these sizes (layers, width, feature-map num_features, "
                             "chunk_size)", device)
        if probe_map:
            self.model.check_map()
        check_backend_runs_on(self.model, device)

    def flat(self) -> dict[str, Any]:
        """Every setting by its (unique) field name."""
        return {key: value for section in asdict(self).values() for key, value in section.items()}


FIELDS = {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
RESUMABLE = {name for name, (_, f) in FIELDS.items() if f.metadata["resumable"]}
VARIANT = {name for name, (_, f) in FIELDS.items() if f.metadata["variant"]}
ABSENT = "<absent>"   # field_default's answer for a name that is no setting


def field_default(key: str) -> Any:
    """A setting's default, or ABSENT."""
    if key not in FIELDS:
        return ABSENT
    field = FIELDS[key][1]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default

