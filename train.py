#!/usr/bin/env python3
"""Train a byte-level language model on enwik8 with softmax or linear attention.

    python data/enwik8/prepare.py --sample                   # offline sample (NON-CANONICAL data)
    python train.py --preset cpu                             # FAVOR+, RoPE after the feature map
    python train.py --preset cpu --attention softmax         # softmax attention with RoPE
    python train.py --preset cpu --feature-map elu --rope pre --steps 200
    python train.py --preset cpu --resume                    # continue runs/<run-name>/ckpt.pt
    torchrun --nproc-per-node 8 train.py --preset paper      # DDP, one process per GPU
    tensorboard --logdir runs

A preset sets sizes and schedule; flags given explicitly override it.  The attention variant comes
from --attention/--feature-map/--rope/--abs-pos only.  For softmax attention --rope is 'post'
(RoPE on q and k) or 'none'; 'pre' (rotate before the feature map) exists for linear attention only.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

import linattn
from linattn.data import DataError, RandomWindows, load_split
from linattn_lm import (CHECKPOINT_NAME, ByteLM, CheckpointError, ModelConfig, bits_per_byte, config_differences,
                    lm_loss, load_checkpoint, save_checkpoint)
from linattn_lm.lm import BITS_PER_NAT
from linattn_lm.runtime import (autocast, decode_bytes, keep_freed_memory, peak_memory_mb, reset_peak_memory,
                            resolve_device, summed_loss)

# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, dict[str, Any]] = {
    # CI smoke test: seconds on one CPU core.
    "tiny": dict(n_layer=2, d_model=64, n_head=2, mlp_ratio=4.0, dropout=0.0, seq_len=64,
                 batch_size=8, lr=3e-3, min_lr=3e-4, warmup=5, steps=30, weight_decay=0.1,
                 grad_clip=1.0, num_features=32, redraw_interval=1000, chunk_size=32,
                 eval_interval=10, eval_iters=2, log_interval=5, ckpt_interval=10, sample_interval=30),
    # Learns visibly in about two minutes per variant on 2 CPU cores (FAVOR+ post).
    # Small batches: on CPU more, noisier steps learn faster per second than fewer large ones.
    "cpu": dict(n_layer=4, d_model=128, n_head=4, mlp_ratio=4.0, dropout=0.0, seq_len=256,
                batch_size=4, lr=3e-3, min_lr=3e-4, warmup=50, steps=600, weight_decay=0.1,
                grad_clip=1.0, num_features=64, redraw_interval=1000, chunk_size=64,
                eval_interval=100, eval_iters=16, log_interval=10, ckpt_interval=200, sample_interval=200),
    # EleutherAI rotary-embedding blog, Performer on enwik8: 8 layers, 512 wide, 8 heads, 1024 context.
    "eleuther": dict(n_layer=8, d_model=512, n_head=8, mlp_ratio=4.0, dropout=0.1, seq_len=1024,
                     batch_size=32, lr=6e-4, min_lr=6e-5, warmup=1000, steps=20000, weight_decay=0.1,
                     grad_clip=1.0, num_features=256, redraw_interval=1000, chunk_size=64,
                     eval_interval=1000, eval_iters=50, log_interval=50, ckpt_interval=1000,
                     sample_interval=2000),
    # RoFormer section 4.4: 12 layers, 768 wide, 12 heads, 1024 context, batch 128, lr 1e-4.
    "paper": dict(n_layer=12, d_model=768, n_head=12, mlp_ratio=4.0, dropout=0.1, seq_len=1024,
                  batch_size=128, lr=1e-4, min_lr=1e-5, warmup=2000, steps=100000, weight_decay=0.1,
                  grad_clip=1.0, num_features=256, redraw_interval=1000, chunk_size=64,
                  eval_interval=2000, eval_iters=50, log_interval=100, ckpt_interval=2000,
                  sample_interval=5000),
}
DEFAULT_PRESET = "cpu"
SAMPLE_PROMPT_BYTES = 128
SAMPLE_NEW_BYTES = 256

# Keys that may change when resuming: they never change what the optimiser computes.
RESUMABLE_KEYS = {"steps", "eval_interval", "eval_iters", "log_interval", "ckpt_interval",
                  "sample_interval", "out_dir", "run_name", "data_dir", "device", "compile",
                  "threads", "preset"}


@dataclass
class TrainConfig(ModelConfig):
    """Model fields (inherited) plus training fields: one flat dict of plain values, so it goes
    into checkpoints as is.  Defaults (here and in ModelConfig) are the cpu preset's."""

    preset: str = DEFAULT_PRESET
    batch_size: int = 4             # global: split across DDP ranks
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 50
    steps: int = 600
    decay_steps: int = 600          # cosine reaches min_lr here (= steps unless given)
    weight_decay: float = 0.1
    grad_clip: float = 1.0          # 0: no clipping
    eval_interval: int = 100
    eval_iters: int = 16
    log_interval: int = 10
    ckpt_interval: int = 200        # 0: only at the end and on Ctrl-C
    sample_interval: int = 200      # 0: never
    data_dir: str = "data/enwik8"
    out_dir: str = "runs"
    run_name: str = ""
    device: str = "auto"
    compile: bool = False
    threads: int = 0                # 0: torch's default

    def validate(self) -> None:
        super().validate()
        for name in ("batch_size", "steps", "decay_steps", "eval_interval", "eval_iters", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "ckpt_interval", "sample_interval", "threads", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr or self.lr <= 0:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got min_lr={self.min_lr}, lr={self.lr}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if not self.run_name:
            raise ValueError("run_name must not be empty")


# ----------------------------------------------------------------------------- flags


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser(description: str = "Train a byte-level LM on enwik8.", *,
                 variant_flags: bool = True) -> argparse.ArgumentParser:
    """Every flag defaults to None so that only flags given explicitly override the preset.
    grid.py leaves out the flags that pick the variant (variant_flags=False)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", choices=PRESETS, help=f"sizes and schedule (default {DEFAULT_PRESET})")
    variant = p.add_argument_group("attention variant")
    if variant_flags:
        variant.add_argument("--attention", choices=("softmax", "linear"), help="attention type (default linear)")
        variant.add_argument("--feature-map", choices=linattn.available_feature_maps(),
                             help="linear attention feature map (default favor)")
        variant.add_argument("--rope", choices=linattn.ROPE_PLACEMENTS,
                             help="linear: RoPE after the map (post, default), before it (pre) or none; "
                                  "softmax: post = RoPE on q,k (default), none = no RoPE")
        variant.add_argument("--abs-pos", action=argparse.BooleanOptionalAction,
                             help="add learned absolute position embeddings (default off)")
    variant.add_argument("--num-features", type=positive_int, help="FAVOR+ random features M (favor only)")
    variant.add_argument("--redraw-interval", type=non_negative_int,
                         help="redraw FAVOR+ projections every K training steps, 0 = never (favor only)")
    variant.add_argument("--chunk-size", type=positive_int,
                         help="causal linear attention block size (speed only; linear only)")
    model = p.add_argument_group("model size")
    model.add_argument("--n-layer", type=positive_int, help="number of Transformer blocks")
    model.add_argument("--d-model", type=positive_int, help="model width")
    model.add_argument("--n-head", type=positive_int, help="attention heads (must divide d-model)")
    model.add_argument("--mlp-ratio", type=float, help="MLP hidden width / d-model")
    model.add_argument("--dropout", type=float, help="residual and embedding dropout probability")
    optim = p.add_argument_group("optimisation")
    optim.add_argument("--seq-len", type=positive_int, help="training context length in bytes")
    optim.add_argument("--batch-size", type=positive_int, help="global batch size (split across DDP ranks)")
    optim.add_argument("--lr", type=float, help="peak learning rate (AdamW)")
    optim.add_argument("--min-lr", type=float, help="learning rate at the end of the cosine decay")
    optim.add_argument("--warmup", type=non_negative_int, help="linear warmup steps")
    optim.add_argument("--steps", type=positive_int, help="training steps")
    optim.add_argument("--decay-steps", type=positive_int,
                       help="step at which the cosine decay reaches min-lr (default: --steps); "
                            "set it to stop early and later --resume with more --steps exactly")
    optim.add_argument("--weight-decay", type=float, help="AdamW weight decay on matrices")
    optim.add_argument("--grad-clip", type=float, help="clip the global gradient norm (0 = off)")
    optim.add_argument("--seed", type=non_negative_int, help="seed for init, data order and FAVOR+ draws (default 0)")
    logs = p.add_argument_group("logging and checkpoints")
    logs.add_argument("--eval-interval", type=positive_int, help="steps between validation estimates")
    logs.add_argument("--eval-iters", type=positive_int, help="fixed validation batches per estimate")
    logs.add_argument("--log-interval", type=positive_int, help="steps between train scalars")
    logs.add_argument("--ckpt-interval", type=non_negative_int, help="steps between checkpoints (0 = end only)")
    logs.add_argument("--sample-interval", type=non_negative_int, help="steps between text samples (0 = never)")
    run = p.add_argument_group("run")
    run.add_argument("--data-dir", help="prepared enwik8 directory (default data/enwik8)")
    run.add_argument("--out-dir", help="parent directory of run directories (default runs)")
    run.add_argument("--run-name", help="run directory under --out-dir (default: the variant, e.g. "
                                        "linear-favor-post-M64; grid.py: grid-<preset>)")
    run.add_argument("--device", help="auto (CUDA if available), cpu, cuda, cuda:1, ... (default auto)")
    run.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile the model")
    run.add_argument("--threads", type=non_negative_int, help="torch CPU threads (0 = torch default)")
    run.add_argument("--resume", action="store_true", help="continue from <out-dir>/<run-name>/ckpt.pt")
    for action in p._actions:   # short placeholders keep the usage line readable
        if action.type in (int, positive_int, non_negative_int) and action.metavar is None:
            action.metavar = "N"
        elif action.type is float and action.metavar is None:
            action.metavar = "X"
    return p


def resolve_variant(given: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """Attention fields from explicit flags; flags that do not apply to the variant are errors."""
    attention = given.get("attention", "linear")
    if attention == "softmax":
        for flag in ("feature_map", "num_features", "redraw_interval", "chunk_size"):
            if flag in given:
                raise ValueError(f"--{flag.replace('_', '-')} applies to linear attention only, "
                                 "not --attention softmax")
        rope = given.get("rope", "post")
        if rope == "pre":
            raise ValueError("--rope pre rotates q, k before a feature map, which softmax attention "
                             "lacks: use --rope post (RoPE on q, k) or --rope none")
        return dict(attention=attention, feature_map="", rope=rope, num_features=0, redraw_interval=0,
                    chunk_size=preset["chunk_size"])
    feature_map = given.get("feature_map", "favor")
    is_favor = feature_map == "favor"
    for flag in ("num_features", "redraw_interval"):
        if flag in given and not is_favor:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --feature-map favor only, "
                             f"not {feature_map}")
    return dict(attention=attention, feature_map=feature_map, rope=given.get("rope", "post"),
                num_features=given.get("num_features", preset["num_features"]) if is_favor else 0,
                redraw_interval=given.get("redraw_interval", preset["redraw_interval"]) if is_favor else 0,
                chunk_size=given.get("chunk_size", preset["chunk_size"]))


def config_from_flags(given: dict[str, Any]) -> TrainConfig:
    """Merge: dataclass defaults < preset < explicit flags; derives decay_steps and run_name."""
    given = {key: value for key, value in given.items() if value is not None and key != "resume"}
    preset_name = given.get("preset", DEFAULT_PRESET)
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[preset_name]
    values = {**preset, **given, **resolve_variant(given, preset), "preset": preset_name}
    values.setdefault("decay_steps", values["steps"])
    values.setdefault("run_name", ModelConfig.from_dict(values).variant)
    config = TrainConfig(**values)
    resolve_device(config.device)   # fail now, not after the data is loaded
    return config


# ----------------------------------------------------------------------------- distributed


@dataclass
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (so all ranks stop at the same step)."""
        if self.world_size == 1:
            return flag
        return bool(self.sum(torch.tensor(float(flag), device=self.device)).item())

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


@contextlib.contextmanager
def distributed(device_name: str) -> Iterator[Distributed]:
    """Join the torchrun process group when RANK/WORLD_SIZE are set: nccl on CUDA, gloo on CPU."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_name)
    if world_size == 1:
        yield Distributed(0, 1, device)
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield Distributed(rank, world_size, device)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- pieces of the loop


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at decay_steps (step counts from 0)."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    if step >= config.decay_steps:
        return config.min_lr
    progress = (step - config.warmup) / max(1, config.decay_steps - config.warmup)
    return config.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def make_optimizer(model: ByteLM, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings only, not on biases and LayerNorm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


class UsageError(ValueError):
    """A run that cannot start as asked (reported as `error: ...`, exit status 2)."""


class StopRequest:
    """Ctrl-C / SIGTERM ask to stop after the current step (then a checkpoint is saved); a second
    Ctrl-C aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint after this step "
                   "(Ctrl-C again to abort without saving)")

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():   # signal() works there only
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


