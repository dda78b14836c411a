"""grid.py: variants x seeds under one budget, whole-split scores, resuming, and bad flags."""
from __future__ import annotations

import argparse
import csv
import json
import math
import signal
from pathlib import Path

import linattn
import pytest

from linattn_lm import grid, presets, load_checkpoint, save_checkpoint, training
from linattn_lm.checkpoint import CheckpointError, recorded_digest
from linattn_lm.runlock import DirectoryLock
from linattn_lm.data import load_split
from linattn_lm.ngram import reference_bpc
from linattn_lm.variants import default_variants, variant_flags

VARIANTS = "softmax-abs,linear-elu-none,linear-elu-post"


def read_rows(grid_dir: Path) -> list[dict[str, str]]:
    with open(grid_dir / "results.csv") as file:
        return list(csv.DictReader(file))


@pytest.fixture
def grid_argv(data_dir: Path, tiny: list[str], tmp_path: Path) -> list[str]:
    return [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "4", "--eval-interval", "2",
            "--variants", VARIANTS, "--seeds", "0,1", "--eval-multiples", "2"]


@pytest.mark.slow
def test_grid_trains_every_seed_and_variant_and_reports(grid_argv: list[str], data_dir: Path, tmp_path: Path,
                                                        run_main, scalars) -> None:
    code, out, _ = run_main(grid.main, grid_argv)
    assert code == 0, out
    grid_dir = tmp_path / "grid-tiny"
    rows = read_rows(grid_dir)
    # seed-major: each finished seed completes the paired comparisons
    assert [(row["seed"], row["variant"]) for row in rows] == [(s, v) for s in "01" for v in VARIANTS.split(",")]
    assert all(row["steps"] == "4" for row in rows)
    assert {"val_bpc@64", "val_bpc@128", "test_bpc@64", "test_bpc@128"} <= set(rows[0])
    assert [row["val_bpc@128"] for row in rows if row["variant"] == "softmax-abs"] == ["nan", "nan"]   # n/a: abs_pos
    assert (grid_dir / grid.GRID_MARKER).is_file()
    record = json.loads((grid_dir / "softmax-abs" / "seed-0" / grid.RESULT_NAME).read_text())
    assert record[grid.DIGEST_KEY] == recorded_digest(grid_dir / "softmax-abs" / "seed-0" / "ckpt.pt")
    assert all(2 < float(row["test_bpc@64"]) < 9 for row in rows)

    report = (grid_dir / "results.md").read_text()
    assert "| linear-elu-post | 0,1 |" in report
    assert "| linear-elu-none | linear-elu-post | rope |" in report   # the one pair differing in one factor
    assert report.count("| softmax-abs | linear") == 0               # different families are not paired
    assert "## Length extrapolation" in report and "| 128 (2x) |" in report
    lines = reference_bpc(data_dir, "val"), reference_bpc(data_dir, "test")
    assert f"| 2 | {lines[0][2]:.4f} | {lines[1][2]:.4f} |" in report
    assert (grid_dir / "val_bpc.png").read_bytes()[:4] == b"\x89PNG"

    run = grid_dir / "linear-elu-post" / "seed-1"
    assert len(scalars(run, "val/bpc")) == 2
    assert load_checkpoint(run)["config"]["model"]["seed"] == 1
    record = json.loads((run / "result.json").read_text())
    assert record["seed"] == 1 and record["scores"]["val"]["64"] == float(rows[-1]["val_bpc@64"])
    assert len(record["train_bpc"]) == len(record["val_steps"]) == 2 and all(2 < v < 9 for v in record["train_bpc"])
    assert record["train_bytes"] == len(load_split(data_dir, "train")) and "## Fit" in report
    # same seed, same data order and initial weights across variants: the elu runs start alike
    first = {v: load_checkpoint(grid_dir / v / "seed-0")["config"]["model"]["seed"] for v in VARIANTS.split(",")}
    assert set(first.values()) == {0}


@pytest.mark.slow
def test_grid_resumes_and_adds_seeds_without_retraining(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                        run_main, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "4", "--eval-interval", "2",
            "--variants", VARIANTS]
    assert run_main(grid.main, [*argv, "--seeds", "0"])[0] == 0
    grid_dir = tmp_path / "grid-tiny"
    code, _, err = run_main(grid.main, [*argv, "--seeds", "0"])
    assert code == 2 and f"{grid_dir} already holds .linattn-grid, linear-elu-none, linear-elu-post ...: pass --resume" in err

    (grid_dir / "linear-elu-none" / "seed-0" / "result.json").unlink()   # as if stopped while scoring
    stale = grid_dir / "linear-elu-post" / "seed-0" / "result.json"       # written under other settings
    stale.write_text(stale.read_text().replace('"lr": 0.003', '"lr": 0.5'))
    code, out, _ = run_main(grid.main, [*argv, "--seeds", "0,2", "--resume"])
    assert code == 0, out
    assert "softmax-abs seed 0 (done before)" in out
    for rescored in ("linear-elu-none", "linear-elu-post"):   # from their finished checkpoints
        assert f"{rescored} seed 0 (done before)" not in out
    assert '"lr": 0.003' in stale.read_text()
    assert "resumed" in out and "linear-elu-none seed 2" in out
    assert [(row["seed"], row["variant"]) for row in read_rows(grid_dir)] == [
        (s, v) for s in "02" for v in VARIANTS.split(",")]

    code, _, err = run_main(grid.main, [*argv, "--seeds", "0", "--resume", "--steps", "3", "--decay-steps", "4"])
    assert code == 2 and "is at step 4, past --steps 3: there is nothing to train; pass --steps 4" in err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(grid, "whole_split_scores", interrupted)
    code, _, err = run_main(grid.main, [*argv, "--seeds", "5", "--resume"])
    assert code == 130 and "stopped while scoring" in err and "--resume scores it again" in err
    assert (grid_dir / "softmax-abs" / "seed-5" / "ckpt.pt").exists()


