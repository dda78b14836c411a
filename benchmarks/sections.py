"""The four sections.  Each has a task, run in a fresh process per config (`*_task(task) -> dict`),
and a runner that sweeps the configs in the parent and prints its tables.

  attention   forward and forward+backward time and peak memory vs N: softmax (SDPA, flash,
              xformers), every linattn feature map with RoPE post/none, performer-pytorch, fla-chunk
  efficiency  achieved GFLOP/s of causal favor-post next to the measured matmul peak
  decode      per-token `step` latency vs context: LinearAttention's state vs softmax's KV cache
  model       training tokens/s of the byte-level LM, softmax vs favor-post
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

import torch

import linattn
from linattn_lm.lm import ByteLM, ModelConfig, lm_loss
from linattn_lm.device import autocast

from . import report as tables
from .methods import (DTYPES, MASKS, SOFTMAX_BLOCKS, Method, Shape, block_parts, build_attention, drop_grads,
                      forward_call, is_softmax, linear_parts, make_inputs, method_table, model_size, runs_with,
                      train_call, unavailable)
from .report import Report, fmt, markdown_table, measured
from .settings import PASSES, Settings, selected_methods
from .timing import (MB, SLOW_RUN_REPEATS, SLOW_RUN_S, ChildRunner, History, PeakMemory, child_timeout,
                     median_time, one_call_peak, run_budgeted, saved_tensor_bytes, time_call)

QUADRATIC_FAMILIES = ("softmax",)   # the budget assumes time ~ N^2 for these (performer's CPU path is linear)


# ---------------------------------------------------------------------------------------------
# Attention: time and memory vs N
# ---------------------------------------------------------------------------------------------

def prime(attend, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
    """One tiny forward + backward, so that one-time lazy set-up (thread pool, BLAS buffers, CUDA
    kernels) is paid before the memory baseline and not counted as the config's peak."""
    train_call(attend, *make_inputs(shape, 64, device, dtype))()


def attention_task(task: dict) -> dict:
    device, shape, n = torch.device(task["device"]), task["shape"], task["n"]
    dtype = DTYPES[task["dtype"]]
    attend = build_attention(task["method"], shape, device, MASKS[task["mask"]], task["chunk_size"])
    prime(attend, shape, device, dtype)
    q, k, v, grad = make_inputs(shape, n, device, dtype)
    timing = dict(repeats=task["repeats"], warmup=task["warmup"], device=device)
    result = {}
    if "fwd" in task["passes"]:
        call = forward_call(attend, q, k, v)
        result["forward_s"], result["forward_repeats"] = median_time(call, **timing)
        result["forward_baseline_bytes"], result["forward_peak_bytes"] = one_call_peak(call, device)
    if "fwd+bwd" in task["passes"]:
        call = train_call(attend, q, k, v, grad)
        result["train_s"], result["train_repeats"] = median_time(call, **timing)
        drop_grads(q, k, v)   # so that the call's own gradients count toward its peak
        result["train_baseline_bytes"], result["train_peak_bytes"] = one_call_peak(call, device)
        result["saved_bytes"] = saved_tensor_bytes(lambda: attend(q, k, v))
    return result


def attention_configs(settings: Settings, device: torch.device, report: Report) -> list[tuple[Method, str, str]]:
    """(method, mask, dtype) of every selected method that can run here; a note for the rest."""
    configs = []
    for method in selected_methods(settings):
        reason = unavailable(method, device)
        if reason:
            report.add(f"- {method.name}: skipped ({reason})")
            continue
        wanted = [(mask, dtype) for mask in settings.masks for dtype in settings.dtypes]
        runnable = [(mask, dtype) for mask, dtype in wanted if runs_with(method, MASKS[mask], dtype)]
        if len(runnable) < len(wanted):
            limits = f"dtypes {','.join(method.dtypes)}" + (", causal only" if method.causal_only else "")
            report.add(f"- {method.name}: runs with {limits}; "
                       f"not run for {', '.join(' '.join(c) for c in wanted if c not in runnable)}")
        configs += [(method, mask, dtype) for mask, dtype in runnable]
    return configs


