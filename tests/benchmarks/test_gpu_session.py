"""The prepared GPU session (benchmarks/gpu_session.sh, gpu_wheels.sh): valid scripts, wheels pinned to
the versions this project installs."""
import os
import re
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION, WHEELS = ROOT / "benchmarks" / "gpu_session.sh", ROOT / "benchmarks" / "gpu_wheels.sh"


@pytest.mark.parametrize("script", [SESSION, WHEELS], ids=["session", "wheels"])
def test_the_scripts_are_valid_bash(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0


def test_the_wheels_are_the_gpu_extras_fla_and_the_performer_stack_that_imports_linattn():
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = dict(re.findall(r"([a-z][a-z0-9-]*)==([0-9][0-9.]*)", WHEELS.read_text()))
    assert f"fla-core=={pins['fla-core']}" in gpu_extra
    # linattn imports performer_pytorch, which imports local_attention -> hyper_connections -> torch_einops_utils
    assert {"performer-pytorch", "local-attention", "axial-positional-embedding", "hyper-connections",
            "torch-einops-utils"} <= set(pins)
    assert ".whl/" in (ROOT / ".gitignore").read_text().split()   # they travel carried, never committed



def stand_in_tools(tmp_path):
    """nvidia-smi and python3 stand-ins that log their arguments (python3 fails with $FAIL)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, body in (("nvidia-smi", "echo gpu"), ("python3", f'echo "$*" >> {tmp_path}/calls; [ "$2" = pip ] || exit ${{FAIL:-0}}')):
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    return {"PATH": f"{tools}:/usr/bin:/bin"}


def test_the_session_runs_its_stages_in_order_each_to_its_file_within_the_budget(tmp_path):
    """With stand-ins for nvidia-smi and python3: every stage runs, in order, into its own file; a failing
    stage's status is the script's; stages that no longer fit the budget are skipped and say so."""
    env = stand_in_tools(tmp_path)
    out = tmp_path / "out"
    assert subprocess.run(["bash", str(SESSION), str(out)], env=env, capture_output=True).returncode == 0
    calls = [call for call in (tmp_path / "calls").read_text().splitlines() if not call.startswith("-c")]
    order = ["--deselect", "benchmarks.gpu_checks warm", "--sections block", "-s tests/linattn", "--sections kernels",
             "gpu_checks profile", "--sections model"]
    found = [next(i for i, call in enumerate(calls) if want in call) for want in order]
    assert found == sorted(found), calls
    stages = ("setup", "gpu_tests", "warm", "blocks", "accuracy", "kernels", "profile", "model")
    with tarfile.open(out / "session.tgz") as archive:   # the device machine returns at most 8 files
        assert {f"{stage}.txt" for stage in stages} <= set(archive.getnames())
    assert sorted(path.name for path in out.iterdir()) == ["session.tgz"]
    failed = subprocess.run(["bash", str(SESSION), str(out)], env={**env, "FAIL": "3"}, capture_output=True)
    assert failed.returncode == 3
    short = subprocess.run(["bash", str(SESSION), str(out)], env={**env, "BUDGET_S": "20"}, capture_output=True,
                           text=True)
    assert "skipped" in short.stdout and short.returncode == 0


@pytest.mark.slow
def test_the_dry_run_checks_every_stages_command_and_the_budget(tmp_path):
    """The dry run on CPU: each stage's command parses (pytest collects, the benchmark takes its flags)
    and the budgeted limits fit 580 s; a budget they exceed fails it."""
    done = subprocess.run(["bash", str(SESSION), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(" ok ") == 8 and "485 s of 580 s" in done.stdout, done.stdout
    over = subprocess.run(["bash", str(SESSION), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "BUDGET_S": "400"})
    assert over.returncode == 1 and "over the budget" in over.stdout
