"""How it is measured: timers, peak memory, one fresh process per config, and the time budget.

By default nothing here changes process-wide settings (allocator, environment): each config runs as a
user who imports the library gets it.  A child takes `torch.set_num_threads` when --threads asks for it,
and glibc's keep-freed-memory setting (train.py's) when --keep-freed-memory does.
"""
from __future__ import annotations

import math
import multiprocessing
import statistics
import time
import traceback
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from linattn_lm.device import keep_freed_memory, peak_memory_mb, release_free_memory, reset_peak_memory

SLOW_RUN_S = 1.0               # runs longer than this are timed at most SLOW_RUN_REPEATS times
SLOW_RUN_REPEATS = 3
MEMORY_HEADROOM = 0.7          # skip configs predicted to need more than this share of free memory
MB = 2 ** 20


def time_call(call: Callable[[], object], device: torch.device) -> float:
    """Seconds one call takes: CUDA events around it on a GPU, wall time on CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def interleaved_samples(calls: dict[Any, Callable[[], object]], *, repeats: int, warmup: int,
                        device: torch.device) -> dict[Any, list[float]]:
    """Times in seconds of each call, run round-robin so that a slow spell of a shared machine
    hits every call alike; `warmup` rounds are run first and discarded."""
    samples: dict[Any, list[float]] = {key: [] for key in calls}
    for round_index in range(warmup + repeats):
        for key, call in calls.items():
            seconds = time_call(call, device)
            if round_index >= warmup:
                samples[key].append(seconds)
    return samples


class Timing(NamedTuple):
    seconds: float   # the median
    repeats: int     # how many runs were timed


def median_time(call: Callable[[], object], *, repeats: int, warmup: int, device: torch.device) -> Timing:
    """Median of `repeats` runs after `warmup` untimed ones.  When the last warm-up run (without
    warm-up: the first timed run) took over SLOW_RUN_S, at most SLOW_RUN_REPEATS runs are timed:
    such runs are long enough that noise is small relative to them, and they dominate the length of
    a full sweep."""
    slow = bool(warmup) and interleaved_samples({0: call}, repeats=warmup, warmup=0, device=device)[0][-1] > SLOW_RUN_S
    samples: list[float] = []
    while len(samples) < (min(repeats, SLOW_RUN_REPEATS) if slow else repeats):
        samples.append(time_call(call, device))
        slow = slow or samples[0] > SLOW_RUN_S
    return Timing(statistics.median(samples), len(samples))


def one_call_peak(call: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """(bytes resident before, peak bytes above that) of one call of its own.  On CPU the heap's free
    memory goes back to the OS first: glibc keeps what earlier calls freed (its mmap threshold rises
    after the first large free), which would otherwise count toward, or hide, this call's peak, the
    more so the more often it was called (SDPA at N=8192: 83 MB for one call, 160 MB after five)."""
    release_free_memory()
    memory = PeakMemory(device)
    call()
    return memory.baseline, memory.peak_above_baseline()


class _Saved:
    """What a node keeps in place of a saved tensor while it is measured: its storage and view, with no
    reference back to the graph (a tensor saved by its own node would otherwise never be freed).  For
    counting: a conjugate or negative view's lazy bit is not restored, so no backward should run on it."""

    def __init__(self, tensor: torch.Tensor):
        self.storage = tensor.untyped_storage()
        self.view = (tensor.dtype, tensor.storage_offset(), tensor.shape, tensor.stride())

    def tensor(self) -> torch.Tensor:
        dtype, offset, shape, stride = self.view
        return torch.empty(0, dtype=dtype, device=self.storage.device).set_(self.storage, offset, shape, stride)


