"""data/enwik8/prepare.py: the download (against an HTTP server on 127.0.0.1 serving a small zip whose
checksums stand in for enwik8's), the loud fallback to the bundled sample, local sources, --verify,
atomic outputs and one-line errors."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import socket
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from linattn_lm.data import load_split
from linattn_lm import files
from linattn_lm.files import WriteFailed

REPO_ROOT = Path(__file__).resolve().parents[3]
SCRIPT = REPO_ROOT / "data" / "enwik8" / "prepare.py"


def import_script():
    """data/ is not a package: load prepare.py from its path, as the command runs it."""
    spec = importlib.util.spec_from_file_location("enwik8_prepare_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


prep = import_script()

CORPUS = b"".join(b"<page>the [[linear]] attention \xc3\xa9 %d</page>\n" % i for i in range(600))


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


ZIP = zip_bytes({"enwik8": CORPUS})
SAMPLE_SPLIT_SIZES = [3_738_657, 207_703, 207_704]  # what --sample gave before the sample was bundled


@pytest.fixture(autouse=True)
def corpus_plays_enwik8(monkeypatch: pytest.MonkeyPatch) -> None:
    """meta.json's `canonical` is checked against enwik8's sha256 on every load: CORPUS stands in for it."""
    monkeypatch.setattr("linattn_lm.data.ENWIK8_SHA256", hashlib.sha256(CORPUS).hexdigest())


def download_of(url: str, zip_data: bytes = ZIP) -> prep.Download:
    """A stand-in for enwik8: the small zip at `url` plays the canonical corpus."""
    return prep.Download(url, hashlib.sha256(zip_data).hexdigest(), "enwik8", prep.Digest.of(CORPUS))


def split_bytes(data: bytes) -> list[bytes]:
    n = len(data)
    return [data[: n * 90 // 100], data[n * 90 // 100 : n * 95 // 100], data[n * 95 // 100 :]]


def prepared_bytes(out_dir: Path) -> list[bytes]:
    return [(out_dir / f"{split}.bin").read_bytes() for split in ("train", "val", "test")]


def snapshot(out_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime_ns) for path in out_dir.iterdir()}


def assert_no_temporaries(out_dir: Path) -> None:
    assert not [path.name for path in out_dir.iterdir() if path.name.startswith((".", "tmp"))]


# ----------------------------------------------------------------------------- local HTTP server


class Server:
    """Serves `routes` (path -> (status, body, announced length)) and records the paths asked for."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, bytes, int | None]] = {}
        self.requests: list[str] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def serve(self, path: str, body: bytes = b"", status: int = 200, announced: int | None = None) -> str:
        self.routes[path] = (status, body, announced)
        return self.base_url + path

    def handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                status, body, announced = server.routes.get(self.path, (404, b"", None))
                if status != 200:
                    self.send_error(status)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(announced or len(body)))
                self.end_headers()
                self.wfile.write(body)  # HTTP/1.0: the connection closes after this, short or not

        return Handler


