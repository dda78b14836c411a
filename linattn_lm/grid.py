"""Train several attention variants one after another with the same seed, data order and step
budget, and compare them (`python grid.py`).

    python grid.py --preset cpu                                   # the 11 default variants
    python grid.py --preset cpu --variants softmax-rope,linear-favor-post --steps 200
    python grid.py --preset cpu --resume                          # continue an interrupted grid
    tensorboard --logdir runs/grid-cpu

Variants: softmax-rope, softmax-abs, softmax-none, softmax-rope-abs and linear-<map>-<post|pre|none>
for every registered feature map (--import registers more), optionally with -abs.  Takes every
train.py flag except those that pick the variant; a --feature-map-option applies to the variants whose
map takes it, --chunk-size to linear ones.  Writes results.md, results.csv and val_bpc.png into <out-dir>/<run-name> (default
runs/grid-<preset>), one TensorBoard run and checkpoint per variant in its subdirectories.
"""
from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)

import linattn  # noqa: E402
from . import training  # noqa: E402
from .checkpoint import CHECKPOINT_NAME, CheckpointError  # noqa: E402
from .cli import variant_skip  # noqa: E402
from .config import DEFAULT_PRESET, TrainConfig, config_from_flags  # noqa: E402
from .data import default_data_dir  # noqa: E402
from .lm import feature_map_parameters  # noqa: E402
from .ngram import reference_bpc  # noqa: E402
from .runtime import keep_freed_memory, write_atomically  # noqa: E402
from .training import TrainResult  # noqa: E402


def default_variants() -> list[str]:
    """Every softmax variant with RoPE or learned positions, and every registered map x placement."""
    return ["softmax-rope", "softmax-abs"] + [
        f"linear-{feature_map}-{rope}"
        for feature_map in linattn.available_feature_maps() for rope in linattn.ROPE_PLACEMENTS]


COLUMNS = ["variant", "final_val_bpc", "best_val_bpc", "tokens_per_s", "peak_memory_mb", "parameters",
           "steps", "wall_time_s", "seed", "data"]


SOFTMAX_VARIANTS = {"softmax-rope": ("post", False), "softmax-abs": ("none", True),
                    "softmax-none": ("none", False), "softmax-rope-abs": ("post", True)}


def variant_flags(name: str) -> dict[str, Any]:
    """'linear-favor-pre-abs' -> {attention: linear, feature_map: favor, rope: pre, abs_pos: True}."""
    if name in SOFTMAX_VARIANTS:
        rope, abs_pos = SOFTMAX_VARIANTS[name]
        return dict(attention="softmax", rope=rope, abs_pos=abs_pos)
    abs_pos = name.endswith("-abs")
    parts = name.removesuffix("-abs").split("-")
    if parts[0] == "linear" and len(parts) >= 3 and parts[-1] in linattn.ROPE_PLACEMENTS:
        return dict(attention="linear", feature_map="-".join(parts[1:-1]), rope=parts[-1], abs_pos=abs_pos)
    raise ValueError(f"unknown variant {name!r}: expected one of {', '.join(SOFTMAX_VARIANTS)} or "
                     f"linear-<map>-<post|pre|none>[-abs] with a map in {linattn.available_feature_maps()} "
                     "(--import registers more)")


def variant_configs(given: dict[str, Any], variants: list[str]) -> dict[str, TrainConfig]:
    """One TrainConfig per variant, all checked before anything trains.  Each variant takes the
    feature-map options its map accepts; an option no variant's map takes is an error."""
    preset = given.get("preset") or DEFAULT_PRESET
    grid_name = given.get("run_name") or f"grid-{preset}"
    options = given.get("feature_map_options", {})
    used: set[str] = set()
    configs = {}
    for name in variants:
        flags = {**given, **variant_flags(name), "run_name": f"{grid_name}/{name}"}
        flags.pop("feature_map_options", None)
        if flags["attention"] == "softmax":
            flags.pop("chunk_size", None)
        else:
            accepted = {key: value for key, value in options.items()
                        if key in feature_map_parameters(flags["feature_map"])}
            used |= set(accepted)
            flags["feature_map_options"] = accepted
        configs[name] = config_from_flags(flags)
    unused = sorted(set(options) - used)
    if unused:
        raise ValueError(f"no variant's feature map takes option(s) {unused}")
    return configs


def result_rows(results: dict[str, TrainResult]) -> list[dict[str, Any]]:
    return [{"variant": name, "final_val_bpc": round(r.final_val_bpc, 4), "best_val_bpc": round(r.best_val_bpc, 4),
             "tokens_per_s": round(r.tokens_per_s), "peak_memory_mb": round(r.peak_memory_mb),
             "parameters": r.parameters, "steps": r.steps, "wall_time_s": round(r.wall_seconds, 1),
             "seed": r.seed, "data": r.data} for name, r in results.items()]


def curve_style(name: str, families: dict[str, str]) -> dict[str, Any]:
    """One colour per attention family (softmax, each feature map), line style per RoPE placement,
    square markers for learned absolute positions."""
    flags = variant_flags(name)
    family = flags.get("feature_map", "softmax attention")
    color = families.setdefault(family, f"C{len(families)}")
    return dict(color=color, linestyle={"post": "-", "pre": "--", "none": ":"}[flags["rope"]],
                marker="s" if flags["abs_pos"] else "o", markersize=3)


