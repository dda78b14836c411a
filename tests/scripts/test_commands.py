"""train.py, grid.py and eval.py as commands: signals and exit codes, errors without tracebacks,
and a user's feature map, in its own file, trained, resumed and evaluated."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from linattn_lm import load_checkpoint

TINY = ["--preset", "tiny", "--threads", "1"]
USER_MAP = '''
import torch
from linattn import FeatureMap, register_feature_map


@register_feature_map("scaled-relu")
class ScaledRelu(FeatureMap):
    def __init__(self, head_dim, scale=1.0):
        super().__init__(head_dim)
        if not scale > 0:
            raise ValueError(f"scale must be positive, got {scale}")
        self.scale = scale

    def forward(self, x, *, is_query):
        return torch.relu(self.scale * x.float()) + 1e-6
'''


def long_run_flags(data_dir: Path, tmp_path: Path, run_name: str) -> list[str]:
    """A tiny run that estimates every 5 steps and saves only at the end or on a signal."""
    return [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", run_name,
            "--eval-interval", "5", "--eval-iters", "1", "--ckpt-interval", "0", "--sample-interval", "0"]


def started_past_step_5(start_script, flags: list[str]):
    """train.py with `flags` for 5,000 steps, returned once it has printed step 5 (the caller stops it)."""
    process = start_script("train.py", *flags, "--steps", "5000")
    for line in process.stdout:
        if line.startswith("step 5/"):
            break
    return process


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_it(signum: int, data_dir: Path, tmp_path: Path,
                                                            start_script, script) -> None:
    flags = long_run_flags(data_dir, tmp_path, "stop")
    process = started_past_step_5(start_script, flags)
    try:
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err and "checkpoint saved" in out
    step = load_checkpoint(tmp_path / "stop")["step"]
    assert 5 <= step < 5000
    done = script("train.py", *flags, "--resume", "--steps", str(step + 2), "--decay-steps", "5000")
    assert done.returncode == 0 and f"resumed {tmp_path / 'stop' / 'ckpt.pt'} at step {step}" in done.stdout
    assert load_checkpoint(tmp_path / "stop")["step"] == step + 2


@pytest.mark.slow
@pytest.mark.parametrize("name, args, message", [
    ("eval.py", ["nothing.pt"], "error: checkpoint not found"),
    ("train.py", ["--import", "/nonexistent/user_map.py"], "cannot import it"),
    ("grid.py", ["--variants", "linear-nothing-post"], "unknown feature map 'nothing'"),
])
def test_errors_are_one_line_without_traceback(name: str, args: list[str], message: str, script) -> None:
    done = script(name, *args)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_a_user_feature_map_trains_resumes_and_evaluates(data_dir: Path, tmp_path: Path, script) -> None:
    """From its own file, with an option; eval.py rebuilds it from what the checkpoint records."""
    user_map = tmp_path / "my_maps.py"
    user_map.write_text(USER_MAP)
    flags = [*TINY, "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "runs"), "--import", str(user_map),
             "--feature-map", "scaled-relu", "--feature-map-option", "scale=0.5", "--decay-steps", "8",
             "--eval-interval", "4", "--sample-interval", "0"]
    first = script("train.py", *flags, "--steps", "4")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "linear-scaled-relu-post"
    resumed = script("train.py", *flags, "--steps", "8", "--resume")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout, resumed.stderr
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint["step"] == 8 and checkpoint["config"]["model"]["feature_map_options"] == {"scale": 0.5}
    assert checkpoint["config"]["run"]["imports"] == [str(user_map)]
    scored = script("eval.py", str(run_dir), "--max-bytes", "500", "--threads", "1")
    assert scored.returncode == 0 and "linear-scaled-relu-post" in scored.stdout, scored.stderr
    user_map.rename(tmp_path / "moved.py")
    lost = script("eval.py", str(run_dir), "--max-bytes", "500")
    assert lost.returncode == 2 and "needs feature map 'scaled-relu'" in lost.stderr and "--import" in lost.stderr
    found = script("eval.py", str(run_dir), "--max-bytes", "500", "--import", str(tmp_path / "moved.py"))
    assert found.returncode == 0, found.stderr
    bad = script("train.py", "--import", str(tmp_path / "moved.py"), "--feature-map", "scaled-relu",
                 "--feature-map-option", "scale=-1")
    assert bad.returncode == 2 and "scale must be positive" in bad.stderr


@pytest.mark.slow
def test_two_runs_of_one_directory_the_second_is_refused_and_kill_9_frees_it(data_dir: Path, tmp_path: Path,
                                                                             start_script, script) -> None:
    flags = long_run_flags(data_dir, tmp_path, "shared")
    first = started_past_step_5(start_script, flags)
    try:
        second = script("train.py", *flags, "--lr", "0.001", "--steps", "2")
        assert second.returncode == 2 and "model:" not in second.stdout, second.stderr   # refused before building it
        assert second.stderr == (f"error: {tmp_path / 'shared'} is in use by another run (pid {first.pid}); wait for "
                                 "it to finish, or choose another --run-name / --out-dir\n")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    again = script("train.py", *flags, "--steps", "2", "--decay-steps", "5000")
    assert again.returncode == 0, again.stderr
    assert load_checkpoint(tmp_path / "shared")["step"] == 2
