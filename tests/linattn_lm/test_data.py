"""Tests for data/enwik8/prepare.py (download, verification, atomic writes) and linattn.data (the loader).

Downloads go to a real HTTP server on 127.0.0.1 serving small files; the expected checksums are
overridden to match them, so the production download code runs unchanged.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import socket
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from linattn_lm.data import (
    ByteSplit,
    DataError,
    DataNotFoundError,
    RandomWindows,
    SequentialWindows,
    describe_data,
    load_split,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE = REPO_ROOT.parent / "shared" / "data" / "enwik8-head.gz"
SAMPLE_SIZE = 4_154_064
SAMPLE_SHA256 = "d8b3b95fb4993726ea7dcc93ae3c9e08a1a04cc540d05d7656fd267cc8ab5d6a"


def import_prepare() -> ModuleType:
    """data/ is not a package: load prepare.py from its path."""
    path = REPO_ROOT / "data" / "enwik8" / "prepare.py"
    spec = importlib.util.spec_from_file_location("enwik8_prepare", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


prep = import_prepare()

# ----------------------------------------------------------------------------- small corpus


def make_corpus(size: int = 20_000, seed: int = 1) -> bytes:
    """Text-like bytes (so zip/gzip compress them) with a handful of rare byte values."""
    rng = np.random.default_rng(seed)
    words = [b"the ", b"linear ", b"attention ", b"<page>", b"</page>\n", b"[[enwik8]] ", b"\xc3\xa9 "]
    chunks = [words[i] for i in rng.integers(0, len(words), size=size)]
    return b"".join(chunks)[:size]


CORPUS = make_corpus()


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


ZIP = zip_bytes({"enwik8": CORPUS})


def expected_for(zip_data: bytes, corpus: bytes, member: str = "enwik8") -> prep.Expected:
    return prep.Expected(
        zip_size=len(zip_data),
        zip_sha256=hashlib.sha256(zip_data).hexdigest(),
        member=member,
        member_size=len(corpus),
        member_md5=hashlib.md5(corpus).hexdigest(),
        member_sha256=hashlib.sha256(corpus).hexdigest(),
    )


EXPECTED = expected_for(ZIP, CORPUS)


def quiet(message: str) -> None:
    pass


def prepare_small(out_dir: Path, **kwargs: Any) -> dict:
    kwargs.setdefault("expected", EXPECTED)
    kwargs.setdefault("log", quiet)
    kwargs.setdefault("timeout", 5.0)
    return prep.prepare(out_dir, **kwargs)


def split_bytes(data: bytes) -> dict[str, bytes]:
    n = len(data)
    return {"train": data[: n * 90 // 100], "val": data[n * 90 // 100 : n * 95 // 100], "test": data[n * 95 // 100 :]}


def assert_prepared(out_dir: Path, data: bytes) -> dict:
    for name, expected in split_bytes(data).items():
        assert (out_dir / f"{name}.bin").read_bytes() == expected
    assert_no_temp_files(out_dir)
    return json.loads((out_dir / "meta.json").read_text())


def assert_nothing_prepared(out_dir: Path) -> None:
    leftovers = [p.name for p in out_dir.iterdir()] if out_dir.exists() else []
    assert not [name for name in leftovers if name.endswith((".bin", ".tmp")) or name == "meta.json"], leftovers
    assert "enwik8.zip" not in leftovers  # an unverified download never gets the cache name


def assert_no_temp_files(out_dir: Path) -> None:
    assert not list(out_dir.glob("*.tmp"))
    assert not list(out_dir.glob("*.part"))


# ----------------------------------------------------------------------------- local HTTP server


@dataclass
class Route:
    """What the test server does for one path."""

    body: bytes = b""
    status: int = 200
    honour_range: bool = True
    cut_first_request_at: int | None = None  # send only this many body bytes on the first request, then close
    claimed_length: int | None = None  # Content-Length to announce (larger than the body = truncated transfer)


@dataclass
class FileServer:
    base_url: str
    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[dict[str, str]] = field(default_factory=list)

    def serve(self, path: str, route: Route) -> str:
        self.routes[path] = route
        return self.base_url + path


def make_handler(server_state: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            server_state.requests.append({"path": self.path, **dict(self.headers)})
            route = server_state.routes.get(self.path)
            if route is None or route.status != 200:
                self.send_error(route.status if route else 404)
                return
            start = self.requested_start(route)
            body = route.body[start:]
            first_request = sum(r["path"] == self.path for r in server_state.requests) == 1
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(route.body) - 1}/{len(route.body)}")
            self.send_header("Content-Length", str(route.claimed_length or len(body)))
            self.end_headers()
            if first_request and route.cut_first_request_at is not None:
                body = body[: route.cut_first_request_at]
            self.wfile.write(body)  # HTTP/1.0: the connection closes after this, short or not

        def requested_start(self, route: Route) -> int:
            header = self.headers.get("Range", "")
            if not route.honour_range or not header.startswith("bytes="):
                return 0
            return int(header.removeprefix("bytes=").split("-")[0])

    return Handler


@pytest.fixture
def http_server() -> Iterator[FileServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    state = FileServer(base_url=f"http://127.0.0.1:{httpd.server_address[1]}")
    httpd.RequestHandlerClass = make_handler(state)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


# ----------------------------------------------------------------------------- download


def test_download_success_and_second_run_does_nothing(http_server: FileServer, tmp_path: Path) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP))
    meta = prepare_small(tmp_path, url=url)

    assert assert_prepared(tmp_path, CORPUS) == meta
    assert (tmp_path / "enwik8.zip").read_bytes() == ZIP  # the verified download is cached
    n = len(CORPUS)
    assert meta["canonical"] is True
    assert meta["source"]["url"] == url and meta["source"]["kind"] == "download"
    assert meta["source"]["sha256"] == hashlib.sha256(CORPUS).hexdigest()
    assert meta["source"]["md5"] == hashlib.md5(CORPUS).hexdigest()
    assert meta["split_boundaries"] == [0, n * 90 // 100, n * 95 // 100, n]
    assert {k: v["size"] for k, v in meta["splits"].items()} == {k: len(v) for k, v in split_bytes(CORPUS).items()}
    assert meta["distinct_bytes"] == len(set(CORPUS)) and meta["vocab_size"] == 256

    mtimes = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    messages: list[str] = []
    assert prepare_small(tmp_path, url=url, log=messages.append) == meta
    assert prepare_small(tmp_path, url=url, verify=True, log=messages.append) == meta
    assert len(http_server.requests) == 1
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == mtimes
    assert "nothing to do" in messages[0] and "re-hashed" in messages[-1]


def test_cli_second_run_says_nothing_to_do(
    http_server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP))
    argv = ["--out-dir", str(tmp_path)]
    assert prep.main(argv, url=url, expected=EXPECTED) == 0
    assert "sha256:    " + EXPECTED.member_sha256 in capsys.readouterr().out
    assert prep.main(argv, url=url, expected=EXPECTED) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_resume_after_cut_connection(http_server: FileServer, tmp_path: Path) -> None:
    half = len(ZIP) // 2
    url = http_server.serve("/enwik8.zip", Route(ZIP, cut_first_request_at=half))

    with pytest.raises(prep.DataError, match=f"expected {len(ZIP):,} bytes .* got {half:,}.*re-run to resume"):
        prepare_small(tmp_path, url=url)
    assert (tmp_path / "enwik8.zip.part").stat().st_size == half
    assert_nothing_prepared(tmp_path)

    prepare_small(tmp_path, url=url)
    assert http_server.requests[-1]["Range"] == f"bytes={half}-"
    assert_prepared(tmp_path, CORPUS)
    assert (tmp_path / "enwik8.zip").read_bytes() == ZIP


def test_server_ignoring_range_restarts_cleanly(http_server: FileServer, tmp_path: Path) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP, honour_range=False))
    (tmp_path / "enwik8.zip.part").write_bytes(b"stale partial bytes")
    messages: list[str] = []

    prepare_small(tmp_path, url=url, log=messages.append)
    assert http_server.requests[-1]["Range"] == "bytes=19-"
    assert any("ignored the resume request" in m for m in messages)
    assert_prepared(tmp_path, CORPUS)


def test_checksum_mismatch(http_server: FileServer, tmp_path: Path) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP))
    wrong = prep.Expected(**{**EXPECTED.__dict__, "zip_sha256": "0" * 64})
    with pytest.raises(prep.DataError, match=f"checksum mismatch.*expected sha256 0{{64}}, got {EXPECTED.zip_sha256}"):
        prepare_small(tmp_path, url=url, expected=wrong)
    assert_nothing_prepared(tmp_path)
    assert_no_temp_files(tmp_path)  # a download that fails verification is deleted


def test_truncated_download_keeps_only_the_resumable_part(http_server: FileServer, tmp_path: Path) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP[:1000], claimed_length=len(ZIP)))
    with pytest.raises(prep.DataError, match=f"download truncated: expected {len(ZIP):,} bytes .*, got 1,000"):
        prepare_small(tmp_path, url=url)
    assert_nothing_prepared(tmp_path)
    assert (tmp_path / "enwik8.zip.part").read_bytes() == ZIP[:1000]


def test_size_mismatch(http_server: FileServer, tmp_path: Path) -> None:
    url = http_server.serve("/enwik8.zip", Route(ZIP[:1000]))
    with pytest.raises(prep.DataError, match=f"size mismatch: .* is 1,000 bytes, expected {len(ZIP):,}"):
        prepare_small(tmp_path, url=url)
    assert_nothing_prepared(tmp_path)
    assert_no_temp_files(tmp_path)


def test_zip_without_enwik8_member(http_server: FileServer, tmp_path: Path) -> None:
    other_zip = zip_bytes({"README.txt": b"hello", "data.txt": CORPUS})
    url = http_server.serve("/enwik8.zip", Route(other_zip))
    with pytest.raises(prep.DataError, match=r"has no member 'enwik8' \(it has: README.txt, data.txt\)"):
        prepare_small(tmp_path, url=url, expected=expected_for(other_zip, CORPUS))
    assert_nothing_prepared(tmp_path)
    assert_no_temp_files(tmp_path)


@pytest.mark.parametrize("status", [404, 500])
def test_http_error(
    http_server: FileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], status: int
) -> None:
    url = http_server.serve("/enwik8.zip", Route(status=status))
    assert prep.main(["--out-dir", str(tmp_path)], url=url, expected=EXPECTED) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: HTTP error {status} ") and url in error and "Traceback" not in error
    assert_nothing_prepared(tmp_path)
    assert_no_temp_files(tmp_path)


def test_connection_refused(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/enwik8.zip"
    with pytest.raises(prep.DataError, match=f"cannot connect to {url}"):
        prepare_small(tmp_path, url=url)
    assert_nothing_prepared(tmp_path)
    assert_no_temp_files(tmp_path)


# ----------------------------------------------------------------------------- local sources


@pytest.fixture
def source_files(tmp_path: Path) -> dict[str, Path]:
    paths = {"raw": tmp_path / "enwik8", "gz": tmp_path / "enwik8.gz", "zip": tmp_path / "enwik8.zip"}
    paths["raw"].write_bytes(CORPUS)
    paths["gz"].write_bytes(gzip.compress(CORPUS))
    paths["zip"].write_bytes(ZIP)
    return paths


def test_gz_raw_and_zip_sources_give_identical_splits(source_files: dict[str, Path], tmp_path: Path) -> None:
    metas = {}
    for kind, path in source_files.items():
        metas[kind] = prepare_small(tmp_path / f"out-{kind}", source=path)
        assert_prepared(tmp_path / f"out-{kind}", CORPUS)
        assert metas[kind]["canonical"] is True and metas[kind]["source"]["kind"] == kind
    assert metas["raw"]["splits"] == metas["gz"]["splits"] == metas["zip"]["splits"]


def test_noncanonical_source_refused_then_accepted(tmp_path: Path) -> None:
    head = CORPUS[:5_000]
    source = tmp_path / "head.gz"
    source.write_bytes(gzip.compress(head))
    out_dir = tmp_path / "out"
    found = hashlib.sha256(head).hexdigest()
    pattern = (f"expected {len(CORPUS):,} bytes with sha256 {EXPECTED.member_sha256}.*found 5,000 bytes "
               f"with sha256 {found}.*pass --allow-noncanonical to use it anyway")
    with pytest.raises(prep.DataError, match=pattern):
        prepare_small(out_dir, source=source)
    assert_nothing_prepared(out_dir)

    meta = prepare_small(out_dir, source=source, allow_noncanonical=True)
    assert meta["canonical"] is False
    assert meta["description"] == "head.gz (NON-CANONICAL, 5,000 bytes)"
    assert [meta["splits"][s]["size"] for s in ("train", "val", "test")] == [4_500, 250, 250]
    assert_prepared(out_dir, head)
    assert describe_data(out_dir) == "head.gz (NON-CANONICAL, 5,000 bytes)"
    assert load_split(out_dir, "val").canonical is False


@pytest.mark.parametrize("kind", ["missing", "directory", "corrupt_gz", "corrupt_zip"])
def test_unreadable_source(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    names = {"missing": "nope.gz", "directory": "adir", "corrupt_gz": "bad.gz", "corrupt_zip": "bad.zip"}
    source = tmp_path / names[kind]
    if kind == "directory":
        source.mkdir()
    elif kind == "corrupt_gz":
        source.write_bytes(gzip.compress(CORPUS)[:-100])  # truncated stream
    elif kind == "corrupt_zip":
        source.write_bytes(b"PK\x03\x04 definitely not a zip")
    message = {"missing": "source not found", "directory": "source is not a regular file",
               "corrupt_gz": "corrupt gzip file", "corrupt_zip": "corrupt zip file"}[kind]
    out_dir = tmp_path / "out"

    assert prep.main(["--out-dir", str(out_dir), "--source", str(source)], expected=EXPECTED) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and str(source) in error and "Traceback" not in error
    assert_nothing_prepared(out_dir)


@pytest.mark.skipif(not SAMPLE.exists(), reason=f"{SAMPLE} not present")
def test_real_sample_file(tmp_path: Path) -> None:
    meta = prep.prepare(tmp_path, source=SAMPLE, allow_noncanonical=True, log=quiet)
    sizes = [(tmp_path / f"{s}.bin").stat().st_size for s in ("train", "val", "test")]
    assert sum(sizes) == SAMPLE_SIZE and sizes == [3_738_657, 207_703, 207_704]
    whole = b"".join((tmp_path / f"{s}.bin").read_bytes() for s in ("train", "val", "test"))
    assert hashlib.sha256(whole).hexdigest() == SAMPLE_SHA256 == prep.SAMPLE_SHA256
    assert meta["canonical"] is False and meta["distinct_bytes"] == 200
    assert meta["description"] == "enwik8-head.gz (NON-CANONICAL, 4,154,064 bytes)"
    assert prep.SAMPLE_SOURCE.resolve() == SAMPLE.resolve()


# ----------------------------------------------------------------------------- interruption


def interrupt_second_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the split writer raise KeyboardInterrupt halfway through the second split."""
    real_write_split = prep.write_split
    calls = []

    def write_then_interrupt(path: Path, data: memoryview) -> None:
        calls.append(path)
        if len(calls) == 2:
            real_write_split(path, data[: len(data) // 2])
            raise KeyboardInterrupt
        real_write_split(path, data)

    monkeypatch.setattr(prep, "write_split", write_then_interrupt)


def test_interrupted_first_run_leaves_nothing(
    source_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    interrupt_second_split(monkeypatch)
    out_dir = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare_small(out_dir, source=source_files["raw"])
    assert_nothing_prepared(out_dir)


def test_interrupted_rerun_keeps_previous_preparation(
    source_files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = tmp_path / "out"
    prepare_small(out_dir, source=source_files["raw"])
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    other = tmp_path / "other"
    other.write_bytes(CORPUS[::-1])

    interrupt_second_split(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        prepare_small(out_dir, source=other, allow_noncanonical=True)
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before
    assert load_split(out_dir, "train").data.tobytes() == split_bytes(CORPUS)["train"]


# ----------------------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("enwik8-small")
    source = out_dir / "small.raw"
    source.write_bytes(CORPUS)
    prepare_small(out_dir, source=source)
    return out_dir


def test_load_split(data_dir: Path) -> None:
    split = load_split(data_dir, "val")
    assert isinstance(split, ByteSplit) and isinstance(split.data, np.memmap)
    assert split.data.dtype == np.uint8 and split.vocab_size == 256
    assert split.data.tobytes() == split_bytes(CORPUS)["val"]
    assert split.description == "enwik8 (canonical, 20,000 bytes)"  # canonical under the test's EXPECTED


def test_random_windows_shapes_shift_and_seed(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    batches = RandomWindows(train, batch_size=4, seq_len=64, seed=7)
    x, y = next(batches)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = np.asarray(train.data)
    for row, start in zip(x.numpy(), batches.window_starts(0)):
        assert row.tobytes() == data[start : start + 64].astype(np.int64).tobytes()
    again = RandomWindows(train, batch_size=4, seq_len=64, seed=7)
    other = RandomWindows(train, batch_size=4, seq_len=64, seed=8)
    assert torch.equal(next(again)[0], x)
    assert not torch.equal(next(other)[0], x)


def test_random_windows_resume_exactly(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    original = RandomWindows(train, batch_size=3, seq_len=32, seed=11)
    for _ in range(5):
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(4)]

    resumed = RandomWindows(train, batch_size=3, seq_len=32, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(4))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="saved seq_len is 32, this stream's is 16"):
        RandomWindows(train, batch_size=3, seq_len=16).load_state_dict(state)


def test_random_windows_ranks_split_the_global_batch(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    single = RandomWindows(train, batch_size=4, seq_len=16, seed=3)
    ranks = [RandomWindows(train, batch_size=2, seq_len=16, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, _ = next(single)
        parts = [next(r)[0] for r in ranks]
        assert not torch.equal(parts[0], parts[1])
        assert torch.equal(torch.cat(parts), x)


def test_sequential_windows_cover_every_target_once(data_dir: Path) -> None:
    val = load_split(data_dir, "val")
    data = np.asarray(val.data).astype(np.int64)
    windows = SequentialWindows(val, batch_size=3, seq_len=64)
    batches = list(windows)
    assert len(batches) == len(windows)
    assert windows.remainder == (len(val) - 1) % 64 != 0  # the test exercises the shorter last window
    assert batches[-1][0].shape == (1, windows.remainder)
    inputs = torch.cat([x.reshape(-1) for x, _ in batches]).numpy()
    targets = torch.cat([y.reshape(-1) for _, y in batches]).numpy()
    assert windows.num_targets == len(targets) == len(val) - 1
    assert np.array_equal(inputs, data[:-1]) and np.array_equal(targets, data[1:])


def test_seq_len_longer_than_split(data_dir: Path) -> None:
    val = load_split(data_dir, "val")
    message = f"seq_len 1,000 needs windows of 1,001 bytes .* only {len(val):,} bytes"
    with pytest.raises(DataError, match=message):
        RandomWindows(val, batch_size=1, seq_len=1000)
    with pytest.raises(DataError, match=message):
        SequentialWindows(val, batch_size=1, seq_len=1000)


def test_missing_data_names_the_prepare_command(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError, match=r"data not found at .*train\.bin: run python data/enwik8/prepare.py"):
        load_split(tmp_path / "nowhere", "train")
    message = str(pytest.raises(DataNotFoundError, load_split, tmp_path, "val").value)
    assert "--source ../shared/data/enwik8-head.gz --allow-noncanonical" in message


def test_size_mismatch_with_meta_is_detected(data_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in data_dir.glob("*.bin"):
        (copy / path.name).write_bytes(path.read_bytes())
    (copy / "meta.json").write_text((data_dir / "meta.json").read_text())
    with open(copy / "test.bin", "ab") as f:
        f.write(b"extra")
    with pytest.raises(DataError, match=r"test\.bin is 1,005 bytes but .*meta\.json says 1,000"):
        load_split(copy, "test")
    (copy / "meta.json").unlink()
    with pytest.raises(DataNotFoundError, match="incompletely prepared"):
        load_split(copy, "train")