@pytest.mark.slow
def test_resume_and_report_take_the_grids_recorded_settings(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                            run_main) -> None:
    where = ["--out-dir", str(tmp_path), "--run-name", "g"]
    started = [*tiny, *where, "--data-dir", str(data_dir), "--steps", "4", "--eval-interval", "2",
               "--variants", "linear-elu-post", "--seeds", "0", "--eval-multiples", "2"]
    assert run_main(grid.main, started)[0] == 0
    code, out, _ = run_main(grid.main, [*where, "--resume"])   # the flags, variants and seeds as recorded
    assert code == 0 and "linear-elu-post seed 0 (done before)" in out, out

    code, out, _ = run_main(grid.main, [*where, "--resume", "--variants", "linear-elu-none", "--seeds", "1"])
    assert code == 0 and "linear-elu-none seed 1" in out, out
    marker = json.loads((tmp_path / "g" / grid.GRID_MARKER).read_text())
    assert marker["variants"] == ["linear-elu-post", "linear-elu-none"] and marker["seeds"] == [0, 1]
    assert marker["flags"]["steps"] == 4 and "out_dir" not in marker["flags"]
    assert "feature_map_options" not in marker["flags"]   # none given: the resume adds no empty record of them
    assert marker["resolved"]["seq_len"] == 64 and marker["resolved"]["steps"] == 4   # the tiny preset's values

    assert marker["flags"]["data_dir"] == str(data_dir.resolve())   # absolute, as a checkpoint records it
    code, out, _ = run_main(grid.main, [*where, "--resume", "--seed", "1", "--variants", "linear-elu-none"])
    assert code == 0 and "linear-elu-none seed 1 (done before)" in out and "seed 0" not in out, out

    code, out, _ = run_main(grid.main, [*where, "--report-only"])
    assert code == 0 and "2 of 4 runs finished" in out, out   # elu-post seed 1 and elu-none seed 0 never trained
    assert "| 128 (2x) |" in (tmp_path / "g" / "results.md").read_text()   # the recorded --eval-multiples

    code, _, err = run_main(grid.main, [*where, "--resume", "--lr", "0.5", "--preset", "cpu", "--threads", "2"])
    assert code == 2 and "contradict" in err and "--lr" in err and "--preset" in err and "--threads" not in err
    (tmp_path / "g" / grid.GRID_MARKER).write_text('{"flags": {}, "variants": "x"}')
    code, _, err = run_main(grid.main, [*where, "--resume"])
    assert code == 2 and "damaged" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("edit", [{"variants": []}, {"seeds": []}, {"eval_multiples": []}, {"seeds": [-1]},
                                  {"seeds": [True]}, {"eval_multiples": [0]}, {"variants": [""]}, {"variants": [3]}])
def test_an_edited_marker_with_an_empty_or_wrong_list_is_damaged(tmp_path, edit):
    """An empty list would read as the defaults (every registered variant, seed 0) and start runs the
    grid never listed; a seed or multiple out of range would be blamed on flags nobody gave."""
    marker = {"flags": {}, "resolved": None, "variants": ["softmax-rope"], "seeds": [0], "eval_multiples": [1]}
    (tmp_path / grid.GRID_MARKER).write_text(json.dumps({**marker, **edit}))
    key = next(iter(edit))
    with pytest.raises(CheckpointError, match=f"damaged: its '{key}'"):
        grid.started_settings(tmp_path)
    (tmp_path / grid.GRID_MARKER).write_text(json.dumps(marker))
    assert grid.started_settings(tmp_path) == marker


@pytest.mark.parametrize("flags", [{"lr": "abc"}, {"steps": 2.5}, {"no_such_setting": 1}, {"preset": 3},
                                   {"feature_map_options": "ab"}])
def test_a_marker_whose_flags_do_not_load_is_named_not_blamed_on_the_code(tmp_path, flags):
    """lr 'abc' would resolve to other values than the marker recorded, read as a preset changed in the code."""
    marker = {"flags": flags, "resolved": {}, "variants": ["softmax-rope"], "seeds": [0], "eval_multiples": [1]}
    (tmp_path / grid.GRID_MARKER).write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match="do not load"):
        grid.started_settings(tmp_path)


def started_grid(tmp_path: Path, data_dir: Path) -> tuple[Path, dict]:
    """A grid directory whose marker records a tiny grid of 4 steps (flags and what they resolve to)."""
    grid_dir = tmp_path / "g"
    grid_dir.mkdir()
    flags = {"preset": "tiny", "steps": 4, "data_dir": str(data_dir)}
    marker = {"flags": flags, "resolved": grid.resolved_settings(flags), "variants": ["softmax-rope"], "seeds": [0],
              "eval_multiples": [1]}
    (grid_dir / grid.GRID_MARKER).write_text(json.dumps(marker))
    return grid_dir, marker


@pytest.mark.parametrize("mode", ["--resume", "--report-only"])
def test_a_grid_whose_preset_changed_since_it_started_is_refused_before_training(mode, tmp_path: Path, run_main,
                                                                                 monkeypatch, data_dir: Path) -> None:
    grid_dir, marker = started_grid(tmp_path, data_dir)
    where = ["--out-dir", str(tmp_path), "--run-name", "g", mode]
    unchecked = "nothing to report"   # what --report-only answers past the check: no run finished
    assert unchecked in run_main(grid.main, where[:-1] + ["--report-only"])[2]
    monkeypatch.setitem(presets.PRESETS, "tiny", {**presets.PRESETS["tiny"], "seq_len": 32})
    code, _, err = run_main(grid.main, where)
    assert code == 2 and "seq_len" in err and len(err.strip().splitlines()) == 1, err
    del marker["resolved"]   # a marker from before they recorded values: it cannot tell
    (grid_dir / grid.GRID_MARKER).write_text(json.dumps(marker))
    assert unchecked in run_main(grid.main, where[:-1] + ["--report-only"])[2]


