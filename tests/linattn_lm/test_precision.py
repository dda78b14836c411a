"""--dtype: bf16 and fp16 autocast on CPU (fp16 with a gradient scaler that travels in checkpoints),
configs from before the field, and eval.py's default precision.  (train.py --compile is measured,
not tested here: inductor took over 2 minutes to compile even the tiny model on 2 busy CPU cores.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linattn_lm import load_checkpoint, training
from linattn_lm.flags import config_from_flags
from linattn_lm.resume import config_differences
from linattn_lm.evaluate import recorded_dtype
from linattn_lm.device import autocast, resolve_dtype

SHORT = ["--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--sample-interval", "0",
         "--ckpt-interval", "0", "--warmup", "1"]


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32 and resolve_dtype("auto", cuda) == torch.bfloat16
    assert [resolve_dtype(name, cpu) for name in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16,
                                                                               torch.float16]
    with pytest.raises(ValueError, match="one of auto, fp32, bf16, fp16, got 'fp64'"):
        resolve_dtype("fp64", cpu)
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(cpu, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_bad_dtype_is_a_usage_error(tiny: list[str], run_main):
    code, _, err = run_main(training.main, [*tiny, "--dtype", "fp64"])
    assert code == 2 and "invalid choice: 'fp64'" in err and "Traceback" not in err


@pytest.mark.slow
def test_bf16_trains_on_cpu_and_changes_the_computation(data_dir: Path, tiny: list[str], tmp_path: Path):
    """3 steps in bf16 autocast: finite, recorded in the checkpoint, no scaler state, and not the
    fp32 run's weights (autocast did act)."""
    common = [*tiny, *SHORT, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "3"]
    assert training.main([*common, "--dtype", "bf16", "--run-name", "bf16"]) == 0
    assert training.main([*common, "--dtype", "fp32", "--run-name", "fp32"]) == 0
    bf16, fp32 = load_checkpoint(tmp_path / "bf16"), load_checkpoint(tmp_path / "fp32")
    assert bf16["config"]["run"]["dtype"] == "bf16" and bf16["scaler"] == {}
    weights = {key: t for key, t in bf16["model"].items() if isinstance(t, torch.Tensor) and t.is_floating_point()}
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(not torch.equal(t, fp32["model"][key]) for key, t in weights.items())


@pytest.mark.slow
def test_fp16_scaler_is_checkpointed_and_resume_continues_exactly(data_dir: Path, tiny: list[str], tmp_path: Path):
    """6 steps in one go == 3 steps, then --resume to 6: the loss scale comes back from the checkpoint."""
    common = [*tiny, *SHORT, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--dtype", "fp16",
              "--decay-steps", "6"]
    assert training.main([*common, "--steps", "6", "--run-name", "whole"]) == 0
    assert training.main([*common, "--steps", "3", "--run-name", "split"]) == 0
    assert load_checkpoint(tmp_path / "split")["scaler"]["_growth_tracker"] == 3
    assert training.main([*common, "--steps", "6", "--run-name", "split", "--resume"]) == 0
    whole, split = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "split")
    assert whole["scaler"] == split["scaler"] and whole["scaler"]["scale"] == 2.0 ** 16
    for key, tensor in whole["model"].items():
        assert torch.equal(tensor, split["model"][key]) if isinstance(tensor, torch.Tensor) else \
            tensor == split["model"][key], key


def test_configs_without_dtype_compare_as_the_default():
    """Checkpoints and result.json files written before --dtype have no such key: it means the field's
    default (auto, what those runs did), so they still resume and are still reused by grid.py."""
    current = config_from_flags({"preset": "tiny"}).flat()
    older = {key: value for key, value in current.items() if key != "dtype"}
    assert config_differences(older, current) == []
    assert config_differences({**older, "dtype": "bf16"}, current) == ["dtype: checkpoint 'bf16', now 'auto'"]
    assert config_differences(older, {**current, "dtype": "fp16"}) == ["dtype: checkpoint 'auto', now 'fp16'"]
    assert config_differences({**current, "not_a_setting": 1}, current) == [
        "not_a_setting: checkpoint 1, now '<absent>'"]


