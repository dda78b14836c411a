"""train.py and grid.py on a small slice of the enwik8 sample: learning, TensorBoard scalars,
checkpoints (exact resume, Ctrl-C, refusals), flag errors, DDP on CPU, the comparison grid."""
from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import grid
import train
from lm_testing import REPO_ROOT, TINY, prepare_enwik8_slice
from linattn_lm import ByteLM, ModelConfig, load_checkpoint


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_enwik8_slice(tmp_path_factory.mktemp("enwik8-slice"))


def run(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an in-process main(argv), argparse exits included."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


@pytest.fixture(scope="module")
def tiny_run(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 30-step tiny run (favor + post), shared by the tests that only read its outputs."""
    out_dir = tmp_path_factory.mktemp("runs")
    assert train.main([*TINY, "--data-dir", str(data_dir), "--out-dir", str(out_dir), "--run-name", "tiny"]) == 0
    return out_dir / "tiny"


def test_tiny_run_learns_and_logs_to_tensorboard(tiny_run: Path) -> None:
    losses = [value for _, value in scalars(tiny_run, "train/loss")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0
    bpc = scalars(tiny_run, "val/bpc")
    assert [step for step, _ in bpc] == [10, 20, 30] and bpc[-1][1] < bpc[0][1] < 8
    val_loss = scalars(tiny_run, "val/loss")[-1][1]
    assert val_loss / 0.6931471805599453 == pytest.approx(bpc[-1][1], rel=1e-5)
    for tag in ("lr", "grad_norm", "tokens_per_s", "hparams/final_val_bpc"):
        assert scalars(tiny_run, tag), tag
    events = EventAccumulator(str(tiny_run))
    events.Reload()
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert "NON-CANONICAL" in texts["data/text_summary"] and "sample:" in texts["sample/text_summary"]


def test_checkpoint_is_weights_only_with_plain_config(tiny_run: Path) -> None:
    checkpoint = torch.load(tiny_run / "ckpt.pt", weights_only=True)
    assert checkpoint["step"] == 30 and checkpoint["loader"]["batches_drawn"] == 30
    assert all(isinstance(v, (str, int, float, bool)) for v in checkpoint["config"].values())
    assert {"model", "optimizer", "rng", "stats", "data"} <= set(checkpoint)
    assert not list(tiny_run.glob("*.tmp"))


def test_resume_continues_exactly(data_dir: Path, tmp_path: Path) -> None:
    """12 steps in one go == 6 steps, then --resume to 12 (dropout on, so RNG state matters)."""
    common = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--dropout", "0.1",
              "--log-interval", "1", "--eval-interval", "6", "--sample-interval", "0", "--ckpt-interval", "0",
              "--redraw-interval", "4", "--decay-steps", "12"]
    assert train.main([*common, "--steps", "12", "--run-name", "whole"]) == 0
    assert train.main([*common, "--steps", "6", "--run-name", "split"]) == 0
    assert train.main([*common, "--steps", "12", "--run-name", "split", "--resume"]) == 0
    whole, split = scalars(tmp_path / "whole", "train/loss"), scalars(tmp_path / "split", "train/loss")
    assert len(whole) == 12 and split == whole
    a, b = (load_checkpoint(tmp_path / name) for name in ("whole", "split"))
    assert a["step"] == b["step"] == 12 and a["loader"] == b["loader"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]) if isinstance(tensor, torch.Tensor) else tensor == b["model"][key], key


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(data_dir: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "stop",
             "--eval-interval", "5", "--eval-iters", "1", "--ckpt-interval", "0", "--sample-interval", "0"]
    process = subprocess.Popen([sys.executable, "-u", "train.py", *flags, "--steps", "5000"], cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stdout:
            if line.startswith("step 5/"):
                process.send_signal(signal.SIGINT)
                break
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err and "checkpoint saved" in out
    step = load_checkpoint(tmp_path / "stop")["step"]
    assert 5 <= step < 5000
    code, out, err = run(train.main, [*flags, "--resume", "--steps", str(step + 2), "--decay-steps", "5000"], capsys)
    assert code == 0 and f"resumed {tmp_path / 'stop' / 'ckpt.pt'} at step {step}" in out
    assert load_checkpoint(tmp_path / "stop")["step"] == step + 2


@pytest.mark.parametrize("argv, message", [
    (["--attention", "softmax", "--feature-map", "elu"], "--feature-map applies to linear attention only"),
    (["--attention", "softmax", "--num-features", "64"], "--num-features applies to linear attention only"),
    (["--feature-map", "elu", "--num-features", "64"], "--num-features applies to --feature-map favor only"),
    (["--feature-map", "softmax", "--redraw-interval", "5"], "--redraw-interval applies to --feature-map favor"),
    (["--attention", "softmax", "--rope", "pre"], "--rope pre"),
    (["--preset", "huge"], "invalid choice: 'huge'"),
    (["--n-layer", "0"], "must be a positive integer"),
    (["--d-model", "100", "--n-head", "3"], "must be a multiple of n_head"),
    (["--lr", "0.001", "--min-lr", "0.01"], "min_lr <= lr"),
    (["--dropout", "1.5"], "dropout must be in"),
    (["--feature-map", "favor", "--num-features", "33"], "must be even"),
])
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(train.main, argv, capsys)
    assert code == 2 and message in err, err


def test_seq_len_beyond_split_and_missing_data(data_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(train.main, [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path),
                                    "--seq-len", "50000"], capsys)
    assert code == 2 and "seq_len 50,000" in err and "split has only 20,000 bytes" in err
    code, _, err = run(train.main, [*TINY, "--data-dir", str(tmp_path / "none"), "--out-dir", str(tmp_path)], capsys)
    assert code == 2 and "data not found" in err and "prepare.py" in err and "Traceback" not in err


def test_checkpoint_refusals(tiny_run: Path, data_dir: Path, tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "tiny"
    shutil.copytree(tiny_run, run_dir)
    flags = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "tiny"]
    code, _, err = run(train.main, flags, capsys)
    assert code == 2 and "exists: pass --resume" in err
    code, _, err = run(train.main, [*flags, "--resume", "--n-layer", "3", "--lr", "0.002"], capsys)
    assert code == 2 and "n_layer: checkpoint 2, now 3" in err and "lr: checkpoint 0.003, now 0.002" in err
    code, _, err = run(train.main, [*flags, "--resume", "--attention", "softmax"], capsys)
    assert code == 2 and "attention: checkpoint 'linear', now 'softmax'" in err
    (run_dir / "ckpt.pt").write_bytes((run_dir / "ckpt.pt").read_bytes()[:5000])
    code, _, err = run(train.main, [*flags, "--resume"], capsys)
    assert code == 2 and "corrupt or truncated" in err
    code, _, err = run(train.main, [*flags, "--resume", "--run-name", "never-ran"], capsys)
    assert code == 2 and "checkpoint not found" in err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ddp_worker(rank: int, world_size: int, port: int, argv: list[str], out_dir: str) -> None:
    """One torchrun-like rank: environment variables in, its final model state out."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    config = train.config_from_flags(vars(train.build_parser().parse_args(argv)))
    with train.distributed(config.device) as ctx:
        trainer = train.Trainer(config, ctx, resume=False)
        result = trainer.run()
    state = result.model.state_dict()
    torch.save({"tensors": {k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
                "favor": [fm.get_extra_state() for fm in result.model.feature_maps()],
                "first_windows": torch.from_numpy(trainer.train_batches.window_starts(0))},
               Path(out_dir) / f"rank{rank}.pt")


def test_ddp_two_cpu_ranks_stay_identical(data_dir: Path, tmp_path: Path) -> None:
    argv = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "8", "--redraw-interval", "3",
            "--eval-interval", "4", "--sample-interval", "4", "--device", "cpu"]
    mp.spawn(ddp_worker, args=(2, free_port(), argv, str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert rank0["tensors"].keys() == rank1["tensors"].keys()
    for key, tensor in rank0["tensors"].items():
        assert torch.equal(tensor, rank1["tensors"][key]), key
    assert rank0["favor"] == rank1["favor"] and rank0["favor"][0]["draws"] == 2   # redrawn at steps 3, 6
    assert len(rank0["first_windows"]) == 4 and not torch.equal(rank0["first_windows"], rank1["first_windows"])
    config = ModelConfig.from_dict(load_checkpoint(tmp_path / "linear-favor-post-M32")["config"])
    initial = ByteLM(config).state_dict()["blocks.0.attn.feature_map.projection"]
    assert not torch.equal(rank0["tensors"]["blocks.0.attn.feature_map.projection"], initial)


def test_grid_trains_variants_and_writes_results(data_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(grid.main, [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--steps", "4",
                                   "--eval-interval", "2", "--num-features", "16",
                                   "--variants", "softmax-abs,linear-elu-none,linear-favor-pre"], capsys)
    assert code == 0, out
    grid_dir = tmp_path / "grid-tiny"
    with open(grid_dir / "results.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["variant"] for row in rows] == ["softmax-abs", "linear-elu-none", "linear-favor-pre"]
    assert list(rows[0]) == grid.COLUMNS and all(row["steps"] == "4" for row in rows)
    assert "| linear-favor-pre |" in (grid_dir / "results.md").read_text()
    assert (grid_dir / "val_bpc.png").read_bytes()[:4] == b"\x89PNG"
    for name in ("softmax-abs", "linear-elu-none", "linear-favor-pre"):
        assert len(scalars(grid_dir / name, "val/bpc")) == 2
    assert load_checkpoint(grid_dir / "linear-favor-pre")["config"]["num_features"] == 16
    assert load_checkpoint(grid_dir / "linear-elu-none")["config"]["num_features"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--variants", "linear-favor-sideways"], "unknown variant 'linear-favor-sideways'"),
    (["--variants", "softmax-rope", "--attention", "linear"], "unrecognized arguments: --attention"),
    (["--variants", ""], "--variants must list distinct variants"),
])
def test_grid_rejects_bad_variants(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(grid.main, argv, capsys)
    assert code == 2 and message in err


def test_explicit_flags_override_the_preset() -> None:
    config = train.config_from_flags({"preset": "tiny", "d_model": 96, "n_head": 4, "steps": 7})
    assert (config.n_layer, config.d_model, config.n_head) == (2, 96, 4)
    assert config.decay_steps == 7 and config.run_name == "linear-favor-post-M32"
    softmax = train.config_from_flags({"preset": "tiny", "attention": "softmax", "rope": "none", "abs_pos": True})
    assert softmax.run_name == "softmax-abs" and softmax.num_features == 0 and softmax.feature_map == ""


def test_dataclass_defaults_are_the_cpu_preset() -> None:
    defaults = train.TrainConfig(run_name="defaults")
    assert {key: getattr(defaults, key) for key in train.PRESETS["cpu"]} == train.PRESETS["cpu"]