def test_a_resume_with_more_steps_records_what_they_resolve_to_for_the_next_one(tmp_path: Path,
                                                                                 data_dir: Path) -> None:
    """decay_steps stays what it resolved to at the start: the marker records it with the new steps."""
    grid_dir, _ = started_grid(tmp_path, data_dir)
    args = argparse.Namespace(report_only=False, resume=True, seeds=None, eval_multiples=None, variants=None)
    where = {"out_dir": str(tmp_path), "run_name": "g"}
    settings = grid.parse_grid_flags({**where, "steps": 8}, args)[-1]
    assert settings["resolved"]["decay_steps"] == 4   # kept, as train.py's --resume keeps it: the runs extend
    (grid_dir / grid.GRID_MARKER).write_text(json.dumps(settings))
    assert grid.parse_grid_flags(where, args)[-1]["flags"]["steps"] == 8   # the next resume is not refused


def test_a_grid_with_grid_wide_flags_resumes_before_any_run_has_finished(tmp_path: Path, data_dir: Path) -> None:
    """The earlier runs to report are looked up only where a result.json exists: none finished is no
    runs, not run_configs' checks of --chunk-size and --backend against an empty grid."""
    grid_dir = tmp_path / "g"
    grid_dir.mkdir()
    flags = {"preset": "tiny", "steps": 4, "data_dir": str(data_dir), "backend": "torch", "chunk_size": 8}
    marker = {"flags": flags, "resolved": grid.resolved_settings(flags), "variants": ["linear-elu-post"],
              "seeds": [0], "eval_multiples": [1]}
    (grid_dir / grid.GRID_MARKER).write_text(json.dumps(marker))
    args = argparse.Namespace(report_only=False, resume=True, seeds=None, eval_multiples=None, variants=None)
    configs, earlier, *_ = grid.parse_grid_flags({"out_dir": str(tmp_path), "run_name": "g"}, args)
    assert list(configs) == [(0, "linear-elu-post")] and earlier == {}


def test_a_resume_may_repeat_the_grids_options_one_by_one_but_not_change_them() -> None:
    recorded = {"preset": "tiny", "feature_map_options": {"num_features": 16, "shape": [1, 2]}}
    flags = grid.continued_flags(recorded, {"feature_map_options": {"num_features": 16, "shape": (1, 2)}, "seed": 3})
    assert flags["feature_map_options"] == {"num_features": 16, "shape": [1, 2]} and flags["seed"] == 3
    with pytest.raises(ValueError, match="--feature-map-option num_features"):
        grid.continued_flags(recorded, {"feature_map_options": {"num_features": 8}})


def test_each_run_gets_its_seed_and_the_options_its_map_takes(data_dir: Path) -> None:
    given = dict(preset="tiny", data_dir=str(data_dir), feature_map_options={"num_features": 16})
    configs = grid.run_configs(given, ["linear-favor-pre", "linear-elu-none",
                                       "linear-favor-post+redraw_interval=0"], [0, 3])
    assert list(configs)[:2] == [(0, "linear-favor-pre"), (0, "linear-elu-none")]
    assert [config.model.seed for config in configs.values()] == [0, 0, 0, 3, 3, 3]
    assert configs[3, "linear-favor-post+redraw_interval=0"].run.run_name == (
        "grid-tiny/linear-favor-post+redraw_interval=0/seed-3")
    options = {name: config.model.feature_map_options for (_, name), config in configs.items()}
    assert options == {"linear-favor-pre": {"num_features": 16, "redraw_interval": 1000},
                       "linear-elu-none": {},
                       "linear-favor-post+redraw_interval=0": {"num_features": 16, "redraw_interval": 0}}


def test_backend_goes_to_the_variants_of_its_attention(data_dir: Path) -> None:
    mixed = ["softmax-rope", "linear-favor-post"]
    for backend, softmax, linear in (("torch", "auto", "torch"), ("sdpa", "sdpa", "auto"), ("auto", "auto", "auto")):
        configs = grid.run_configs(dict(preset="tiny", data_dir=str(data_dir), backend=backend), mixed, [0])
        assert [configs[0, name].model.backend for name in mixed] == [softmax, linear]
    with pytest.raises(ValueError, match="kernel of no listed variant's attention"):
        grid.run_configs(dict(preset="tiny", data_dir=str(data_dir), backend="sdpa"), ["linear-favor-post"], [0])


def record(seed: int, variant: str, val: float) -> dict:
    return {"variant": variant, "seed": seed, "scores": {"val": {"256": val}}}


def test_paired_difference_is_a_t_interval_over_seeds() -> None:
    from linattn_lm.grid_report import paired_difference, val_bpc
    a = [record(s, "a", v) for s, v in enumerate([2.1, 2.2, 2.3])]
    b = [record(s, "b", 2.0) for s in range(3)] + [record(7, "b", 9.0)]   # seed 7 has no partner
    diff = paired_difference(a, b, val_bpc(256))
    assert diff["seeds"] == [0, 1, 2]
    assert diff["mean"] == pytest.approx(0.2) and diff["std"] == pytest.approx(0.1)
    half = 4.302652729911275 * 0.1 / 3 ** 0.5            # t(0.975, 2 dof)
    assert diff["ci"] == pytest.approx((0.2 - half, 0.2 + half))
    assert diff["p"] == pytest.approx(0.0742, abs=1e-3)  # two-sided, t = 0.2 / (0.1 / sqrt 3) = 3.46, 2 dof
    single = paired_difference(a[:1], b, val_bpc(256))
    assert single["mean"] == pytest.approx(0.1) and all(map(math.isnan, single["ci"]))   # one seed: no interval


def test_variants_whose_settings_differ_in_one_factor_are_paired() -> None:
    from linattn_lm.grid_report import comparable_pairs
    configs = grid.run_configs({"preset": "cpu"}, [
        "softmax-rope", "softmax-abs", "linear-favor-post", "linear-favor-pre", "linear-favor-pre-abs",
        "linear-favor-post+redraw_interval=250", "linear-favor-post+redraw_interval=0", "linear-elu-post"], [0])
    assert comparable_pairs({name: config.flat() for (_, name), config in configs.items()}) == [
        ("linear-favor-post", "linear-favor-pre", "rope"),
        ("linear-favor-post", "linear-favor-post+redraw_interval=250", "redraw_interval"),
        ("linear-favor-pre", "linear-favor-pre-abs", "positions"),
        ("linear-favor-pre", "linear-favor-post+redraw_interval=0", "rope"),
        ("linear-favor-post+redraw_interval=250", "linear-favor-post+redraw_interval=0", "redraw_interval")]
    # softmax-rope and -abs differ in two factors; linear-favor-post+redraw_interval=0 is
    # linear-favor-post itself under the cpu preset (no redraws): the same settings, no pair


