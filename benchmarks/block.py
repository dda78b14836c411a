"""The block section: what a user imports.  `LinearAttention` beside `SoftmaxAttention`, each the whole
block (projections, RoPE, attention, output projection) on x of shape (1, N, dim), forward + backward,
in the same run.  Under bf16 the blocks keep float32 weights and run under autocast, as mixed-precision
training runs them.  Timed warm; the first call (Triton's compile and autotune, cuDNN's choice) is
reported apart.  Peak memory counts as much as time: the table gives both ratios, and issue 34's
targets are judged for favor-post and elu-post against softmax."""
from __future__ import annotations

import resource
import statistics

import torch

from linattn_lm.device import autocast

from .methods import block_parts, build_block, is_softmax
from .report import Report, endpoint_slope, fmt, markdown_table, note, timed_line
from .settings import Settings
from .timing import MB, ChildRunner, History, child_timeout, median_time, one_call_peak, run_budgeted, time_call

# Issue 34: softmax's time over the block's, at least, per block and N; favor-post's peak over softmax's,
# at most, from MEMORY_FROM_N on.
SPEEDUP_TARGETS = {"favor-post": {16384: 1.0, 65536: 2.0}, "elu-post": {65536: 3.0}}
MEMORY_LIMIT, MEMORY_FROM_N, MEMORY_JUDGED = 2.0, 4096, "favor-post"
PAGE = resource.getpagesize()
# Issue 45: a block with a window or decay against the same block without it.  On CPU: time and peak at
# OPTION_CPU_N, and the log-log time slope over OPTION_SLOPE_SPAN; on CUDA: time at every N.
OPTION_TIME_LIMIT, OPTION_PEAK_LIMIT, OPTION_CPU_N = 1.3, 1.5, 8192
OPTION_SLOPE_LIMIT, OPTION_SLOPE_SPAN = 1.1, (4096, 16384)


def block_task(task: dict) -> dict:
    device = torch.device(task["device"])
    block = build_block(task["block"], task["dim"], task["heads"], task["num_features"]).to(device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, task["n"], task["dim"], generator=generator).to(device).requires_grad_()
    grad = torch.randn(1, task["n"], task["dim"], generator=generator).to(device)

    def step() -> None:
        x.grad = None
        block.zero_grad(set_to_none=True)   # so that every call allocates its gradients alike
        with autocast(device, task["dtype"]):   # fp32: as built; bf16: autocast over float32 weights
            out = block(x)
        out.backward(grad.to(out.dtype))

    first_call_s = time_call(step, device)
    faults = minor_page_faults()
    timing = median_time(step, repeats=task["repeats"], warmup=task["warmup"], device=device)
    faults = (minor_page_faults() - faults) / (task["warmup"] + timing.repeats)
    baseline, peak = one_call_peak(step, device)
    return {"train_s": timing.seconds, "train_repeats": timing.repeats, "first_call_s": first_call_s,
            "train_baseline_bytes": baseline, "train_peak_bytes": peak, "page_faults_per_call": faults}


def minor_page_faults() -> int:
    """The process's minor page faults so far: memory the OS maps in afresh (on CPU, what glibc handed
    back and a large temporary then touches again; --keep-freed-memory), a count no machine's speed moves."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def block_sweep(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> list[dict]:
    """Every block at every N and dtype, small N first; each config in a fresh process.  With several
    --rounds the whole sweep runs again, each config once per round, and a config's record holds the
    median over rounds (`by_rounds`); a config skipped or failed in the first round is not run again."""
    configs = [(name, dtype) for dtype in settings.dtypes for name in settings.block_methods]
    histories = {config: History(assume_quadratic=is_softmax(config[0])) for config in configs}
    rounds: dict[tuple, list[dict]] = {}
    for round_index in range(settings.rounds):
        for n in settings.lengths:
            for name, dtype in configs:
                first = rounds.get((name, dtype, n))
                if first and "train_s" not in first[0]:
                    continue
                task = {"device": str(device), "threads": settings.threads, "block": name, "dtype": dtype, "n": n,
                        "dim": settings.heads * settings.head_dim, "heads": settings.heads,
                        "num_features": settings.num_features, "repeats": settings.repeats,
                        "warmup": settings.warmup}
                result = run_budgeted(runner, block_task, task, histories[(name, dtype)], n,
                                      settings.budget_s, device, "train_peak_bytes") if not first else \
                    runner.run(block_task, task, child_timeout(settings.budget_s))
                record = {"block": name, "dtype": dtype, "n": n, **result}
                prefix = f"  round {round_index + 1}/{settings.rounds}" if settings.rounds > 1 else ""
                report.progress(f"{prefix}  N={n:>6}  {name:<18} {dtype}  " + timed_line(record))
                rounds.setdefault((name, dtype, n), []).append(record)
    return [by_rounds(records) for records in rounds.values()]


MEASURED = ("train_s", "train_peak_bytes", "page_faults_per_call", "first_call_s")


def by_rounds(records: list[dict]) -> dict:
    """One config's record over its rounds: each measured value's median (the first round's record where
    a later round failed), with the rounds' times kept as `train_s_rounds`."""
    timed = [r for r in records if "train_s" in r]
    if len(records) == 1 or len(timed) < len(records):
        return records[0]
    merged = {**records[0], **{key: statistics.median(r[key] for r in timed) for key in MEASURED}}
    return {**merged, "train_s_rounds": [r["train_s"] for r in timed]}