@dataclass
class RunStats:
    """Counters that survive resumes, so rates and curves cover the whole run."""

    train_seconds: float = 0.0      # training loop time, excluding evaluation and sampling
    compute_seconds: float = 0.0    # forward + backward + optimiser step
    other_seconds: float = 0.0      # evaluation and sampling
    tokens: int = 0
    val_steps: list[int] = field(default_factory=list)
    val_bpc: list[float] = field(default_factory=list)

    @property
    def best_val_bpc(self) -> float:
        return min(self.val_bpc, default=math.nan)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else math.nan

    @property
    def loop_overhead(self) -> float:
        """Share of training-loop time spent outside forward/backward/optimiser step."""
        return 1 - self.compute_seconds / self.train_seconds if self.train_seconds else math.nan


@dataclass
class TrainResult:
    run_name: str
    variant: str
    final_val_bpc: float
    best_val_bpc: float
    tokens_per_s: float
    peak_memory_mb: float
    parameters: int
    steps: int
    wall_seconds: float
    loop_overhead: float
    seed: int
    data: str
    val_steps: list[int]
    val_bpc: list[float]
    interrupted: bool
    model: ByteLM | None = None

    def summary(self) -> str:
        return (f"result {self.run_name}: final val bpc {self.final_val_bpc:.4f} "
                f"(best {self.best_val_bpc:.4f}) | {self.tokens_per_s:,.0f} tokens/s | "
                f"wall time {self.wall_seconds:.1f}s | {self.steps} steps | "
                f"peak memory {self.peak_memory_mb:,.0f} MiB")


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng(saved: list[dict[str, torch.Tensor]], ctx: Distributed, seed: int) -> None:
    """Each rank continues its own dropout RNG; a different world size reseeds instead."""
    if len(saved) != ctx.world_size:
        tqdm.write(f"warning: checkpoint holds RNG states for {len(saved)} rank(s), this job has "
                   f"{ctx.world_size}: dropout masks are reseeded, so the run is not bit-identical")
        torch.manual_seed(seed + 1 + ctx.rank)
        return
    torch.set_rng_state(saved[ctx.rank]["torch"])
    if "cuda" in saved[ctx.rank] and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(saved[ctx.rank]["cuda"], ctx.device)


