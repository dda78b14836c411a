"""Fixtures for every test folder: seeds and threads, the gpu marker, and a small prepared slice
of enwik8 (`data_dir`) for the LM harness and command tests."""
import gzip
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.  @triton.jit reads the
# switch when it decorates, so it is set here, before any test module can import the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "data" / "enwik8" / "enwik8-sample.gz"   # bundled with the repository
SLICE_BYTES = 400_000     # -> train 360,000 / val 20,000 / test 20,000 bytes


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same RNG state; 2 threads match CI's 2 cores."""
    torch.manual_seed(0)
    torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped here, run whenever a GPU is lent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first SLICE_BYTES of the enwik8 sample, split by data/enwik8/prepare.py."""
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
