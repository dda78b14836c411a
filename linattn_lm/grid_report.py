"""A grid's report from its runs' records: per-seed rows (results.csv), mean +- std per variant,
seed-paired differences with 95% confidence intervals, the length-extrapolation table and the
n-gram reference lines (results.md), and mean validation curves with their seed range (val_bpc.png).

The headline score is bpc on the whole val split at the training length (eval.py's scoring); a
variant's runs differ only in the seed, and a paired difference takes variant A minus variant B
on the same seed, so the seed's share of the variance (initial weights, data order, FAVOR+ draws)
cancels.  The interval is Student's t over the seeds' differences: with 3 seeds it is wide, and
says so.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from .settings import field_default  # noqa: E402
from .variants import BLOCK_OPTIONS  # noqa: E402
from .files import write_together  # noqa: E402
from .grid_record import COLUMNS, FAR_CLASSES, FAR_MATCHES, REPORT_TITLE, Records  # noqa: E402
from .mqar import HELD_OUT_BATCHES, position_only_accuracy  # noqa: E402

def score_columns(records: Records) -> list[str]:
    """'val_bpc@256', 'test_bpc@256', ... for every (split, window length) scored."""
    keys = {(split, int(length)) for record in records.values() for split, by_length in record["scores"].items()
            for length in by_length}
    return [f"{split}_bpc@{length}" for length, split in sorted((n, s) for s, n in keys)]


def row(record: dict[str, Any]) -> dict[str, Any]:
    scores = {f"{split}_bpc@{length}": bpc for split, by_length in record["scores"].items()
              for length, bpc in by_length.items()}
    return {**{column: record[column] for column in COLUMNS}, **scores}


Score = Callable[[dict[str, Any]], float]   # a number per run record, what paired differences compare


def val_bpc(seq_len: int) -> Score:
    """The headline score: whole-val-split bpc at the training length (always scored)."""
    return lambda record: record["scores"]["val"][str(seq_len)]


def mqar_accuracy(record: dict[str, Any]) -> float:
    """--task mqar: the fraction of the held-out val stream's queries answered right."""
    return record["mqar"]["val"]["accuracy"]


def mean_std(values: Iterable[float], digits: int = 3) -> str:
    """'mean ± sample std'; n/a when any value is (learned positions past their length, say)."""
    values = list(values)
    if not values or any(math.isnan(v) for v in values):
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def by_variant(records: Records) -> dict[str, list[dict[str, Any]]]:
    """Each variant's records in seed order (records arrive seed-major)."""
    variants: dict[str, list[dict[str, Any]]] = {}
    for (_, name), record in records.items():
        variants.setdefault(name, []).append(record)
    return variants


def factors(config: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(family, {factor: level}) of a run's flat config, as it trained: ('linear-favor', {rope: 'post',
    positions: '-', normalization: 'denominator', num_features: '64', redraw_interval: '0'}) for
    linear-favor-post under the cpu preset."""
    family = f"linear-{config['feature_map']}" if config["attention"] == "linear" else "softmax"
    levels = {"rope": config["rope"], "positions": "learned" if config["abs_pos"] else "-",
              "normalization": config.get("normalization", "denominator")}   # records from before it existed
    levels.update({key: repr(value) for key, value in sorted(config["feature_map_options"].items())})
    levels.update({key: str(config[key]) for key in BLOCK_OPTIONS   # a level only where set: older records lack them
                   if config.get(key, field_default(key)) != field_default(key)})
    return family, levels


def comparable_pairs(configs: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(a, b, factor) for every two variants (name -> flat config) of one family whose settings
    differ in exactly one factor (an option only one of them has is a level of its own)."""
    described = {name: factors(config) for name, config in configs.items()}
    names, pairs = list(configs), []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            (family_a, levels_a), (family_b, levels_b) = described[a], described[b]
            differing = [key for key in dict.fromkeys([*levels_a, *levels_b]) if levels_a.get(key) != levels_b.get(key)]
            if family_a == family_b and len(differing) == 1:
                pairs.append((a, b, differing[0]))
    return pairs


