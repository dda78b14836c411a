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