@pytest.fixture
def server() -> Iterator[Server]:
    state = Server()
    thread = threading.Thread(target=state.httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    state.httpd.shutdown()
    state.httpd.server_close()
    thread.join(timeout=5)


def refused_url() -> str:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/enwik8.zip"


# ----------------------------------------------------------------------------- download


def test_download_verifies_splits_and_a_second_run_does_nothing(server: Server, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    download = download_of(server.serve("/enwik8.zip", ZIP))
    assert prep.main(["--out-dir", str(tmp_path)], download=download) == 0
    out = capsys.readouterr().out
    assert f"sha256:    {hashlib.sha256(CORPUS).hexdigest()}" in out and "enwik8 (canonical" in out
    assert prepared_bytes(tmp_path) == split_bytes(CORPUS)
    assert (tmp_path / "enwik8.zip").read_bytes() == ZIP  # the verified download is cached
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["canonical"] is True and meta["source"]["kind"] == "download" and meta["source"]["url"] == download.url
    assert meta["source"]["md5"] == hashlib.md5(CORPUS).hexdigest() and meta["distinct_bytes"] == len(set(CORPUS))
    assert_no_temporaries(tmp_path)

    before = snapshot(tmp_path)
    assert prep.main(["--out-dir", str(tmp_path)], download=download) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert prep.main(["--out-dir", str(tmp_path), "--force"], download=download) == 0  # the cached zip is reused
    assert server.requests == ["/enwik8.zip"]
    assert prepared_bytes(tmp_path) == split_bytes(CORPUS)
    assert snapshot(tmp_path)["enwik8.zip"] == before["enwik8.zip"]


def failing_download(server: Server, failure: str) -> tuple[prep.Download, str]:
    """A download that fails as `failure` says, and the words its warning must contain."""
    if failure == "checksum mismatch":
        return download_of(server.serve("/enwik8.zip", ZIP), zip_bytes({"enwik8": b"other"})), "hash"
    if failure == "member missing":
        other = zip_bytes({"README": b"hi"})
        return download_of(server.serve("/enwik8.zip", other), other), "has no member 'enwik8'"
    if failure == "member differs":
        other = zip_bytes({"enwik8": CORPUS[::-1]})
        return download_of(server.serve("/enwik8.zip", other), other), f"expected {len(CORPUS):,} bytes"
    if failure == "truncated":
        return download_of(server.serve("/enwik8.zip", ZIP[:100], announced=len(ZIP))), "failed"
    if failure == "connection refused":
        return download_of(refused_url()), "Connection refused"
    status = int(failure.split()[1])
    return download_of(server.serve("/enwik8.zip", status=status)), f"{status}"


FAILURES = ["checksum mismatch", "member missing", "member differs", "truncated", "connection refused",
            "http 404", "http 500"]


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_download_falls_back_to_the_bundled_sample_loudly(failure: str, server: Server, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    download, reason = failing_download(server, failure)
    assert prep.main(["--out-dir", str(tmp_path)], download=download) == 0
    err = capsys.readouterr().err
    assert "WARNING: could not get the canonical enwik8" in err and reason in err and "NON-CANONICAL" in err
    assert "--source PATH/TO/enwik8.zip" in err and "Traceback" not in err
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["canonical"] is False and meta["description"] == "enwik8-sample.gz (NON-CANONICAL, 4,154,064 bytes)"
    assert [meta["splits"][split]["size"] for split in ("train", "val", "test")] == SAMPLE_SPLIT_SIZES
    assert not (tmp_path / "enwik8.zip").exists()  # only a zip whose hash matched is ever kept
    assert_no_temporaries(tmp_path)


def test_the_fallback_never_replaces_other_prepared_data(server: Server, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert prep.main(["--out-dir", str(tmp_path)], download=download_of(server.serve("/enwik8.zip", ZIP))) == 0
    (tmp_path / "enwik8.zip").unlink()
    before = snapshot(tmp_path)
    assert prep.main(["--out-dir", str(tmp_path), "--force"], download=download_of(refused_url())) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: downloading") and "kept the data prepared in" in err and err.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_a_repeated_fallback_rewrites_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    download = download_of(refused_url())
    assert prep.main(["--out-dir", str(tmp_path)], download=download) == 0
    before = snapshot(tmp_path)
    assert prep.main(["--out-dir", str(tmp_path)], download=download) == 0
    captured = capsys.readouterr()
    assert captured.err.count("WARNING: could not get the canonical enwik8") == 2
    assert "nothing to do" in captured.out
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- the bundled sample, --verify


def test_sample_gives_the_same_splits_as_before_and_verifies_offline(server: Server, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    download = download_of(server.serve("/enwik8.zip", ZIP))
    assert prep.main(["--out-dir", str(tmp_path), "--sample"], download=download) == 0
    whole = b"".join(prepared_bytes(tmp_path))
    assert [len(part) for part in prepared_bytes(tmp_path)] == SAMPLE_SPLIT_SIZES
    assert prep.Digest.of(whole) == prep.SAMPLE_DIGEST
    assert hashlib.sha256(gzip.decompress(prep.SAMPLE.read_bytes())).hexdigest() == prep.SAMPLE_DIGEST.sha256
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["canonical"] is False and meta["distinct_bytes"] == 200

    before = snapshot(tmp_path)
    capsys.readouterr()
    assert prep.main(["--out-dir", str(tmp_path), "--verify"], download=download) == 0
    assert "verified" in capsys.readouterr().out
    assert server.requests == [] and snapshot(tmp_path) == before


def test_verify_reports_damage_and_replaces_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prep.prepare(tmp_path, source=prep.SAMPLE, allow_noncanonical=True, log=lambda message: None)
    with open(tmp_path / "val.bin", "r+b") as val:
        val.write(b"X")  # same size: only re-hashing finds it
    before = snapshot(tmp_path)
    assert prep.main(["--out-dir", str(tmp_path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "val.bin does not hash" in err and "--force" in err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("edit, message", [
    (lambda meta: json.dumps({**meta, "splits": {}}), "splits lacks 'train'"),
    (lambda meta: json.dumps(meta).replace('"size": 207703', '"size": "big"'),
     "splits['val']['size'] is 'big', not an integer"),
    (lambda meta: json.dumps({key: value for key, value in meta.items() if key != "description"}),
     "lacks 'description'"),
    (lambda meta: "{ not json", "not valid JSON"),
])
def test_verify_refuses_a_hand_edited_meta_json(edit, message: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    prep.prepare(tmp_path, source=prep.SAMPLE, allow_noncanonical=True, log=lambda message: None)
    (tmp_path / "meta.json").write_text(edit(json.loads((tmp_path / "meta.json").read_text())))
    before = snapshot(tmp_path)
    assert prep.main(["--out-dir", str(tmp_path), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert snapshot(tmp_path) == before


def test_verify_without_prepared_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert prep.main(["--out-dir", str(tmp_path / "nothing"), "--verify"]) == 2
    assert "data not found at" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


def test_a_damaged_bundled_sample_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = tmp_path / "enwik8-sample.gz"
    damaged.write_bytes(gzip.compress(CORPUS))
    monkeypatch.setattr(prep, "SAMPLE", damaged)
    with pytest.raises(prep.DataError, match="the bundled sample .* is damaged"):
        prep.prepare(tmp_path / "out", source=damaged, allow_noncanonical=True)

    damaged.unlink()
    with pytest.raises(prep.DataError, match="is missing: restore it with git checkout"):
        prep.prepare(tmp_path / "out", source=damaged, allow_noncanonical=True)


def test_real_enwik8_is_replaced_by_other_data_only_with_force(sources: dict[str, Path], tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    quiet = {"log": lambda message: None, "download": download_of(refused_url())}
    prep.prepare(out_dir, source=sources["raw"], **quiet)          # plays the real enwik8 here
    other = tmp_path / "other"
    other.write_bytes(CORPUS[::-1])
    with pytest.raises(prep.DataError, match="holds the real enwik8.*pass --force"):
        prep.prepare(out_dir, source=other, allow_noncanonical=True, **quiet)
    assert prepared_bytes(out_dir) == split_bytes(CORPUS)
    prep.prepare(out_dir, source=other, allow_noncanonical=True, force=True, **quiet)
    assert prepared_bytes(out_dir) == split_bytes(CORPUS[::-1])
    prep.prepare(out_dir, source=sources["gz"], **quiet)           # back to the real data needs no force
    assert prepared_bytes(out_dir) == split_bytes(CORPUS)


def test_a_failed_write_is_a_one_line_error_that_keeps_what_was_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(path: Path, write) -> Path:
        raise WriteFailed(f"cannot write {path} (No space left on device); the file already there, if any, "
                               "is kept: free some space or choose a writable --out-dir")
    monkeypatch.setattr(files, "write_staged", disk_full)
    assert prep.main(["--out-dir", str(tmp_path / "out"), "--sample"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write") and "No space left" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()   # the directory it made, removed with nothing in it


# ----------------------------------------------------------------------------- local sources


@pytest.fixture
def sources(tmp_path: Path) -> dict[str, Path]:
    paths = {"raw": tmp_path / "enwik8", "gz": tmp_path / "enwik8.gz", "zip": tmp_path / "enwik8.zip"}
    paths["raw"].write_bytes(CORPUS)
    paths["gz"].write_bytes(gzip.compress(CORPUS))
    paths["zip"].write_bytes(ZIP)
    return paths


def test_gz_raw_and_zip_sources_give_identical_splits(sources: dict[str, Path], tmp_path: Path) -> None:
    download = download_of(refused_url())
    for kind, path in sources.items():
        meta = prep.prepare(tmp_path / kind, source=path, download=download, log=lambda message: None)
        assert meta["canonical"] is True and meta["source"]["kind"] == kind
        assert prepared_bytes(tmp_path / kind) == split_bytes(CORPUS)


def test_noncanonical_source_refused_then_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "head.gz"
    source.write_bytes(gzip.compress(CORPUS[:5_000]))
    out_dir = tmp_path / "out"
    assert prep.main(["--out-dir", str(out_dir), "--source", str(source)]) == 2
    err = capsys.readouterr().err
    assert "head.gz is not canonical enwik8: expected 100,000,000 bytes" in err and "--allow-noncanonical" in err
    assert not out_dir.exists()

    assert prep.main(["--out-dir", str(out_dir), "--source", str(source), "--allow-noncanonical"]) == 0
    split = load_split(out_dir, "val")
    assert split.description == "head.gz (NON-CANONICAL, 5,000 bytes)" and len(split) == 250


@pytest.mark.parametrize("kind, message", [
    ("missing", "source not found"), ("directory", "source is not a regular file"),
    ("corrupt gz", "corrupt gz file"), ("corrupt zip", "corrupt zip file"),
    ("zip without enwik8", "has no member 'enwik8' (it has: other.txt)"), ("tiny", "has only 10 bytes"),
])
def test_unusable_sources_are_one_line_errors(kind: str, message: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / {"missing": "nope.gz", "directory": "adir", "corrupt gz": "bad.gz", "corrupt zip": "bad.zip",
                         "zip without enwik8": "other.zip", "tiny": "tiny"}[kind]
    if kind == "directory":
        source.mkdir()
    elif kind == "corrupt gz":
        source.write_bytes(gzip.compress(CORPUS)[:-100])
    elif kind == "corrupt zip":
        source.write_bytes(b"PK\x03\x04 not a zip")
    elif kind == "zip without enwik8":
        source.write_bytes(zip_bytes({"other.txt": CORPUS}))
    elif kind == "tiny":
        source.write_bytes(b"0123456789")
    out_dir = tmp_path / "out"
    assert prep.main(["--out-dir", str(out_dir), "--source", str(source), "--allow-noncanonical"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not out_dir.exists()


@pytest.mark.parametrize("argv, message", [
    (["--verify", "--force"], "--verify checks the prepared data as it is"),
    (["--sample", "--source", "x.gz"], "not allowed with argument"),
    (["--sample", "--verify"], "not allowed with argument"),
    (["--bogus"], "unrecognized arguments"),
    (["--allow-noncanonical"], "--allow-noncanonical applies to a --source file"),
    (["--sample", "--allow-noncanonical"], "--allow-noncanonical applies to a --source file"),
    (["--sample", "--out-dir", ""], "argument --out-dir: expected a path, got '' (for the current directory, pass .)"),
    (["--source", ""], "argument --source: expected a path, got ''"),
])
def test_bad_flags_are_one_line_usage_errors(argv: list[str], message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        prep.main(["--out-dir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_out_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    regular = tmp_path / "file"
    regular.write_text("keep me")
    assert prep.main(["--out-dir", str(regular), "--sample"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err and regular.read_text() == "keep me"


# ----------------------------------------------------------------------------- atomic outputs


def interrupt_second_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second file prepare.py writes is half written when the user presses Ctrl-C."""
    real = files.write_staged
    calls = []

    def write_then_interrupt(path: Path, write) -> Path:
        calls.append(path)
        if len(calls) != 2:
            return real(path, write)

        def half_then_interrupt(tmp: Path) -> None:
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt

        return real(path, half_then_interrupt)

    monkeypatch.setattr(files, "write_staged", write_then_interrupt)


def test_an_interrupted_run_leaves_the_old_preparation_whole_and_no_temporaries(
        sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out_dir = tmp_path / "out"
    quiet = {"log": lambda message: None, "download": download_of(refused_url())}
    prep.prepare(out_dir, source=sources["raw"], **quiet)
    other = tmp_path / "other"
    other.write_bytes(CORPUS[::-1])
    with monkeypatch.context() as patch:
        interrupt_second_file(patch)
        with pytest.raises(KeyboardInterrupt):
            prep.prepare(out_dir, source=other, allow_noncanonical=True, force=True, **quiet)
    assert_no_temporaries(out_dir)
    assert prepared_bytes(out_dir) == split_bytes(CORPUS)    # nothing already written was lost
    assert bytes(load_split(out_dir, "val").data) == split_bytes(CORPUS)[1]
    prep.prepare(out_dir, source=other, allow_noncanonical=True, force=True, **quiet)
    assert prepared_bytes(out_dir) == split_bytes(CORPUS[::-1])


def test_temporaries_of_a_killed_run_are_removed(sources: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / ".train.bin.k1ll3d.tmp").write_bytes(b"left by kill -9")
    prep.prepare(tmp_path, source=sources["raw"], download=download_of(refused_url()), log=lambda message: None)
    assert_no_temporaries(tmp_path)


@pytest.mark.slow
def test_the_command_runs_from_any_directory(tmp_path: Path) -> None:
    """As a user runs it: from outside the repository, offline with --sample."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--sample", "--out-dir", str(tmp_path)], cwd="/",
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "enwik8-sample.gz (NON-CANONICAL, 4,154,064 bytes)" in result.stdout
    assert prep.verify(tmp_path, log=lambda message: None)["source"]["sha256"] == prep.SAMPLE_DIGEST.sha256


def test_a_failed_run_leaves_no_directory_it_made_and_keeps_those_it_found(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "rand.bin"
    source.write_bytes(bytes(range(256)) * 40)   # not enwik8: refused without --allow-noncanonical
    assert prep.main(["--source", str(source), "--out-dir", str(tmp_path / "new" / "data")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert prep.main(["--source", str(source), "--out-dir", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()
