"""Benchmarks for linattn: attention-level scaling, matmul efficiency, decoding and LM throughput.

    python bench.py                 # full run on CUDA when available, else CPU (~15 min on 2 cores)
    python bench.py --quick         # smoke run: N <= 2048, few repeats, tiny budget
    python bench.py --sections attention,efficiency --methods "favor+post causal" --lengths 4096,32768

Sections (--sections, comma-separated):
  attention   forward and forward+backward time and peak memory vs N for torch SDPA, xformers (CUDA),
              every registered linattn feature map with RoPE post/none, and performer-pytorch;
              log-log slopes, crossover with SDPA, speed-up over performer, JSON and a PNG plot.
  efficiency  achieved GFLOP/s of the causal favor+post path next to the measured fp32 matmul peak.
  decode      per-token `step` latency at 1k..32k context: LinearAttention state vs softmax KV cache.
  model       training tokens/s of the byte-level LM (models/lm.py), softmax vs favor+post.

Every measurement runs in a fresh process forked from a server that has already imported torch and
linattn, so each config starts from a clean allocator and its own peak-RSS counter (VmHWM) without
paying the ~5 s import again.  Times are medians over --repeats runs after --warmup runs; a config
whose time, extrapolated from the same method at the previous N, exceeds --budget-s is skipped and
says so.  On a shared machine use --threads 1: two OpenMP threads that wait for each other's time
slice at every op make 2-thread timings erratic there.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import math
import multiprocessing
import os
import platform
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

import linattn
from linattn.feature_maps import FEATURE_MAPS
from linattn.functional import DEFAULT_CHUNK_SIZE
from models.lm import ByteLM, ModelConfig, lm_loss
from models.runtime import autocast, keep_freed_memory, peak_memory_mb, reset_peak_memory, resolve_device, write_atomically

SECTIONS = ("attention", "efficiency", "decode", "model")
FULL_LENGTHS = tuple(2 ** p for p in range(8, 16))          # 256 .. 32768
QUICK_LENGTHS = (256, 1024, 2048)
FULL_DECODE_CONTEXTS = tuple(1024 * 2 ** p for p in range(6))   # 1k .. 32k
QUICK_DECODE_CONTEXTS = (1024, 2048)
FULL_MODEL_CONTEXTS = (256, 1024, 4096)
QUICK_MODEL_CONTEXTS = (128, 256)
QUADRATIC_METHODS = ("sdpa", "xformers", "performer")   # budget assumes time ~ N^2 for these
SLOPE_FIT_MIN_N = 4096
TARGET_SLOPE_SPAN = (4096, 32768)
SLOW_RUN_S = 1.0               # runs longer than this are timed at most SLOW_RUN_REPEATS times
SLOW_RUN_REPEATS = 3
MEMORY_HEADROOM = 0.7          # skip configs predicted to need more than this share of free memory
MB = 2 ** 20


# ---------------------------------------------------------------------------------------------
# What is measured
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """Attention inputs q, k, v of shape (batch, heads, N, head_dim); M features for favor."""
    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    num_features: int = 256


@dataclass(frozen=True)
class Method:
    """One attention implementation at one causality; `feature_map` is set for linattn methods."""
    name: str
    causal: bool
    feature_map: str | None = None
    rope: str = "none"

    @property
    def label(self) -> str:
        return f"{self.name} {'causal' if self.causal else 'non-causal'}"

    @property
    def is_linear(self) -> bool:
        return self.feature_map is not None


def linear_method(feature_map: str, rope: str, causal: bool) -> Method:
    return Method(f"{feature_map}+{rope}", causal, feature_map, rope)


def attention_methods(include_xformers: bool) -> list[Method]:
    methods = []
    for causal in (True, False):
        methods.append(Method("sdpa", causal))
        if include_xformers:
            methods.append(Method("xformers", causal))
        methods += [linear_method(fm, rope, causal)
                    for fm in linattn.available_feature_maps() for rope in ("post", "none")]
        methods.append(Method("performer", causal))
    return methods


def xformers_skip_reason(device: torch.device) -> str | None:
    """Why xformers cannot be benchmarked here, or None when it can."""
    if device.type != "cuda":
        return f"xformers' kernels run on CUDA only (device is {device.type})"
    if importlib.util.find_spec("xformers") is None:
        return "xformers is not installed (pip install 'linattn[xformers]' on a GPU machine)"
    return None


def make_feature_map(name: str, shape: Shape) -> linattn.FeatureMap:
    """A registered map with M = shape.num_features where the map has that option."""
    takes_num_features = "num_features" in inspect.signature(FEATURE_MAPS[name]).parameters
    options = {"num_features": shape.num_features} if takes_num_features else {}
    return linattn.make_feature_map(name, shape.head_dim, **options).eval()


def build_attention(method: Method, shape: Shape, device: torch.device,
                    chunk_size: int = DEFAULT_CHUNK_SIZE) -> Callable[..., torch.Tensor]:
    """attend(q, k, v) -> (B, H, N, D) for `method`; linattn methods include the feature map."""
    if method.is_linear:
        fm = make_feature_map(method.feature_map, shape).to(device)

        def attend_linear(q, k, v):
            return linattn.linear_attention(fm(q, is_query=True), fm(k, is_query=False), v,
                                            causal=method.causal, rotary=method.rope == "post",
                                            chunk_size=chunk_size)
        return attend_linear
    if method.name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=method.causal)
    if method.name == "xformers":
        return _xformers_attention(method.causal)
    if method.name == "performer":
        return _performer_attention(shape, method.causal).to(device)
    raise ValueError(f"unknown attention method {method.name!r}")


def _xformers_attention(causal: bool) -> Callable[..., torch.Tensor]:
    import xformers.ops as xops

    bias = xops.LowerTriangularMask() if causal else None

    def attend(q, k, v):   # xformers takes (B, N, H, D)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return xops.memory_efficient_attention(q, k, v, attn_bias=bias).transpose(1, 2)
    return attend


def _performer_attention(shape: Shape, causal: bool) -> torch.nn.Module:
    from performer_pytorch import FastAttention

    # Its causal path prints a warning about missing CUDA code at construction; the CPU fallback
    # it announces is exactly what is measured, so the message is noise here.
    with contextlib.redirect_stdout(io.StringIO()):
        return FastAttention(dim_heads=shape.head_dim, nb_features=shape.num_features, causal=causal)


def make_inputs(shape: Shape, n: int, device: torch.device, seed: int = 0):
    """q, k, v (B, H, N, D) requiring grad, and a fixed output gradient for backward."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.heads, n, shape.head_dim)
    q, k, v, grad = (torch.randn(size, generator=generator).to(device) for _ in range(4))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def forward_call(attend: Callable, q, k, v) -> Callable[[], None]:
    """Inference forward: no autograd graph is kept."""
    def run() -> None:
        with torch.no_grad():
            attend(q, k, v)
    return run


