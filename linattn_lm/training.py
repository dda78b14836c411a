"""Train a byte-level language model on enwik8 with softmax or linear attention: `python train.py`.

A preset sets sizes and schedule; flags given explicitly override it (`python train.py --help`).
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from pathlib import Path
from dataclasses import asdict
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from .checkpoint import (CHECKPOINT_NAME, CheckpointError, check_optimizer_state, load_state, load_weights,
                         save_checkpoint, saved_precision)
from .data import RandomWindows, load_split
from .device import (autocast, gradient_scaler, keep_freed_memory, peak_memory_mb, precision_key, precision_name,
                     release_free_memory, reset_peak_memory)
from .errors import UsageError
from .files import check_writable, remove_stale_temporaries
from .flags import build_parser, parse_config
from . import mqar
from .lm import BITS_PER_NAT, ByteLM, bits_per_byte, lm_loss, state_size
from .process import Distributed, StopRequest, data_parallel, distributed, launched_rank
from .results import RunFailed, RunStats, TrainResult, TrainingDiverged, exit_code, run_reporting_errors
from .resume import load_for_resume, restore_rng, resume_settings, rng_states, schedule_note
from .runlock import DirectoryLock, check_can_write, check_not_nested, enclosing_grid
from .scoring import TRAIN_ESTIMATE_FIRST_BATCH, evaluate
from .settings import TrainConfig
from .text import sample_prompt, text_sample

# fp16: the gradient scaler skips a step whose gradients overflowed and halves its scale.  Now and
# then that is expected; this many skips in a row, or a scale below the floor (the gradients then
# overflow fp16 even unscaled), means no step will be taken again: training stops.
MAX_SKIPPED_STEPS = 20
MIN_LOSS_SCALE = 1.0


# ----------------------------------------------------------------------------- distributed
def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at decay_steps (step counts from 0)."""
    optim = config.optim
    if step < optim.warmup:
        return optim.lr * (step + 1) / optim.warmup
    if step >= optim.decay_steps:
        return optim.min_lr
    progress = (step - optim.warmup) / max(1, optim.decay_steps - optim.warmup)
    return optim.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def make_optimizer(model: ByteLM, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings only, not on biases, norm gains and feature-map
    weights (hedgehog's, taylor's).  A feature map's weights set the sharpness of the attention, as a
    temperature does, rather than carry content: decay would pull them toward 0, the map of uniform
    attention, instead of toward their identity-like initialisation."""
    feature_map_params = {id(p) for fm in model.feature_maps() for p in fm.parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    decays = {id(p): p.dim() >= 2 and id(p) not in feature_map_params for p in params}
    groups = [{"params": [p for p in params if decays[id(p)]], "weight_decay": config.optim.weight_decay},
              {"params": [p for p in params if not decays[id(p)]], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.optim.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


# ----------------------------------------------------------------------------- training


def after_earlier_logs(run_dir: Path) -> None:
    """Wait, if need be, until the second after the run's newest event file began.  TensorBoard reads a
    run's event files in name order, and a name is the second the writer began, then the host, the pid
    and a per-process count compared as text: a resume within that second in the same process (tests,
    notebooks) could sort before the segment it continues ('.10' < '.9') and be read as purged."""
    began = [int(part) for path in run_dir.glob("events.out.tfevents.*")
             if (part := path.name.split(".")[3]).isdigit()]
    wait = max(began, default=0) + 1 - time.time()
    if wait > 0:
        time.sleep(wait)


class Trainer:
    """One run: data, model and optimiser (fresh or from the run's checkpoint), then `run()`."""

    def __init__(self, config: TrainConfig, ctx: Distributed, *, resume: bool):
        if config.optim.batch_size % ctx.world_size:
            raise UsageError(f"batch_size {config.optim.batch_size} must be divisible by the "
                             f"{ctx.world_size} ranks")
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        self.config, self.ctx, self.device = config, ctx, ctx.device
        self.log = tqdm.write if ctx.is_main else (lambda message: None)
        self.run_dir = config.run.run_dir
        self.ckpt_file = self.run_dir / CHECKPOINT_NAME
        release_free_memory()   # so that this run's peak is its own (a grid trains many in one process)
        reset_peak_memory(self.device)
        self._load_data()      # first, so missing or too-small data fails before anything is written
        self.lock = self._lock_run_dir() if ctx.is_main else None
        try:
            checkpoint = load_for_resume(self.ckpt_file, config, self.data) if resume else self._no_checkpoint()
            if ctx.is_main:
                remove_stale_temporaries(self.ckpt_file)
            self._build_model(checkpoint)
            self._open_logs(checkpoint)
        except BaseException:
            if self.lock:
                self.lock.discard()   # a failed start leaves no directory of its own (--resume of no run)
            raise

    def _lock_run_dir(self) -> DirectoryLock:
        """Held until close(): a second run of this directory is refused before it reads or writes
        anything there (the checkpoint's existence included)."""
        # The lock makes the directory (and makes it again should a failing start beside this one
        # remove it), so the write test runs inside it.
        lock = DirectoryLock(self.run_dir)
        try:
            check_writable(self.run_dir)
        except BaseException:
            lock.discard()
            raise
        return lock

    def _load_data(self) -> None:
        config, ctx = self.config, self.ctx
        if config.task.task == "mqar":   # synthetic: the seed is the data, there is no split and no text
            model = config.model
            streams = dict(batch_size=config.optim.batch_size // ctx.world_size, seed=model.seed, rank=ctx.rank,
                           world_size=ctx.world_size, filler=config.task.mqar_filler)
            sizes = (model.vocab_size, model.seq_len, config.task.mqar_kv_pairs)
            self.train_batches = mqar.MqarBatches(*sizes, **streams, stream="train")
            self.val_batches = mqar.MqarBatches(*sizes, **streams, stream="val")
            self.val_split, self.data, self.train_bytes = None, mqar.describe(*sizes, config.task.mqar_filler), 0
            self.log(f"data: {self.data}")
            return
        self.data_dir = str(config.run.data_path)
        train_split, self.val_split = load_split(self.data_dir, "train"), load_split(self.data_dir, "val")
        windows = dict(batch_size=config.optim.batch_size // ctx.world_size, seq_len=config.model.seq_len,
                       seed=config.model.seed, rank=ctx.rank, world_size=ctx.world_size)
        self.train_batches = RandomWindows(train_split, **windows)
        self.val_batches = RandomWindows(self.val_split, **windows)
        self.data, self.train_bytes = train_split.description, len(train_split)
        self.log(f"data: {self.data} from {self.data_dir} "
                 f"(train {len(train_split):,} bytes, val {len(self.val_split):,})")

    def _no_checkpoint(self) -> None:
        if self.ckpt_file.is_dir():
            raise CheckpointError(f"{self.ckpt_file} is a directory, where this run would write its checkpoint: "
                                  "move it away, or choose another --run-name / --out-dir")
        if self.ckpt_file.exists():
            raise CheckpointError(f"{self.ckpt_file} exists: pass --resume to continue that run, or choose "
                                  "another --run-name / --out-dir (or delete the directory)")

    def _build_model(self, checkpoint: dict[str, Any] | None) -> None:
        config, ctx = self.config, self.ctx
        torch.manual_seed(config.model.seed)   # identical initial weights on every rank
        self.model = ByteLM(config.model).to(self.device)
        self.optimizer = make_optimizer(self.model, config, self.device)
        self.dtype = self._run_precision(checkpoint)
        self.scaler = gradient_scaler(self.device, self.dtype)
        self.stats, self.step, self.saved_step, self.resumed_step = RunStats(), 0, None, None
        self.saved_step_went_on = False   # whether a step from the saved weights was finite
        self.skipped_steps = 0            # fp16 steps skipped in a row by the gradient scaler
        self.loss_sum, self.loss_count = torch.zeros((), device=self.device), 0
        if checkpoint is None:
            torch.manual_seed(config.model.seed + 1 + ctx.rank)   # per-rank dropout masks
        else:
            path = self.ckpt_file
            if checkpoint["step"] > config.optim.steps:
                raise CheckpointError(f"{path} is at step {checkpoint['step']}, past --steps {config.optim.steps}: "
                                      f"there is nothing to train; pass --steps {checkpoint['step']} to score it "
                                      f"again, more to go on, or another --run-name")
            load_weights(self.model, checkpoint["model"], path)
            check_optimizer_state(checkpoint["optimizer"], self.optimizer, self.model, path, checkpoint["step"])
            load_state(path, "optimizer", lambda: self.optimizer.load_state_dict(checkpoint["optimizer"]))
            if checkpoint.get("scaler"):   # fp16 runs save their loss scale (checkpoints before --dtype: none)
                load_state(path, "scaler", lambda: self.scaler.load_state_dict(checkpoint["scaler"]))
            load_state(path, "loader", lambda: self.train_batches.load_state_dict(checkpoint["loader"]))
            load_state(path, "rng", lambda: restore_rng(checkpoint["rng"], ctx, config.model.seed))
            load_state(path, "stats", lambda: setattr(self, "stats", RunStats.from_state(checkpoint["stats"])))
            load_state(path, "log_window", lambda: self._restore_log_window(checkpoint["log_window"]))
            self.step = self.saved_step = self.resumed_step = checkpoint["step"]
            self.log(f"resumed {self.ckpt_file} at step {self.step}")
            saved_steps = checkpoint["config"]["optim"]["steps"]
            if config.optim.steps > saved_steps:
                self.log(schedule_note(saved_steps, config))
        self.compiled = torch.compile(self.model) if config.run.compile else self.model
        self.trainable = data_parallel(self.compiled) if ctx.world_size > 1 else self.compiled
        model = config.model
        self.log(f"model: {model.variant}, {self.model.num_parameters():,} parameters, {model.n_layer} "
                 f"layers x {model.d_model} wide, {model.n_head} heads; device {self.device}, "
                 f"{ctx.world_size} process(es), {precision_name(self.dtype, self.device)}")

    def _run_precision(self, checkpoint: dict[str, Any] | None) -> str:
        """--dtype resolved on this device (fp32, bf16, fp16).  A resumed run keeps the precision it
        started in: --dtype auto resolves by device (bf16 on CUDA, fp32 elsewhere), and the device may
        change on --resume while the precision, which changes what the optimiser computes, may not
        (an explicit --dtype that differs is refused with the other settings)."""
        here = precision_key(self.config.run.dtype, self.device)
        saved = saved_precision(checkpoint, self.ckpt_file) if checkpoint is not None else None
        if saved is None or saved == here:
            return here
        self.log(f"--dtype {self.config.run.dtype}: continuing in {saved}, the precision this run started in "
                 f"(here {self.config.run.dtype} would mean {here})")
        return saved

    def _restore_log_window(self, window: dict[str, Any]) -> None:
        """Each rank's open loss sum (log_train adds them up); a job of another size splits their
        total evenly, which gives the same mean.  (Checkpoints before this held rank 0's sum alone.)"""
        sums, count = window["loss_sums"] if "loss_sums" in window else [window["loss_sum"]], window["count"]
        if not isinstance(sums, list) or not sums or not all(isinstance(t, torch.Tensor) and t.numel() == 1
                                                             and t.isfinite().all() for t in sums) \
                or not isinstance(count, int) or count < 0:
            raise ValueError(f"expected one finite one-element loss sum per rank and a count >= 0, got {window}")
        mine = sums[self.ctx.rank] if len(sums) == self.ctx.world_size else sum(sums) / len(sums)
        self.loss_sum, self.loss_count = mine.reshape(()).to(self.device), count

    def _open_logs(self, checkpoint: dict[str, Any] | None) -> None:
        # purge_step hides what a stopped or killed run logged after its last checkpoint.
        if self.ctx.is_main:
            after_earlier_logs(self.run_dir)
        self.writer = SummaryWriter(self.run_dir, purge_step=self.step + 1) if self.ctx.is_main else None
        if self.writer and checkpoint is None:   # a resumed run has them already
            self.writer.add_text("data", self.data, self.step)
            settings = "\n".join(f"    {key} = {value}" for key, value in self.config.flat().items())
            self.writer.add_text("config", settings, self.step)
        self.prompt, self.sample_bytes = (sample_prompt(self.val_split.data, self.config) if self.val_split
                                          else (None, 0))
        self.bar = tqdm(total=self.config.optim.steps, initial=self.step, desc=self.config.run.run_name,
                        dynamic_ncols=True, disable=not (self.ctx.is_main and sys.stderr.isatty()))
        self.window_start = time.perf_counter()

    def scalar(self, tag: str, value: float) -> None:
        if self.writer:
            self.writer.add_scalar(tag, value, self.step)

    def train_step(self) -> torch.Tensor:
        """One optimiser step on the next batch; returns the gradient norm before clipping.  A
        non-finite loss or gradient stops training before the step changes the weights, and a step
        that makes a weight non-finite stops it before anything is saved."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.step, self.config)
        x, y = (t.to(self.device, non_blocking=True) for t in next(self.train_batches))
        compute_start = time.perf_counter()
        with autocast(self.device, self.dtype):
            loss = lm_loss(self.trainable(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.grad_clip or math.inf)
        # fp16: a gradient that overflowed the loss scale is expected now and then; the scaler skips
        # that step and lowers the scale.  Without a scaler it means divergence.
        gradient_ok = torch.isfinite(grad_norm) | torch.tensor(self.scaler.is_enabled(), device=self.device)
        if self.ctx.any(~(torch.isfinite(loss) & gradient_ok)):
            raise self.diverged(f"loss {loss.item():.4g}, gradient norm {grad_norm.item():.4g} (non-finite)"
                                + self.linear_attention_hint())
        self.saved_step_went_on |= self.step == self.saved_step
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.count_skipped_step(scale_before)
        if self.ctx.any(~torch.stack([p.isfinite().all() for p in self.model.parameters()]).all()):
            raise self.diverged("the optimiser step made weights non-finite")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # so the compute timer covers the GPU work
        self.stats.compute_seconds += time.perf_counter() - compute_start
        self.step += 1
        self.stats.tokens += self.config.optim.batch_size * self.config.model.seq_len
        self.loss_sum += loss.detach()
        self.loss_count += 1
        return grad_norm

    def count_skipped_step(self, scale_before: float) -> None:
        """fp16: a step the scaler skipped lowered its scale.  Stops training (TrainingDiverged) after
        MAX_SKIPPED_STEPS skips in a row or once the scale is below MIN_LOSS_SCALE."""
        if not self.scaler.is_enabled():
            return
        scale = self.scaler.get_scale()
        self.skipped_steps = self.skipped_steps + 1 if scale < scale_before else 0
        if self.skipped_steps >= MAX_SKIPPED_STEPS or scale < MIN_LOSS_SCALE:
            raise TrainingDiverged(
                f"training stopped at step {self.step + 1}: the fp16 gradients overflowed in {self.skipped_steps} "
                f"step(s) in a row and the gradient scaler skipped each (loss scale now {scale:.3g}, floor "
                f"{MIN_LOSS_SCALE:g}), so the weights stopped changing; {self.checkpoint_kept()}; train with "
                "--dtype bf16 (or fp32), or lower --lr")

    def diverged(self, what: str) -> TrainingDiverged:
        """The error that stops a run whose step went non-finite; nothing of that step is saved."""
        return TrainingDiverged(f"training stopped at step {self.step + 1}: {what}; {self.checkpoint_kept()}; "
                                f"{self.likely_cause()}")

    def linear_attention_hint(self) -> str:
        """Linear attention checks no input values unless asked (a check reads the GPU): out-of-range
        features (negative, or log-features beyond 1/eps) come out NaN, so a NaN loss may be that."""
        if self.config.model.attention != "linear":
            return ""
        return ("; linear attention gives NaN for features out of its range (negative, or log-features past "
                "1/eps): rerun with LINATTN_DEBUG=1 to have it name the bad input")

    def checkpoint_kept(self) -> str:
        """A checkpoint is called good only once a step from its weights was finite."""
        if self.saved_step is None:
            return "no checkpoint was written"
        if self.saved_step_went_on:
            return f"the last good checkpoint (step {self.saved_step}) is kept in {self.ckpt_file}"
        return (f"the checkpoint of step {self.saved_step} is kept in {self.ckpt_file}, but the first step from it "
                "was not finite, so it may be damaged")

    def likely_cause(self) -> str:
        """The learning rate only where steps with it were finite before."""
        if self.step == 0:
            model = self.config.model
            suspect = (f"feature map {model.feature_map!r} likely gives non-finite values on the model's inputs"
                       if model.attention == "linear" else "the model's settings likely overflow")
            return f"no update had been made, so the learning rate is not the cause: {suspect}"
        if self.step == self.resumed_step:
            return "it failed at the first step after the resume: use an earlier copy of the checkpoint or start again"
        return "lower --lr"

    def log_train(self, grad_norm: torch.Tensor) -> None:
        """Mean training loss since the last log (over all ranks), lr, gradient norm, tokens/s.  The
        window restarts at multiples of log_interval only, so a run stopped and resumed elsewhere
        logs the same means as one that was not."""
        summed = self.ctx.sum(self.loss_sum.clone())
        mean_loss = (summed / (self.loss_count * self.ctx.world_size)).item()
        tokens = self.loss_count * self.config.optim.batch_size * self.config.model.seq_len
        self.scalar("train/loss", mean_loss)
        self.scalar("train/bpc", bits_per_byte(mean_loss))
        self.scalar("lr", self.optimizer.param_groups[0]["lr"])
        self.scalar("grad_norm", grad_norm.item())
        self.scalar("tokens_per_s", tokens / (time.perf_counter() - self.window_start))
        self.bar.set_postfix(loss=f"{mean_loss:.3f}", bpc=f"{bits_per_byte(mean_loss):.3f}")
        if self.step % self.config.log.log_interval == 0:
            self.loss_sum.zero_()
            self.loss_count, self.window_start = 0, time.perf_counter()

    def evaluate_and_sample(self) -> None:
        config, step = self.config, self.step
        if step % config.log.eval_interval == 0 or step == config.optim.steps:
            if config.task.task == "mqar":   # the task's scorer: bits per query and accuracy at the queries
                val_bpc, accuracy = mqar.evaluate_queries(self.compiled, self.val_batches, config, self.ctx, self.dtype)
                train_bpc, _ = mqar.evaluate_queries(self.compiled, self.train_batches, config, self.ctx, self.dtype,
                                                first_batch=TRAIN_ESTIMATE_FIRST_BATCH)
                self.stats.val_accuracy.append(accuracy)
                self.scalar("val/accuracy", accuracy)
                self.log(f"step {step}: val accuracy {accuracy:.1%} at the queries")
            else:
                val_bpc = evaluate(self.compiled, self.val_batches, config, self.ctx, self.dtype)
                train_bpc = evaluate(self.compiled, self.train_batches, config, self.ctx, self.dtype,
                                     first_batch=TRAIN_ESTIMATE_FIRST_BATCH)
            if not (math.isfinite(val_bpc) and math.isfinite(train_bpc)):
                raise RunFailed(f"training stopped at step {step}: the model's estimates are not finite (val bpc "
                                f"{val_bpc}, train bpc {train_bpc}) although its training loss was, so its outputs "
                                f"overflow in eval mode (a feature map that differs there?); this step is not saved, "
                                f"{self.checkpoint_kept()}")
            self.stats.val_steps.append(step)
            self.stats.val_bpc.append(val_bpc)
            self.stats.train_bpc.append(train_bpc)
            self.scalar("val/loss", val_bpc / BITS_PER_NAT)
            self.scalar("val/bpc", val_bpc)
            self.scalar("train_windows/bpc", train_bpc)
            self.scalar("val/gap_to_train_bpc", val_bpc - train_bpc)
            if self.train_bytes:   # mqar's data never repeats
                self.scalar("passes", self.passes)
            speed = self.stats.tokens_per_s   # nan until a step's time is counted (right after the first)
            self.log(f"step {step}/{config.optim.steps} | val bpc {val_bpc:.4f} | train bpc {train_bpc:.4f} "
                     + (f"| {self.passes:.2f} passes" if self.train_bytes else "| new data every step")
                     + (f" | {speed:,.0f} tokens/s" if math.isfinite(speed) else ""))
        if (self.writer and self.prompt is not None   # mqar has no text to sample
                and config.log.sample_interval and step % config.log.sample_interval == 0):
            sample = text_sample(self.model, self.prompt, self.sample_bytes, config.model.seed, self.device,
                                 self.dtype)
            self.writer.add_text("sample", sample, step)

    @property
    def passes(self) -> float:
        """Passes over the training split so far: the bytes of the windows trained on / its length."""
        return self.step * self.config.optim.batch_size * self.config.model.seq_len / self.train_bytes

    def save(self) -> None:
        """Model, optimiser, data position, every rank's RNG, the counters and the open log window."""
        self.stats.peak_memory_mb = max(self.stats.peak_memory_mb, peak_memory_mb(self.device))
        payload = dict(config=asdict(self.config), step=self.step, model=self.model.state_dict(),
                       optimizer=self.optimizer.state_dict(), scaler=self.scaler.state_dict(), precision=self.dtype,
                       loader=self.train_batches.state_dict(),
                       rng=self.ctx.gather(rng_states(self.device)), stats=asdict(self.stats), data=self.data,
                       log_window={"loss_sums": self.ctx.gather(self.loss_sum.cpu().clone()),
                                   "count": self.loss_count})
        if self.ctx.is_main:
            save_checkpoint(self.ckpt_file, payload)
        self.saved_step, self.saved_step_went_on = self.step, False

    def run(self) -> TrainResult:
        """Train to steps; Ctrl-C/SIGTERM stop after the current step with a checkpoint.

        Evaluation and sampling are timed apart from the loop, so tokens/s and the loop overhead
        (time outside forward/backward/optimiser step) describe training alone."""
        config, stop_signal, late_signal = self.config, 0, 0
        with StopRequest() as stop:
            while self.step < config.optim.steps:
                step_start = time.perf_counter()
                grad_norm = self.train_step()
                if self.step % config.log.log_interval == 0 or self.step == config.optim.steps:
                    self.log_train(grad_norm)
                self.bar.update(1)
                excluded_start = time.perf_counter()
                self.evaluate_and_sample()
                excluded = time.perf_counter() - excluded_start
                self.stats.other_seconds += excluded
                self.window_start += excluded
                if self.ctx.any(stop.requested):
                    received = stop.signum or signal.SIGINT   # another rank's signal
                    if self.step < config.optim.steps:
                        stop_signal = received
                    else:   # it came with the last step or evaluation: the run is complete
                        late_signal = received
                self.stats.train_seconds += time.perf_counter() - step_start - excluded
                if stop_signal or self.step == config.optim.steps or (
                        config.log.ckpt_interval and self.step % config.log.ckpt_interval == 0):
                    save_start = time.perf_counter()
                    with stop.whole_save():
                        self.save()
                    self.stats.train_seconds += time.perf_counter() - save_start
                if stop_signal:
                    self.log(f"stopped at step {self.step}; checkpoint saved to {self.ckpt_file} "
                             "(continue with --resume)")
                    break
        self.bar.close()
        if late_signal:
            self.log(f"{signal.Signals(late_signal).name} came with the last step: the run is complete")
        result = self.finish(int(stop_signal))
        result.late_signal = int(late_signal)
        return result

    def finish(self, stop_signal: int) -> TrainResult:
        stats, config = self.stats, self.config
        result = TrainResult(
            run_name=config.run.run_name, variant=config.model.variant,
            final_val_bpc=stats.val_bpc[-1] if stats.val_bpc else math.nan, best_val_bpc=stats.best_val_bpc,
            final_val_step=stats.val_steps[-1] if stats.val_steps else 0,
            tokens_per_s=stats.tokens_per_s,
            peak_memory_mb=stats.peak_memory_mb,   # every run ends with a save, which updates it
            parameters=self.model.num_parameters(), steps=self.step,
            wall_seconds=stats.train_seconds + stats.other_seconds, loop_overhead=stats.loop_overhead,
            seed=config.model.seed, data=self.data, val_steps=list(stats.val_steps),
            val_bpc=list(stats.val_bpc), train_bpc=list(stats.train_bpc), train_bytes=self.train_bytes,
            dtype=self.dtype, stop_signal=stop_signal, model=self.model,
            val_accuracy=stats.val_accuracy[-1] if stats.val_accuracy else math.nan,
            state_size=state_size(config.model))
        self.log(f"loop overhead {100 * result.loop_overhead:.1f}% of step time (data, logging, "
                 f"checkpoints; evaluation and sampling, {stats.other_seconds:.1f}s, not counted)")
        if self.writer:
            if not stop_signal:
                metrics = {"final_val_bpc": result.final_val_bpc, "best_val_bpc": result.best_val_bpc,
                           "tokens_per_s": result.tokens_per_s, "loop_overhead": result.loop_overhead}
                if not math.isnan(result.val_accuracy):
                    metrics["val_accuracy"] = result.val_accuracy
                hparams = {key: value if isinstance(value, (int, float, str, bool)) else str(value)
                           for key, value in config.flat().items()}
                self.writer.add_hparams(hparams, {f"hparams/{k}": v for k, v in metrics.items()}, run_name=".")
            self.writer.close()
        self.log(result.summary())
        return result

    def close(self) -> None:
        """Flush the logs (of a run that stopped on an error, too) and let go of the run directory."""
        self.bar.close()
        if self.writer:
            self.writer.close()
        if self.lock:
            self.lock.release()


def train(config: TrainConfig, ctx: Distributed, *, resume: bool = False) -> TrainResult:
    """Train one configuration (resuming its run directory's checkpoint if asked)."""
    trainer = Trainer(config, ctx, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()


# ----------------------------------------------------------------------------- entry point

def main(argv: list[str] | None = None) -> int:
    args, config = parse_config(build_parser(), argv, resume=resume_settings)
    keep_freed_memory()   # large CPU temporaries reuse freed memory instead of page-faulting

    def run() -> int:
        if not args.resume:   # a run resumed is where it started; grid.py starts its runs in its grid itself
            check_not_nested(config.run.run_dir, itself=True)
        if launched_rank() == 0:   # the job's other ranks write nothing there
            check_can_write(config.run.run_dir)
        # A grid's run trained further here: its grid is locked meanwhile, as grid.py locks it, so that the
        # grid cannot train or score the run at the same time (an unlocked grid is locked, and left as it was).
        grid_dir = enclosing_grid(config.run.run_dir) if args.resume and launched_rank() == 0 else None
        with DirectoryLock(grid_dir, created=[]) if grid_dir else contextlib.nullcontext():
            with distributed(config.run.device) as ctx:
                return exit_code(train(config, ctx, resume=args.resume))
    return run_reporting_errors(run)