def test_a_score_that_is_not_a_number_shows_as_n_a() -> None:
    from linattn_lm.grid_report import mean_std, paired_table, val_bpc
    assert mean_std([2.0, 2.2]) == "2.100 ± 0.141" and mean_std([2.0]) == "2.000"
    assert mean_std([2.0, math.nan]) == "n/a" and mean_std([]) == "n/a"
    config = lambda rope: {"attention": "linear", "feature_map": "elu", "rope": rope, "abs_pos": False,
                           "feature_map_options": {}}
    runs = {rope: [{**record(seed, rope, value), "config": config(rope)} for seed, value in enumerate(values)]
            for rope, values in (("post", [2.0, math.nan]), ("none", [2.1, 2.2]))}
    row = paired_table(runs, val_bpc(256))[2]
    assert "| post | none | rope | -0.100 (s0), n/a (s1) | n/a | n/a | n/a | n/a |" == row


def test_variant_names_carry_feature_map_options() -> None:
    assert variant_flags("linear-favor-pre-abs+redraw_interval=0+num_features=32") == dict(
        attention="linear", feature_map="favor", rope="pre", abs_pos=True, normalization="denominator",
        feature_map_options={"redraw_interval": 0, "num_features": 32})
    assert variant_flags("softmax-rope") == dict(attention="softmax", rope="post", abs_pos=False)


@pytest.mark.parametrize("name, feature_map, rope, normalization, abs_pos, run_name", [
    ("linear-favor-post-rmsnorm", "favor", "post", "rmsnorm", False, "linear-favor-post-rmsnorm-M32"),
    ("linear-hedgehog-pre-rmsnorm-abs", "hedgehog", "pre", "rmsnorm", True, "linear-hedgehog-pre-rmsnorm-abs"),
    ("linear-taylor-none", "taylor", "none", "denominator", False, "linear-taylor-none"),
    ("linear-hedgehog-post+num_features=16", "hedgehog", "post", "denominator", False, "linear-hedgehog-post-M16"),
])
def test_variant_names_select_the_new_maps_and_the_normalization(name, feature_map, rope, normalization, abs_pos,
                                                                  run_name, data_dir: Path) -> None:
    flags = variant_flags(name)
    assert (flags["feature_map"], flags["rope"], flags["normalization"], flags["abs_pos"]) == (
        feature_map, rope, normalization, abs_pos)
    config = grid.run_configs(dict(preset="tiny", data_dir=str(data_dir)), [name], [0])[0, name]
    assert (config.model.feature_map, config.model.normalization) == (feature_map, normalization)
    assert config.model.variant == run_name


def test_variants_that_differ_in_the_normalization_only_are_paired() -> None:
    from linattn_lm.grid_report import comparable_pairs
    names = ["linear-favor-post", "linear-favor-post-rmsnorm", "linear-favor-pre-rmsnorm", "linear-taylor-post"]
    configs = {name: config.flat() for (_, name), config in grid.run_configs({"preset": "cpu"}, names, [0]).items()}
    assert comparable_pairs(configs) == [("linear-favor-post", "linear-favor-post-rmsnorm", "normalization"),
                                         ("linear-favor-post-rmsnorm", "linear-favor-pre-rmsnorm", "rope")]
    del configs["linear-favor-post"]["normalization"]   # a record written before the setting existed
    assert comparable_pairs(configs)[0] == ("linear-favor-post", "linear-favor-post-rmsnorm", "normalization")


def test_results_written_before_normalization_existed_are_reused(data_dir: Path, tmp_path: Path) -> None:
    """grid.py --resume reuses a finished run whose result.json has no normalization key: it trained
    with the default; under another normalization it is not reused."""
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), steps=4)
    config = grid.run_configs(given, ["linear-favor-post"], [0])[0, "linear-favor-post"]
    old = config.flat()
    del old["normalization"]
    record = {key: 0 for key in grid.RECORD_KEYS} | {
        "variant": "linear-favor-post", "data": "sample", "val_steps": [], "val_bpc": [],
        "config": old, "steps": 4, "scores": {split: {"64": 3.0} for split in grid.EVAL_SPLITS}}
    config.run.run_dir.mkdir(parents=True)
    (config.run.run_dir / grid.RESULT_NAME).write_text(json.dumps(record))
    assert grid.saved_record((0, "linear-favor-post"), config, [1]) == record
    config.model.normalization = "rmsnorm"
    assert grid.saved_record((0, "linear-favor-post"), config, [1]) is None


def test_config_differences_take_an_absent_setting_as_its_default() -> None:
    from linattn_lm.resume import config_differences
    current = {"normalization": "denominator", "lr": 0.003, "steps": 5}
    assert config_differences({"lr": 0.003, "steps": 9}, current) == []
    assert config_differences({"lr": 0.003, "normalization": "rmsnorm"}, current) == [
        "normalization: checkpoint 'rmsnorm', now 'denominator'"]
    assert config_differences({"lr": 0.003}, {**current, "normalization": "rmsnorm"}) == [
        "normalization: checkpoint 'denominator', now 'rmsnorm'"]
    assert config_differences({"lr": 0.003, "mystery": 1}, current) == ["mystery: checkpoint 1, now '<absent>'"]


