"""grid.py: variants trained with the same seed, data and steps; results files; bad variants."""
from __future__ import annotations

import csv
from pathlib import Path

import linattn
import pytest

from linattn_lm import grid, load_checkpoint
from linattn_lm.ngram import reference_bpc


def test_grid_trains_variants_and_writes_results(data_dir: Path, tiny: list[str], tmp_path: Path, run_main,
                                                 scalars) -> None:
    code, out, _ = run_main(grid.main, [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "4",
                                        "--eval-interval", "2", "--feature-map-option", "num_features=16",
                                        "--variants", "softmax-abs,linear-elu-none,linear-favor-pre"])
    assert code == 0, out
    grid_dir = tmp_path / "grid-tiny"
    with open(grid_dir / "results.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["variant"] for row in rows] == ["softmax-abs", "linear-elu-none", "linear-favor-pre"]
    assert list(rows[0]) == grid.COLUMNS and all(row["steps"] == "4" for row in rows)
    assert "| linear-favor-pre |" in (grid_dir / "results.md").read_text()
    assert f"| 2 | {reference_bpc(data_dir, 'val')[2]:.4f} |" in (grid_dir / "results.md").read_text()
    assert (grid_dir / "val_bpc.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("softmax-abs", "linear-elu-none", "linear-favor-pre"):
        assert len(scalars(grid_dir / name, "val/bpc")) == 2
    options = lambda name: load_checkpoint(grid_dir / name)["config"]["model"]["feature_map_options"]
    assert options("linear-favor-pre") == {"num_features": 16, "redraw_interval": 1000}
    assert options("linear-elu-none") == {}


@pytest.mark.parametrize("argv, message", [
    (["--variants", "linear-favor-sideways"], "unknown variant 'linear-favor-sideways'"),
    (["--variants", "softmax-rope", "--attention", "linear"], "unrecognized arguments: --attention"),
    (["--variants", ""], "--variants must list distinct variants"),
    (["--variants", "softmax-rope,linear-elu-post", "--feature-map-option", "scale=2"],
     "no variant's feature map takes option(s) ['scale']"),
])
def test_grid_rejects_bad_variants(argv: list[str], message: str, run_main) -> None:
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and message in err


def test_default_variants_cover_every_registered_map() -> None:
    variants = grid.default_variants()
    assert all(f"linear-{name}-post" in variants for name in linattn.available_feature_maps())
