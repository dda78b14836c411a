"""Fixtures for the command-line tests: each runs train.py, grid.py or eval.py as a user would."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def script() -> Callable[..., subprocess.CompletedProcess]:
    """Run `python <repo>/<name> *args` from `cwd` (default: a directory outside the repository)."""
    def run(name: str, *args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO_ROOT / name), *args], cwd=cwd or Path("/"),
                              capture_output=True, text=True, timeout=timeout)
    return run


@pytest.fixture(scope="session")
def start_script() -> Callable[..., subprocess.Popen]:
    def start(name: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-u", str(REPO_ROOT / name), *args], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return start