def kept_for_backward(forward: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """The tensors autograd keeps for backward of `forward()` (inputs it saves included), once forward
    has returned: a node that only forward's own temporaries referred to is freed by then, and what it
    saved does not count."""
    saved: list[weakref.ref] = []

    def pack(tensor: torch.Tensor) -> _Saved:
        held = _Saved(tensor)
        saved.append(weakref.ref(held))
        return held

    with torch.autograd.graph.saved_tensors_hooks(pack, _Saved.tensor):
        output = forward()
    kept = [held.tensor() for ref in saved if (held := ref()) is not None]
    del output
    return kept


def saved_tensor_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for backward of `forward()` (`kept_for_backward`):
    a deterministic measure of activation memory, free of allocator and OS noise."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept_for_backward(forward)}
    return sum(storages.values())


class PeakMemory:
    """Peak memory above a baseline taken at construction: VmHWM on CPU (the process's own peak
    RSS, so run one config per fresh process), max_memory_allocated on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        reset_peak_memory(device)
        self.baseline = int(peak_memory_mb(device) * MB)

    def peak_above_baseline(self) -> int:
        return int(peak_memory_mb(self.device) * MB) - self.baseline


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


# ---------------------------------------------------------------------------------------------
# One fresh process per config
# ---------------------------------------------------------------------------------------------

def child_main(run_task: Callable[[dict], dict], task: dict, connection, keep_freed: bool = False) -> None:
    """Entry point of a forked child: run one task and send back its result dict (or an error)."""
    start = time.perf_counter()
    try:
        if keep_freed and not keep_freed_memory():
            raise RuntimeError("--keep-freed-memory needs glibc's mallopt, which this system lacks")
        if task["threads"]:
            torch.set_num_threads(task["threads"])
        torch.manual_seed(0)
        result = run_task(task)
        result["elapsed_s"] = time.perf_counter() - start
    except Exception as error:   # reported in the table instead of ending the whole sweep
        result = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:200],
                  "traceback": traceback.format_exc()}
    connection.send(result)
    connection.close()


class ChildRunner:
    """Runs each task in a fresh process forked from a server that has imported torch and linattn
    once (a plain subprocess would pay ~5 s of imports per config)."""

    def __init__(self, *, keep_freed_memory: bool = False) -> None:
        self.keep_freed = keep_freed_memory
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "linattn", "benchmarks.sections", "benchmarks.block",
                                             "benchmarks.kernels"])

    def run(self, run_task: Callable[[dict], dict], task: dict, timeout_s: float) -> dict:
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(target=child_main, args=(run_task, task, sender, self.keep_freed),
                                       daemon=True)
        start = time.perf_counter()
        process.start()
        sender.close()
        result = self._receive(receiver, process, timeout_s)
        result["wall_s"] = time.perf_counter() - start
        return result

    @staticmethod
    def _receive(receiver, process, timeout_s: float) -> dict:
        try:
            if receiver.poll(timeout_s):
                result = receiver.recv()
                process.join()
                return result
            error = f"timed out after {timeout_s:.0f} s"
        except EOFError:   # the child died without answering: usually the OOM killer
            process.join()
            error = f"child process died (exit code {process.exitcode}; out of memory?)"
        if process.is_alive():
            process.kill()
            process.join()
        return {"error": error}


# ---------------------------------------------------------------------------------------------
# Budget: predict a config's cost from the same method at the previous N
# ---------------------------------------------------------------------------------------------

@dataclass
class History:
    """Measured (N, seconds that grow with N, peak bytes) of one method, to extrapolate to the next N:
    the time of the timed calls (`run_budgeted`), not the child's one-time costs (a Triton compile)."""
    assume_quadratic: bool
    points: list[tuple[int, float, float]] = field(default_factory=list)
    failure: str | None = None     # once a config fails, larger N are not attempted

    def _slope(self, index: int, quadratic_default: float) -> float:
        if len(self.points) < 2:
            return quadratic_default
        (n0, *a), (n1, *b) = self.points[-2], self.points[-1]
        if a[index] <= 0 or b[index] <= 0:
            return quadratic_default
        # Clamp: at small N fixed overheads flatten the slope, and no method here is worse than N^2.
        return min(max(math.log(b[index] / a[index]) / math.log(n1 / n0), 1.0), 2.0)

    def predict(self, n: int) -> tuple[float, float] | None:
        """(seconds, peak bytes) predicted at N, or None before the first measurement."""
        if not self.points:
            return None
        n_last, seconds, peak = self.points[-1]
        time_slope = 2.0 if self.assume_quadratic else self._slope(0, 1.0)
        memory_slope = self._slope(1, 2.0 if self.assume_quadratic else 1.0)
        growth = n / n_last
        return seconds * growth ** time_slope, peak * growth ** memory_slope


def skip_reason(history: History, n: int, budget_s: float, free_bytes: int) -> str | None:
    prediction = history.predict(n)
    if prediction is None:
        return None
    seconds, peak = prediction
    if seconds > budget_s:
        return f"skipped: predicted {seconds:.1f} s > budget {budget_s:.0f} s"
    if peak > MEMORY_HEADROOM * free_bytes:
        return (f"skipped: predicted peak {peak / MB:.0f} MB > {MEMORY_HEADROOM:.0%} of "
                f"{free_bytes / MB:.0f} MB available")
    return None


def child_timeout(budget_s: float) -> float:
    """A child may overrun its prediction (noise, slope change) but not forever."""
    return max(60.0, 4 * budget_s)


def run_budgeted(runner: ChildRunner, run_task: Callable[[dict], dict], task: dict, history: History,
                 n: int, budget_s: float, device: torch.device, peak_key: str) -> dict:
    """Run `task` unless the method already failed or its prediction breaks the budget."""
    if history.failure:
        return {"skipped": f"skipped: {history.failure}"}
    reason = skip_reason(history, n, budget_s, available_memory_bytes(device))
    if reason:
        return {"skipped": reason}
    result = runner.run(run_task, task, child_timeout(budget_s))
    if "error" in result:
        history.failure = f"failed at N={n}"
    else:
        history.points.append((n, scaling_seconds(result, task), result.get(peak_key, 0)))
    return result


def scaling_seconds(result: dict, task: dict) -> float:
    """The part of a child's time that grows with N: each pass's median times the calls made of it
    (warm-up, timed, and the memory and saved-tensor calls).  What is left of elapsed_s (imports,
    priming, a kernel compile at the first call) does not grow, and is not extrapolated."""
    passes = [(result[f"{name}_s"], result.get(f"{name}_repeats", task.get("repeats", 1)))
              for name in ("forward", "train") if f"{name}_s" in result]
    if not passes:
        return result["elapsed_s"]
    return sum(seconds * (repeats + task.get("warmup", 0) + 2) for seconds, repeats in passes)
