"""eval.py: bpc equals a hand computation over non-overlapping windows, length-extrapolation table,
sampling, and clear errors for bad checkpoints and missing data."""
from __future__ import annotations

import importlib
import math
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from lm_testing import REPO_ROOT, prepare_enwik8_slice, small_config
from linattn.data import load_split
from linattn_lm import ByteLM, save_checkpoint

evaluate = importlib.import_module("eval")   # eval.py; `import eval` would read like the builtin


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_enwik8_slice(tmp_path_factory.mktemp("enwik8-slice"))


def write_checkpoint(path: Path, model: ByteLM, data_dir: Path) -> Path:
    """A checkpoint as train.py writes it, for a model built here."""
    config = train.TrainConfig(**model.config.to_dict(), data_dir=str(data_dir), run_name="test")
    save_checkpoint(path, dict(config=asdict(config), step=0, model=model.state_dict(), optimizer={},
                               loader={}, rng=[], stats={}, data="test"))
    return path


def make_model(**overrides) -> ByteLM:
    torch.manual_seed(0)
    return ByteLM(small_config(**overrides)).eval()


def hand_bpc(model: ByteLM, data: np.ndarray, seq_len: int) -> float:
    """Window k: inputs data[kL : kL+L], targets data[kL+1 : kL+L+1], cut at the end of the data."""
    total, count = 0.0, 0
    for start in range(0, len(data) - 1, seq_len):
        window = torch.from_numpy(data[start:start + seq_len + 1].astype(np.int64))
        with torch.no_grad():
            log_probs = model(window[None, :-1])[0].double().log_softmax(-1)
        total -= log_probs.gather(1, window[1:, None]).sum().item()
        count += len(window) - 1
    assert count == len(data) - 1
    return total / count / math.log(2)


def run_eval(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = evaluate.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def table(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^\s+(\d+)\s+(\S+)", out, flags=re.MULTILINE)}


def test_bpc_equals_hand_computation(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model(seq_len=16)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, data_dir)
    val = load_split(data_dir, "val").data[:1234]          # 1233 targets: 77 windows of 16 + 1 of 1
    expected = hand_bpc(model, val, 16)
    bpc, _ = evaluate.evaluate_bpc(model, val, 16, batch_size=5, device=torch.device("cpu"))
    assert bpc == pytest.approx(expected, abs=1e-5)   # float32 logits vs float64 by hand
    code, out, _ = run_eval([str(ckpt), "--max-bytes", "1234", "--seq-len", "16", "40"], capsys)
    assert code == 0 and "NON-CANONICAL" in out and "val split, 1,234 of 20,000 bytes" in out
    rows = table(out)
    assert float(rows[16]) == pytest.approx(expected, abs=1e-4)
    assert float(rows[40]) == pytest.approx(hand_bpc(model, val, 40), abs=1e-4)


def test_uniform_model_scores_eight_bits(data_dir: Path) -> None:
    model = make_model()
    torch.nn.init.zeros_(model.head.weight)   # all logits 0: every byte has probability 1/256
    bpc, _ = evaluate.evaluate_bpc(model, load_split(data_dir, "test").data[:500], 16, 4, torch.device("cpu"))
    assert bpc == pytest.approx(8.0, abs=1e-5)     # log(256) in float32


def test_extrapolation_table_marks_learned_positions(data_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "abs.pt", make_model(attention="softmax", rope="none", abs_pos=True), data_dir)
    code, out, _ = run_eval([str(ckpt), "--max-bytes", "300", "--seq-len", "16", "32"], capsys)
    rows = table(out)
    assert code == 0 and rows[32] == "n/a" and float(rows[16]) > 0
    assert "learned absolute positions cover 16 bytes only" in out


def test_generate_is_reproducible(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    sample = lambda seed: run_eval([str(ckpt), "--generate", "The ", "--max-new-tokens", "30",
                                    "--top-k", "20", "--seed", str(seed)], capsys)[1].split("\n", 1)[1]
    assert sample(1) == sample(1) != sample(2)
    assert sample(1).startswith("The ")


def test_errors_are_clear(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_eval([str(tmp_path / "missing.pt")], capsys)
    assert code == 2 and "checkpoint not found" in err
    (tmp_path / "corrupt.pt").write_bytes(b"\x00not a checkpoint" * 10)
    code, _, err = run_eval([str(tmp_path / "corrupt.pt")], capsys)
    assert code == 2 and "cannot read checkpoint" in err
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    code, _, err = run_eval([str(tmp_path / "foreign.pt")], capsys)
    assert code == 2 and "not a linattn LM checkpoint" in err
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, _, err = run_eval([str(ckpt), "--data-dir", str(tmp_path / "nodata")], capsys)
    assert code == 2 and "data not found" in err and "prepare.py" in err
    code, _, err = run_eval([str(ckpt), "--max-bytes", "10", "--seq-len", "16"], capsys)
    assert code == 2 and "only 10 bytes" in err


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "eval.py", str(tmp_path / "nothing.pt")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: checkpoint not found")
    assert "Traceback" not in done.stderr