@pytest.mark.parametrize("argv, message", [
    (["--variants", "linear-favor-sideways"], "unknown variant 'linear-favor-sideways'"),
    (["--variants", "linear-favor-rmsnorm-post"], "unknown feature map 'favor-rmsnorm'"),
    (["--variants", "softmax-rope-rmsnorm"], "unknown variant 'softmax-rope-rmsnorm'"),
    (["--variants", "softmax-rope+redraw_interval=0"], "unknown variant 'softmax-rope+redraw_interval=0'"),
    (["--variants", "linear-favor-post+redraw"], "variant 'linear-favor-post+redraw': expected KEY=VALUE"),
    (["--variants", "linear-favor-post+redraw_interval=1+redraw_interval=2"], "gives an option twice"),
    (["--variants", "linear-elu-post+redraw_interval=5"], "redraw_interval"),
    (["--variants", "softmax-rope", "--attention", "linear"], "unrecognized arguments: --attention"),
    (["--variants", ""], "--variants must list distinct variant names"),
    (["--variants", "softmax-rope,softmax-rope"], "--variants must list distinct"),
    (["--variants", "softmax-rope,linear-elu-post", "--feature-map-option", "scale=2"],
     "no variant's feature map takes option(s) ['scale']"),
    (["--seeds", "0,x"], "--seeds must list distinct integer seeds"),
    (["--seeds", "0,0"], "--seeds must list distinct"),
    (["--seeds", "0,1", "--seed", "3"], "give either --seed or --seeds"),
    (["--seeds", "-1"], "--seeds must be >= 0, got -1"),
    (["--eval-multiples", "0"], "--eval-multiples must be >= 1, got 0"),
    (["--variants", "softmax-rope,softmax-abs", "--chunk-size", "32"], "--chunk-size applies to linear variants only"),
])
def test_grid_rejects_bad_flags(argv: list[str], message: str, run_main) -> None:
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and message in err, err


@pytest.mark.parametrize("text", ["softmax-rope,,linear-elu-post", "softmax-rope,", ",softmax-rope", " , "])
def test_a_list_flag_with_an_empty_item_is_refused(text: str) -> None:
    """As an empty list is, not read as 'a,b'; called directly: through grid.main, an accepted list trains."""
    with pytest.raises(ValueError, match=f"no empty item, got '{text}'"):
        grid.listed(text, [], str, "--variants", "variant names")


@pytest.mark.parametrize("name", ["", ".", " ", "g/./h"])
def test_a_grid_name_that_names_no_directory_of_its_own_is_refused(name: str, data_dir: Path, tiny: list[str],
                                                                    tmp_path: Path, run_main) -> None:
    """'' fell back to grid-<preset>, '.' reported on --out-dir itself."""
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", name, "--report-only"]
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and "run_name must be a relative name inside --out-dir" in err and f"got {name!r}" in err, err
    assert list(tmp_path.iterdir()) == []


def test_default_variants_cover_every_registered_map() -> None:
    variants = default_variants()
    assert all(f"linear-{name}-post" in variants for name in linattn.available_feature_maps())


def test_resume_of_a_grid_that_does_not_exist_is_refused(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                         run_main) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--variants", VARIANTS, "--resume"]
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and "there is none at" in err and "drop --resume" in err
    assert not (tmp_path / "grid-tiny").exists()


def test_eval_windows_longer_than_a_split_are_refused_before_training(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                                      run_main) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--variants", VARIANTS,
            "--eval-multiples", "1,100000"]
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and "--eval-multiples 100000 x --seq-len" in err and "choose smaller multiples" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "grid-tiny").exists()


def test_a_signal_with_a_runs_last_step_stops_the_grid_before_scoring_it(grid_argv: list[str], tmp_path: Path,
                                                                        run_main, signal_at_the_last_step) -> None:
    signal_at_the_last_step(signal.SIGINT)
    code, _, err = run_main(grid.main, [*grid_argv, "--variants", "linear-elu-post", "--seeds", "0"])
    run = tmp_path / "grid-tiny" / "linear-elu-post" / "seed-0"
    assert code == 130 and "--resume scores it and goes on" in err, err
    assert load_checkpoint(run)["step"] == 4 and not (run / "result.json").exists()


def test_resume_with_fewer_seeds_or_variants_keeps_the_finished_ones_in_the_report(grid_argv: list[str],
                                                                                   tmp_path: Path, run_main) -> None:
    argv = [*grid_argv, "--eval-multiples", "1"]
    assert run_main(grid.main, [*argv, "--variants", "linear-elu-post", "--seeds", "1,2"])[0] == 0
    code, out, _ = run_main(grid.main, [*argv, "--variants", "linear-elu-post", "--seeds", "0", "--resume"])
    assert code == 0, out
    assert [row["seed"] for row in read_rows(tmp_path / "grid-tiny")] == ["0", "1", "2"]
    assert "seeds 0,1,2" in (tmp_path / "grid-tiny" / "results.md").read_text()
    code, out, _ = run_main(grid.main, [*argv, "--variants", "linear-elu-none", "--seeds", "0", "--resume"])
    assert code == 0, out
    assert sorted((row["variant"], row["seed"]) for row in read_rows(tmp_path / "grid-tiny")) == [
        ("linear-elu-none", "0"), ("linear-elu-post", "0"), ("linear-elu-post", "1"), ("linear-elu-post", "2")]


def write_finished_run(given: dict, variant: str, seed: int, val: float, train: float | None = None) -> None:
    """A run's result.json as grid.py writes it, for the configuration these flags give; without
    `train` (the train-split estimate), as it wrote it before that was measured."""
    config = grid.run_configs(given, [variant], [seed])[seed, variant]
    scores = {split: {"64": val} for split in grid.EVAL_SPLITS}
    record = {key: 0 for key in grid.RECORD_KEYS} | {
        "variant": variant, "seed": seed, "steps": config.optim.steps, "data": "sample", "val_steps": [1],
        "val_bpc": [val], "final_val_bpc": val, "best_val_bpc": val, "scores": scores, "config": config.flat()}
    if train is not None:
        record |= {"train_bpc": [train], "train_bytes": 1000}
    config.run.run_dir.mkdir(parents=True)
    (config.run.run_dir / grid.RESULT_NAME).write_text(json.dumps(record))