def progress_line(record: dict) -> str:
    head = f"  N={record['n']:>6}  {record['label']:<32}"
    if "elapsed_s" not in record:
        return f"{head} {tables.note(record)}"
    parts = [f"fwd {record['forward_s'] * 1e3:9.1f} ms" if "forward_s" in record else "",
             f"fwd+bwd {record['train_s'] * 1e3:9.1f} ms" if "train_s" in record else ""]
    peak = record.get("train_peak_bytes", record.get("forward_peak_bytes", 0))
    return f"{head} {'  '.join(p for p in parts if p)}  peak {peak / MB:7.0f} MB  ({record['elapsed_s']:.1f} s)"


def attention_sweep(settings: Settings, device: torch.device, runner: ChildRunner, report: Report,
                    configs: list[tuple[Method, str, str]]) -> list[dict]:
    """Every config at every N, small N first, so that every config's history grows together."""
    histories = {config: History(assume_quadratic=config[0].family in QUADRATIC_FAMILIES) for config in configs}
    peak = "train_peak_bytes" if "fwd+bwd" in settings.passes else "forward_peak_bytes"
    records = []
    for n in settings.lengths:
        for config in configs:
            method, mask, dtype = config
            task = {"device": str(device), "threads": settings.threads, "method": method, "shape": settings.shape,
                    "mask": mask, "dtype": dtype, "n": n, "passes": settings.passes,
                    "chunk_size": settings.chunk_size, "repeats": settings.repeats, "warmup": settings.warmup}
            result = run_budgeted(runner, attention_task, task, histories[config], n, settings.budget_s,
                                  device, peak)
            record = {"method": method.name, "mask": mask, "dtype": dtype, "label": f"{method.name} {mask} {dtype}",
                      "linear": method.is_linear, "n": n, **result}
            report.progress(progress_line(record))
            records.append(record)
    return records


PEAK_MEMORY_NOTE = {
    "cpu": "peak MB: what one call raises the child process's VmHWM (peak RSS) by, measured on a call "
           "of its own after the timed ones, with the heap's free memory handed back to the OS first "
           "(so that what glibc kept from earlier calls neither hides nor adds to it; resident "
           "before each pass's call: forward_baseline_bytes and train_baseline_bytes in the JSON).",
    "cuda": "peak MB: torch.cuda.max_memory_allocated above memory_allocated during one call of its "
            "own after the timed ones (reset_peak_memory_stats first).",
}


