"""Fixtures for the LM harness tests: a small prepared slice of enwik8, small model configs, and
in-process runs of the commands."""
from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from linattn_lm import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE = REPO_ROOT.parent / "shared" / "data" / "enwik8-head.gz"
SLICE_BYTES = 400_000     # -> train 360,000 / val 20,000 / test 20,000 bytes


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny() -> list[str]:
    """Flags every test run of train.py / grid.py uses: tiny sizes, one thread (CPU is shared)."""
    return ["--preset", "tiny", "--threads", "1"]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first SLICE_BYTES of the enwik8 sample, split by data/enwik8/prepare.py."""
    if not SAMPLE.exists():
        pytest.skip(f"{SAMPLE} not present")
    out_dir = tmp_path_factory.mktemp("enwik8-slice")
    raw = out_dir / "enwik8-slice"
    with gzip.open(SAMPLE, "rb") as file:
        raw.write_bytes(file.read(SLICE_BYTES))
    spec = importlib.util.spec_from_file_location("enwik8_prepare_for_lm_tests",
                                                  REPO_ROOT / "data" / "enwik8" / "prepare.py")
    prepare = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = prepare   # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(prepare)
    prepare.prepare(out_dir, source=raw, allow_noncanonical=True, log=lambda message: None)
    return out_dir


@pytest.fixture(scope="session")
def small_config() -> Callable[..., ModelConfig]:
    """A 2-layer, 32-wide model config; favor + post unless overridden."""
    def make(**overrides: Any) -> ModelConfig:
        values = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, chunk_size=8,
                      feature_map_options={"num_features": 16, "redraw_interval": 1000})
        values.update(overrides)
        if values.get("attention") == "softmax":
            values.update(feature_map="", feature_map_options={})
        elif values.get("feature_map", "favor") != "favor" and "feature_map_options" not in overrides:
            values.update(feature_map_options={})
        config = ModelConfig(**values)
        config.validate()
        return config
    return make


@pytest.fixture
def run_main(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """(exit status, stdout, stderr) of an in-process main(argv), argparse exits included."""
    def run(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture(scope="session")
def scalars() -> Callable[[Path, str], list[tuple[int, float]]]:
    """(step, value) of a TensorBoard scalar tag as TensorBoard shows it (purged steps dropped)."""
    def read(run_dir: Path, tag: str) -> list[tuple[int, float]]:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        return [(event.step, event.value) for event in events.Scalars(tag)]
    return read