def train_call(attend: Callable, q, k, v, grad) -> Callable[[], None]:
    """Forward + backward to q, k, v; gradients are dropped first so they never accumulate."""
    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        attend(q, k, v).backward(grad)
    return run


# ---------------------------------------------------------------------------------------------
# How it is measured
# ---------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_samples(calls: dict[Any, Callable[[], object]], *, repeats: int, warmup: int,
                        device: torch.device) -> dict[Any, list[float]]:
    """Wall times in seconds of each call, run round-robin so that a slow spell of a shared
    machine hits every call alike; `warmup` rounds are run first and discarded."""
    samples: dict[Any, list[float]] = {key: [] for key in calls}
    for round_index in range(warmup + repeats):
        for key, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            if round_index >= warmup:
                samples[key].append(time.perf_counter() - start)
    return samples


def median_time(call: Callable[[], object], *, repeats: int, warmup: int,
                device: torch.device) -> float:
    """Median of `repeats` runs after `warmup` untimed ones.  When the last warm-up run took over
    SLOW_RUN_S, at most SLOW_RUN_REPEATS runs are timed: such runs are long enough that noise is
    small relative to them, and they dominate the length of a full sweep."""
    if warmup:
        last_warmup = interleaved_samples({0: call}, repeats=warmup, warmup=0, device=device)[0][-1]
        if last_warmup > SLOW_RUN_S:
            repeats = min(repeats, SLOW_RUN_REPEATS)
    return statistics.median(interleaved_samples({0: call}, repeats=repeats, warmup=0,
                                                 device=device)[0])


def saved_tensor_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd keeps for backward of `forward()` (inputs it saves
    included): a deterministic measure of activation memory, free of allocator and OS noise."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


class PeakMemory:
    """Peak memory above a baseline taken at construction: VmHWM on CPU (the process's own peak
    RSS, so run one config per fresh process), max_memory_allocated on CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        reset_peak_memory(device)
        self.baseline = peak_memory_mb(device)

    def peak_above_baseline(self) -> int:
        return int((peak_memory_mb(self.device) - self.baseline) * MB)


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def loglog_slope(ns: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) against log(N); None with fewer than two usable points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


# ---------------------------------------------------------------------------------------------
# Child processes: one per config
# ---------------------------------------------------------------------------------------------

def prime(attend: Callable, shape: Shape, device: torch.device) -> None:
    """One tiny forward + backward, so that one-time lazy set-up (thread pool, BLAS buffers, CUDA
    kernels) is paid before the memory baseline and not counted as the config's peak."""
    train_call(attend, *make_inputs(shape, 64, device))()


def attention_task(task: dict) -> dict:
    device = torch.device(task["device"])
    method, shape, n = Method(**task["method"]), Shape(**task["shape"]), task["n"]
    repeats, warmup = task["repeats"], task["warmup"]
    attend = build_attention(method, shape, device, task["chunk_size"])
    prime(attend, shape, device)
    q, k, v, grad = make_inputs(shape, n, device)
    memory = PeakMemory(device)
    forward_s = median_time(forward_call(attend, q, k, v), repeats=repeats, warmup=warmup,
                            device=device)
    forward_peak = memory.peak_above_baseline()     # VmHWM only grows: read it before backward
    train_s = median_time(train_call(attend, q, k, v, grad), repeats=repeats, warmup=warmup,
                          device=device)
    return {"forward_s": forward_s, "train_s": train_s, "forward_peak_bytes": forward_peak,
            "train_peak_bytes": memory.peak_above_baseline(), "baseline_bytes": memory.baseline,
            "saved_bytes": saved_tensor_bytes(lambda: attend(q, k, v))}


def matmul_task(task: dict) -> dict:
    device, size = torch.device(task["device"]), task["size"]
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    seconds = median_time(lambda: a @ b, repeats=task["repeats"], warmup=task["warmup"],
                          device=device)
    return {"size": size, "seconds": seconds, "gflops": 2 * size ** 3 / seconds / 1e9}