def test_eval_takes_the_runs_dtype_unless_told():
    assert recorded_dtype({"config": {"run": {"dtype": "bf16"}}}, "ckpt.pt") == "bf16"
    assert recorded_dtype({"config": {"run": {}}}, "ckpt.pt") == "auto"
    assert recorded_dtype({"config": {"run": {"dtype": "auto"}}, "precision": "bf16"}, "ckpt.pt") == "bf16"


class OverflowingGradient(torch.autograd.Function):
    """The loss as it is, its gradient inf: every fp16 step overflows, whatever the loss scale."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.mark.parametrize("floor, skips", [(1.0, 17), (0.0, 20)])   # 2**16 halved 17 times is below 1
def test_fp16_stops_when_the_scaler_skips_step_after_step(floor: float, skips: int, data_dir: Path, tiny: list[str],
                                                          tmp_path: Path, run_main, monkeypatch) -> None:
    loss = training.lm_loss
    monkeypatch.setattr(training, "lm_loss", lambda logits, targets: OverflowingGradient.apply(loss(logits, targets)))
    monkeypatch.setattr(training, "MIN_LOSS_SCALE", floor, raising=False)
    code, _, err = run_main(training.main, [*tiny, *SHORT, "--eval-interval", "100", "--data-dir", str(data_dir),
                                            "--out-dir", str(tmp_path), "--dtype", "fp16"])
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"training stopped at step {skips}: the fp16 gradients overflowed in {skips} step(s) in a row" in err
    assert "train with --dtype bf16 (or fp32), or lower --lr" in err


def test_resume_keeps_the_precision_auto_chose_where_the_run_started(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                                     run_main) -> None:
    """--dtype auto is bf16 on CUDA, fp32 on CPU: a run started on CUDA and resumed on CPU continues in
    bf16, says so, and saves bf16 again (its checkpoint is edited here as CUDA would have written it)."""
    common = [*tiny, *SHORT, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "auto",
              "--decay-steps", "4"]
    assert training.main([*common, "--steps", "2"]) == 0
    checkpoint = load_checkpoint(tmp_path / "auto")
    assert checkpoint["config"]["run"]["dtype"] == "auto" and checkpoint["precision"] == "fp32"
    checkpoint["precision"] = "bf16"
    torch.save(checkpoint, tmp_path / "auto" / "ckpt.pt")
    code, out, err = run_main(training.main, [*common, "--steps", "4", "--resume"])
    assert code == 0, err
    assert "--dtype auto: continuing in bf16, the precision this run started in (here auto would mean fp32)" in out
    assert "bf16 autocast" in out
    resumed = load_checkpoint(tmp_path / "auto")
    assert resumed["precision"] == "bf16" and resumed["config"]["run"]["dtype"] == "auto"


def test_resume_refuses_an_explicit_dtype_other_than_the_runs(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                              run_main) -> None:
    common = [*tiny, *SHORT, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "auto",
              "--decay-steps", "4"]
    assert training.main([*common, "--steps", "2"]) == 0
    code, _, err = run_main(training.main, [*common, "--steps", "4", "--resume", "--dtype", "bf16"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "contradict" in err and "--dtype" in err
    # a --dtype equal in effect to the record is the record: auto resolved to fp32 here
    code, _, err = run_main(training.main, [*common, "--steps", "3", "--resume", "--dtype", "fp32"])
    assert code == 0, err
    resumed = load_checkpoint(tmp_path / "auto")
    assert resumed["step"] == 3 and resumed["config"]["run"]["dtype"] == "auto" and resumed["precision"] == "fp32"


@pytest.mark.parametrize("precision", ["bf17", ["bf16"], {"a": 1}, 16])
def test_a_damaged_saved_precision_is_refused_by_eval_and_resume_alike(precision):
    from linattn_lm.checkpoint import CheckpointError, saved_precision
    checkpoint = {"config": {"run": {"dtype": "auto"}}, "precision": precision}
    for read in (lambda: recorded_dtype(checkpoint, "ckpt.pt"), lambda: saved_precision(checkpoint, "ckpt.pt")):
        with pytest.raises(CheckpointError, match="'precision' entry"):
            read()
