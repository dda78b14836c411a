"""Shared helpers for test_lm.py, test_train.py and test_eval.py (not a test module itself)."""
from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from linattn_lm import ModelConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT.parent / "shared" / "data" / "enwik8-head.gz"
SLICE_BYTES = 400_000     # -> train 360,000 / val 20,000 / test 20,000 bytes

# Flags every test run of train.py / grid.py uses: tiny sizes, one thread (CPU is shared).
TINY = ["--preset", "tiny", "--threads", "1"]


def import_prepare() -> ModuleType:
    """data/ is not a package: load prepare.py from its path."""
    spec = importlib.util.spec_from_file_location("enwik8_prepare_for_lm_tests",
                                                  REPO_ROOT / "data" / "enwik8" / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def prepare_enwik8_slice(out_dir: Path) -> Path:
    """The first SLICE_BYTES of the offline enwik8 sample, split by data/enwik8/prepare.py."""
    if not SAMPLE.exists():
        pytest.skip(f"{SAMPLE} not present")
    with gzip.open(SAMPLE, "rb") as file:
        raw = out_dir / "enwik8-slice"
        raw.write_bytes(file.read(SLICE_BYTES))
    import_prepare().prepare(out_dir, source=raw, allow_noncanonical=True, log=lambda message: None)
    return out_dir


def small_config(**overrides) -> ModelConfig:
    """A 2-layer, 32-wide model; favor + post unless overridden."""
    values = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, num_features=16, redraw_interval=1000,
                  chunk_size=8)
    values.update(overrides)
    if values.get("attention") == "softmax":
        values.update(feature_map="", num_features=0, redraw_interval=0)
    elif values.get("feature_map", "favor") != "favor":
        values.update(num_features=0, redraw_interval=0)
    return ModelConfig(**values)
