"""The kernels section: linattn's causal Eq. 19 op (rope post) beside flash-linear-attention's chunk
kernels on the same shapes, forward + backward, warm.

  linattn-log    linear_attention(log_space=True): float32 log-features b, a (as the FAVOR+ block
                 hands them) and values in the run's dtype; numerator and denominator, rotation fused
  linattn-plain  linear_attention on plain features, everything in the run's dtype
  linattn-fla-log, linattn-fla-plain
                 the same calls with backend="fla": fla's kernels below Eq. 19's mapping (fla_kernels.py;
                 "auto" takes it on CUDA where fla is installed, so there the two rows time one route)
  fla-gla        fla's chunk_gla (q, k, v and a per-feature gate g): the peer of the log-space path,
                 whose running maxima are a per-feature decay
  fla-linear     fla's chunk_linear_attn(normalize=False): the peer of the plain path (one numerator,
                 no rotation, no denominator)

Each (method, M, dtype) runs in one fresh process over every N, so a kernel compiles and autotunes
once: the first call at each N is reported apart from the median.  Achieved bandwidth counts the
least traffic a fused forward + backward must move: every input read in forward and again in backward,
its gradient written, the output written and its gradient read."""
from __future__ import annotations

import importlib.util

import torch

import linattn

from .methods import DTYPES, FLA_METHODS, OURS
from .report import Report, fmt, markdown_table, note, timed_line
from .settings import Settings
from .timing import MB, ChildRunner, child_timeout, median_time, one_call_peak, time_call

TARGETS = {method: 2.0 if method.endswith("-log") else 1.5 for method in OURS}   # issue 34: ours / fla's, at most
NEEDS_FLA = FLA_METHODS + tuple(method for method in OURS if method.startswith("linattn-fla-"))
# HBM bandwidth in bytes/s by device name, for the share of the physical limit.
PEAK_BANDWIDTH = {"H100 80GB HBM3": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H200": 4.8e12,
                  "A100-SXM4-80GB": 2.04e12, "A100-SXM4-40GB": 1.56e12}


def unavailable(method: str, device: torch.device) -> str | None:
    if method in NEEDS_FLA:
        if importlib.util.find_spec("fla") is None:
            return "needs the fla package (pip install 'linattn[gpu]')"
        if device.type != "cuda":
            return "runs on CUDA only"
    return None


def make_inputs(method: str, shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype):
    """The inputs of one call, requiring grad: log-features are float32, as FAVOR+'s block gives them;
    fla takes (B, T, H, K) tensors."""
    batch, heads, n, m, dv = shape
    generator = torch.Generator(device).manual_seed(0)

    def normal(*size, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device) * scale

    log_q, log_k = normal(batch, heads, n, m, scale=0.5), normal(batch, heads, n, m, scale=0.5)
    v = normal(batch, heads, n, dv).to(dtype)
    if method in OURS and method.endswith("-log"):
        inputs = [log_q, log_k, v]
    elif method in OURS:
        inputs = [log_q.exp().to(dtype), log_k.exp().to(dtype), v]
    else:
        inputs = [t.transpose(1, 2).contiguous() for t in (log_q.exp().to(dtype), log_k.exp().to(dtype), v)]
        if method == "fla-gla":
            inputs.append(torch.nn.functional.logsigmoid(normal(batch, n, heads, m)))
    return [t.requires_grad_() for t in inputs]


def attend(method: str):
    """The call of `method` on its inputs, returning the output."""
    if method in OURS:
        log_space, backend = method.endswith("-log"), "fla" if method in NEEDS_FLA else "auto"
        return lambda q, k, v: linattn.linear_attention(q, k, v, causal=True, rotary=True, log_space=log_space,
                                                        backend=backend)
    if method == "fla-gla":
        from fla.ops.gla import chunk_gla
        return lambda q, k, v, g: chunk_gla(q, k, v, g, scale=1.0)[0]
    from fla.ops.linear_attn import chunk_linear_attn
    return lambda q, k, v: chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0]


def least_traffic_bytes(inputs: list[torch.Tensor], out: torch.Tensor) -> int:
    """Inputs read twice and their gradients written once; the output written, its gradient read."""
    return sum(3 * t.numel() * t.element_size() for t in inputs) + 2 * out.numel() * out.element_size()


def measure(call, inputs: list[torch.Tensor], task: dict) -> dict:
    """Forward + backward of `call` on `inputs`: the first call apart, the median, one call's peak."""
    device, values = torch.device(task["device"]), inputs[2]   # every output has the values' shape and dtype
    grad = torch.randn_like(values)

    def step() -> None:
        for t in inputs:
            t.grad = None
        call(*inputs).backward(grad)

    first_call_s = time_call(step, device)
    timing = median_time(step, repeats=task["repeats"], warmup=task["warmup"], device=device)
    _, peak = one_call_peak(step, device)
    return {"train_s": timing.seconds, "first_call_s": first_call_s, "train_repeats": timing.repeats,
            "train_peak_bytes": peak, "traffic_bytes": least_traffic_bytes(inputs, values)}


