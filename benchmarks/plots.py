"""The scaling plot: time and peak memory vs N, log-log, one row per mask."""
from __future__ import annotations

from pathlib import Path

from linattn_lm.files import write_atomically

from .report import labels_in_order, measured, peak_key, time_key
from .timing import MB


def plot_scaling(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    # One colour per method (backends and kernels apart), shared by a RoPE-none method with its
    # post twin, which is dashed; a second dtype gets square markers.
    families = list(dict.fromkeys(_twin(r["method"]) for r in records))
    colors = {family: plt.cm.tab20(i % 20) for i, family in enumerate(families)}
    dtypes = list(dict.fromkeys(r["dtype"] for r in records))
    masks = list(dict.fromkeys(r["mask"] for r in records))
    lengths = sorted({r["n"] for r in records})
    seconds, peak = time_key(records), peak_key(records)
    figure, axes = plt.subplots(len(masks), 2, figsize=(13, 5 * len(masks)), squeeze=False)
    for row, mask in enumerate(masks):
        for label in labels_in_order([r for r in records if r["mask"] == mask]):
            points = measured(records, label)
            if not points:
                continue
            first = points[0]
            style = {"color": colors[_twin(first["method"])],
                     "marker": "os"[dtypes.index(first["dtype"]) % 2],
                     "linestyle": "--" if "-none" in first["method"] else "-",
                     "label": first["method"] + (f" {first['dtype']}" if len(dtypes) > 1 else "")}
            ns = [r["n"] for r in points]
            axes[row][0].plot(ns, [r[seconds] * 1e3 for r in points], **style)
            axes[row][1].plot(ns, [max(r[peak], 1) / MB for r in points], **style)
        what = "fwd+bwd" if seconds == "train_s" else "fwd"
        for column, ylabel in enumerate((f"{what} time (ms)", f"{what} peak memory (MB)")):
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


def _twin(method: str) -> str:
    """favor-none-torch -> favor-post-torch: the method a RoPE-none one is drawn beside."""
    return method.replace("-none", "-post")
