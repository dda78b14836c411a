"""Tables and summaries of the attention sweep, and the report written beside the JSON.

Records are dicts with method, mask, dtype, label ("<method> <mask> <dtype>"), linear, n and the
measured values (forward_s, train_s, *_peak_bytes, saved_bytes) or `skipped` / `error`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from linattn_lm.files import write_atomically

from .timing import MB

SLOPE_FIT_MIN_N = 4096
TARGET_SLOPE_SPAN = (4096, 32768)


class Report:
    """Prints each part as it comes and keeps it, so OUT.md holds exactly the printed tables."""

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def section(self, title: str) -> None:
        self.add(f"\n## {title}\n")

    @staticmethod
    def progress(text: str) -> None:
        """A line for the terminal only: the tables repeat it."""
        print(text, flush=True)

    def markdown(self) -> str:
        return "\n".join(self.parts) + "\n"


def write_outputs(out: Path, results: dict, report: Report) -> None:
    """OUT.json (every number) and OUT.md (the printed report), each replaced atomically."""
    write_atomically(out.with_name(out.name + ".json"),
                     lambda tmp: tmp.write_text(json.dumps(results, indent=1, default=str)))
    write_atomically(out.with_name(out.name + ".md"), lambda tmp: tmp.write_text(report.markdown()))


def markdown_table(headers: list[str], rows: Iterable[list[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:.{digits}f}{suffix}"


def note(record: dict) -> str:
    return record.get("skipped") or ("error: " + record["error"] if "error" in record else "")


def timed_line(record: dict) -> str:
    """A progress line's measurement: fwd+bwd time, peak and first call, or why there is none."""
    if "train_s" not in record:
        return note(record)
    return (f"fwd+bwd {record['train_s'] * 1e3:9.2f} ms  peak {record['train_peak_bytes'] / 2 ** 20:8.0f} MB  "
            f"first call {record['first_call_s']:.1f} s")


def measured(records: list[dict], label: str) -> list[dict]:
    """The successful records of one method, mask and dtype, by increasing N."""
    return sorted((r for r in records if r["label"] == label and "elapsed_s" in r), key=lambda r: r["n"])


def labels_in_order(records: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in records))


def peer_label(record: dict, method: str) -> str:
    """The label of `method` with the same mask and dtype as `record`."""
    return f"{method} {record['mask']} {record['dtype']}"


def results_table(records: list[dict]) -> str:
    rows = [[r["method"], r["mask"], r["dtype"], r["n"], fmt(r.get("forward_s"), 1e3),
             fmt(r.get("train_s"), 1e3), fmt(r.get("forward_peak_bytes"), 1 / MB, 0),
             fmt(r.get("train_peak_bytes"), 1 / MB, 0), fmt(r.get("saved_bytes"), 1 / MB, 0), note(r)]
            for label in labels_in_order(records)
            for r in sorted((r for r in records if r["label"] == label), key=lambda r: r["n"])]
    return markdown_table(["method", "mask", "dtype", "N", "fwd ms", "fwd+bwd ms", "fwd peak MB",
                           "fwd+bwd peak MB", "saved MB", "note"], rows)


