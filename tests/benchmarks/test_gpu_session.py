"""The prepared GPU session (benchmarks/gpu_session.sh, gpu_wheels.sh): valid scripts, wheels pinned to
the versions this project installs."""
import re
import subprocess
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



@pytest.mark.parametrize("limits,ran", [({}, ["-m pytest", "--preset gpu-targets"]),
                                        ({"TESTS_S": "0", "BENCH_S": "0", "GAP_S": "9"}, ["--preset gap-closers"])])
def test_the_session_runs_the_stages_whose_limit_is_not_0(tmp_path, limits, ran):
    """With stand-ins for nvidia-smi and python3 that log their arguments: the first call runs the GPU
    tests and the gpu-targets benchmark, a second call with GAP_S the gap-closers one alone; a failing
    stage's status is the script's."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, body in (("nvidia-smi", "echo gpu"), ("python3", f'echo "$*" >> {tmp_path}/calls; [ "$2" = pip ] || exit ${{FAIL:-0}}')):
        (tools / name).write_text(f"#!/bin/sh\n{body}\n")
        (tools / name).chmod(0o755)
    env = {"PATH": f"{tools}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), **limits}
    assert subprocess.run(["bash", str(SESSION)], env=env, capture_output=True).returncode == 0
    calls = [call for call in (tmp_path / "calls").read_text().splitlines()   # not the wheels' or versions'
             if call.startswith(("-m pytest", "-m benchmarks"))]
    assert len(calls) == len(ran) and all(want in call for want, call in zip(ran, calls)), calls
    assert subprocess.run(["bash", str(SESSION)], env={**env, "FAIL": "3"}, capture_output=True).returncode == 3