def find(records: list[dict], name: str, dtype: str, n: int) -> dict | None:
    return next((r for r in records if (r["block"], r["dtype"], r["n"]) == (name, dtype, n) and "train_s" in r), None)


def comparisons(records: list[dict], softmax: str = "softmax") -> list[dict]:
    """Per other block (linear, the window-only control, xformers), dtype and N: softmax's time over its
    time, and its peak over softmax's."""
    rows = []
    for record in records:
        peer = find(records, softmax, record["dtype"], record["n"])
        if record["block"] == softmax or "train_s" not in record or peer is None:
            continue
        rows.append({"block": record["block"], "dtype": record["dtype"], "n": record["n"],
                     "speedup": peer["train_s"] / record["train_s"],
                     "memory_ratio": record["train_peak_bytes"] / max(peer["train_peak_bytes"], 1)})
    return rows


def option_rows(records: list[dict], device_type: str) -> list[dict]:
    """Per block with options (+window, +decay, +short_conv), dtype and N: its time and peak over those of
    the same block without them in this run, its time slope over OPTION_SLOPE_SPAN beside the plain
    block's, and issue 45's verdicts where they are set (None elsewhere)."""
    rows = []
    for record in records:
        plain_name = block_parts(record["block"])[0]
        plain = find(records, plain_name, record["dtype"], record["n"])
        if plain_name == record["block"] or "train_s" not in record or plain is None:
            continue
        time_ratio = record["train_s"] / plain["train_s"]
        peak_ratio = record["train_peak_bytes"] / max(plain["train_peak_bytes"], 1)
        slopes = [endpoint_slope([r for r in records if (r["block"], r["dtype"]) == (name, record["dtype"])],
                                 "train_s", OPTION_SLOPE_SPAN) for name in (record["block"], plain_name)]
        # the window-only control is judged against softmax (comparisons); the slope once per block, at OPTION_CPU_N
        linear = not is_softmax(record["block"])
        judged_here = linear and (device_type == "cuda" or record["n"] == OPTION_CPU_N)
        rows.append({"block": record["block"], "dtype": record["dtype"], "n": record["n"], "time_ratio": time_ratio,
                     "peak_ratio": peak_ratio, "slope": slopes[0], "plain_slope": slopes[1],
                     "time_met": time_ratio <= OPTION_TIME_LIMIT if judged_here else None,
                     "peak_met": peak_ratio <= OPTION_PEAK_LIMIT if judged_here and device_type != "cuda" else None,
                     "slope_met": None if device_type == "cuda" or not judged_here or slopes[0] is None
                     else slopes[0] <= OPTION_SLOPE_LIMIT})
    return rows


def judge(rows: list[dict]) -> list[dict]:
    """Issue 34's block targets, for the blocks that have them, at the N where they are set."""
    judged = []
    for row in rows:
        if row["block"] not in SPEEDUP_TARGETS:
            continue
        speed_target = SPEEDUP_TARGETS[row["block"]].get(row["n"])
        memory_judged = row["block"] == MEMORY_JUDGED and row["n"] >= MEMORY_FROM_N
        if speed_target is None and not memory_judged:   # a length without a target for this block
            continue
        judged.append({**row, "speedup_target": speed_target,
                       "speed_met": None if speed_target is None else row["speedup"] >= speed_target,
                       "memory_met": row["memory_ratio"] <= MEMORY_LIMIT if memory_judged else None})
    return judged


