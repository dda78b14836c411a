"""Fixtures for every test folder: seeds and threads, the gpu marker, and a small prepared slice
of enwik8 (`data_dir`) for the LM harness and command tests."""
import contextlib
import gzip
import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.  @triton.jit reads the
# switch when it decorates, so it is set here, before any test module can import the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Autotuning results go to Triton's disk cache, so a kernel autotunes once for every process of the
# session (the benchmark tests run each config in a fresh process) and not again in later sessions.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import linattn  # noqa: E402  (after the switches above: importing it may import the kernels)

# The library's own feature maps, from its registry, for the tests over every map (`from tests.conftest
# import LIBRARY_MAPS`): a map the library adds is tested everywhere, and maps that tests register are not
# the library's.
LIBRARY_MAPS = tuple(sorted(name for name in linattn.available_feature_maps()
                            if linattn.feature_map_class(name).__module__ == "linattn.feature_maps"))

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "data" / "enwik8" / "enwik8-sample.gz"   # bundled with the repository
SLICE_BYTES = 400_000     # -> train 360,000 / val 20,000 / test 20,000 bytes


# pytest-xdist runs the suite in one process per core (`-n auto`, set in pyproject.toml): each then
# takes one thread, so the processes together match the cores; alone, a test takes CI's 2.
THREADS = 1 if "PYTEST_XDIST_WORKER" in os.environ else 2


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a process per core on CPU; on a GPU machine the tests run in this one process, so
    they share the GPU one at a time and their progress lines show (`pytest -m gpu`)."""
    return 0 if torch.cuda.is_available() else os.cpu_count()


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts from the same RNG state and thread count."""
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped here, run whenever a GPU is lent."""
    if torch.cuda.is_available():
        items.sort(key=lambda item: "gpu" not in item.keywords)   # the GPU tests first, so their
        return                                                     # progress lines come together
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


def say(config: pytest.Config, line: str) -> None:
    """A line on the terminal now, whatever pytest captures (progress of long GPU tests)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    # Inside a test's setup or a fixture, pytest captures stdout: the line would wait for the report
    # (on an H200 it was never seen in 200 s).  Capture is lifted for the write.
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.ensure_newline()
        reporter.write_line(line, flush=True)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a GPU, each gpu test announces itself before it runs: its first kernel launches compile
    (and fla's autotune), which took minutes in silence."""
    if "gpu" in item.keywords and torch.cuda.is_available():
        say(item.config, f"[gpu] {item.nodeid} ...")


@pytest.fixture(scope="session")
def fla_autotuned(request: pytest.FixtureRequest) -> None:
    """flash-linear-attention's chunk kernel, autotuned once for the session at the shapes the
    benchmark tests run it at (n = 256 and 512, fp32 and bf16), with a line that says so: its first
    call autotunes for about 90 s.  Without CUDA or fla, nothing (those tests skip)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return
    from benchmarks.methods import Shape, build_attention, make_inputs, method_table
    fla_chunk = next(method for method in method_table(("auto",)) if method.name == "fla-chunk")
    say(request.config, "[gpu] autotuning flash-linear-attention's chunk kernel once for the session "
                        "(about 90 s the first time; Triton's disk cache keeps it) ...")
    started = time.perf_counter()
    cuda, shape = torch.device("cuda"), Shape()
    attend = build_attention(fla_chunk, shape, cuda, causal=True, chunk_size=64)
    for n in (256, 512):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, _ = make_inputs(shape, n, cuda, dtype)
            with torch.no_grad():
                attend(q, k, v)
    torch.cuda.synchronize()
    say(request.config, f"[gpu] fla autotuned in {time.perf_counter() - started:.0f} s")
