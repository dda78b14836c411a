"""A run's settings, declared once: one dataclass per concern (the model's, `ModelConfig`, lives beside
the model in lm.py), `TrainConfig` holding them all, and the one validation every config goes through
(from flags, presets or a checkpoint).

Flags are generated from these fields (`linattn_lm.flags`); linattn_lm.fields declares them.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Any

from .data import default_data_dir
from .fields import check_finite, check_types, default_value, setting
from .files import check_run_name, check_utf8
from .lm import ModelConfig
from .presets import MODELS_DIR, PRESET_SUFFIX, PRESETS, is_preset_file
from .preflight import activation_bytes, check_backend_runs_on, check_memory, parameter_bytes
from .device import DTYPES, resolve_device, resolve_dtype

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
MQAR_FILLERS = ("random", "zeros")   # linattn_lm/mqar.py draws them


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
    mqar_filler: str = setting("random", "mqar: what fills the positions between the pairs and queries: random "
                                         "(tokens of the whole vocabulary, which may repeat a key; Zoology's "
                                         "generator default) or zeros (token 0, never a key; Zoology's published "
                                         "configurations)")

    def validate(self) -> None:
        check_types(self)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.mqar_filler not in MQAR_FILLERS:
            raise ValueError(f"mqar_filler must be one of {', '.join(MQAR_FILLERS)}, got {self.mqar_filler!r}")


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

    def check_types(self) -> None:
        """Every section's fields hold their declared types (settings read back from a file may hold
        anything); the other checks need the machine (validate)."""
        for name in SECTIONS:
            check_types(getattr(self, name))

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
    return default_value(FIELDS[key][1])