def decode_block(kind: str, dim: int, heads: int, num_features: int) -> torch.nn.Module:
    if kind == "linear":
        return linattn.LinearAttention(dim, heads, feature_map="favor", rope="post", causal=True,
                                       feature_map_options={"num_features": num_features})
    return linattn.SoftmaxAttention(dim, heads, rope=True, causal=True)


def decode_task(task: dict) -> dict:
    device, context = torch.device(task["device"]), task["context"]
    block = decode_block(task["block"], task["dim"], task["heads"], task["num_features"])
    block = block.to(device).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, context, task["dim"], generator=generator).to(device)
    token = torch.randn(1, task["dim"], generator=generator).to(device)
    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        _, state = block(prompt, return_state=True)
        synchronize(device)
        prefill_s = time.perf_counter() - start
        # Every timed step extends the same state, so the context length stays `context`.
        step_s = median_time(lambda: block.step(token, state), repeats=task["repeats"],
                             warmup=task["warmup"], device=device)
    state_bytes = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
    return {"prefill_s": prefill_s, "step_s": step_s, "state_bytes": state_bytes}


MODEL_KINDS = {"softmax": "softmax + RoPE", "linear": "linear favor+post"}
MODEL_SIZE = {"n_layer": 4, "d_model": 256, "n_head": 4}


def lm_config(kind: str, context: int, num_features: int):
    """The same small LM with softmax or favor+post attention (models/lm.py)."""

    if kind == "softmax":
        return ModelConfig(**MODEL_SIZE, seq_len=context, attention="softmax", feature_map="",
                           rope="post", num_features=0, redraw_interval=0)
    return ModelConfig(**MODEL_SIZE, seq_len=context, attention="linear", feature_map="favor",
                       rope="post", num_features=num_features)


def model_task(task: dict) -> dict:

    device, context = torch.device(task["device"]), task["context"]
    model = ByteLM(lm_config(task["model"], context, task["num_features"])).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = max(1, task["tokens"] // context)
    data = torch.randint(256, (batch, context + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = data[:, :-1].to(device), data[:, 1:].to(device)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device):    # the precision train.py uses: fp32 on CPU, bf16 on CUDA
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    memory = PeakMemory(device)
    step_s = median_time(train_step, repeats=task["repeats"], warmup=1, device=device)
    return {"step_s": step_s, "batch": batch, "tokens_per_step": batch * context,
            "tokens_per_s": batch * context / step_s, "peak_bytes": memory.peak_above_baseline(),
            "parameters": model.num_parameters()}


TASKS: dict[str, Callable[[dict], dict]] = {
    "attention": attention_task, "matmul": matmul_task, "decode": decode_task, "model": model_task,
}


def child_main(task: dict, connection) -> None:
    """Entry point of a forked child: run one task and send back its result dict (or an error)."""
    start = time.perf_counter()
    keep_freed_memory()   # the forkserver is a fresh process: set the allocator in each child
    try:
        torch.set_num_threads(task["threads"])
        torch.manual_seed(0)
        result = TASKS[task["kind"]](task)
        result["elapsed_s"] = time.perf_counter() - start
    except Exception as error:   # reported in the table instead of killing the whole sweep
        result = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:200],
                  "traceback": traceback.format_exc()}
    connection.send(result)
    connection.close()


class ChildRunner:
    """Runs each task in a fresh process forked from a server that has imported torch and linattn
    once (a plain subprocess would pay ~5 s of imports per config)."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torch", "linattn", "performer_pytorch"])

    def run(self, task: dict, timeout_s: float) -> dict:
        receiver, sender = self.context.Pipe(duplex=False)
        process = self.context.Process(target=child_main, args=(task, sender), daemon=True)
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
    """Measured (N, seconds in the child, peak bytes) of one method, to extrapolate to the next N.
    The child's own time leaves out process start-up, which does not grow with N."""
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


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------

@dataclass
class Settings:
    sections: tuple[str, ...]
    device: torch.device
    threads: int
    lengths: tuple[int, ...]
    methods: tuple[str, ...]
    shape: Shape
    chunk_size: int
    repeats: int
    warmup: int
    budget_s: float
    decode_contexts: tuple[int, ...]
    decode_steps: int
    model_contexts: tuple[int, ...]
    model_tokens: int
    model_steps: int
    json_path: Path
    plot_path: Path | None