def test_report_only_tabulates_the_finished_runs_and_trains_nothing(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                                    run_main) -> None:
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    for seed, post, none in ((0, 3.0, 3.5), (1, 3.1, 3.4)):
        write_finished_run(given, "linear-elu-post", seed, post)
        write_finished_run(given, "linear-elu-none", seed, none)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--seeds", "0,1,2",
            "--variants", "linear-elu-post,linear-elu-none,softmax-rope", "--report-only"]
    code, out, err = run_main(grid.main, argv)
    assert code == 0, err
    assert "4 of 9 runs finished" in out
    report = (tmp_path / "g" / "results.md").read_text()
    assert "| linear-elu-post | linear-elu-none | rope | -0.500 (s0), -0.300 (s1) | -0.400 |" in report
    assert not any((tmp_path / "g").glob("*/seed-*/ckpt.pt"))   # nothing trained
    assert not (tmp_path / "g" / "softmax-rope").exists()
    assert "## Fit" not in report   # records from before the train-split estimate


@pytest.mark.parametrize("change, key", [(lambda r: r["config"].update(lr=0.5), "lr"),
                                         (lambda r: r.update(steps=1), "steps")])
def test_report_only_says_which_result_it_leaves_out_for_other_settings(change, key, data_dir: Path, tiny: list[str],
                                                                        tmp_path: Path, run_main) -> None:
    """A result.json written for other settings than the grid's is not reported, and a line names it."""
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    for variant in ("linear-elu-post", "linear-elu-none"):
        write_finished_run(given, variant, 0, 3.0)
    result = tmp_path / "g" / "linear-elu-post" / "seed-0" / grid.RESULT_NAME
    damage(result, change)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--report-only",
            "--variants", "linear-elu-post,linear-elu-none"]
    code, out, err = run_main(grid.main, argv)
    assert code == 0 and "1 of 2 runs finished" in out, out + err
    assert f"{result}: written for other settings ({key}: result.json" in err and "not used" in err, err


def test_the_report_gives_passes_and_the_train_val_gap_where_records_have_them(data_dir: Path, tiny: list[str],
                                                                               tmp_path: Path, run_main) -> None:
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    for seed, val, train in ((0, 3.0, 2.5), (1, 3.2, 2.9)):
        write_finished_run(given, "linear-elu-post", seed, val, train)
        write_finished_run(given, "linear-elu-none", seed, val + 0.5)   # an older record: no estimate
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--seeds", "0,1",
            "--variants", "linear-elu-post,linear-elu-none", "--report-only"]
    code, _, err = run_main(grid.main, argv)
    assert code == 0, err
    config = grid.run_configs(given, ["linear-elu-post"], [0])[0, "linear-elu-post"]
    passes = config.optim.steps * config.optim.batch_size * config.model.seq_len / 1000
    report = (tmp_path / "g" / "results.md").read_text()
    assert "## Fit: passes over the training split and the train-val gap" in report
    assert f"| linear-elu-post | 0,1 | {passes:.3g} | 2.700 ± 0.283 | 3.100 ± 0.141 | 0.400 ± 0.141 |" in report
    assert "| linear-elu-none | 0,1 | " not in report.split("## Fit")[1]


def damage(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("spoil, message", [
    (lambda path: damage(path, lambda r: r.update(final_val_bpc="oops")), "final_val_bpc is 'oops', not a number"),
    (lambda path: damage(path, lambda r: r["scores"]["val"].update({"64": None})), "scores.val.64 is None, not a number"),
    (lambda path: damage(path, lambda r: r.update(val_bpc=[3.0, 3.1])), "val_bpc has 2 values for 1 val_steps"),
    (lambda path: damage(path, lambda r: r.update(train_bpc=[2.0, 2.1], train_bytes=10)),
     "train_bpc has 2 values for 1 val_steps"),
    (lambda path: damage(path, lambda r: r.update(train_bpc=["a"], train_bytes=10)),
     "train_bpc is ['a'], not a list of numbers (or null)"),
    (lambda path: damage(path, lambda r: r.update(train_bpc=[2.0], train_bytes=0)), "train_bytes is 0, not a whole number > 0"),
    (lambda path: damage(path, lambda r: r.update(train_bpc=[2.0])), "train_bpc without train_bytes"),
    (lambda path: damage(path, lambda r: r["config"].pop("rope")), "config.rope is None, not str"),
    (lambda path: damage(path, lambda r: r.update(final_val_bpc=math.nan)), "final_val_bpc is nan, not a finite score"),
    (lambda path: damage(path, lambda r: r["scores"]["test"].update({"64": math.inf})),
     "scores.test.64 is inf, not a finite score"),
    (lambda path: damage(path, lambda r: r.update(checkpoint_sha256="abc")), "checkpoint_sha256 is 'abc'"),
    (lambda path: path.write_text(path.read_text()[:40]), "not valid JSON"),
    (lambda path: path.write_text("[" * 200000 + "]" * 200000), "not valid JSON"),   # a RecursionError
    (lambda path: damage(path, lambda r: r.update(variant="linear-elu-none")),   # another run's, copied here
     "it records linear-elu-none seed 0, but its directory is linear-elu-post seed 0"),
    (lambda path: damage(path, lambda r: r.update(seed=1)), "it records linear-elu-post seed 1, but its directory"),
])
def test_report_only_refuses_a_damaged_result_and_keeps_the_report_it_had(spoil, message: str, data_dir: Path,
                                                                          tiny: list[str], tmp_path: Path,
                                                                          run_main) -> None:
    """Not a traceback, not a run silently left out, and no results.csv of one state beside a
    results.md of another: one line naming the file and the field, and the earlier report kept."""
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    for variant, val in (("linear-elu-post", 3.0), ("linear-elu-none", 3.5)):
        write_finished_run(given, variant, 0, val)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--report-only",
            "--variants", "linear-elu-post,linear-elu-none"]
    assert run_main(grid.main, argv)[0] == 0
    report = {path.name: path.read_bytes() for path in (tmp_path / "g").glob("*.*")}
    result = tmp_path / "g" / "linear-elu-post" / "seed-0" / grid.RESULT_NAME
    spoil(result)
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and err.startswith(f"error: {result}: ") and message in err, err
    assert "delete it and run grid.py again with --resume" in err and len(err.strip().splitlines()) == 1
    assert {path.name: path.read_bytes() for path in (tmp_path / "g").glob("*.*")} == report