def loglog_slope(ns: list[int], values: list[float]) -> float | None:
    """Least-squares slope of log(value) against log(N); None with fewer than two usable points."""
    points = [(math.log(n), math.log(v)) for n, v in zip(ns, values) if v is not None and v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


def time_key(records: list[dict]) -> str:
    """fwd+bwd time when it was measured, else forward time."""
    return "train_s" if any("train_s" in r for r in records) else "forward_s"


def peak_key(records: list[dict]) -> str:
    return "train_peak_bytes" if any("train_peak_bytes" in r for r in records) else "forward_peak_bytes"


def endpoint_slope(points: list[dict], key: str, span: tuple[int, int]) -> float | None:
    by_n = {r["n"]: r.get(key) for r in points}
    if span[0] in by_n and span[1] in by_n:
        return loglog_slope(list(span), [by_n[span[0]], by_n[span[1]]])
    return None


def slope_summary(records: list[dict]) -> list[dict]:
    """Log-log slopes of time and peak memory vs N per method: least squares over N >= 4096 when
    at least two such N were measured (else over all N), and the 4096 -> 32768 endpoints."""
    seconds, peak = time_key(records), peak_key(records)
    summary = []
    for label in labels_in_order(records):
        points = measured(records, label)
        large = [r for r in points if r["n"] >= SLOPE_FIT_MIN_N]
        fit = large if len(large) >= 2 else points
        ns = [r["n"] for r in fit]
        summary.append({
            "label": label, "fit_over": f"N>={SLOPE_FIT_MIN_N}" if fit is large else "all N",
            "fit_points": len(fit),
            "time_slope": loglog_slope(ns, [r.get(seconds) for r in fit]),
            "peak_memory_slope": loglog_slope(ns, [r.get(peak) for r in fit]),
            "saved_memory_slope": loglog_slope(ns, [r.get("saved_bytes") for r in fit]),
            "target_time_slope": endpoint_slope(points, seconds, TARGET_SLOPE_SPAN),
            "target_memory_slope": endpoint_slope(points, peak, TARGET_SLOPE_SPAN)})
    return summary


def slopes_table(summary: list[dict]) -> str:
    span = "{}→{}".format(*TARGET_SLOPE_SPAN)
    rows = [[s["label"], f"{s['fit_over']} ({s['fit_points']} pts)", fmt(s["time_slope"], digits=2),
             fmt(s["peak_memory_slope"], digits=2), fmt(s["saved_memory_slope"], digits=2),
             fmt(s["target_time_slope"], digits=2), fmt(s["target_memory_slope"], digits=2)]
            for s in summary]
    return markdown_table(["method", "least-squares fit over", "time slope", "peak-mem slope",
                           "saved-mem slope", f"time slope {span}", f"peak-mem slope {span}"], rows)


def crossover(linear: list[dict], softmax: list[dict], key: str = "train_s") -> dict:
    """Smallest N from which `linear` is faster than `softmax` at every larger N both measured,
    interpolated log-log between the bracketing lengths."""
    softmax_s = {r["n"]: r[key] for r in softmax}
    common = [(r["n"], r[key], softmax_s[r["n"]]) for r in linear if r["n"] in softmax_s]
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


def first_records(records: list[dict]) -> list[dict]:
    """The first record of each method, mask and dtype."""
    return [next(r for r in records if r["label"] == label) for label in labels_in_order(records)]


def linear_labels(records: list[dict]) -> list[dict]:
    return [first for first in first_records(records) if first["linear"]]


def crossover_summary(records: list[dict], peer: str) -> list[dict]:
    """From which N each linear method (other than `peer` itself) is faster than `peer`."""
    key = time_key(records)
    return [{"label": first["label"], **crossover(measured(records, first["label"]),
                                                  measured(records, peer_label(first, peer)), key)}
            for first in linear_labels(records) if first["method"] != peer]


def speedup_summary(records: list[dict], peer: str) -> list[dict]:
    """Time of `peer` / time of each linear method, same mask and dtype, at each N."""
    key, rows = time_key(records), []
    for first in linear_labels(records):
        theirs = {r["n"]: r[key] for r in measured(records, peer_label(first, peer))}
        ours = {r["n"]: r[key] for r in measured(records, first["label"])}
        if first["method"] != peer and theirs:
            rows.append({"label": first["label"], "speedup": {n: theirs[n] / ours[n] for n in ours if n in theirs}})
    return rows


def speedup_table(speedups: list[dict], lengths: tuple[int, ...]) -> str:
    return markdown_table(["method"] + [f"N={n}" for n in lengths],
                          [[s["label"]] + [fmt(s["speedup"].get(n), digits=2, suffix="×") for n in lengths]
                           for s in speedups])


# ---------------------------------------------------------------------------------------------
# The targets, as data: each is a ratio of two measured values and a bound
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Term:
    """A measured value: `method` is "ours" (the linattn favor-post variant judged), "ours-none"
    (its rope=none twin) or a method name; n=None takes every N from `Target.from_n` on."""
    method: str
    key: str
    n: int | None = None


@dataclass(frozen=True)
class Target:
    what: str
    top: Term
    bottom: Term
    bound: float
    at_least: bool          # ratio >= bound is met (else ratio <= bound)
    from_n: int = 0         # with n=None terms: the worst ratio over every common N >= from_n


TARGETS = {
    "cpu": (   # issue 8, section 3 (causal, as imported)
        Target("fwd+bwd speed-up over sdpa at N=8192", Term("sdpa", "train_s", 8192),
               Term("ours", "train_s", 8192), 4.0, at_least=True),
        Target("fwd+bwd time growth N=2048→8192", Term("ours", "train_s", 8192),
               Term("ours", "train_s", 2048), 4.6, at_least=False),
        Target("fwd+bwd peak memory / sdpa's at N=8192", Term("ours", "train_peak_bytes", 8192),
               Term("sdpa", "train_peak_bytes", 8192), 2.0, at_least=False),
        Target("fwd+bwd time rope=post / rope=none at N=8192", Term("ours", "train_s", 8192),
               Term("ours-none", "train_s", 8192), 1.15, at_least=False),
    ),
    "cuda": (  # issue 8, section 6 (one H100)
        Target("fwd+bwd speed-up over sdpa-flash at N=4096", Term("sdpa-flash", "train_s", 4096),
               Term("ours", "train_s", 4096), 1.0, at_least=True),
        Target("fwd+bwd time / fla-chunk's, worst N", Term("ours", "train_s"), Term("fla-chunk", "train_s"),
               1.5, at_least=False),
        Target("fwd+bwd peak memory / sdpa-flash's, worst N >= 4096", Term("ours", "train_peak_bytes"),
               Term("sdpa-flash", "train_peak_bytes"), 1.0, at_least=False, from_n=4096),
    ),
}


def judged_methods(records: list[dict]) -> list[dict]:
    """The causal favor-post records of linattn (one per backend variant and dtype), first N."""
    return [first for first in linear_labels(records)
            if first["mask"] == "causal" and first["method"].startswith("favor-post")]


def target_ratio(records: list[dict], ours: dict, target: Target) -> float | None:
    def values(term: Term) -> dict[int, float]:
        method = {"ours": ours["method"],
                  "ours-none": ours["method"].replace("favor-post", "favor-none", 1)}.get(term.method, term.method)
        return {r["n"]: r[term.key] for r in measured(records, peer_label(ours, method)) if term.key in r}

    top, bottom = values(target.top), values(target.bottom)
    if target.top.n is not None:
        if target.top.n in top and target.bottom.n in bottom:
            return top[target.top.n] / bottom[target.bottom.n]
        return None
    ratios = [top[n] / bottom[n] for n in top if n in bottom and n >= target.from_n]
    return (min if target.at_least else max)(ratios) if ratios else None


def target_summary(records: list[dict], device_type: str) -> list[dict]:
    rows = []
    for ours in judged_methods(records):
        for target in TARGETS[device_type]:
            ratio = target_ratio(records, ours, target)
            met = None if ratio is None else (ratio >= target.bound if target.at_least else ratio <= target.bound)
            rows.append({"label": ours["label"], "target": target.what, "ratio": ratio,
                         "bound": f"{'≥' if target.at_least else '≤'} {target.bound:g}", "met": met})
    return rows


def targets_table(rows: list[dict]) -> str:
    """The measured targets, then one line naming those this run's lengths and methods cannot give."""
    measured_rows = [r for r in rows if r["ratio"] is not None]
    given = {r["target"] for r in measured_rows}   # by some row: fp32 rows have no sdpa-flash, say
    missing = list(dict.fromkeys(r["target"] for r in rows if r["ratio"] is None and r["target"] not in given))
    table = markdown_table(["method", "target", "measured", "bound", ""],
                           [[r["label"], r["target"], fmt(r["ratio"], digits=2), r["bound"],
                             "met" if r["met"] else "NOT met"] for r in measured_rows]) if measured_rows else ""
    line = f"Not measured in this run (lengths or methods missing): {'; '.join(missing)}." if missing else ""
    return "\n\n".join(part for part in (table, line) if part)