def int_list(text: str) -> tuple[int, ...]:
    """'1024,256,1024' -> (256, 1024): sweeps run small to large, which the budget relies on."""
    values = sorted({int(item) for item in text.split(",") if item.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return tuple(values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark linattn: attention scaling, efficiency, decoding, LM throughput. "
                    "Defaults in [brackets]; --quick changes those marked 'quick'.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N in 256,1024,2048, 2 repeats, 10 s budget, short decode/model runs")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of sections [%(default)s]")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: cuda when available, else cpu [%(default)s]")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads [all CPUs this process may use]")
    parser.add_argument("--lengths", type=int_list, default=None,
                        help="comma-separated sequence lengths N [256,512,..,32768; quick: 256,1024,2048]")
    parser.add_argument("--methods", default="",
                        help="comma-separated substrings; keep only attention methods whose label "
                             "contains one, e.g. 'favor+post,sdpa causal' [all]")
    parser.add_argument("--batch", type=int, default=1, help="attention batch b [%(default)s]")
    parser.add_argument("--heads", type=int, default=8, help="attention heads h [%(default)s]")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension D [%(default)s]")
    parser.add_argument("--num-features", type=int, default=256,
                        help="random features M of favor and performer [%(default)s]")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE,
                        help="chunk C of the causal linear path [linattn's default, %(default)s]")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"timed runs per config and pass, at most {SLOW_RUN_REPEATS} for runs "
                             f"over {SLOW_RUN_S:.0f} s [5; quick: 2]")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed runs before timing [%(default)s]")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip a config whose predicted time exceeds this many seconds [90; quick: 10]")
    parser.add_argument("--decode-contexts", type=int_list, default=None,
                        help="context lengths for the decode section [1024,2048,..,32768; quick: 1024,2048]")
    parser.add_argument("--decode-steps", type=int, default=None, help="timed decode steps [30; quick: 10]")
    parser.add_argument("--model-contexts", type=int_list, default=None,
                        help="LM context lengths [256,1024,4096; quick: 128,256]")
    parser.add_argument("--model-tokens", type=int, default=None,
                        help="LM tokens per training batch, the same at every context [4096; quick: 256]")
    parser.add_argument("--model-steps", type=int, default=None,
                        help="timed LM optimizer steps [3; quick: 2]")
    parser.add_argument("--json", default="bench_results/attention.json",
                        help="where to write all results as JSON, atomically [%(default)s]")
    parser.add_argument("--plot", default="bench_results/scaling.png",
                        help="where to write the scaling plot; '' for none [%(default)s]")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> Settings:
    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {','.join(SECTIONS)}")
    return Settings(
        sections=sections, device=resolve_device(args.device),
        threads=args.threads or len(os.sched_getaffinity(0)),
        lengths=pick(args.lengths, FULL_LENGTHS, QUICK_LENGTHS),
        methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()),
        shape=Shape(args.batch, args.heads, args.head_dim, args.num_features),
        chunk_size=args.chunk_size, repeats=pick(args.repeats, 5, 2), warmup=args.warmup,
        budget_s=pick(args.budget_s, 90.0, 10.0),
        decode_contexts=pick(args.decode_contexts, FULL_DECODE_CONTEXTS, QUICK_DECODE_CONTEXTS),
        decode_steps=pick(args.decode_steps, 30, 10),
        model_contexts=pick(args.model_contexts, FULL_MODEL_CONTEXTS, QUICK_MODEL_CONTEXTS),
        model_tokens=pick(args.model_tokens, 4096, 256), model_steps=pick(args.model_steps, 3, 2),
        json_path=Path(args.json), plot_path=Path(args.plot) if args.plot else None)


# ---------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------

def markdown_table(headers: list[str], rows: Iterable[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}{suffix}"


def print_section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def write_json(path: Path, results: dict) -> None:
    def dump(tmp: Path) -> None:
        with open(tmp, "w") as out:
            json.dump(results, out, indent=1, default=str)
    write_atomically(path, dump)


def machine_info(settings: Settings) -> dict:
    if settings.device.type == "cuda":
        name = torch.cuda.get_device_name(settings.device)
    else:
        name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name")), platform.processor())
    return {"device": str(settings.device), "name": name, "torch": torch.__version__,
            "python": platform.python_version(), "threads": settings.threads,
            "cpus_allowed": len(os.sched_getaffinity(0)), "dtype": "float32",
            # every measuring child sets it too (child_main), so all methods share one allocator
            "malloc_keeps_freed_memory": keep_freed_memory()}


# ---------------------------------------------------------------------------------------------
# Section 1-2: attention scaling
# ---------------------------------------------------------------------------------------------

def select_methods(methods: list[Method], filters: tuple[str, ...]) -> list[Method]:
    if not filters:
        return methods
    return [m for m in methods if any(f in m.label for f in filters)]


def attention_task_for(settings: Settings, method: Method, n: int) -> dict:
    return {"kind": "attention", "device": str(settings.device), "threads": settings.threads,
            "method": asdict(method), "shape": asdict(settings.shape), "n": n,
            "chunk_size": settings.chunk_size, "repeats": settings.repeats,
            "warmup": settings.warmup}


def progress_line(label: str, n: int, record: dict) -> str:
    head = f"  N={n:>6}  {label:<26}"
    if "skipped" in record or "error" in record:
        return f"{head} {record.get('skipped') or 'error: ' + record['error']}"
    return (f"{head} fwd {record['forward_s'] * 1e3:9.1f} ms  fwd+bwd {record['train_s'] * 1e3:9.1f} ms"
            f"  peak {record['train_peak_bytes'] / MB:7.0f} MB  ({record['elapsed_s']:.1f} s)")


def run_budgeted(runner: ChildRunner, history: History, task: dict, n: int, settings: Settings,
                 peak_key: str) -> dict:
    """Run `task` unless the method already failed or its prediction breaks the budget."""
    if history.failure:
        return {"skipped": f"skipped: {history.failure}"}
    reason = skip_reason(history, n, settings.budget_s, available_memory_bytes(settings.device))
    if reason:
        return {"skipped": reason}
    result = runner.run(task, child_timeout(settings.budget_s))
    if "error" in result:
        history.failure = f"failed at N={n}"
    else:
        history.points.append((n, result["elapsed_s"], result.get(peak_key, 0)))
    return result


def run_attention_sweep(settings: Settings, runner: ChildRunner, methods: list[Method]) -> list[dict]:
    """Every method at every N, small N first, so every method's history grows together."""
    histories = {m: History(assume_quadratic=m.name in QUADRATIC_METHODS) for m in methods}
    records = []
    for n in settings.lengths:
        for method in methods:
            result = run_budgeted(runner, histories[method], attention_task_for(settings, method, n),
                                  n, settings, "train_peak_bytes")
            record = {"method": method.name, "causal": method.causal, "label": method.label,
                      "linear": method.is_linear, "n": n, **result}
            print(progress_line(method.label, n, record), flush=True)
            records.append(record)
    return records


def measured(records: list[dict], label: str) -> list[dict]:
    """The successful records of one method, by increasing N."""
    return sorted((r for r in records if r["label"] == label and "train_s" in r), key=lambda r: r["n"])


def labels_in_order(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in records))