def test_the_report_is_built_whole_before_any_file_is_replaced(tmp_path: Path, monkeypatch) -> None:
    """A failure while plotting leaves the earlier results.csv, results.md and val_bpc.png, not a new
    csv beside the old plot."""
    from linattn_lm import grid_report
    configs = grid.run_configs({"preset": "tiny", "out_dir": str(tmp_path)}, ["linear-elu-post"], [0])
    config = configs[0, "linear-elu-post"]
    record = {key: 0 for key in grid.RECORD_KEYS} | {
        "variant": "linear-elu-post", "data": "sample", "val_steps": [1], "val_bpc": [3.0],
        "scores": {split: {"64": 3.0} for split in grid.EVAL_SPLITS}, "config": config.flat()}
    for name in ("results.csv", "results.md", "val_bpc.png"):
        (tmp_path / name).write_text("earlier")

    def fail(*args) -> None:
        raise RuntimeError("plot failed")
    monkeypatch.setattr(grid_report, "plot_curves", fail)
    with pytest.raises(RuntimeError, match="plot failed"):
        grid_report.write_report(tmp_path, {(0, "linear-elu-post"): record}, config, {"val": {0: 8.0}})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results.csv", "results.md", "val_bpc.png"]
    assert all(path.read_text() == "earlier" for path in tmp_path.iterdir())


@pytest.mark.parametrize("existing, resume, message", [
    ({"results.md": "my notes\n"}, False, "already holds results.md: pass --resume to continue the grid there"),
    ({"notes.txt": "mine\n"}, False, "already holds notes.txt"),
    ({"results.md": "my notes\n"}, True, "is not a grid's directory (no .linattn-grid marker, and it holds results.md"),
    ({"ckpt.pt": "a train.py run's\n"}, True, "is not a grid's directory (no .linattn-grid marker, and it holds ckpt.pt"),
    ({"linear-favor-post-M64/ckpt.pt": "a train.py run's\n"}, True, "and it holds linear-favor-post-M64, which grid.py"),
])
def test_a_grid_writes_only_into_a_new_directory_or_one_grid_py_wrote(existing, resume, message, data_dir: Path,
                                                                     tiny: list[str], tmp_path: Path, run_main) -> None:
    grid_dir = tmp_path / "g"
    grid_dir.mkdir()
    for name, text in existing.items():
        (grid_dir / name).parent.mkdir(exist_ok=True)
        (grid_dir / name).write_text(text)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--steps", "1",
            "--variants", "softmax-rope", *(["--resume"] if resume else [])]
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert {str(path.relative_to(grid_dir)): path.read_text() for path in grid_dir.rglob("*") if path.is_file()} == existing


@pytest.mark.parametrize("extra, message", [
    (["--resume"], "--resume does not apply"),
    (["--run-name", "absent"], "--report-only reports a grid, but there is none at"),
    (["--variants", "softmax-rope"], "no finished run of these variants and seeds"),
])
def test_report_only_refuses_what_it_cannot_report(extra: list[str], message: str, data_dir: Path, tiny: list[str],
                                                   tmp_path: Path, run_main) -> None:
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    write_finished_run(given, "linear-elu-post", 0, 3.0)
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--report-only",
            "--variants", "linear-elu-post", *extra]
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_every_linear_variant_is_paired_with_softmax_rope_closest_first() -> None:
    from linattn_lm.grid_report import baseline_table, val_bpc
    configs = grid.run_configs({"preset": "cpu"}, ["softmax-rope", "softmax-abs", "linear-favor-post",
                                                   "linear-elu-pre", "linear-favor-pre"], [0, 1])
    values = {"softmax-rope": (2.4, 2.5), "softmax-abs": (2.0, 2.0), "linear-favor-post": (3.0, 3.2),
              "linear-elu-pre": (2.6, 2.6), "linear-favor-pre": (2.0, 2.0)}   # closest: by |mean|, either sign
    variants = {name: [{**record(seed, name, values[name][seed]), "config": configs[seed, name].flat()}
                       for seed in (0, 1)] for name in values}
    rows = baseline_table(variants, val_bpc(256))[2:]
    assert [row.split(" | ")[:3] for row in rows] == [["| linear-elu-pre", "softmax-rope", "attention"],
                                                      ["| linear-favor-pre", "softmax-rope", "attention"],
                                                      ["| linear-favor-post", "softmax-rope", "attention"]]
    assert "+0.200 (s0), +0.100 (s1) | +0.150 |" in rows[0] and "-0.450 |" in rows[1] and "+0.650 |" in rows[2]
    del variants["softmax-rope"]   # no softmax + RoPE in the grid: no such table
    assert baseline_table(variants, val_bpc(256)) == []


def test_a_report_notices_a_run_that_changed_after_its_result(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                              run_main) -> None:
    """result.json records the digest of the checkpoint it was scored from; one sealed since (trained on
    by a later --resume) makes the result stale."""
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(tmp_path), run_name="g")
    write_finished_run(given, "linear-elu-post", 0, 3.0)
    run_dir = tmp_path / "g" / "linear-elu-post" / "seed-0"
    save_checkpoint(run_dir / "ckpt.pt", {"step": 1})
    damage(run_dir / grid.RESULT_NAME, lambda r: r.update(checkpoint_sha256=recorded_digest(run_dir / "ckpt.pt")))
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--report-only",
            "--variants", "linear-elu-post"]
    assert run_main(grid.main, argv)[0] == 0
    save_checkpoint(run_dir / "ckpt.pt", {"step": 2})   # trained on after its result was written
    code, _, err = run_main(grid.main, argv)
    assert code == 2 and "changed after its result.json was written" in err and str(run_dir) in err, err


def test_resume_continues_a_grid_from_before_the_marker_and_no_other_directory(tmp_path: Path) -> None:
    grid_dir = tmp_path / "old-grid"
    (grid_dir / "linear-elu-post" / "seed-0").mkdir(parents=True)
    (grid_dir / "results.md").write_text(f"{grid.REPORT_TITLE}old-grid\n")
    grid.check_grid_directory(grid_dir, existing=True)   # laid out as grid.py lays out a grid
    (grid_dir / "linear-elu-post" / "events.out.tfevents.1").write_text("")   # a train.py run's directory
    with pytest.raises(CheckpointError, match="which grid.py does not write"):
        grid.check_grid_directory(grid_dir, existing=True)
    (grid_dir / grid.GRID_MARKER).write_text("{}")
    grid.check_grid_directory(grid_dir, existing=True)   # marked: grid.py's