def kernel_task(task: dict) -> dict:
    """Every N of one (method, M, dtype), smallest first, until the next N is predicted over budget."""
    device, method = torch.device(task["device"]), task["method"]
    call, rows, previous = attend(method), [], None
    for n in task["lengths"]:
        if previous and previous["train_s"] * n / previous["n"] > task["budget_s"]:
            rows.append({"n": n, "skipped": f"skipped: predicted over the {task['budget_s']:g} s budget"})
            continue
        try:
            inputs = make_inputs(method, (task["batch"], task["heads"], n, task["m"], task["dv"]), device,
                                 DTYPES[task["dtype"]])
            previous = {"n": n, **measure(call, inputs, task)}
        except Exception as error:   # an OOM at a large N keeps the smaller N measured before it
            failure = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            rows.append({"n": n, "error": failure})
            rows += [{"n": later, "skipped": f"skipped: failed at N={n}"} for later in task["lengths"] if later > n]
            break
        rows.append(previous)
    return {"rows": rows}


def kernel_sweep(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> list[dict]:
    records = []
    for dtype in settings.dtypes:
        for m in settings.kernel_features:
            for method in settings.kernel_methods:
                reason = unavailable(method, device)
                if reason:
                    records.append({"method": method, "m": m, "dtype": dtype, "skipped": f"skipped: {reason}"})
                    report.progress(f"  {method:<17} M={m:<4} {dtype}  skipped: {reason}")
                    continue
                task = {"device": str(device), "threads": settings.threads, "method": method, "m": m,
                        "dtype": dtype, "lengths": settings.lengths, "batch": settings.batch,
                        "heads": settings.heads, "dv": settings.head_dim, "repeats": settings.repeats,
                        "warmup": settings.warmup, "budget_s": settings.budget_s}
                result = runner.run(kernel_task, task, child_timeout(settings.budget_s) * len(settings.lengths))
                for row in result.get("rows", [{"n": n, "error": result.get("error", "?")} for n in settings.lengths]):
                    record = {"method": method, "m": m, "dtype": dtype, **row}
                    report.progress(f"  {method:<17} M={m:<4} {dtype} N={record['n']:>6}  " + timed_line(record))
                    records.append(record)
    return records


def peak_bandwidth(device_name: str) -> float | None:
    return next((value for name, value in PEAK_BANDWIDTH.items() if name in device_name), None)


def with_bandwidth(records: list[dict], device_name: str) -> list[dict]:
    peak = peak_bandwidth(device_name)
    for record in records:
        if "train_s" in record:
            record["bandwidth"] = record["traffic_bytes"] / record["train_s"]
            record["bandwidth_share"] = record["bandwidth"] / peak if peak else None
    return records


def comparisons(records: list[dict]) -> list[dict]:
    """Per (ours, M, dtype, N) with both measured: our time over fla's peer, against issue 34's target."""
    timed = {(r["method"], r["m"], r["dtype"], r["n"]): r for r in records if "train_s" in r}
    rows = []
    for (method, m, dtype, n), record in timed.items():
        peer = timed.get((OURS.get(method), m, dtype, n))
        if peer is None:
            continue
        ratio = record["train_s"] / peer["train_s"]
        rows.append({"method": method, "peer": OURS[method], "m": m, "dtype": dtype, "n": n, "ratio": ratio,
                     "target": TARGETS[method], "met": ratio <= TARGETS[method],
                     "memory_ratio": record["train_peak_bytes"] / max(peer["train_peak_bytes"], 1)})
    return rows


def run_kernels(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> dict:
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report.section("Kernels: the causal Eq. 19 op beside flash-linear-attention's chunk kernels")
    report.add(f"b={settings.batch}, h={settings.heads}, Dv={settings.head_dim}, rope post, forward + backward to "
               f"every input. Median of {settings.repeats} after {settings.warmup} warm-up; first call = the first "
               "at that N in the process (compile and autotune at the first N). Bandwidth: the least traffic "
               f"(inputs read twice, gradients written, output written and its gradient read) over the time; "
               f"share of the HBM peak of {device_name} where this module knows it.\n")
    records = with_bandwidth(kernel_sweep(settings, device, runner, report), device_name)
    report.add(markdown_table(
        ["method", "M", "dtype", "N", "fwd+bwd ms", "peak MB", "first call s", "GB/s", "of peak", "note"],
        [[r["method"], r["m"], r["dtype"], r.get("n", "—"), fmt(r.get("train_s"), 1e3, 2),
          fmt(r.get("train_peak_bytes"), 1 / MB, 0), fmt(r.get("first_call_s"), digits=1),
          fmt(r.get("bandwidth"), 1e-9, 1), fmt(r.get("bandwidth_share"), 100, 0, "%"), note(r)] for r in records]))
    rows = comparisons(records)
    if rows:
        report.section("Targets of issue 34 for the op (our time / fla's, measured in this run)")
        report.add(markdown_table(
            ["ours", "fla", "M", "dtype", "N", "time ratio", "target", "", "peak ratio"],
            [[r["method"], r["peer"], r["m"], r["dtype"], r["n"], fmt(r["ratio"], digits=2, suffix="×"),
              f"≤ {r['target']:g}×", "met" if r["met"] else "**missed**", fmt(r["memory_ratio"], digits=2, suffix="×")]
             for r in rows]))
    return {"device_name": device_name, "records": records, "comparisons": rows}