def results_table(records: list[dict]) -> str:
    rows = []
    for label in labels_in_order(records):
        for r in sorted((r for r in records if r["label"] == label), key=lambda r: r["n"]):
            ok = "train_s" in r
            rows.append([r["method"], "causal" if r["causal"] else "full", r["n"],
                         fmt(r.get("forward_s"), 1e3), fmt(r.get("train_s"), 1e3),
                         fmt(r.get("forward_peak_bytes"), 1 / MB, 0),
                         fmt(r.get("train_peak_bytes"), 1 / MB, 0),
                         fmt(r.get("saved_bytes"), 1 / MB, 0),
                         "" if ok else r.get("skipped") or "error: " + r.get("error", "")])
    return markdown_table(["method", "mask", "N", "fwd ms", "fwd+bwd ms", "fwd peak MB",
                           "fwd+bwd peak MB", "saved MB", "note"], rows)


def endpoint_slope(points: list[dict], key: str, span: tuple[int, int]) -> float | None:
    by_n = {r["n"]: r[key] for r in points}
    if span[0] in by_n and span[1] in by_n:
        return loglog_slope(list(span), [by_n[span[0]], by_n[span[1]]])
    return None


def slope_summary(records: list[dict]) -> list[dict]:
    """Log-log slopes of fwd+bwd time and memory vs N per method: least squares over N >= 4096
    when at least two such N were measured (else over all N), and the 4096 -> 32768 endpoints."""
    summary = []
    for label in labels_in_order(records):
        points = measured(records, label)
        large = [r for r in points if r["n"] >= SLOPE_FIT_MIN_N]
        fit = large if len(large) >= 2 else points
        ns = [r["n"] for r in fit]
        summary.append({
            "label": label, "fit_over": f"N>={SLOPE_FIT_MIN_N}" if fit is large else "all N",
            "fit_points": len(fit),
            "time_slope": loglog_slope(ns, [r["train_s"] for r in fit]),
            "peak_memory_slope": loglog_slope(ns, [r["train_peak_bytes"] for r in fit]),
            "saved_memory_slope": loglog_slope(ns, [r["saved_bytes"] for r in fit]),
            "target_time_slope": endpoint_slope(points, "train_s", TARGET_SLOPE_SPAN),
            "target_memory_slope": endpoint_slope(points, "train_peak_bytes", TARGET_SLOPE_SPAN)})
    return summary


def slopes_table(summary: list[dict]) -> str:
    span = "{}→{}".format(*TARGET_SLOPE_SPAN)
    rows = [[s["label"], f"{s['fit_over']} ({s['fit_points']} pts)", fmt(s["time_slope"], digits=2),
             fmt(s["peak_memory_slope"], digits=2), fmt(s["saved_memory_slope"], digits=2),
             fmt(s["target_time_slope"], digits=2), fmt(s["target_memory_slope"], digits=2)]
            for s in summary]
    return markdown_table(["method", "least-squares fit over", "time slope", "peak-mem slope",
                           "saved-mem slope", f"time slope {span}", f"peak-mem slope {span}"], rows)


def crossover(linear: list[dict], softmax: list[dict]) -> dict:
    """Smallest N from which `linear` is faster (fwd+bwd) than `softmax` at every larger N both
    measured, interpolated log-log between the bracketing lengths."""
    softmax_s = {r["n"]: r["train_s"] for r in softmax}
    common = [(r["n"], r["train_s"], softmax_s[r["n"]]) for r in linear if r["n"] in softmax_s]
    if not common:
        return {"n": None, "text": "no common N measured"}
    first_faster = len(common)
    while first_faster > 0 and common[first_faster - 1][1] < common[first_faster - 1][2]:
        first_faster -= 1
    if first_faster == len(common):
        return {"n": None, "text": f"not faster up to N={common[-1][0]}"}
    if first_faster == 0:
        return {"n": common[0][0], "text": f"≤ {common[0][0]} (faster at every measured N)"}
    (n0, lin0, soft0), (n1, lin1, soft1) = common[first_faster - 1], common[first_faster]
    # log(lin/soft) is linear in log N between the two points; find where it crosses zero.
    gap0, gap1 = math.log(lin0 / soft0), math.log(lin1 / soft1)
    n_cross = math.exp(math.log(n0) + gap0 / (gap0 - gap1) * (math.log(n1) - math.log(n0)))
    return {"n": round(n_cross), "text": f"≈ {n_cross:.0f} (between {n0} and {n1})"}