def test_seeds_that_learn_recall_are_counted_and_compared_exactly() -> None:
    from linattn_lm.grid_report import success_table
    names = ["softmax-rope", "linear-favor-post+window=8", "linear-favor-pre+window=8", "softmax-rope+window=8"]
    seeds = range(5)
    configs = grid.run_configs({"preset": "mqar"}, names, list(seeds))
    accuracy = {"softmax-rope": [0.99] * 5, "linear-favor-post+window=8": [0.9] * 5,
                "linear-favor-pre+window=8": [0.3, 0.2, 0.5, 0.3, 0.6], "softmax-rope+window=8": [0.1] * 5}
    variants = {name: [{"seed": s, "mqar": {"val": {"accuracy": accuracy[name][s]}}, "config": configs[s, name].flat()}
                       for s in seeds] for name in names}
    rows = {tuple(row.split(" | ")[:3]): row for row in success_table(variants)[2:]}
    post_pre = rows["| linear-favor-post+window=8", "linear-favor-pre+window=8", "rope"]
    assert "| 5 of 5 | 1 of 5 | 0.048 |" in post_pre   # 0.5 itself is not above the line
    assert "| 5 of 5 | 0 of 5 | 0.008 |" in rows["| linear-favor-post+window=8", "softmax-rope+window=8", "linear term"]
    assert "| 5 of 5 | 5 of 5 | 1.000 |" in rows["| linear-favor-post+window=8", "softmax-rope", "attention"]


@pytest.mark.parametrize("marker, message", [
    (None, "holds no grid"), ("[1, 2]", "not a marker grid.py writes"), ('{"flags": {}, "mine": 1}', "['mine']"),
    ('{"written_by": "me"}', "not a marker grid.py writes")])
def test_resume_refuses_a_folder_without_a_grid_or_with_a_marker_grid_py_did_not_write(marker, message, data_dir: Path,
                                                                                      tiny: list[str], tmp_path: Path,
                                                                                      run_main) -> None:
    grid_dir = tmp_path / "g"
    grid_dir.mkdir()
    if marker is not None:
        (grid_dir / grid.GRID_MARKER).write_text(marker)
    code, _, err = run_main(grid.main, [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name",
                                        "g", "--resume"])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert sorted(path.name for path in grid_dir.iterdir()) == ([grid.GRID_MARKER] if marker else [])


@pytest.mark.parametrize("where, inside", [
    (["--out-dir", "{tmp}/run"], "the run directory"),              # a grid inside a train.py run
    (["--out-dir", "{tmp}", "--run-name", "run/g"], "the run directory"),
    (["--out-dir", "{tmp}/grid", "--run-name", "g"], "the grid directory"),   # a grid in a grid
    (["--out-dir", "{tmp}/grid/softmax-rope/seed-0"], "the grid directory"),])
def test_a_grid_refuses_to_start_inside_another_runs_or_grids_directory(where, inside, data_dir: Path, tiny: list[str],
                                                                       tmp_path: Path, run_main) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_text("a train.py run's\n")
    (tmp_path / "grid" / "softmax-rope" / "seed-0").mkdir(parents=True)
    (tmp_path / "grid" / grid.GRID_MARKER).write_text("{}")
    argv = [*tiny, "--data-dir", str(data_dir), "--steps", "1", "--variants", "softmax-rope",
            *[arg.format(tmp=tmp_path) for arg in where]]
    for resume in ([], ["--resume"]):
        code, _, err = run_main(grid.main, argv + resume)
        assert code == 2 and inside in err and len(err.strip().splitlines()) == 1, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "grid", "grid/.linattn-grid", "grid/softmax-rope", "grid/softmax-rope/seed-0", "run", "run/ckpt.pt"]


@pytest.mark.slow
def test_a_grid_run_trained_further_by_train_py_is_scored_again_by_resume(data_dir: Path, tiny: list[str],
                                                                          tmp_path: Path, run_main) -> None:
    """docs/checkpoints.md's rescoring path, end to end: train.py --resume extends one run of the grid
    (repeating the decay_steps the grid resolved), grid.py --resume says which --steps scores it, and
    with them scores it (and extends the others with their recorded schedule)."""
    common = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "g", "--eval-interval", "2"]
    assert run_main(grid.main, [*common, "--steps", "4", "--variants", "linear-elu-post,softmax-rope"])[0] == 0
    run_dir = tmp_path / "g" / "linear-elu-post" / "seed-0"
    further = ["--out-dir", str(tmp_path), "--run-name", "g/linear-elu-post/seed-0", "--threads", "1", "--resume",
               "--steps", "6", "--decay-steps", "4"]
    with DirectoryLock(tmp_path / "g"):   # the grid at work: train.py waits its turn, and changes nothing
        before = recorded_digest(run_dir / "ckpt.pt")
        code, _, err = run_main(training.main, further)
        assert code == 2 and "in use" in err and recorded_digest(run_dir / "ckpt.pt") == before, err
    code, _, err = run_main(training.main, further)
    assert code == 0, err
    code, _, err = run_main(grid.main, ["--out-dir", str(tmp_path), "--run-name", "g", "--resume"])
    assert code == 2 and "pass --steps 6" in err, err
    code, _, err = run_main(grid.main, ["--out-dir", str(tmp_path), "--run-name", "g", "--resume", "--steps", "6"])
    assert code == 0, err
    record = json.loads((run_dir / grid.RESULT_NAME).read_text())
    assert record["steps"] == 6 and record[grid.DIGEST_KEY] == recorded_digest(run_dir / "ckpt.pt")
    assert load_checkpoint(tmp_path / "g" / "softmax-rope" / "seed-0")["config"]["optim"]["decay_steps"] == 4
    assert {row["steps"] for row in read_rows(tmp_path / "g")} == {"6"}
