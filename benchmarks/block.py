"""The block section: what a user imports.  `LinearAttention` beside `SoftmaxAttention`, each the whole
block (projections, RoPE, attention, output projection) on x of shape (1, N, dim), forward + backward,
in the same run.  Under bf16 the blocks keep float32 weights and run under autocast, as mixed-precision
training runs them.  Timed warm; the first call (Triton's compile and autotune, cuDNN's choice) is
reported apart.  Peak memory counts as much as time: the table gives both ratios, and issue 34's
targets are judged for favor-post and elu-post against softmax."""
from __future__ import annotations

import torch

from linattn_lm.device import autocast

from .methods import build_block, is_softmax
from .report import Report, fmt, markdown_table, note, timed_line
from .settings import Settings
from .timing import MB, ChildRunner, History, median_time, one_call_peak, run_budgeted, time_call

# Issue 34: softmax's time over the block's, at least, per block and N; favor-post's peak over softmax's,
# at most, from MEMORY_FROM_N on.
SPEEDUP_TARGETS = {"favor-post": {16384: 1.0, 65536: 2.0}, "elu-post": {65536: 3.0}}
MEMORY_LIMIT, MEMORY_FROM_N, MEMORY_JUDGED = 2.0, 4096, "favor-post"


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
    timing = median_time(step, repeats=task["repeats"], warmup=task["warmup"], device=device)
    baseline, peak = one_call_peak(step, device)
    return {"train_s": timing.seconds, "train_repeats": timing.repeats, "first_call_s": first_call_s,
            "train_baseline_bytes": baseline, "train_peak_bytes": peak}


def block_sweep(settings: Settings, device: torch.device, runner: ChildRunner, report: Report) -> list[dict]:
    """Every block at every N and dtype, small N first; each config in a fresh process."""
    configs = [(name, dtype) for dtype in settings.dtypes for name in settings.block_methods]
    histories = {config: History(assume_quadratic=is_softmax(config[0])) for config in configs}
    records = []
    for n in settings.lengths:
        for name, dtype in configs:
            task = {"device": str(device), "threads": settings.threads, "block": name, "dtype": dtype, "n": n,
                    "dim": settings.heads * settings.head_dim, "heads": settings.heads,
                    "num_features": settings.num_features, "repeats": settings.repeats, "warmup": settings.warmup}
            result = run_budgeted(runner, block_task, task, histories[(name, dtype)], n, settings.budget_s,
                                  device, "train_peak_bytes")
            record = {"block": name, "dtype": dtype, "n": n, **result}
            report.progress(f"  N={n:>6}  {name:<18} {dtype}  " + timed_line(record))
            records.append(record)
    return records


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
               f"weights. Median of {settings.repeats} after {settings.warmup} warm-up; first call = the first "
               "forward + backward of a fresh process (kernel compile and autotune), not in the median. Peak: "
               "memory above what was allocated before one call of its own.\n")
    records = block_sweep(settings, device, runner, report)
    report.add(markdown_table(
        ["block", "dtype", "N", "fwd+bwd ms", "peak MB", "first call s", "note"],
        [[r["block"], r["dtype"], r["n"], fmt(r.get("train_s"), 1e3, 2), fmt(r.get("train_peak_bytes"), 1 / MB, 0),
          fmt(r.get("first_call_s"), digits=1), note(r)] for r in records]))
    rows = comparisons(records)
    if rows:
        report.add("\n" + markdown_table(
            ["block", "dtype", "N", "softmax time / its time", "its peak / softmax peak"],
            [[r["block"], r["dtype"], r["n"], fmt(r["speedup"], digits=2, suffix="×"),
              fmt(r["memory_ratio"], digits=2, suffix="×")] for r in rows]))
    targets = judge(rows)
    if targets:
        report.section("Targets of issue 34 for the blocks (against softmax, measured in this run)")
        report.add(markdown_table(
            ["block", "dtype", "N", "speed-up", "target", "speed",
             f"peak ratio ({MEMORY_JUDGED} ≤ {MEMORY_LIMIT:g}× from N={MEMORY_FROM_N})", "memory"],
            [[t["block"], t["dtype"], t["n"], fmt(t["speedup"], digits=2, suffix="×"),
              fmt(t["speedup_target"], digits=1, suffix="×") if t["speedup_target"] else "—", verdict(t["speed_met"]),
              fmt(t["memory_ratio"], digits=2, suffix="×"), verdict(t["memory_met"])] for t in targets]))
    return {"records": records, "comparisons": rows, "targets": targets}
