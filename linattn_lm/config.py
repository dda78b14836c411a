"""Training settings, declared once: one dataclass per concern, presets as data layered over the
defaults, and the one validation every config goes through (from flags, presets or a checkpoint).

Flags are generated from these fields (`linattn_lm.cli`); a field's metadata holds its help text,
whether it may change on --resume and whether it picks the attention variant.
"""
from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any

import torch

from linattn.attention import _xformers_ops
from linattn.feature_maps import FEATURE_MAPS
from linattn.ops.linear_attention.backends import resolve as resolve_linear_backend

from .data import default_data_dir
from .lm import ModelConfig, check_finite, check_memory, check_types, from_plain_dict, setting
from .runtime import resolve_device, resolve_dtype


MAX_STEPS = 2**63   # steps are logged as int64, like the seeds' range [0, 2**63)


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
        for name in ("ckpt_interval", "sample_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass
class RunConfig:
    """Where data and outputs live, the device, and the user code the run needs."""

    preset: str = setting("cpu", "sizes and schedule", resumable=True)
    data_dir: str = setting("", "prepared enwik8 directory (default: the repository's data/enwik8)",
                            resumable=True)
    out_dir: str = setting("runs", "parent directory of run directories", resumable=True)
    run_name: str = setting("", "run directory under --out-dir (default: the variant, e.g. "
                                "linear-favor-post-M64; grid.py: grid-<preset>)", resumable=True)
    device: str = setting("auto", "auto (CUDA if available), cpu, cuda, cuda:1, mps", resumable=True)
    compile: bool = setting(False, "torch.compile the model", resumable=True)
    dtype: str = setting("auto", "compute precision: bf16 or fp16 autocast (fp16 with a gradient scaler) or fp32; "
                                 "auto: bf16 on CUDA, fp32 elsewhere")
    threads: int = setting(0, "torch CPU threads (0 = torch default)", resumable=True)
    imports: list[str] = setting([], "a module name or a .py file to import first, e.g. one that registers a "
                                     "feature map (repeatable); recorded in the checkpoint", resumable=True)

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
        check_types(self)
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if not self.out_dir:
            raise ValueError("out_dir must name a directory, got ''; pass --out-dir . for the current directory")
        if not self.run_name or self.run_name.startswith("/") or ".." in self.run_name.split("/"):
            raise ValueError(f"run_name must be a relative name inside --out-dir, got {self.run_name!r}")
        if not 0 <= self.threads <= 4096:
            raise ValueError(f"threads must be in [0, 4096], got {self.threads}")
        if not all(isinstance(name, str) and name for name in self.imports):
            raise ValueError(f"imports must be module names or file paths, got {self.imports!r}")
        resolve_dtype(self.dtype, resolve_device(self.device))


def check_backend_runs_on(model: ModelConfig, device: torch.device) -> None:
    """The attention kernels asked for exist for the device (each error says what to do instead)."""
    if model.attention == "linear":
        log_space = getattr(FEATURE_MAPS.get(model.feature_map), "log_space", True)
        resolve_linear_backend(model.backend, device, cpp_kernel_runs=log_space)
    elif model.backend == "xformers":
        if device.type != "cuda":
            raise ValueError(f"backend 'xformers' runs on CUDA only, and this run is on {device}; "
                             "use --backend sdpa")
        try:
            _xformers_ops()
        except ImportError as err:
            raise ValueError(str(err)) from err


SECTIONS = {"model": ModelConfig, "optim": OptimConfig, "log": LogConfig, "run": RunConfig}


@dataclass
class TrainConfig:
    """One run's settings, a section per concern; `asdict` gives the plain nested dict that goes
    into checkpoints."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def validate(self) -> None:
        """Every section's checks, then the memory a training step needs, estimated before
        anything is allocated; the feature map is built (once, to check its options) last."""
        self.optim.validate()
        self.log.validate()
        self.run.validate()
        device = resolve_device(self.run.device)
        self.model.check_fields()
        needed = 4 * self.model.parameter_bytes() + self.model.activation_bytes(self.optim.batch_size)
        check_memory(needed, f"a training step with batch_size {self.optim.batch_size}, seq_len "
                             f"{self.model.seq_len} and these sizes (layers, width, feature-map num_features, "
                             "chunk_size)", device)
        self.model.validate()
        check_backend_runs_on(self.model, device)

    def flat(self) -> dict[str, Any]:
        """Every setting by its (unique) field name."""
        return {key: value for section in asdict(self).values() for key, value in section.items()}

    @classmethod
    def from_dict(cls, values: Any) -> "TrainConfig":
        """A checkpoint's config, checked like any other.  A section or setting it lacks (written
        before that setting existed) takes the default."""
        if not isinstance(values, dict):
            raise ValueError(f"the config must be a dict of sections, got {type(values).__name__}")
        unknown = sorted(set(values) - set(SECTIONS), key=str)
        if unknown:
            raise ValueError(f"unknown config section(s) {unknown}; known: {sorted(SECTIONS)}")
        config = cls(**{name: from_plain_dict(SECTIONS[name], values.get(name, {}), name) for name in SECTIONS})
        config.validate()
        return config

    @classmethod
    def resumed(cls, saved: Any, current: "TrainConfig") -> "TrainConfig":
        """A checkpoint's config validated like flags, with the settings that may change on --resume
        taken from `current` (the saved device or paths may not exist on this machine)."""
        if not isinstance(saved, dict):
            raise ValueError(f"the config must be a dict of sections, got {type(saved).__name__}")
        merged = {name: {**values, **{key: value for key, value in asdict(getattr(current, name)).items()
                                      if key in RESUMABLE}}
                  if name in SECTIONS and isinstance(values, dict) else values
                  for name, values in saved.items()}
        return cls.from_dict(merged)


FIELDS = {f.name: (section, f) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
RESUMABLE = {name for name, (_, f) in FIELDS.items() if f.metadata["resumable"]}
VARIANT = {name for name, (_, f) in FIELDS.items() if f.metadata["variant"]}

PRESETS: dict[str, dict[str, Any]] = {
    # CI smoke test: seconds on one CPU core.
    "tiny": dict(n_layer=2, d_model=64, n_head=2, mlp_ratio=4.0, dropout=0.0, seq_len=64,
                 batch_size=8, lr=3e-3, min_lr=3e-4, warmup=5, steps=30, weight_decay=0.1, grad_clip=1.0,
                 feature_map="favor", feature_map_options=dict(num_features=32, redraw_interval=1000),
                 chunk_size=32, eval_interval=10, eval_iters=2, log_interval=5, ckpt_interval=10,
                 sample_interval=30),
    # The defaults, and the budget of the RoPE-placement study (docs/results/study-cpu.md): about 6-8
    # (softmax) and 8-12 (FAVOR+) minutes of training per run on 2 CPU cores; softmax and FAVOR+ with
    # RoPE beat the order-2 n-gram line (3.31 val bpc) clearly, FAVOR+ without RoPE does not (3.50);
    # FAVOR+ post (the quick start) measured 3.02-3.04 at step 1200 on the torch backend, 3.06 on the cpp
    # backend (the same maths to float rounding: a different trajectory, like another seed).
    # No redraws: a redraw late in a short run costs more than it brings (the study measures it).
    "cpu": dict(n_layer=4, d_model=128, n_head=4, mlp_ratio=4.0, dropout=0.0, seq_len=256,
                batch_size=16, lr=3e-3, min_lr=3e-4, warmup=50, steps=1200, weight_decay=0.1, grad_clip=1.0,
                feature_map="favor", feature_map_options=dict(num_features=64, redraw_interval=0),
                chunk_size=64, eval_interval=100, eval_iters=16, log_interval=10, ckpt_interval=200,
                sample_interval=200),
    # EleutherAI rotary-embedding blog, Performer on enwik8: 8 layers, 512 wide, 8 heads, 1024 context.
    # No redraws here either: at the cpu preset redraws every 500 steps cost 0.22 val bpc [0.16, 0.28]
    # over 3 seeds, each redraw throwing the model back (docs/results/study-cpu.md); the map's default.
    "eleuther": dict(n_layer=8, d_model=512, n_head=8, mlp_ratio=4.0, dropout=0.1, seq_len=1024,
                     batch_size=32, lr=6e-4, min_lr=6e-5, warmup=1000, steps=20000, weight_decay=0.1,
                     grad_clip=1.0, feature_map="favor",
                     feature_map_options=dict(num_features=256, redraw_interval=0), chunk_size=64,
                     eval_interval=1000, eval_iters=50, log_interval=50, ckpt_interval=1000,
                     sample_interval=2000),
    # RoFormer section 4.4: 12 layers, 768 wide, 12 heads, 1024 context, batch 128, lr 1e-4.  No
    # redraws, as in eleuther (the study's measurement above).
    "paper": dict(n_layer=12, d_model=768, n_head=12, mlp_ratio=4.0, dropout=0.1, seq_len=1024,
                  batch_size=128, lr=1e-4, min_lr=1e-5, warmup=2000, steps=100000, weight_decay=0.1,
                  grad_clip=1.0, feature_map="favor",
                  feature_map_options=dict(num_features=256, redraw_interval=0), chunk_size=64,
                  eval_interval=2000, eval_iters=50, log_interval=100, ckpt_interval=2000,
                  sample_interval=5000),
}
DEFAULT_PRESET = "cpu"
LINEAR_ONLY = ("feature_map", "feature_map_options", "chunk_size")


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
    given = {key: value for key, value in given.items() if value is not None}
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}")
    preset_name = given.get("preset", DEFAULT_PRESET)
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    preset = copy.deepcopy(PRESETS[preset_name])
    values = {**preset, **given, **resolve_variant(given, preset), "preset": preset_name}
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        sections[FIELDS[key][0]][key] = value
    config = TrainConfig(**{name: SECTIONS[name](**fields) for name, fields in sections.items()})
    config.optim.decay_steps = config.optim.decay_steps or config.optim.steps
    config.run.run_name = config.run.run_name or config.model.variant
    config.validate()
    return config


ABSENT = "<absent>"


def field_default(key: str) -> Any:
    """A setting's default (ABSENT for a name that is no setting)."""
    if key not in FIELDS:
        return ABSENT
    field = FIELDS[key][1]
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: checkpoint A, now B' for every differing setting that may not change on --resume.  A
    setting absent from a config was added after it was written, and it ran with the setting's
    default (normalization, say): checkpoints and results from before still match."""
    keys = sorted((set(saved) | set(current)) - RESUMABLE)
    differing = [(key, saved.get(key, field_default(key)), current.get(key, field_default(key))) for key in keys]
    return [f"{key}: checkpoint {before!r}, now {now!r}" for key, before, now in differing if before != now]