def paired_difference(a: list[dict[str, Any]], b: list[dict[str, Any]], score: Score) -> dict[str, Any] | None:
    """score(a) - score(b) on the seeds both have: the differences, their mean, std, 95% t interval and
    paired t-test p."""
    scores_b = {record["seed"]: score(record) for record in b}
    diffs = {record["seed"]: score(record) - scores_b[record["seed"]]
             for record in a if record["seed"] in scores_b}
    if not diffs:
        return None
    values = np.array(list(diffs.values()))
    result: dict[str, Any] = {"seeds": list(diffs), "diffs": values, "mean": float(values.mean()),
                              "std": math.nan, "ci": (math.nan, math.nan), "p": math.nan}
    if len(values) > 1:
        std = float(values.std(ddof=1))
        half = float(stats.t.ppf(0.975, len(values) - 1)) * std / math.sqrt(len(values))
        result.update(std=std, ci=(result["mean"] - half, result["mean"] + half),
                      p=float(stats.ttest_1samp(values, 0.0).pvalue) if std > 0 else math.nan)
    return result


def variant_table(columns: list[str], variants: dict[str, list[dict[str, Any]]],
                  cells: Callable[[list[dict[str, Any]]], list[str]]) -> list[str]:
    """A row per variant: its name, its seeds, then cells(its runs); no table where no variant is given."""
    lines = ["| variant | seeds | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    lines += [f"| {name} | {','.join(str(r['seed']) for r in runs)} | " + " | ".join(cells(runs)) + " |"
              for name, runs in variants.items()]
    return lines if variants else []


def summary_table(variants: dict[str, list[dict[str, Any]]], seq_len: int, unit: str, scope: str) -> list[str]:
    """Scores in `unit` (bpc, or bits per query), over the whole split or held-out streams (`scope`)."""
    return variant_table(
        [f"val {unit} ({scope})", f"test {unit} ({scope})", f"final val {unit} (estimate)",
         f"best val {unit} (estimate)", "wall time per run (s)", "tokens/s", "peak memory (MB)"], variants,
        lambda runs: [mean_std(val_bpc(seq_len)(r) for r in runs),
                      mean_std(r["scores"].get("test", {}).get(str(seq_len), math.nan) for r in runs),
                      mean_std(r["final_val_bpc"] for r in runs), mean_std(r["best_val_bpc"] for r in runs),
                      f"{np.mean([r['wall_time_s'] for r in runs]):,.0f}",
                      f"{np.mean([r['tokens_per_s'] for r in runs]):,.0f}",
                      f"{np.mean([r['peak_memory_mb'] for r in runs]):,.0f}"])


PAIRED_HEADER = ["| A | B | factor | per-seed A - B | mean | std | 95% CI | paired t-test p |",
                 "|---|---|---|---|---|---|---|---|"]


def paired_row(a: str, b: str, factor: str, diff: dict[str, Any]) -> str:
    per_seed = ", ".join(f"{signed(value)} (s{seed})" for seed, value in zip(diff["seeds"], diff["diffs"]))
    ci = f"[{signed(diff['ci'][0])}, {signed(diff['ci'][1])}]" if not math.isnan(diff["ci"][0]) else "n/a"
    std, p = ("n/a" if math.isnan(x) else f"{x:.3f}" for x in (diff["std"], diff["p"]))
    return f"| {a} | {b} | {factor} | {per_seed} | {signed(diff['mean'])} | {std} | {ci} | {p} |"


def paired_table(variants: dict[str, list[dict[str, Any]]], score: Score) -> list[str]:
    rows = [paired_row(a, b, factor, diff)
            for a, b, factor in comparable_pairs({name: runs[0]["config"] for name, runs in variants.items()})
            if (diff := paired_difference(variants[a], variants[b], score)) is not None]
    return [*PAIRED_HEADER, *rows] if rows else []


def softmax_baseline(variants: dict[str, list[dict[str, Any]]]) -> str | None:
    """The grid's softmax attention with RoPE and no learned positions, the yardstick of linear variants."""
    return next((name for name, runs in variants.items()
                 if factors(runs[0]["config"]) == ("softmax", {"rope": "post", "positions": "-",
                                                               "normalization": "denominator"})), None)