def verdict(met: bool | None) -> str:
    return "—" if met is None else ("met" if met else "**missed**")


def run_block(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> dict:
    dim = settings.heads * settings.head_dim
    report.section("Block: the blocks as imported, forward + backward")
    report.add(f"x of shape (1, N, {dim}), {settings.heads} heads, M={settings.num_features} for maps with "
               "that option; softmax = SoftmaxAttention(rope=True, backend='sdpa'); bf16 = autocast over float32 "
               f"weights. Median of {settings.repeats} after {settings.warmup} warm-up"
               + (f", then each value's median over {settings.rounds} rounds of the whole sweep" if settings.rounds > 1
                  else "") + "; first call = the first "
               "forward + backward of a fresh process (kernel compile and autotune), not in the median. Peak: "
               "memory above what was allocated before one call of its own. Page faults: memory the OS mapped in "
               "afresh per timed call (on CPU, what glibc handed back, touched again; --keep-freed-memory).\n")
    records = block_sweep(settings, device, runner, report)
    report.add(markdown_table(
        ["block", "dtype", "N", "fwd+bwd ms", "peak MB", "page faults MB / call", "first call s", "note"],
        [[r["block"], r["dtype"], r["n"], fmt(r.get("train_s"), 1e3, 2), fmt(r.get("train_peak_bytes"), 1 / MB, 0),
          fmt(r.get("page_faults_per_call"), PAGE / MB, 0), fmt(r.get("first_call_s"), digits=1), note(r)]
         for r in records]))
    rows = comparisons(records)
    if rows:
        report.add("\n" + markdown_table(
            ["block", "dtype", "N", "softmax time / its time", "its peak / softmax peak"],
            [[r["block"], r["dtype"], r["n"], fmt(r["speedup"], digits=2, suffix="×"),
              fmt(r["memory_ratio"], digits=2, suffix="×")] for r in rows]))
    options = option_rows(records, device.type)
    if options:
        span = "-".join(f"{n // 1024}k" for n in OPTION_SLOPE_SPAN)
        report.section("Each option against the same block without it (issue 45's targets, this run)")
        report.add(f"Targets: time at most {OPTION_TIME_LIMIT:g}× the plain block's"
                   + (" at every N." if device.type == "cuda" else
                      f" and peak at most {OPTION_PEAK_LIMIT:g}× at N={OPTION_CPU_N}; time slope {span} at most "
                      f"{OPTION_SLOPE_LIMIT:g} (the plain block's beside it).") + "\n")
        report.add(markdown_table(
            ["block", "dtype", "N", "time / plain", "peak / plain", f"slope {span} (plain)", "time", "peak", "slope"],
            [[r["block"], r["dtype"], r["n"], fmt(r["time_ratio"], digits=2, suffix="×"),
              fmt(r["peak_ratio"], digits=2, suffix="×"),
              f"{fmt(r['slope'], digits=2)} ({fmt(r['plain_slope'], digits=2)})", verdict(r["time_met"]),
              verdict(r["peak_met"]), verdict(r["slope_met"])] for r in options]))
    targets = judge(rows)
    if targets:
        report.section("Targets of issue 34 for the blocks (against softmax, measured in this run)")
        report.add(markdown_table(
            ["block", "dtype", "N", "speed-up", "target", "speed",
             f"peak ratio ({MEMORY_JUDGED} ≤ {MEMORY_LIMIT:g}× from N={MEMORY_FROM_N})", "memory"],
            [[t["block"], t["dtype"], t["n"], fmt(t["speedup"], digits=2, suffix="×"),
              fmt(t["speedup_target"], digits=1, suffix="×") if t["speedup_target"] else "—", verdict(t["speed_met"]),
              fmt(t["memory_ratio"], digits=2, suffix="×"), verdict(t["memory_met"])] for t in targets]))
    return {"records": records, "comparisons": rows, "targets": targets, "options": options}
