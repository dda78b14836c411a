"""eval.py --ar-split: the associative-recall mask on hand-made sequences and against a loop, the split
scores against eval.py's bpc, and the scores recorded in a grid run's result.json and its report."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from linattn_lm import ByteLM, evaluate, grid, save_checkpoint
from linattn_lm.checkpoint import recorded_digest
from linattn_lm.data import load_split
from linattn_lm.evaluate import ar_split_bpc, copy_distances, distance_classes, evaluate_bpc, recall_hits


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def hits_of(*windows: bytes) -> list[list[bool]]:
    """recall_hits of windows of bytes (inputs: all but the last byte, targets: all but the first)."""
    rows = torch.tensor([list(window) for window in windows])
    return recall_hits(rows[:, :-1], rows[:, 1:]).tolist()


def test_hits_on_hand_made_windows() -> None:
    assert hits_of(b"abab") == [[False, False, True]]            # ab, ba, ab: the second ab
    assert hits_of(b"aaaa") == [[False, True, True]]             # aa seen from the second target on
    assert hits_of(b"abcab") == [[False, False, False, True]]    # ab again after c
    assert hits_of(b"abac") == [[False, False, False]]           # a again, but followed by c: no hit
    assert hits_of(b"xabab", b"abxyz") == [[False, False, False, True], [False] * 4]   # rows do not share
    assert hits_of(b"ab") == [[False]]


def test_hits_match_a_loop_over_bytes() -> None:
    rows = torch.randint(0, 4, (3, 40))   # a small alphabet: many repeats
    x, y = rows[:, :-1], rows[:, 1:]
    expected = [[any((x[r, j], y[r, j]) == (x[r, i], y[r, i]) for j in range(i)) for i in range(x.shape[1])]
                for r in range(3)]
    assert recall_hits(x, y).tolist() == expected


def distances_of(window: bytes, length: int) -> list[int]:
    row = torch.tensor([list(window)])
    return copy_distances(row[:, :-1], row[:, 1:], length)[0].tolist()


def test_copy_distances_on_hand_made_windows() -> None:
    # abab: the second ab (target 2) copies b from key 1, one position back
    assert distances_of(b"abab", 2) == [-1, -1, 1]
    # the bigram ab again 5 targets later: its source key (the first b) lies 4 back from query 5
    assert distances_of(b"abxyzab", 2) == [-1, -1, -1, -1, -1, 4]
    # a 3-byte match needs the byte before too: xab matches, yab does not
    assert distances_of(b"xabxab", 3) == [-1, -1, -1, -1, 2]
    assert distances_of(b"xabyab", 3) == [-1] * 5
    assert distances_of(b"aaaa", 2) == [-1, 0, 0]   # the nearest copy, not the first


@pytest.mark.parametrize("length", [2, 3, 8])
def test_copy_distances_match_a_loop(length: int) -> None:
    rows = torch.randint(0, 3, (3, 60), generator=torch.Generator().manual_seed(length))
    x, y = rows[:, :-1], rows[:, 1:]
    def gram(r: int, i: int) -> list[int]:
        return [*x[r, i - length + 2:i + 1].tolist(), int(y[r, i])]
    expected = [[next((i - j - 1 for j in range(i - 1, length - 3, -1) if gram(r, j) == gram(r, i)), -1)
                 if i >= length - 2 else -1 for i in range(x.shape[1])] for r in range(3)]
    assert copy_distances(x, y, length).tolist() == expected


def test_distance_classes_split_the_hits() -> None:
    rows = torch.randint(0, 5, (4, 200), generator=torch.Generator().manual_seed(1))
    x, y = rows[:, :-1], rows[:, 1:]
    classes = distance_classes(copy_distances(x, y, 2), 16)
    assert torch.equal(classes["near"] | classes["far"], recall_hits(x, y))
    assert torch.equal(classes["none"], ~recall_hits(x, y))
    assert not (classes["near"] & classes["far"]).any() and classes["far"].any() and classes["near"].any()


def test_the_far_split_averages_to_evals_bpc(small_config, data_dir: Path) -> None:
    torch.manual_seed(0)
    model = ByteLM(small_config(seq_len=64)).eval()
    data = load_split(data_dir, "val").data[:4001]
    split = ar_split_bpc(model, data, 64, 4, torch.device("cpu"), far_window=8)
    assert split["far"]["window"] == 8
    for name in ("bigram", "match8"):
        scores = split["far"][name]
        shares = [scores[f"{kind}_fraction"] for kind in ("near", "far", "none")]
        assert sum(shares) == pytest.approx(1.0) and 0 < scores["far_fraction"] < 0.5
        mixed = sum(scores[f"{kind}_fraction"] * scores[f"{kind}_bpc"] for kind in ("near", "far", "none")
                    if scores[f"{kind}_fraction"])   # an empty class scores nan
        assert mixed == pytest.approx(split["bpc"], rel=1e-6)
    assert split["far"]["bigram"]["none_bpc"] == split["rest_bpc"]


def test_the_split_averages_to_evals_bpc(small_config, data_dir: Path) -> None:
    torch.manual_seed(0)
    model = ByteLM(small_config(seq_len=32)).eval()
    data = load_split(data_dir, "val").data[:3001]
    split = ar_split_bpc(model, data, 32, 4, torch.device("cpu"))
    bpc, _ = evaluate_bpc(model, data, 32, 4, torch.device("cpu"))
    assert split["bpc"] == pytest.approx(bpc, rel=1e-6)
    mixed = split["hit_fraction"] * split["hit_bpc"] + (1 - split["hit_fraction"]) * split["rest_bpc"]
    assert mixed == pytest.approx(bpc, rel=1e-6)
    assert 0.05 < split["hit_fraction"] < 0.95   # text repeats bigrams within 32 bytes, not always


def run_with_record(data_dir: Path, out_dir: Path, seed: int, val: float) -> Path:
    """A grid run directory (linear-elu-post, tiny preset) holding a checkpoint and its result.json."""
    given = dict(preset="tiny", data_dir=str(data_dir), out_dir=str(out_dir), run_name="g")
    config = grid.run_configs(given, ["linear-elu-post"], [seed])[seed, "linear-elu-post"]
    config.run.run_dir.mkdir(parents=True)
    torch.manual_seed(seed)
    model = ByteLM(config.model)
    save_checkpoint(config.run.run_dir / "ckpt.pt", dict(config=asdict(config), step=0, model=model.state_dict(),
                                                         optimizer={}, loader={}, rng=[], stats={}, data="test",
                                                         log_window={}))
    scores = {split: {"64": val} for split in grid.EVAL_SPLITS}
    record = {key: 0 for key in grid.RECORD_KEYS} | {
        "variant": "linear-elu-post", "seed": seed, "steps": config.optim.steps, "data": "sample", "val_steps": [1],
        "val_bpc": [val], "final_val_bpc": val, "best_val_bpc": val, "scores": scores, "config": config.flat()}
    record[grid.DIGEST_KEY] = recorded_digest(config.run.run_dir / "ckpt.pt")   # scored from this checkpoint
    (config.run.run_dir / grid.RESULT_NAME).write_text(json.dumps(record))
    return config.run.run_dir


def grid_report(data_dir: Path, tiny: list[str], out_dir: Path, run_main) -> str:
    """results.md of grid g (seeds 0 and 1 of linear-elu-post) rewritten by grid.py --report-only."""
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--run-name", "g", "--seeds", "0,1",
            "--variants", "linear-elu-post", "--report-only"]
    code, _, err = run_main(grid.main, argv)
    assert code == 0, err
    return (out_dir / "g" / "results.md").read_text()


def test_eval_records_the_split_and_the_report_tabulates_it(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                             run_main) -> None:
    runs = [run_with_record(data_dir, tmp_path, seed, 3.0 + seed) for seed in (0, 1)]
    for run_dir in runs:
        code, out, err = run_main(evaluate.main, [str(run_dir), "--ar-split", "--threads", "1"])
        assert code == 0, err
        assert "AR-hit bpc" in out and "AR split recorded" in out
    record = json.loads((runs[0] / "result.json").read_text())
    scores = record["ar_split"]["val"]["64"]
    assert set(scores) == {"hit_bpc", "rest_bpc", "hit_fraction"} and 0 < scores["hit_fraction"] < 1
    assert record["scores"]["val"]["64"] == 3.0   # the rest of the record as it was
    report = grid_report(data_dir, tiny, tmp_path, run_main)
    assert "## Associative recall split" in report
    splits = [json.loads((run_dir / "result.json").read_text())["ar_split"]["val"]["64"] for run_dir in runs]
    hit = [split["hit_bpc"] for split in splits]
    share = np.mean([split["hit_fraction"] for split in splits])
    assert f"| linear-elu-post | 0,1 | {np.mean(hit):.3f} ± {np.std(hit, ddof=1):.3f} | " in report
    assert f"| {share:.1%} |" in report


def test_eval_records_the_far_split_and_the_report_pairs_it(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                            run_main) -> None:
    runs = [run_with_record(data_dir, tmp_path, seed, 3.0 + seed) for seed in (0, 1)]
    for run_dir in runs:
        code, out, err = run_main(evaluate.main, [str(run_dir), "--ar-split", "--far-window", "16", "--threads", "1"])
        assert code == 0, err
        assert "match8 source < 16 back" in out
    far = json.loads((runs[0] / "result.json").read_text())["ar_split"]["val"]["64"]["far"]
    assert far["window"] == 16 and set(far) == {"window", "bigram", "match8"}
    report = grid_report(data_dir, tiny, tmp_path, run_main)
    assert "## Far-only split at W = 16" in report
    far_bpc = [json.loads((r / "result.json").read_text())["ar_split"]["val"]["64"]["far"]["match8"]["far_bpc"]
               for r in runs]
    assert f"{np.mean(far_bpc):.3f} ± {np.std(far_bpc, ddof=1):.3f}" in report


@pytest.mark.parametrize("argv, word", [(["--far-window", "8"], "--ar-split"),
                                        (["--ar-split", "--far-window", "0"], "--far-window")])
def test_far_window_flag_is_checked(argv: list[str], word: str, tmp_path: Path, run_main) -> None:
    code, _, err = run_main(evaluate.main, [str(tmp_path), *argv])
    assert code == 2 and word in err


def test_a_damaged_far_split_in_a_record_is_refused(data_dir: Path, tmp_path: Path, run_main) -> None:
    run_dir = run_with_record(data_dir, tmp_path, 0, 3.0)
    path = run_dir / "result.json"
    scores = {"hit_bpc": 1.0, "rest_bpc": 1.0, "hit_fraction": 0.5, "far": {"window": 0}}
    path.write_text(json.dumps(json.loads(path.read_text()) | {"ar_split": {"val": {"64": scores}}}))
    code, _, err = run_main(evaluate.main, [str(run_dir), "--ar-split", "--threads", "1"])
    assert code == 2 and "far" in err


def test_a_part_of_the_split_is_printed_not_recorded(data_dir: Path, tmp_path: Path, run_main) -> None:
    run_dir = run_with_record(data_dir, tmp_path, 0, 3.0)
    code, out, _ = run_main(evaluate.main, [str(run_dir), "--ar-split", "--max-bytes", "1000", "--threads", "1"])
    assert code == 0 and "not recorded" in out
    assert "ar_split" not in json.loads((run_dir / "result.json").read_text())


@pytest.mark.parametrize("record_change", ["trained on since", "no digest"])
def test_the_split_is_recorded_only_in_a_result_of_the_checkpoint_it_scored(record_change: str, data_dir: Path,
                                                                           tmp_path: Path, run_main) -> None:
    """A result.json scored from another checkpoint (the run trained on since), or one that cannot
    tell which (no checkpoint_sha256), is stale: eval prints the split and leaves the record as it was."""
    run_dir = run_with_record(data_dir, tmp_path, 0, 3.0)
    path = run_dir / "result.json"
    record = json.loads(path.read_text())
    if record_change == "no digest":
        del record[grid.DIGEST_KEY]
    else:
        record[grid.DIGEST_KEY] = "0" * 64
    path.write_text(json.dumps(record))
    code, out, err = run_main(evaluate.main, [str(run_dir), "--ar-split", "--threads", "1"])
    assert code == 0 and "AR-hit bpc" in out and "AR split not recorded" in out, err
    assert json.loads(path.read_text()) == record


def test_a_damaged_ar_split_in_a_record_is_refused(data_dir: Path, tmp_path: Path, run_main) -> None:
    run_dir = run_with_record(data_dir, tmp_path, 0, 3.0)
    path = run_dir / "result.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"ar_split": {"val": {"64": {"hit_bpc": "x"}}}}))
    code, _, err = run_main(evaluate.main, [str(run_dir), "--ar-split", "--threads", "1"])
    assert code == 2 and "ar_split.val" in err


@pytest.mark.parametrize("extra", [["--generate", "a"], ["--weight-sums"]])
def test_ar_split_is_a_scoring_mode(extra: list[str], tmp_path: Path, run_main) -> None:
    code, _, err = run_main(evaluate.main, [str(tmp_path), "--ar-split", *extra])
    assert code == 2 and "--ar-split" in err