def crossover_summary(records: list[dict]) -> list[dict]:
    rows = []
    for label in labels_in_order(records):
        first = next(r for r in records if r["label"] == label)
        if not first["linear"]:
            continue
        sdpa = measured(records, Method("sdpa", first["causal"]).label)
        rows.append({"label": label, **crossover(measured(records, label), sdpa)})
    return rows


def speedup_summary(records: list[dict], lengths: tuple[int, ...]) -> list[dict]:
    """performer-pytorch fwd+bwd time / linattn fwd+bwd time, same causality, at each N."""
    rows = []
    for label in labels_in_order(records):
        first = next(r for r in records if r["label"] == label)
        if not first["linear"]:
            continue
        peer = {r["n"]: r["train_s"] for r in measured(records, Method("performer", first["causal"]).label)}
        ours = {r["n"]: r["train_s"] for r in measured(records, label)}
        rows.append({"label": label, "speedup": {n: peer[n] / ours[n] for n in lengths
                                                 if n in peer and n in ours}})
    return rows


PEAK_MEMORY_NOTE = {
    "cpu": "peak MB: rise of the child process's VmHWM (peak RSS) above its baseline after imports, "
           "a tiny priming run and input creation (baseline_bytes in the JSON); fwd peak is read "
           "before any backward ran.",
    "cuda": "peak MB: torch.cuda.max_memory_allocated above memory_allocated after a tiny priming "
            "run and input creation.",
}


def print_attention_report(records: list[dict], settings: Settings) -> dict:
    slopes = slope_summary(records)
    crossovers = crossover_summary(records)
    speedups = speedup_summary(records, settings.lengths)
    print_section("Attention: time and memory vs N")
    print("fwd: forward under no_grad; fwd+bwd: forward + backward to q, k, v. Medians of "
          f"{settings.repeats} runs after {settings.warmup} warm-up.")
    print(PEAK_MEMORY_NOTE[settings.device.type])
    print("saved MB: distinct storages autograd keeps for backward (deterministic).\n")
    print(results_table(records))
    print_section("Log-log slopes vs N (fwd+bwd; linear = 1, quadratic = 2)")
    print(slopes_table(slopes))
    print_section("Crossover: linear faster than SDPA (fwd+bwd, same mask)")
    print(markdown_table(["method", "faster than SDPA from N"],
                         [[c["label"], c["text"]] for c in crossovers]))
    print_section("Speed-up over performer-pytorch FastAttention (fwd+bwd time ratio, same mask)")
    print(markdown_table(["method"] + [f"N={n}" for n in settings.lengths],
                         [[s["label"]] + [fmt(s["speedup"].get(n), digits=2, suffix="×")
                                          for n in settings.lengths] for s in speedups]))
    return {"peak_memory": PEAK_MEMORY_NOTE[settings.device.type], "records": records,
            "slopes": slopes, "crossovers": crossovers, "speedups": speedups}