def run_attention(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> dict:
    report.section(f"Attention: time and memory vs N in {list(settings.lengths)}")
    configs = attention_configs(settings, device, report)
    records = attention_sweep(settings, device, runner, report, configs)
    report.add(f"\nfwd: forward under no_grad; fwd+bwd: forward + backward to q, k, v. Medians of "
               f"{settings.repeats} runs after {settings.warmup} warm-up ({SLOW_RUN_REPEATS} for runs over "
               f"{SLOW_RUN_S:g} s; the count is in the JSON). {PEAK_MEMORY_NOTE[device.type]} "
               "saved MB: distinct storages autograd keeps for backward (deterministic).\n")
    report.add(tables.results_table(records))
    summary = {"peak_memory": PEAK_MEMORY_NOTE[device.type], "records": records,
               "targets": tables.target_summary(records, device.type),
               "slopes": tables.slope_summary(records)}
    if summary["targets"]:
        report.section("Targets of issue 8 (ratios measured in this run)")
        report.add(tables.targets_table(summary["targets"]))
    report.section("Log-log slopes vs N (linear = 1, quadratic = 2)")
    report.add(tables.slopes_table(summary["slopes"]))
    for peer in ("sdpa", "sdpa-flash", "performer", "fla-chunk"):
        speedups = tables.speedup_summary(records, peer)
        if speedups:
            crossovers = tables.crossover_summary(records, peer)
            report.section(f"Speed-up over {peer} (its time / ours, same mask and dtype)")
            report.add(tables.speedup_table(speedups, settings.lengths))
            report.add("\n" + markdown_table(["method", f"faster than {peer} from N"],
                                             [[c["label"], c["text"]] for c in crossovers]))
            summary[f"speedup_over_{peer}"] = speedups
            summary[f"crossover_with_{peer}"] = crossovers
    return summary


# ---------------------------------------------------------------------------------------------
# Efficiency of the causal favor-post path
# ---------------------------------------------------------------------------------------------

def causal_favor_flops(n: int, shape: Shape, chunk_size: int) -> tuple[float, float]:
    """Matmul FLOPs (forward, forward+backward) of causal favor-post as the torch backend computes it
    (torch_logspace.py's log-space chunks, which recompute in backward what they do not save).  Per head, with
    C = chunk_size, M features, D = Dv = head_dim:
        forward:  projections x @ W^T of q and k 2 * 2NDM, rotated and unrotated chunk scores
                  2 * 2NCM, scores @ v 2NCDv, q @ state before the chunk 2NMDv, k^T v 2NMDv
        backward: projections again and the gradients of x 4 * 2NDM, k^T v again, (R q)^T g,
                  g @ state^T, R k @ G, v @ G^T 5 * 2NMDv, rotated scores again, d_scores @ R k,
                  d_scores^T @ R q and the denominator's two 5 * 2NCM, g v^T, scores^T g 2 * 2NCDv
    Elementwise work (exp, RoPE, scales, division) is not counted."""
    m, d, c = shape.num_features, shape.head_dim, chunk_size
    forward = 4 * n * d * m + 4 * n * c * m + 2 * n * c * d + 4 * n * m * d
    backward = 8 * n * d * m + 10 * n * m * d + 10 * n * c * m + 4 * n * c * d
    heads = shape.batch * shape.heads
    return forward * heads, (forward + backward) * heads


def matmul_task(task: dict) -> dict:
    device, size = torch.device(task["device"]), task["size"]
    a, b = (torch.randn(size, size, device=device, dtype=DTYPES[task["dtype"]]) for _ in range(2))
    seconds = median_time(lambda: a @ b, repeats=task["repeats"], warmup=task["warmup"], device=device).seconds
    return {"size": size, "seconds": seconds, "gflops": 2 * size ** 3 / seconds / 1e9}


def run_efficiency(settings: Settings, device: torch.device, runner: ChildRunner, report: Report,
                   attention_records: list[dict]) -> dict:
    method = next(m for m in method_table(settings.backends) if m.name.startswith("favor-post"))
    dtype = settings.dtypes[0]
    label = f"{method.name} causal {dtype}"
    records = [r for r in measured(attention_records, label) if "train_s" in r]
    if not records:
        sweep = replace(settings, passes=PASSES)
        records = measured(attention_sweep(sweep, device, runner, report, [(method, "causal", dtype)]), label)
    size = 4096 if device.type == "cuda" else 2048
    peak = runner.run(matmul_task, {"device": str(device), "threads": settings.threads, "size": size,
                                    "dtype": dtype, "repeats": max(settings.repeats, 5), "warmup": 2},
                      child_timeout(settings.budget_s))
    peak_gflops = peak.get("gflops")
    rows = []
    for r in records:
        forward_flops, train_flops = causal_favor_flops(r["n"], settings.shape, settings.chunk_size)
        rows.append({"n": r["n"], "forward_s": r.get("forward_s"), "train_s": r["train_s"],
                     "forward_gflops": forward_flops / r["forward_s"] / 1e9 if "forward_s" in r else None,
                     "train_gflops": train_flops / r["train_s"] / 1e9})
    report.section(f"Efficiency: {label} vs the {dtype} matmul peak")
    error = f"; error: {peak['error']}" if "error" in peak else ""
    report.add(f"{dtype} matmul peak: {fmt(peak_gflops)} GFLOP/s ({size}³ torch.matmul, median{error}). "
               f"FLOPs count matmuls only (see causal_favor_flops), chunk C={settings.chunk_size}.\n")

    def share_of_peak(gflops: float | None) -> str:
        return fmt(gflops / peak_gflops if gflops and peak_gflops else None, 100, suffix="%")

    report.add(markdown_table(
        ["N", "fwd ms", "fwd GFLOP/s", "fwd % peak", "fwd+bwd ms", "fwd+bwd GFLOP/s", "fwd+bwd % peak"],
        [[r["n"], fmt(r["forward_s"], 1e3), fmt(r["forward_gflops"]), share_of_peak(r["forward_gflops"]),
          fmt(r["train_s"], 1e3), fmt(r["train_gflops"]), share_of_peak(r["train_gflops"])] for r in rows]))
    return {"method": label, "chunk_size": settings.chunk_size, "matmul_peak": peak, "rows": rows}


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

DECODE_DIM, DECODE_HEADS = 512, 8
DECODE_BLOCKS = {"linear": "LinearAttention favor-post", "softmax": "SoftmaxAttention + KV cache"}


def decode_block(kind: str, num_features: int) -> torch.nn.Module:
    if kind == "linear":
        return linattn.LinearAttention(DECODE_DIM, DECODE_HEADS, feature_map="favor", rope="post", causal=True,
                                       feature_map_options={"num_features": num_features})
    return linattn.SoftmaxAttention(DECODE_DIM, DECODE_HEADS, rope=True, causal=True)


def decode_task(task: dict) -> dict:
    device, context = torch.device(task["device"]), task["n"]
    block = decode_block(task["block"], task["num_features"]).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, context, DECODE_DIM, generator=generator).to(device)
    token = torch.randn(1, DECODE_DIM, generator=generator).to(device)
    with torch.no_grad():
        outputs = []
        prefill_s = time_call(lambda: outputs.append(block(prompt, return_state=True)), device)
        _, state = outputs[0]
        # Every timed step extends the same state, so the context length stays `context`.
        step_s = median_time(lambda: block.step(token, state), repeats=task["repeats"], warmup=3, device=device).seconds
    state_bytes = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
    return {"prefill_s": prefill_s, "step_s": step_s, "state_bytes": state_bytes}