def write_results(grid_dir: Path, results: dict[str, TrainResult], config: TrainConfig,
                  reference: dict[int, float]) -> None:
    """results.csv, results.md and val_bpc.png, each replaced atomically; `reference`: the n-gram
    lines (order -> val bpc)."""
    rows, model = result_rows(results), config.model
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_atomically(grid_dir / "results.csv", lambda path: path.write_text(buffer.getvalue()))

    header = [c for c in COLUMNS if c not in ("seed", "data")]
    markdown = [f"# Grid {grid_dir.name}", "",
                f"preset {config.run.preset}: {model.n_layer} layers x {model.d_model}, {model.n_head} heads, "
                f"seq_len {model.seq_len}, batch {config.optim.batch_size}, {config.optim.steps} steps, "
                f"seed {model.seed}; data: {rows[0]['data'] if rows else '-'}. val bpc on "
                f"{config.log.eval_iters} fixed val batches.", "",
                "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    markdown += ["| " + " | ".join(f"{row[c]:,}" if isinstance(row[c], int) else str(row[c]) for c in header) + " |"
                 for row in rows]
    markdown += ["", "Reference lines: smoothed byte n-gram count models on the whole val split "
                 "(linattn_lm/ngram.py); a model above the order-k line uses less than k bytes of context "
                 "as well as a count table does.", "", "| n-gram order | val bpc |", "|---|---|"]
    markdown += [f"| {order} | {bpc:.4f} |" for order, bpc in reference.items()]
    write_atomically(grid_dir / "results.md", lambda path: path.write_text("\n".join(markdown) + "\n"))

    figure, axes = plt.subplots(figsize=(9, 5.5))
    families: dict[str, str] = {}
    for name, result in results.items():
        axes.plot(result.val_steps, result.val_bpc, label=name, **curve_style(name, families))
    for order, bpc in reference.items():
        axes.axhline(bpc, color="grey", linewidth=0.8, alpha=0.6)
        axes.annotate(f"order-{order} n-gram", (1, bpc), xycoords=("axes fraction", "data"),
                      ha="right", va="bottom", fontsize=7, color="grey")
    axes.set(xlabel="step", ylabel="val bpc", title=f"{grid_dir.name}: validation bits per byte")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    write_atomically(grid_dir / "val_bpc.png", lambda path: figure.savefig(path, format="png", dpi=120))
    plt.close(figure)


def checkpoint_file(config: TrainConfig) -> Path:
    return Path(config.run.out_dir) / config.run.run_name / CHECKPOINT_NAME


def run_grid(configs: dict[str, TrainConfig], grid_dir: Path, resume: bool) -> int:
    """Train the variants in order, rewriting the results after each; stop on Ctrl-C."""
    results: dict[str, TrainResult] = {}
    first = next(iter(configs.values()))
    with training.distributed(first.run.device) as ctx:
        reference = reference_bpc(first.run.data_dir or default_data_dir(), "val") if ctx.is_main else {}
        for number, (name, config) in enumerate(configs.items(), 1):
            if ctx.is_main:
                print(f"=== [{number}/{len(configs)}] {name}", flush=True)
            result = training.train(config, ctx, resume=resume and checkpoint_file(config).exists())
            result.model = None   # free it before the next variant
            results[name] = result
            if ctx.is_main:
                grid_dir.mkdir(parents=True, exist_ok=True)
                write_results(grid_dir, results, config, reference)
            if result.interrupted:
                return training.exit_code(result)
        if ctx.is_main:
            print(f"\n{(grid_dir / 'results.md').read_text()}\nwrote {grid_dir}/results.md, results.csv, val_bpc.png")
    return 0


def listed_variants(listed: str | None) -> list[str]:
    variants = default_variants() if listed is None else [v.strip() for v in listed.split(",") if v.strip()]
    if not variants or len(set(variants)) != len(variants):
        raise ValueError(f"--variants must list distinct variants, got {variants}")
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = training.build_parser("Train a grid of attention variants (same seed, data, steps).",
                                   skip=variant_skip())
    parser.add_argument("--variants", help="comma-separated variants (default: softmax-rope, softmax-abs and "
                                           "linear-<map>-<post|pre|none> for every registered map)")
    args, configs = training.parse_config(
        parser, argv, resolve=lambda given, args: variant_configs(given, listed_variants(args.variants)))
    keep_freed_memory()   # large CPU temporaries reuse freed memory instead of page-faulting
    first = next(iter(configs.values()))
    grid_dir = Path(first.run.out_dir) / Path(first.run.run_name).parent
    finished_before = [name for name, config in configs.items() if checkpoint_file(config).exists()]

    def run() -> int:
        if finished_before and not args.resume:
            raise CheckpointError(f"{grid_dir} already has checkpoints for {', '.join(finished_before)}: pass "
                                  "--resume to continue the grid, or choose another --run-name / --out-dir")
        return run_grid(configs, grid_dir, args.resume)
    return training.run_reporting_errors(run)