def load_for_resume(path: Path, config: TrainConfig, data: str) -> dict[str, Any]:
    checkpoint = load_checkpoint(path)
    differences = config_differences(checkpoint["config"], asdict(config), RESUMABLE_KEYS)
    if differences:
        raise CheckpointError(f"cannot resume {path}: it was trained with a different configuration "
                              f"({'; '.join(differences)}); only {', '.join(sorted(RESUMABLE_KEYS))} "
                              "may change")
    if checkpoint["data"] != data:
        raise CheckpointError(f"cannot resume {path}: it was trained on {checkpoint['data']}, "
                              f"--data-dir now holds {data}")
    return checkpoint


def evaluate(model: torch.nn.Module, val: RandomWindows, config: TrainConfig, ctx: Distributed) -> float:
    """Validation bpc on eval_iters fixed batches: the same windows at every evaluation and, with
    the same seed, for every variant.  Each rank takes its share; the sums are combined."""
    nats, count = summed_loss(model, (val.batch_at(i) for i in range(config.eval_iters)), ctx.device)
    totals = ctx.sum(torch.tensor([nats, count], dtype=torch.float64, device=ctx.device))
    return bits_per_byte((totals[0] / totals[1]).item())


def sample_prompt(val: np.ndarray, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """The first bytes of val as a prompt, and how many bytes to sample after it (learned absolute
    positions cannot go past seq_len)."""
    prompt_len = min(SAMPLE_PROMPT_BYTES, config.seq_len // 2)
    new_bytes = config.seq_len - prompt_len + 1 if config.abs_pos else SAMPLE_NEW_BYTES
    return torch.from_numpy(val[:prompt_len].astype(np.int64)), min(new_bytes, SAMPLE_NEW_BYTES)


def text_sample(model: ByteLM, prompt: torch.Tensor, new_bytes: int, config: TrainConfig,
                device: torch.device) -> str:
    generator = torch.Generator(device).manual_seed(config.seed)
    with autocast(device):
        new = model.generate(prompt.to(device), new_bytes, temperature=1.0, generator=generator)
    indent = lambda text: "    " + text.replace("\n", "\n    ")   # markdown code block, any content
    return f"prompt:\n\n{indent(decode_bytes(prompt))}\n\nsample:\n\n{indent(decode_bytes(new))}"


# ----------------------------------------------------------------------------- training


class Trainer:
    """One run: data, model and optimiser (fresh or from the run's checkpoint), then `run()`."""

    def __init__(self, config: TrainConfig, ctx: Distributed, *, resume: bool):
        if config.batch_size % ctx.world_size:
            raise UsageError(f"batch_size {config.batch_size} must be divisible by the {ctx.world_size} ranks")
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config, self.ctx, self.device = config, ctx, ctx.device
        self.log = tqdm.write if ctx.is_main else (lambda message: None)
        self.run_dir = Path(config.out_dir) / config.run_name
        self.ckpt_file = self.run_dir / CHECKPOINT_NAME
        reset_peak_memory(self.device)
        self._load_data()      # first, so missing or too-small data fails before anything is written
        self._build_model(load_for_resume(self.ckpt_file, config, self.data) if resume else self._no_checkpoint())
        self._open_logs()

    def _load_data(self) -> None:
        config, ctx = self.config, self.ctx
        train_split, self.val_split = load_split(config.data_dir, "train"), load_split(config.data_dir, "val")
        windows = dict(batch_size=config.batch_size // ctx.world_size, seq_len=config.seq_len,
                       seed=config.seed, rank=ctx.rank, world_size=ctx.world_size)
        self.train_batches = RandomWindows(train_split, **windows)
        self.val_batches = RandomWindows(self.val_split, **windows)
        self.data = train_split.description
        self.log(f"data: {self.data} from {config.data_dir} "
                 f"(train {len(train_split):,} bytes, val {len(self.val_split):,})")

    def _no_checkpoint(self) -> None:
        if self.ckpt_file.exists():
            raise CheckpointError(f"{self.ckpt_file} exists: pass --resume to continue that run, or choose "
                                  "another --run-name / --out-dir (or delete the directory)")

    def _build_model(self, checkpoint: dict[str, Any] | None) -> None:
        config, ctx = self.config, self.ctx
        torch.manual_seed(config.seed)   # identical initial weights on every rank
        self.model = ByteLM(config).to(self.device)
        self.optimizer = make_optimizer(self.model, config, self.device)
        self.stats, self.step = RunStats(), 0
        if checkpoint is None:
            torch.manual_seed(config.seed + 1 + ctx.rank)   # per-rank dropout masks
        else:
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.train_batches.load_state_dict(checkpoint["loader"])
            restore_rng(checkpoint["rng"], ctx, config.seed)
            self.stats, self.step = RunStats(**checkpoint["stats"]), checkpoint["step"]
            self.log(f"resumed {self.ckpt_file} at step {self.step}")
        self.compiled = torch.compile(self.model) if config.compile else self.model
        # FAVOR+ buffers are not broadcast: every rank draws identical projections from the seeds.
        self.trainable = (DistributedDataParallel(self.compiled, broadcast_buffers=False)
                          if ctx.world_size > 1 else self.compiled)
        self.log(f"model: {config.variant}, {self.model.num_parameters():,} parameters, {config.n_layer} "
                 f"layers x {config.d_model} wide, {config.n_head} heads; device {self.device}, "
                 f"{ctx.world_size} process(es)")

    def _open_logs(self) -> None:
        # purge_step hides events that a crashed run logged after its last checkpoint.
        self.writer = SummaryWriter(self.run_dir, purge_step=self.step + 1) if self.ctx.is_main else None
        if self.writer:
            self.writer.add_text("data", self.data, self.step)
            settings = "\n".join(f"    {key} = {value}" for key, value in asdict(self.config).items())
            self.writer.add_text("config", settings, self.step)
        self.prompt, self.sample_bytes = sample_prompt(self.val_split.data, self.config)
        self.bar = tqdm(total=self.config.steps, initial=self.step, desc=self.config.run_name,
                        dynamic_ncols=True, disable=not (self.ctx.is_main and sys.stderr.isatty()))
        self.loss_sum, self.loss_count = torch.zeros((), device=self.device), 0
        self.window_start = time.perf_counter()

    def scalar(self, tag: str, value: float) -> None:
        if self.writer:
            self.writer.add_scalar(tag, value, self.step)

    def train_step(self) -> torch.Tensor:
        """One optimiser step on the next batch; returns the gradient norm before clipping."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.config)
        x, y = (t.to(self.device, non_blocking=True) for t in next(self.train_batches))
        compute_start = time.perf_counter()
        with autocast(self.device):
            loss = lm_loss(self.trainable(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip or math.inf)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # so the compute timer covers the GPU work
        self.stats.compute_seconds += time.perf_counter() - compute_start
        self.step += 1
        self.stats.tokens += self.config.batch_size * self.config.seq_len
        self.loss_sum += loss.detach()
        self.loss_count += 1
        return grad_norm

    def log_train(self, grad_norm: torch.Tensor) -> None:
        """Mean training loss since the last log (over all ranks), lr, gradient norm, tokens/s."""
        mean_loss = (self.ctx.sum(self.loss_sum) / (self.loss_count * self.ctx.world_size)).item()
        tokens = self.loss_count * self.config.batch_size * self.config.seq_len
        self.scalar("train/loss", mean_loss)
        self.scalar("train/bpc", bits_per_byte(mean_loss))
        self.scalar("lr", self.optimizer.param_groups[0]["lr"])
        self.scalar("grad_norm", grad_norm.item())
        self.scalar("tokens_per_s", tokens / (time.perf_counter() - self.window_start))
        self.bar.set_postfix(loss=f"{mean_loss:.3f}", bpc=f"{bits_per_byte(mean_loss):.3f}")
        self.loss_sum.zero_()
        self.loss_count, self.window_start = 0, time.perf_counter()

    def evaluate_and_sample(self) -> None:
        config, step = self.config, self.step
        if step % config.eval_interval == 0 or step == config.steps:
            val_bpc = evaluate(self.compiled, self.val_batches, config, self.ctx)
            self.stats.val_steps.append(step)
            self.stats.val_bpc.append(val_bpc)
            self.scalar("val/loss", val_bpc / BITS_PER_NAT)
            self.scalar("val/bpc", val_bpc)
            self.log(f"step {step}/{config.steps} | val bpc {val_bpc:.4f} | "
                     f"{self.stats.tokens_per_s:,.0f} tokens/s")
        if self.writer and config.sample_interval and step % config.sample_interval == 0:
            sample = text_sample(self.model, self.prompt, self.sample_bytes, config, self.device)
            self.writer.add_text("sample", sample, step)

    def save(self) -> None:
        """Model, optimiser, data position, every rank's RNG and the counters, as plain values."""
        payload = dict(config=asdict(self.config), step=self.step, model=self.model.state_dict(),
                       optimizer=self.optimizer.state_dict(), loader=self.train_batches.state_dict(),
                       rng=self.ctx.gather(rng_states(self.device)), stats=asdict(self.stats), data=self.data)
        if self.ctx.is_main:
            save_checkpoint(self.ckpt_file, payload)

    def run(self) -> TrainResult:
        """Train to config.steps; Ctrl-C/SIGTERM stop after the current step with a checkpoint.

        Evaluation and sampling are timed apart from the loop, so tokens/s and the loop overhead
        (time outside forward/backward/optimiser step) describe training alone."""
        config, interrupted = self.config, False
        with StopRequest() as stop:
            while self.step < config.steps:
                step_start = time.perf_counter()
                grad_norm = self.train_step()
                if self.step % config.log_interval == 0 or self.step == config.steps:
                    self.log_train(grad_norm)
                self.bar.update(1)
                excluded_start = time.perf_counter()
                self.evaluate_and_sample()
                excluded = time.perf_counter() - excluded_start
                self.stats.other_seconds += excluded
                self.window_start += excluded
                interrupted = self.ctx.any(stop.requested)
                self.stats.train_seconds += time.perf_counter() - step_start - excluded
                if interrupted or self.step == config.steps or (
                        config.ckpt_interval and self.step % config.ckpt_interval == 0):
                    save_start = time.perf_counter()
                    self.save()
                    self.stats.train_seconds += time.perf_counter() - save_start
                if interrupted:
                    self.log(f"stopped at step {self.step}; checkpoint saved to {self.ckpt_file} "
                             "(continue with --resume)")
                    break
        self.bar.close()
        return self.finish(interrupted)

    def finish(self, interrupted: bool) -> TrainResult:
        stats = self.stats
        result = TrainResult(
            run_name=self.config.run_name, variant=self.config.variant,
            final_val_bpc=stats.val_bpc[-1] if stats.val_bpc else math.nan, best_val_bpc=stats.best_val_bpc,
            tokens_per_s=stats.tokens_per_s, peak_memory_mb=peak_memory_mb(self.device),
            parameters=self.model.num_parameters(), steps=self.step,
            wall_seconds=stats.train_seconds + stats.other_seconds, loop_overhead=stats.loop_overhead,
            seed=self.config.seed, data=self.data, val_steps=list(stats.val_steps),
            val_bpc=list(stats.val_bpc), interrupted=interrupted, model=self.model)
        self.log(f"loop overhead {100 * result.loop_overhead:.1f}% of step time (data, logging, "
                 f"checkpoints; evaluation and sampling, {stats.other_seconds:.1f}s, not counted)")
        if self.writer:
            if not interrupted:
                metrics = {"final_val_bpc": result.final_val_bpc, "best_val_bpc": result.best_val_bpc,
                           "tokens_per_s": result.tokens_per_s, "loop_overhead": result.loop_overhead}
                self.writer.add_hparams(asdict(self.config), {f"hparams/{k}": v for k, v in metrics.items()},
                                        run_name=".")
            self.writer.close()
        self.log(result.summary())
        return result


def train(config: TrainConfig, ctx: Distributed, *, resume: bool = False) -> TrainResult:
    """Train one configuration (resuming its run directory's checkpoint if asked)."""
    return Trainer(config, ctx, resume=resume).run()


# ----------------------------------------------------------------------------- entry point

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    keep_freed_memory()   # large CPU temporaries reuse freed memory instead of page-faulting
    try:
        config = config_from_flags(vars(args))
    except ValueError as error:
        parser.error(str(error))
    try:
        with distributed(config.device) as ctx:
            result = train(config, ctx, resume=args.resume)
    except (DataError, CheckpointError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("aborted without saving a checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_INTERRUPTED if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
