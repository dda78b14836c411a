"""What a run gives: its counters (surviving resumes), its result, and the errors that end it with an exit code."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .checkpoint import CheckpointError
from .data import DataError
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_SIGNAL_BASE, EXIT_USAGE, UsageError, is_out_of_memory
from .files import WriteFailed
from .lm import ByteLM


class RunFailed(RuntimeError):
    """A run that cannot give a finite result (exit 1): nothing of the failing step is saved."""


class TrainingDiverged(RunFailed):
    """The loss, the gradient norm or, after the optimiser step, a weight became non-finite: that
    step is not saved."""


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class RunStats:
    """Counters that survive resumes, so rates and curves cover the whole run."""

    train_seconds: float = 0.0      # training loop time, excluding evaluation and sampling
    compute_seconds: float = 0.0    # forward + backward + optimiser step
    other_seconds: float = 0.0      # evaluation and sampling
    tokens: int = 0
    peak_memory_mb: float = 0.0     # the largest peak of the run's segments (resumes included)
    val_steps: list[int] = field(default_factory=list)
    val_bpc: list[float] = field(default_factory=list)
    # bpc on fixed train windows at each val step, measured as val is (eval mode, same precision), so
    # val_bpc - train_bpc is the generalisation gap; None where a run from before it was resumed.
    train_bpc: list[float | None] = field(default_factory=list)
    val_accuracy: list[float] = field(default_factory=list)   # --task mqar: accuracy at the queries, at val_steps

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "RunStats":
        """The counters saved in a checkpoint, refused unless each has its type (a ValueError)."""
        if "train_bpc" not in state and isinstance(state.get("val_steps"), list):   # saved before it was measured
            state = {**state, "train_bpc": [None] * len(state["val_steps"])}
        stats = cls(**state)
        for spec in fields(cls):
            value = getattr(stats, spec.name)
            if spec.name in ("val_steps", "val_bpc", "val_accuracy"):
                if not isinstance(value, list) or not all(map(_is_number, value)):
                    raise ValueError(f"{spec.name} is {value!r}, not a list of numbers")
            elif spec.name == "train_bpc":
                if not isinstance(value, list) or not all(v is None or _is_number(v) for v in value):
                    raise ValueError(f"{spec.name} is {value!r}, not a list of numbers (or None)")
            elif not _is_number(value) or not 0 <= value < math.inf:
                raise ValueError(f"{spec.name} is {value!r}, not a finite number >= 0")
        for name in ("val_bpc", "train_bpc"):
            if len(stats.val_steps) != len(getattr(stats, name)):
                raise ValueError(f"val_steps and {name} differ in length ({len(stats.val_steps)} and "
                                 f"{len(getattr(stats, name))})")
        return stats

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
    final_val_bpc: float             # the estimate at final_val_step (nan: none yet)
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
    train_bpc: list[float | None] = field(default_factory=list)   # at val_steps, on fixed train windows
    train_bytes: int = 0             # the training split's length: tokens seen / train_bytes = passes over it
    dtype: str = "auto"              # the precision it computed in (fp32, bf16, fp16)
    stop_signal: int = 0             # the signal that stopped the run early, 0 if it finished
    late_signal: int = 0             # a signal that came with the last step (the run finished)
    val_accuracy: float = math.nan   # --task mqar: the last estimate's accuracy at the query positions
    state_size: str = ""             # the decoding state per head and layer (lm.state_size)
    final_val_step: int = 0          # the step of final_val_bpc: `steps` unless the run stopped between estimates
    model: ByteLM | None = None

    @property
    def interrupted(self) -> bool:
        return bool(self.stop_signal)

    def summary(self) -> str:
        recall = (f"val accuracy {self.val_accuracy:.1%} at the queries, last estimate "
                  f"(state {self.state_size}) | " if not math.isnan(self.val_accuracy) else "")
        if not self.val_steps:
            score = "no val estimate yet"
        else:
            at = "" if self.final_val_step == self.steps else f" at step {self.final_val_step}, the last estimate"
            score = f"final val bpc {self.final_val_bpc:.4f}{at} (best {self.best_val_bpc:.4f})"
        return (f"result {self.run_name}: {recall}{score} | {self.tokens_per_s:,.0f} tokens/s | "
                f"wall time {self.wall_seconds:.1f}s | {self.steps} steps | "
                f"peak memory {self.peak_memory_mb:,.0f} MiB")


RUN_ERRORS = (DataError, CheckpointError, UsageError)                    # exit 2: fix the input
RUN_FAILURES = (RunFailed, WriteFailed)   # exit 1: the run failed (so does running out of memory)


def failure_message(error: BaseException) -> str:
    if is_out_of_memory(error):
        return "out of memory: choose a smaller --batch-size, --seq-len or model"
    return str(error)


def exit_code(result: TrainResult) -> int:
    return EXIT_SIGNAL_BASE + result.stop_signal if result.stop_signal else 0


def run_reporting_errors(run: Callable[[], int]) -> int:
    """run()'s exit code, or a one-line message and the exit code of what stopped it: a bad
    setting, file or checkpoint (usage, 2), a failure (1), or Ctrl-C before any checkpoint."""
    try:
        return run()
    except RUN_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (*RUN_FAILURES, RuntimeError, MemoryError) as error:
        if not (isinstance(error, RUN_FAILURES) or is_out_of_memory(error)):
            raise
        print(f"error: {failure_message(error)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("aborted without saving a checkpoint", file=sys.stderr)
        return EXIT_INTERRUPTED