def plot_scaling(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    # One colour per family (sdpa, favor, elu, ...); RoPE none is dashed next to its post twin.
    families = list(dict.fromkeys(r["method"].split("+")[0] for r in records))
    colors = {family: plt.cm.tab10(i % 10) for i, family in enumerate(families)}
    lengths = sorted({r["n"] for r in records})
    figure, axes = plt.subplots(2, 2, figsize=(13, 10), squeeze=False)
    for row, causal in enumerate((True, False)):
        for label in labels_in_order([r for r in records if r["causal"] == causal]):
            points = measured(records, label)
            if not points:
                continue
            ns = [r["n"] for r in points]
            name = points[0]["method"]
            style = {"color": colors[name.split("+")[0]], "marker": "o", "label": name,
                     "linestyle": "--" if name.endswith("+none") else "-"}
            axes[row][0].plot(ns, [r["train_s"] * 1e3 for r in points], **style)
            axes[row][1].plot(ns, [max(r["train_peak_bytes"], 1) / MB for r in points], **style)
        mask = "causal" if causal else "non-causal"
        for column, ylabel in enumerate(("fwd+bwd time (ms)", "fwd+bwd peak memory (MB)")):
            axis = axes[row][column]
            axis.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel=ylabel,
                     title=f"{mask}: {ylabel.split(' (')[0]}")
            axis.set_xticks(lengths, [str(n) for n in lengths], minor=False)
            axis.xaxis.set_minor_locator(NullLocator())
            axis.grid(True, which="both", alpha=0.3)
            if axis.get_lines():
                axis.legend(fontsize=8)
    figure.tight_layout()
    write_atomically(path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# Section 3: efficiency of the causal favor+post path
# ---------------------------------------------------------------------------------------------

EFFICIENCY_METHOD = linear_method("favor", "post", causal=True)


def causal_favor_flops(n: int, shape: Shape, chunk_size: int) -> tuple[float, float]:
    """Matmul FLOPs (forward, forward+backward) of fm(q), fm(k) + causal linear_attention, counted
    from linattn.functional's causal product.  Per head, with C = chunk_size, M features,
    D = Dv = head_dim:
        forward:  feature maps 2 * 2NDM (x @ projection^T for q and k), chunk scores q k^T 2NCM,
                  scores @ v 2NCDv, q @ earlier state 2NMDv, per-chunk k^T v 2NMDv
        backward: feature maps 2 * 2NDM (grad w.r.t. x only), grad scores g v^T 2NCDv,
                  d_scores @ k and d_scores^T @ q 2 * 2NCM, scores^T @ g 2NCDv,
                  q^T g, g @ earlier^T, v @ later^T, k @ later 4 * 2NMDv
    (chunk scores and states are kept from the forward pass, not recomputed).  Elementwise work
    (exp, RoPE, the O(NM) denominator scan, division) is not counted."""
    m, d, c = shape.num_features, shape.head_dim, chunk_size
    forward = 4 * n * d * m + 2 * n * c * m + 2 * n * c * d + 4 * n * m * d
    backward = 4 * n * d * m + 4 * n * c * m + 4 * n * c * d + 8 * n * m * d
    heads = shape.batch * shape.heads
    return forward * heads, (forward + backward) * heads


def matmul_size(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 2048


def run_efficiency(settings: Settings, runner: ChildRunner, attention_records: list[dict]) -> dict:
    records = measured(attention_records, EFFICIENCY_METHOD.label)
    if not records:
        records = measured(run_attention_sweep(settings, runner, [EFFICIENCY_METHOD]),
                           EFFICIENCY_METHOD.label)
    size = matmul_size(settings.device)
    peak = runner.run({"kind": "matmul", "device": str(settings.device), "threads": settings.threads,
                       "size": size, "repeats": max(settings.repeats, 5), "warmup": 2},
                      child_timeout(settings.budget_s))
    peak_gflops = peak.get("gflops")
    rows = []
    for r in records:
        forward_flops, train_flops = causal_favor_flops(r["n"], settings.shape, settings.chunk_size)
        rows.append({"n": r["n"], "forward_s": r["forward_s"], "train_s": r["train_s"],
                     "forward_gflops": forward_flops / r["forward_s"] / 1e9,
                     "train_gflops": train_flops / r["train_s"] / 1e9})
    print_section(f"Efficiency: {EFFICIENCY_METHOD.label} vs fp32 matmul peak")
    print(f"fp32 matmul peak: {fmt(peak_gflops)} GFLOP/s ({size}³ torch.matmul, "
          f"threads={settings.threads}, median{'; error: ' + peak['error'] if 'error' in peak else ''}). "
          f"FLOPs count matmuls only (see causal_favor_flops), chunk C={settings.chunk_size}, "
          f"backward counted as 2x forward.\n")

    def share_of_peak(gflops: float) -> str:
        return fmt(gflops / peak_gflops if peak_gflops else None, 100, suffix="%")

    print(markdown_table(
        ["N", "fwd ms", "fwd GFLOP/s", "fwd % peak", "fwd+bwd ms", "fwd+bwd GFLOP/s", "fwd+bwd % peak"],
        [[r["n"], fmt(r["forward_s"], 1e3), fmt(r["forward_gflops"]), share_of_peak(r["forward_gflops"]),
          fmt(r["train_s"], 1e3), fmt(r["train_gflops"]), share_of_peak(r["train_gflops"])]
         for r in rows]))
    return {"method": EFFICIENCY_METHOD.label, "chunk_size": settings.chunk_size,
            "matmul_peak": peak, "rows": rows}


# ---------------------------------------------------------------------------------------------
# Section 4: decoding
# ---------------------------------------------------------------------------------------------

DECODE_DIM, DECODE_HEADS = 512, 8
DECODE_BLOCKS = {"linear": "LinearAttention favor+post", "softmax": "SoftmaxAttention + KV cache"}


def run_decode(settings: Settings, runner: ChildRunner) -> list[dict]:
    print_section("Decoding: per-token step latency vs context length")
    print(f"b=1, dim {DECODE_DIM}, heads {DECODE_HEADS}, M={settings.shape.num_features}; state from "
          f"forward(prompt, return_state=True); median of {settings.decode_steps} steps.\n")
    # The softmax prefill is quadratic in the context, so it is what the budget guards.
    histories = {kind: History(assume_quadratic=kind == "softmax") for kind in DECODE_BLOCKS}
    records = []
    for context in settings.decode_contexts:
        for kind in DECODE_BLOCKS:
            task = {"kind": "decode", "device": str(settings.device), "threads": settings.threads,
                    "block": kind, "context": context, "dim": DECODE_DIM, "heads": DECODE_HEADS,
                    "num_features": settings.shape.num_features, "repeats": settings.decode_steps,
                    "warmup": 3}
            result = run_budgeted(runner, histories[kind], task, context, settings, "state_bytes")
            records.append({"block": kind, "context": context, **result})
            print(f"  context={context:>6}  {DECODE_BLOCKS[kind]:<28} "
                  + (f"step {result['step_s'] * 1e3:.3f} ms  prefill {result['prefill_s'] * 1e3:.0f} ms"
                     if "step_s" in result else result.get("skipped") or "error: " + result["error"]),
                  flush=True)
    print()
    print(decode_table(records, settings.decode_contexts))
    return records


def record_value(records: list[dict], group: str, kind: str, context: int, key: str) -> float | None:
    """`key` of the record whose `group` field is `kind` at `context` (None if absent or skipped)."""
    return next((r.get(key) for r in records if r[group] == kind and r["context"] == context), None)


def decode_table(records: list[dict], contexts: tuple[int, ...]) -> str:
    value = functools.partial(record_value, records, "block")
    rows = []
    for context in contexts:
        linear, softmax = value("linear", context, "step_s"), value("softmax", context, "step_s")
        rows.append([context, fmt(linear, 1e3, 3), fmt(softmax, 1e3, 3),
                     fmt(softmax / linear if linear and softmax else None, digits=2, suffix="×"),
                     fmt(value("linear", context, "state_bytes"), 1 / MB, 2),
                     fmt(value("softmax", context, "state_bytes"), 1 / MB, 2),
                     fmt(value("linear", context, "prefill_s"), 1e3, 0),
                     fmt(value("softmax", context, "prefill_s"), 1e3, 0)])
    return markdown_table(["context", "linear step ms", "softmax step ms", "softmax/linear",
                           "linear state MB", "KV cache MB", "linear prefill ms",
                           "softmax prefill ms"], rows)


# ---------------------------------------------------------------------------------------------
# Section 5: LM training throughput
# ---------------------------------------------------------------------------------------------

def run_model(settings: Settings, runner: ChildRunner) -> list[dict]:
    print_section("Model: LM training throughput (forward + backward + AdamW step)")
    print(f"{MODEL_SIZE['n_layer']} layers, d_model {MODEL_SIZE['d_model']}, {MODEL_SIZE['n_head']} "
          f"heads, {settings.model_tokens} tokens per batch at every context; median of "
          f"{settings.model_steps} steps after 1 warm-up.\n")
    # Same tokens per batch: a step's cost grows at most linearly with context, softmax included.
    histories = {kind: History(assume_quadratic=False) for kind in MODEL_KINDS}
    records = []
    for context in settings.model_contexts:
        for kind in MODEL_KINDS:
            task = {"kind": "model", "device": str(settings.device), "threads": settings.threads,
                    "model": kind, "context": context, "tokens": settings.model_tokens,
                    "num_features": settings.shape.num_features, "repeats": settings.model_steps}
            result = run_budgeted(runner, histories[kind], task, context, settings, "peak_bytes")
            records.append({"model": kind, "context": context, **result})
            print(f"  context={context:>6}  {MODEL_KINDS[kind]:<18} "
                  + (f"{result['tokens_per_s']:9.0f} tokens/s  step {result['step_s'] * 1e3:.0f} ms"
                     if "step_s" in result else result.get("skipped") or "error: " + result["error"]),
                  flush=True)
    print()
    print(model_table(records, settings.model_contexts))
    return records


def model_table(records: list[dict], contexts: tuple[int, ...]) -> str:
    value = functools.partial(record_value, records, "model")
    rows = []
    for context in contexts:
        softmax, linear = value("softmax", context, "tokens_per_s"), value("linear", context, "tokens_per_s")
        rows.append([context, value("linear", context, "batch") or value("softmax", context, "batch") or "—",
                     fmt(softmax, digits=0), fmt(linear, digits=0),
                     fmt(linear / softmax if linear and softmax else None, digits=2, suffix="×"),
                     fmt(value("softmax", context, "peak_bytes"), 1 / MB, 0),
                     fmt(value("linear", context, "peak_bytes"), 1 / MB, 0)])
    return markdown_table(["context", "batch", "softmax tokens/s", "favor+post tokens/s",
                           "linear/softmax", "softmax peak MB", "favor+post peak MB"], rows)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def print_header(settings: Settings, machine: dict) -> None:
    shape = settings.shape
    print(f"# linattn benchmark ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(f"device: {machine['device']} ({machine['name']}), torch {machine['torch']}, "
          f"threads: {settings.threads} (of {machine['cpus_allowed']} CPUs allowed), fp32, "
          f"malloc keeps freed memory: {machine['malloc_keeps_freed_memory']} (see models.runtime)")
    print(f"attention shape: b={shape.batch}, h={shape.heads}, D={shape.head_dim}, "
          f"M={shape.num_features}, causal chunk C={settings.chunk_size}")
    print(f"timing: median of {settings.repeats} after {settings.warmup} warm-up; budget "
          f"{settings.budget_s:.0f} s per config; sections: {','.join(settings.sections)}", flush=True)


def run_attention(settings: Settings, runner: ChildRunner) -> list[dict]:
    reason = xformers_skip_reason(settings.device)
    methods = select_methods(attention_methods(include_xformers=reason is None), settings.methods)
    print_section(f"Attention sweep: {len(methods)} methods x N in {list(settings.lengths)}")
    if reason:
        print(f"xformers: skipped ({reason})")
    return run_attention_sweep(settings, runner, methods)


def main(argv: list[str] | None = None) -> dict:
    settings = settings_from_args(parse_args(argv))
    torch.set_num_threads(settings.threads)
    machine = machine_info(settings)
    results: dict[str, Any] = {"machine": machine, "settings": asdict(settings)}
    print_header(settings, machine)
    started = time.perf_counter()
    runner = ChildRunner()
    records: list[dict] = []
    if "attention" in settings.sections:
        records = run_attention(settings, runner)
        results["attention"] = print_attention_report(records, settings)
        if settings.plot_path and any("train_s" in r for r in records):
            plot_scaling(records, settings.plot_path)
            print(f"\nplot: {settings.plot_path}")
        write_json(settings.json_path, results)
    if "efficiency" in settings.sections:
        results["efficiency"] = run_efficiency(settings, runner, records)
        write_json(settings.json_path, results)
    if "decode" in settings.sections:
        results["decode"] = run_decode(settings, runner)
        write_json(settings.json_path, results)
    if "model" in settings.sections:
        results["model"] = run_model(settings, runner)
    results["elapsed_s"] = time.perf_counter() - started
    write_json(settings.json_path, results)
    print(f"\nresults: {settings.json_path}; total {results['elapsed_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