def record_value(records: list[dict], group: str, kind: str, context: int, key: str) -> float | None:
    """`key` of the record whose `group` field is `kind` at `context` (None if absent or skipped)."""
    return next((r.get(key) for r in records if r[group] == kind and r["n"] == context), None)


def measure_each(group: str, kinds: dict[str, str], contexts: list[int], function: Callable[[dict], dict],
                 histories: dict[str, History], memory_key: str, task_for: Callable[[str, int], dict],
                 describe: Callable[[dict], str], settings: Settings, device: torch.device, runner: ChildRunner,
                 report: Report) -> list[dict]:
    """Every kind at every context, each in its own child process under the time budget; one
    progress line per measurement.  Records carry `group`: kind and n: context."""
    records = []
    for context in contexts:
        for kind, label in kinds.items():
            result = run_budgeted(runner, function, task_for(kind, context), histories[kind], context,
                                  settings.budget_s, device, memory_key)
            records.append({group: kind, "n": context, **result})
            report.progress(f"  context={context:>6}  {label:<28} "
                            + (describe(result) if "step_s" in result else tables.note(result)))
    return records


def run_decode(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> list[dict]:
    report.section("Decoding: per-token step latency vs context length")
    report.add(f"b=1, dim {DECODE_DIM}, heads {DECODE_HEADS}, M={settings.num_features}; state from "
               f"forward(prompt, return_state=True); median of {settings.decode_steps} steps.\n")
    # The softmax prefill is quadratic in the context, so it is what the budget guards.
    histories = {kind: History(assume_quadratic=kind == "softmax") for kind in DECODE_BLOCKS}
    records = measure_each(
        "block", DECODE_BLOCKS, settings.decode_contexts, decode_task, histories, "state_bytes",
        lambda kind, context: {"device": str(device), "threads": settings.threads, "block": kind, "n": context,
                               "num_features": settings.num_features, "repeats": settings.decode_steps},
        lambda result: f"step {result['step_s'] * 1e3:.3f} ms  prefill {result['prefill_s'] * 1e3:.0f} ms",
        settings, device, runner, report)
    value = functools.partial(record_value, records, "block")
    rows = []
    for context in settings.decode_contexts:
        linear, softmax = value("linear", context, "step_s"), value("softmax", context, "step_s")
        rows.append([context, fmt(linear, 1e3, 3), fmt(softmax, 1e3, 3),
                     fmt(softmax / linear if linear and softmax else None, digits=2, suffix="×"),
                     fmt(value("linear", context, "state_bytes"), 1 / MB, 2),
                     fmt(value("softmax", context, "state_bytes"), 1 / MB, 2),
                     fmt(value("linear", context, "prefill_s"), 1e3, 0),
                     fmt(value("softmax", context, "prefill_s"), 1e3, 0)])
    report.add(markdown_table(["context", "linear step ms", "softmax step ms", "softmax/linear",
                               "linear state MB", "KV cache MB", "linear prefill ms", "softmax prefill ms"], rows))
    return records


# ---------------------------------------------------------------------------------------------
# LM training throughput
# ---------------------------------------------------------------------------------------------

def lm_config(kind: str, context: int, num_features: int, size: str = "small") -> ModelConfig:
    """The same LM with the block section's blocks: softmax attention + RoPE or linear attention
    `<map>-<rope>[-<backend>]` (M = num_features where the map has that option), with the name's window
    and decay."""
    base, options = block_parts(kind)
    if isinstance(options.get("decay"), tuple):   # ModelConfig's text: one factor per head, comma-separated
        options["decay"] = ",".join(map(str, options["decay"]))
    if base in SOFTMAX_BLOCKS:
        return ModelConfig(**model_size(size), seq_len=context, attention="softmax", feature_map="",
                           feature_map_options={}, rope="post", backend=SOFTMAX_BLOCKS[base], **options)
    feature_map, rope, backend = linear_parts(base)
    map_options = {"num_features": num_features} if "num_features" in linattn.feature_map_options(feature_map) else {}
    return ModelConfig(**model_size(size), seq_len=context, attention="linear", feature_map=feature_map,
                       feature_map_options=map_options, rope=rope, backend=backend, **options)


def model_task(task: dict) -> dict:
    device, context = torch.device(task["device"]), task["n"]
    model = ByteLM(lm_config(task["model"], context, task["num_features"], task["size"])).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = max(1, task["tokens"] // context)
    data = torch.randint(256, (batch, context + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = data[:, :-1].to(device), data[:, 1:].to(device)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast(device):    # the precision training uses: fp32 on CPU, bf16 on CUDA
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    memory = PeakMemory(device)
    step_s = median_time(train_step, repeats=task["repeats"], warmup=1, device=device).seconds
    return {"step_s": step_s, "batch": batch, "tokens_per_step": batch * context,
            "tokens_per_s": batch * context / step_s, "peak_bytes": memory.peak_above_baseline(),
            "parameters": model.num_parameters()}


# Issue 34: the LM's training tokens/s over softmax's, at least, per context.
MODEL_TARGETS = {"favor-post": {1024: 0.5, 8192: 1.0}}


def run_model(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> list[dict]:
    report.section("Model: LM training throughput (forward + backward + AdamW step)")
    size = model_size(settings.model_size)
    report.add(f"{settings.model_size} LM: {size['n_layer']} layers, d_model {size['d_model']}, {size['n_head']} heads, "
               f"{settings.model_tokens} tokens per batch at every context, M={settings.num_features} for maps with "
               f"that option; {'bf16 autocast' if device.type == 'cuda' else 'fp32'}; median of "
               f"{settings.model_steps} steps after 1 warm-up.\n")
    kinds = {kind: ("softmax + RoPE" if kind == "softmax" else f"softmax + RoPE ({kind})") if is_softmax(kind)
             else f"linear {kind}" for kind in settings.model_methods}
    # Same tokens per batch: a step's cost grows at most linearly with context, softmax included.
    histories = {kind: History(assume_quadratic=False) for kind in kinds}
    records = measure_each(
        "model", kinds, settings.model_contexts, model_task, histories, "peak_bytes",
        lambda kind, context: {"device": str(device), "threads": settings.threads, "model": kind, "n": context,
                               "tokens": settings.model_tokens, "num_features": settings.num_features,
                               "size": settings.model_size, "repeats": settings.model_steps},
        lambda result: f"{result['tokens_per_s']:9.0f} tokens/s  step {result['step_s'] * 1e3:.0f} ms",
        settings, device, runner, report)
    report.add(markdown_table(["context", "LM", "batch", "tokens/s", "of softmax's tokens/s", "peak MB",
                               "issue 34's target"], model_rows(records, list(kinds), settings.model_contexts)))
    return records


def model_rows(records: list[dict], kinds: list[str], contexts: list[int]) -> list[list]:
    """The model table: per context and LM, its tokens/s, their share of softmax's, and the target's verdict."""
    value = functools.partial(record_value, records, "model")
    rows = []
    for context in contexts:
        softmax = value("softmax", context, "tokens_per_s")
        for kind in kinds:
            tokens = value(kind, context, "tokens_per_s")
            share = tokens / softmax if tokens and softmax and kind != "softmax" else None
            target = MODEL_TARGETS.get(kind, {}).get(context)
            rows.append([context, kind, value(kind, context, "batch") or "—", fmt(tokens, digits=0),
                         fmt(share, digits=2, suffix="×"), fmt(value(kind, context, "peak_bytes"), 1 / MB, 0),
                         "—" if target is None or share is None else
                         f"≥ {target:g}× {'met' if share >= target else '**missed**'}"])
    return rows