def baseline_pairs(variants: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(linear variant, softmax + RoPE) for every linear variant: a comparison across families, which
    comparable_pairs leaves out."""
    baseline = softmax_baseline(variants)
    return [(name, baseline) for name, runs in variants.items()
            if baseline and runs[0]["config"]["attention"] == "linear"]


def control_pairs(variants: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str]]:
    """(linear variant with a window, the window-only control of the same window: softmax over the last W
    keys, no linear term): what the linear term adds to the window."""
    controls = {runs[0]["config"].get("window"): name for name, runs in variants.items()
                if runs[0]["config"]["attention"] == "softmax" and runs[0]["config"].get("window")}
    return [(name, controls[window]) for name, runs in variants.items()
            if runs[0]["config"]["attention"] == "linear" and (window := runs[0]["config"].get("window")) in controls]


def baseline_table(variants: dict[str, list[dict[str, Any]]], score: Score) -> list[str]:
    """Every linear variant against softmax + RoPE on the same seeds, closest first: how far each is
    from the attention it replaces."""
    return against_table(variants, score, baseline_pairs(variants), "attention")


def window_control_table(variants: dict[str, list[dict[str, Any]]], score: Score) -> list[str]:
    """Every linear variant with a window against the window-only control on the same seeds."""
    return against_table(variants, score, control_pairs(variants), "linear term")


# A seed has learned MQAR's recall when its held-out val accuracy at the queries is above this: the outcome
# per seed is nearly binary, so seeds that learn are counted and compared with Fisher's exact test.
LEARNED_ACCURACY = 0.5


def learned_seeds(runs: list[dict[str, Any]]) -> int:
    return sum(mqar_accuracy(r) > LEARNED_ACCURACY for r in runs)


def success_table(variants: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Seeds that learn recall, per variant and for each pair the paired tables compare (one factor,
    against softmax + RoPE, against the window-only control), with Fisher's exact test (two-sided) on
    the 2 x 2 table of learned and not learned."""
    pairs = [(a, b, factor) for a, b, factor in comparable_pairs({n: runs[0]["config"] for n, runs in variants.items()})]
    pairs += [(a, b, "attention") for a, b in baseline_pairs(variants)]
    pairs += [(a, b, "linear term") for a, b in control_pairs(variants)]
    lines = ["| A | B | factor | A learned | B learned | Fisher exact p |", "|---|---|---|---|---|---|"]
    for a, b, factor in pairs:
        (k_a, n_a), (k_b, n_b) = ((learned_seeds(variants[v]), len(variants[v])) for v in (a, b))
        p = stats.fisher_exact([[k_a, n_a - k_a], [k_b, n_b - k_b]]).pvalue
        lines.append(f"| {a} | {b} | {factor} | {k_a} of {n_a} | {k_b} of {n_b} | {p:.3f} |")
    return lines if pairs else []


def against_table(variants: dict[str, list[dict[str, Any]]], score: Score, pairs: list[tuple[str, str]],
                  factor: str) -> list[str]:
    """Paired differences of each (variant, baseline) pair on their common seeds, closest first."""
    diffs = [(name, baseline, diff) for name, baseline in pairs
             if (diff := paired_difference(variants[name], variants[baseline], score)) is not None]
    closest_first = sorted(diffs, key=lambda x: abs(x[2]["mean"]))
    rows = [paired_row(name, baseline, factor, diff) for name, baseline, diff in closest_first]
    return [*PAIRED_HEADER, *rows] if rows else []


def signed(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:+.3f}"


def passes(record: dict[str, Any]) -> float:
    """Passes over the training split: the bytes of the windows trained on / the split's length."""
    config = record["config"]
    return record["steps"] * config["batch_size"] * config["seq_len"] / record["train_bytes"]


def last_train_estimate(record: dict[str, Any]) -> float:
    """The train-split estimate at the last evaluation (nan where there is none)."""
    values = record.get("train_bpc") or [None]
    return math.nan if values[-1] is None else values[-1]


def fit_table(variants: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Passes over the training split and the gap between val and train estimates at the last
    evaluation (the same fixed-window measurement on both splits); variants whose records have them."""
    return variant_table(
        ["passes over the train split", "train bpc (estimate)", "val bpc (estimate)", "val - train"],
        {name: runs for name, runs in variants.items() if all("train_bytes" in r for r in runs)},
        lambda runs: [f"{np.mean([passes(r) for r in runs]):.3g}", mean_std(map(last_train_estimate, runs)),
                      mean_std(r["final_val_bpc"] for r in runs),
                      mean_std(r["final_val_bpc"] - last_train_estimate(r) for r in runs)])


def ar_split_table(variants: dict[str, list[dict[str, Any]]], seq_len: int) -> list[str]:
    """eval.py --ar-split's whole-val-split scores at the training length, for the variants whose
    every run has them."""
    def split(record: dict[str, Any]) -> dict[str, float]:
        return record["ar_split"]["val"][str(seq_len)]

    return variant_table(
        ["AR-hit bpc", "rest bpc", "hit share of the bytes"],
        {name: runs for name, runs in variants.items()
         if all(str(seq_len) in r.get("ar_split", {}).get("val", {}) for r in runs)},
        lambda runs: [mean_std(split(r)["hit_bpc"] for r in runs), mean_std(split(r)["rest_bpc"] for r in runs),
                      f"{np.mean([split(r)['hit_fraction'] for r in runs]):.1%}"])


def far_scores(record: dict[str, Any], seq_len: int) -> dict[str, Any] | None:
    """The far-only split of a run's whole val split at `seq_len`, None where eval.py has not scored it."""
    return record.get("ar_split", {}).get("val", {}).get(str(seq_len), {}).get("far")


def far_bpc(seq_len: int, match: str) -> Score:
    """bpc on the bytes whose nearest copy source (of `match`) lies beyond the window only."""
    return lambda record: far_scores(record, seq_len)[match]["far_bpc"]


def far_split_tables(variants: dict[str, list[dict[str, Any]]], seq_len: int) -> dict[int, list[str]]:
    """Per far window W: each variant's bpc by distance class (the variants whose every run was scored at
    W), then the paired differences in far bpc (one factor, against softmax + RoPE, against the control)."""
    windows = sorted({far["window"] for runs in variants.values() for r in runs if (far := far_scores(r, seq_len))})
    tables = {}
    for window in windows:
        scored = {name: runs for name, runs in variants.items()
                  if all((far := far_scores(r, seq_len)) and far["window"] == window for r in runs)}
        cell = lambda runs, match, key: [far_scores(r, seq_len)[match][key] for r in runs]
        lines = variant_table(
            [f"{match} {kind} bpc" for match in FAR_MATCHES for kind in FAR_CLASSES]
            + [f"{match} far share" for match in FAR_MATCHES], scored,
            lambda runs: [mean_std(cell(runs, match, f"{kind}_bpc")) for match in FAR_MATCHES for kind in FAR_CLASSES]
            + [f"{np.mean(cell(runs, match, 'far_fraction')):.1%}" for match in FAR_MATCHES])
        for match in FAR_MATCHES:
            score = far_bpc(seq_len, match)
            paired = [line for table in (paired_table(scored, score), baseline_table(scored, score),
                                         window_control_table(scored, score)) for line in table[len(PAIRED_HEADER):]]
            if paired:
                lines += ["", f"Paired differences in {match} far bpc (negative: A is better): one factor, then "
                          "against softmax + RoPE and against the window-only control.", "", *PAIRED_HEADER, *paired]
        tables[window] = lines
    return tables


def mqar_table(variants: dict[str, list[dict[str, Any]]]) -> list[str]:
    """--task mqar's accuracy at the query positions (held-out streams) beside each variant's decoding state."""
    return variant_table(
        ["val accuracy", "test accuracy", "state per head and layer"],
        {name: runs for name, runs in variants.items() if all("mqar" in r for r in runs)},
        lambda runs: [mean_std(r["mqar"]["val"]["accuracy"] for r in runs),
                      mean_std(r["mqar"]["test"]["accuracy"] for r in runs), str(runs[0]["mqar"]["state_size"])])


def extrapolation_table(variants: dict[str, list[dict[str, Any]]], seq_len: int) -> list[str]:
    lengths = sorted({int(n) for runs in variants.values() for r in runs for n in r["scores"].get("val", {})})
    if len(lengths) < 2:
        return []
    lines = ["| variant | " + " | ".join(f"{n} ({n / seq_len:g}x)" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for name, runs in variants.items():
        cells = [mean_std(r["scores"]["val"].get(str(n), math.nan) for r in runs) for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write_report(grid_dir: Path, records: Records, config: Any, reference: dict[str, dict[int, float]]) -> None:
    """results.csv, results.md and val_bpc.png, all built before any replaces the one there (a
    failure leaves the earlier three, never a mix); `reference`: the n-gram lines, split -> order -> bpc."""
    variants, unit = by_variant(records), score_labels(config).unit
    table, markdown = results_csv(records), results_markdown(grid_dir, records, variants, config, reference)
    write_together({grid_dir / "results.csv": lambda path: path.write_text(table),
                    grid_dir / "results.md": lambda path: path.write_text(markdown),
                    grid_dir / "val_bpc.png": lambda path: plot_curves(path, grid_dir.name, variants, reference, unit)})


def results_csv(records: Records) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS + score_columns(records))
    writer.writeheader()
    writer.writerows(row(record) for record in records.values())
    return buffer.getvalue()


class ScoreLabels(NamedTuple):
    """How a grid's scores are named: enwik8's bits per byte over whole splits, or MQAR's bits per query
    over held-out streams."""
    unit: str      # what the losses are in
    scope: str     # what the headline scores cover, for column names
    split: str     # the paired tables' score, for their headings
    scored: str    # how the headline scores were taken, for the report's opening


def score_labels(config: Any) -> ScoreLabels:
    if config.task.task == "mqar":
        return ScoreLabels("bits per query", "held-out", "held-out val stream, bits per query",
                           f"Held-out scores: the first {HELD_OUT_BATCHES} batches of the val and test streams of "
                           "the run's seed, at the query positions")
    return ScoreLabels("bpc", "whole split", "whole val split, bpc",
                       f"Whole-split scores: every byte of the split, windows of seq_len {config.model.seq_len} "
                       "(eval.py)")


def results_markdown(grid_dir: Path, records: Records, variants: dict[str, list[dict[str, Any]]], config: Any,
                     reference: dict[str, dict[int, float]]) -> str:
    seq_len = config.model.seq_len
    seeds = sorted({seed for seed, _ in records})
    data = next(iter(records.values()))["data"]
    unit, scope, split, scored = score_labels(config)
    markdown = [f"{REPORT_TITLE}{grid_dir.name}", "",
                f"preset {config.run.preset}: {config.model.n_layer} layers x {config.model.d_model}, "
                f"{config.model.n_head} heads, seq_len {seq_len}, batch {config.optim.batch_size}, "
                f"{config.optim.steps} steps, lr {config.optim.lr}; seeds {','.join(map(str, seeds))}; data: {data}.",
                "", f"Mean ± sample std over seeds. {scored}; estimates: {config.log.eval_iters} fixed val batches "
                "during training.",
                "", *summary_table(variants, seq_len, unit, scope)]
    if reference:   # enwik8's n-gram lines (a --task mqar grid has none)
        markdown += ["", "Reference lines: smoothed byte n-gram count models (linattn_lm/ngram.py); a model above "
                     "the order-k line uses less than k bytes of context as well as a count table does.", "",
                     "| n-gram order | " + " | ".join(f"{split} bpc" for split in reference) + " |",
                     "|---|" + "---|" * len(reference)]
        orders = next(iter(reference.values()), {})
        markdown += [f"| {order} | " + " | ".join(f"{lines[order]:.4f}" for lines in reference.values()) + " |"
                     for order in orders]
    bpc = val_bpc(seq_len)
    paired = paired_table(variants, bpc)
    if paired:
        markdown += ["", f"## Paired differences ({split}; negative: A is better)", "",
                     "Variants that differ in one factor, compared on the same seeds.", "", *paired]
    against_softmax = baseline_table(variants, bpc)
    if against_softmax:
        markdown += ["", f"## Against softmax attention with RoPE ({split}; paired by seed, closest "
                     "first)", "", *against_softmax]
    against_control = window_control_table(variants, bpc)
    if against_control:
        markdown += ["", f"## Against the window-only control ({split}; paired by seed, closest first)",
                     "", *against_control]
    fit = fit_table(variants)
    if fit:
        markdown += ["", "## Fit: passes over the training split and the train-val gap (last evaluation)", "",
                     f"Both estimates: {config.log.eval_iters} fixed batches of the split, in eval mode; a gap that "
                     "grows over training means the model has begun to memorise the training split.", "", *fit]
    mqar = mqar_table(variants)
    if mqar:
        pairs = config.task.mqar_kv_pairs
        markdown += ["", "## Multi-query associative recall (train.py --task mqar; accuracy at the query positions)",
                     "", "Held-out streams of the run's seed. A model "
                     f"that answers with one of the sequence's {pairs} values at random scores 1/{pairs} = {1 / pairs:.1%}; "
                     "one that answers by the query's position alone, never its key (the value of the pair a slot most "
                     "often asks for: the gaps' power law gives the first slots to the first pairs, as in Zoology), "
                     f"{position_only_accuracy(config.model.vocab_size, seq_len, pairs):.1%}. Accuracy above both "
                     "needs recall.", "", *mqar]
        tables = (paired_table(variants, mqar_accuracy), baseline_table(variants, mqar_accuracy),
                  window_control_table(variants, mqar_accuracy))
        rows = [line for table in tables for line in table[len(PAIRED_HEADER):]]
        if rows:
            markdown += ["", "Paired differences in val accuracy (positive: A is better): variants that differ in "
                         "one factor, then each against softmax + RoPE and against the window-only control.", "",
                         *PAIRED_HEADER, *rows]
        successes = success_table(variants)
        if successes:
            markdown += ["", f"Seeds that learn recall (held-out val accuracy above {LEARNED_ACCURACY:.0%}), the same "
                         "pairs, with Fisher's exact test: the outcome per seed is nearly all or nothing, which a t "
                         "interval over accuracies hides. With n seeds a side, n of n against 0 of n is the "
                         "strongest result a test can give (p = 0.008 at n = 5, 0.100 at n = 3).", "", *successes]
    recall = ar_split_table(variants, seq_len)
    if recall:
        markdown += ["", "## Associative recall split (whole val split, bpc; eval.py --ar-split)", "",
                     "AR hits: bytes that continue a byte bigram seen earlier in their window (Zoology's split).",
                     "", *recall]
    for window, lines in far_split_tables(variants, seq_len).items():
        markdown += ["", f"## Far-only split at W = {window} (whole val split, bpc; eval.py --ar-split --far-window "
                     f"{window})", "", f"Bytes by where the nearest earlier copy of their bigram, and of their 8-byte "
                     f"match, lies: near (its source key is under {window} positions back), far (only {window} or more "
                     "back: a window of that size cannot see it) and none (no copy in the window of text).", "", *lines]
    extrapolation = extrapolation_table(variants, seq_len)
    if extrapolation:
        markdown += ["", "## Length extrapolation (whole val split, bpc by window length)", "", *extrapolation]
    return "\n".join(markdown) + "\n"


def plot_curves(path: Path, title: str, variants: dict[str, list[dict[str, Any]]],
                reference: dict[str, dict[int, float]], unit: str) -> None:
    """Mean validation curve per variant over the seeds that reached each step, the seeds' range as
    a band; the val n-gram lines in grey.  Where runs have train-split estimates, a second panel
    shows the mean val - train gap over training."""
    with_gap = {name: runs for name, runs in variants.items() if all(gap_curve(r) is not None for r in runs)}
    figure, panels = plt.subplots(1, 2 if with_gap else 1, figsize=(15 if with_gap else 9, 5.5), squeeze=False)
    axes, families = panels[0][0], {}
    for name, runs in variants.items():
        style = curve_style(runs[0]["config"], families)
        steps = runs[0]["val_steps"]
        curves = np.array([r["val_bpc"] for r in runs if r["val_steps"] == steps])
        axes.plot(steps, curves.mean(axis=0), label=f"{name} ({len(curves)} seeds)", **style)
        if len(curves) > 1:
            axes.fill_between(steps, curves.min(axis=0), curves.max(axis=0), color=style["color"], alpha=0.15)
        if name in with_gap:
            gaps = np.array([gap_curve(r) for r in runs if r["val_steps"] == steps])
            panels[0][1].plot(steps, gaps.mean(axis=0), label=name, **style)
    for order, bpc in reference.get("val", {}).items():
        axes.axhline(bpc, color="grey", linewidth=0.8, alpha=0.6)
        axes.annotate(f"order-{order} n-gram", (1, bpc), xycoords=("axes fraction", "data"),
                      ha="right", va="bottom", fontsize=7, color="grey")
    axes.set(xlabel="step", ylabel=f"val {unit} (estimate)", title=f"{title}: validation {unit}, "
             "mean over seeds (band: seed range)")
    if with_gap:
        gap_axes = panels[0][1]
        gap_axes.axhline(0, color="grey", linewidth=0.8)
        gap_axes.set(xlabel="step", ylabel=f"val - train {unit} (estimates)", title="generalisation gap, mean over seeds")
        gap_axes.grid(alpha=0.3)
        gap_axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)


def curve_style(config: dict[str, Any], families: dict[str, str]) -> dict[str, Any]:
    """One colour per family and options (`families` collects them), the line by RoPE placement,
    squares for learned positions."""
    family, levels = factors(config)
    options = {key: level for key, level in levels.items() if key not in ("rope", "positions")}
    color = families.setdefault(f"{family} {options}", f"C{len(families) % 10}")
    return dict(color=color, linestyle={"post": "-", "pre": "--", "none": ":"}[levels["rope"]],
                marker="s" if levels["positions"] == "learned" else "o", markersize=3)


def gap_curve(record: dict[str, Any]) -> list[float] | None:
    """val - train estimate at each val step, None unless every step has a train estimate."""
    train = record.get("train_bpc")
    if not train or any(value is None for value in train):
        return None
    return [val - tr for val, tr in zip(record["val_bpc"], train)]
