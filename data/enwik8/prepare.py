#!/usr/bin/env python3
"""Prepare enwik8 as raw-byte splits (uint8, vocab 256) for linattn.

    python data/enwik8/prepare.py                 # download, verify, split 90M/5M/5M
    python data/enwik8/prepare.py --sample        # offline: ../shared/data/enwik8-head.gz, non-canonical
    python data/enwik8/prepare.py --source PATH   # a local enwik8 .zip, .gz or raw file

Writes train.bin, val.bin, test.bin and meta.json (written last) into --out-dir, which defaults to this
script's directory. A directory without a valid meta.json is never considered prepared.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

# The loader owns the format's names and the error users see; this script writes what it reads.
from linattn_lm.data import META_NAME, SPLITS, DataError

URL = "http://mattmahoney.net/dc/enwik8.zip"
SCRIPT_DIR = Path(__file__).resolve().parent
REPO_ROOT = SCRIPT_DIR.parents[1]
DEFAULT_OUT_DIR = SCRIPT_DIR
# First 4,154,064 bytes of enwik8, for offline development (see ../shared/data/README.md).
SAMPLE_SOURCE = REPO_ROOT.parent / "shared" / "data" / "enwik8-head.gz"
SAMPLE_SHA256 = "d8b3b95fb4993726ea7dcc93ae3c9e08a1a04cc540d05d7656fd267cc8ab5d6a"

SPLIT_END_PERCENTS = (90, 95, 100)  # on 100,000,000 bytes: the standard 90M / 5M / 5M split
ZIP_CACHE_NAME = "enwik8.zip"
PART_SUFFIX = ".part"
TMP_SUFFIX = ".tmp"
META_FORMAT_VERSION = 1
CHUNK_BYTES = 1 << 20
USER_AGENT = "linattn-enwik8-prepare/1"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Expected:
    """What a verified download and a canonical source look like (tests substitute small files)."""

    zip_size: int
    zip_sha256: str
    member: str
    member_size: int
    member_md5: str
    member_sha256: str


CANONICAL = Expected(
    zip_size=36_445_475,
    zip_sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
    member="enwik8",
    member_size=100_000_000,
    member_md5="a1fa5ffddb56f4953e226637dabbb36a",
    member_sha256="2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8",
)


@dataclass(frozen=True)
class Digest:
    size: int
    sha256: str
    md5: str


@dataclass(frozen=True)
class SourceBytes:
    """The uncompressed corpus plus where it came from (recorded in meta.json)."""

    data: bytes
    kind: str  # "download", "zip", "gz" or "raw"
    name: str  # short name used in the human-readable description
    url: str | None
    path: Path | None
    member: str | None
    file_size: int | None  # size and mtime of a local source: a cheap "unchanged since prepared" check
    file_mtime_ns: int | None


# ----------------------------------------------------------------------------- hashing, splitting


def digest_bytes(data: bytes | memoryview) -> Digest:
    return Digest(len(data), hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest())


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sha.update(chunk)
    return sha.hexdigest()


def split_boundaries(total: int) -> list[tuple[int, int]]:
    """(start, end) per split; floor boundaries at 90% and 95%, exact integer arithmetic."""
    ends = [total * percent // 100 for percent in SPLIT_END_PERCENTS]
    return list(zip([0, *ends[:-1]], ends))


def is_canonical(digest: Digest, expected: Expected) -> bool:
    return (digest.size, digest.sha256, digest.md5) == (
        expected.member_size,
        expected.member_sha256,
        expected.member_md5,
    )


def describe(name: str, canonical: bool, size: int) -> str:
    """Human-readable data description that training logs and eval reports print."""
    if canonical:
        return f"enwik8 (canonical, {size:,} bytes)"
    return f"{name} (NON-CANONICAL, {size:,} bytes)"


# ----------------------------------------------------------------------------- local sources


def read_source(path: Path, member: str) -> bytes:
    """Uncompressed bytes of a local .zip (member `member`), .gz or raw file."""
    if not path.exists():
        raise DataError(f"source not found: {path}")
    if not path.is_file():
        raise DataError(f"source is not a regular file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".zip":
        return read_zip_member(path, member)
    compressed_or_raw = read_file_bytes(path)
    return gunzip(compressed_or_raw, path) if suffix == ".gz" else compressed_or_raw


def read_file_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise DataError(f"cannot read source {path}: {error.strerror or error}") from None


def gunzip(compressed: bytes, path: Path) -> bytes:
    try:
        return gzip.decompress(compressed)
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"corrupt gzip file {path}: {error or 'truncated stream'}") from None


def read_zip_member(path: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if member not in names:
                listing = ", ".join(names) if names else "no members"
                raise DataError(f"zip file {path} has no member {member!r} (it has: {listing})")
            return archive.read(member)
    except zipfile.BadZipFile as error:
        raise DataError(f"corrupt zip file {path}: {error}") from None
    except zlib.error as error:
        raise DataError(f"corrupt zip member {member!r} in {path}: {error}") from None
    except OSError as error:
        raise DataError(f"cannot read source {path}: {error.strerror or error}") from None


def load_local_source(path: Path, member: str) -> SourceBytes:
    data = read_source(path, member)
    stat = path.stat()
    kind = {".zip": "zip", ".gz": "gz"}.get(path.suffix.lower(), "raw")
    return SourceBytes(
        data=data,
        kind=kind,
        name=path.name,
        url=None,
        path=path,
        member=member if kind == "zip" else None,
        file_size=stat.st_size,
        file_mtime_ns=stat.st_mtime_ns,
    )


# ----------------------------------------------------------------------------- download


def open_download(url: str, offset: int, timeout: float, log: Log) -> tuple[http.client.HTTPResponse, int]:
    """Open `url`, asking to resume at `offset`; returns the response and the byte its body starts at."""
    headers = {"User-Agent": USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as error:
        error.close()
        if error.code == 416 and offset:  # the partial file is not a prefix of what the server has
            log(f"server refused to resume at byte {offset:,} (HTTP 416); restarting the download")
            return open_download(url, 0, timeout, log)
        raise DataError(f"HTTP error {error.code} ({error.reason}) downloading {url}") from None
    except urllib.error.URLError as error:
        raise DataError(f"cannot connect to {url}: {error.reason}") from None
    except (OSError, http.client.HTTPException) as error:
        raise DataError(f"cannot download {url}: {error}") from None
    if response.status == 206 and offset:
        start = content_range_start(response.headers.get("Content-Range"))
        if start != offset:
            response.close()
            raise DataError(f"{url} answered a resume request at byte {offset:,} with Content-Range start {start}")
        log(f"resuming download at byte {offset:,} (server answered HTTP 206)")
        return response, offset
    if response.status == 200:
        if offset:
            log("server ignored the resume request (HTTP 200); restarting the download from byte 0")
        return response, 0
    response.close()
    raise DataError(f"unexpected HTTP status {response.status} downloading {url}")


def content_range_start(header: str | None) -> int | None:
    """Start byte of a `Content-Range: bytes START-END/TOTAL` header."""
    try:
        return int(header.split()[1].split("-")[0]) if header else None
    except (IndexError, ValueError):
        return None


def reported_total_size(response: http.client.HTTPResponse, body_start: int) -> int | None:
    """Full file size announced by the server (Content-Range total, else offset + Content-Length)."""
    content_range = response.headers.get("Content-Range")
    if response.status == 206 and content_range and "/" in content_range:
        total = content_range.rsplit("/", 1)[1]
        return int(total) if total.isdigit() else None
    length = response.headers.get("Content-Length")
    return body_start + int(length) if length and length.isdigit() else None


def stream_to_file(response: http.client.HTTPResponse, part: Path, body_start: int, expected_size: int) -> int:
    """Append the body to `part` (truncating it first when the body starts at 0); returns the new size.

    Stops as soon as more than `expected_size` bytes arrived, so a wrong file never fills the disk.
    """
    received = body_start
    with open(part, "ab" if body_start else "wb") as out, tqdm(
        total=expected_size, initial=body_start, unit="B", unit_scale=True, unit_divisor=1024,
        desc=part.name.removesuffix(PART_SUFFIX), disable=None,  # None: no bar when stderr is not a terminal
    ) as bar:
        while received <= expected_size and (chunk := response.read(CHUNK_BYTES)):
            out.write(chunk)
            received += len(chunk)
            bar.update(len(chunk))
    return received


def download(url: str, part: Path, expected_size: int, *, timeout: float, log: Log) -> None:
    """Download `url` into `part`, resuming a previous partial download when the server allows it.

    The partial file is kept when the transfer is cut (re-run to resume) and deleted when it can never
    become the expected file (wrong size announced or received).
    """
    offset = part.stat().st_size if part.exists() else 0
    if offset > expected_size:
        log(f"discarding {part}: larger than the expected {expected_size:,} bytes")
        part.unlink()
        offset = 0
    if offset == expected_size:
        log(f"{part} is complete; verifying it")
        return
    log(f"downloading {url} to {part}")
    response, body_start = open_download(url, offset, timeout, log)
    with response:
        announced = reported_total_size(response, body_start)
        if announced is not None and announced != expected_size:
            part.unlink(missing_ok=True)
            raise DataError(f"size mismatch: {url} is {announced:,} bytes, expected {expected_size:,}")
        try:
            received = stream_to_file(response, part, body_start, expected_size)
        except (OSError, http.client.HTTPException) as error:
            got = part.stat().st_size if part.exists() else 0
            raise DataError(
                f"download of {url} interrupted at {got:,} of {expected_size:,} bytes ({error}); "
                f"the partial download is kept at {part}: re-run to resume"
            ) from None
    if received > expected_size:
        part.unlink()
        raise DataError(f"size mismatch: {url} sent more than the expected {expected_size:,} bytes")
    if received < expected_size:
        raise DataError(
            f"download truncated: expected {expected_size:,} bytes from {url}, got {received:,}; "
            f"the partial download is kept at {part}: re-run to resume"
        )


def verify_zip(path: Path, expected: Expected, origin: str) -> None:
    size = path.stat().st_size
    if size != expected.zip_size:
        raise DataError(f"size mismatch for {origin}: expected {expected.zip_size:,} bytes, got {size:,}")
    sha256 = file_sha256(path)
    if sha256 != expected.zip_sha256:
        raise DataError(f"checksum mismatch for {origin}: expected sha256 {expected.zip_sha256}, got {sha256}")


def read_verified_member(path: Path, expected: Expected) -> bytes:
    data = read_zip_member(path, expected.member)
    digest = digest_bytes(data)
    if not is_canonical(digest, expected):
        raise DataError(
            f"checksum mismatch for member {expected.member!r} of {path}: expected {expected.member_size:,} "
            f"bytes, sha256 {expected.member_sha256}, md5 {expected.member_md5}; "
            f"got {digest.size:,} bytes, sha256 {digest.sha256}, md5 {digest.md5}"
        )
    return data


def fetch_verified_zip(out_dir: Path, url: str, expected: Expected, *, timeout: float, log: Log) -> tuple[Path, bytes]:
    """The verified zip cached at out_dir/enwik8.zip and its verified member, downloading when needed."""
    cached = out_dir / ZIP_CACHE_NAME
    if cached.exists():
        try:
            verify_zip(cached, expected, str(cached))
            member = read_verified_member(cached, expected)
            log(f"using the verified cached download {cached}")
            return cached, member
        except DataError as error:
            log(f"discarding the cached download: {error}")
            cached.unlink()
    part = out_dir / (ZIP_CACHE_NAME + PART_SUFFIX)
    download(url, part, expected.zip_size, timeout=timeout, log=log)
    try:
        verify_zip(part, expected, url)
        member = read_verified_member(part, expected)
    except DataError as error:
        part.unlink(missing_ok=True)
        raise DataError(f"{error} (deleted the download)") from None
    os.replace(part, cached)  # only a verified zip ever gets the cache name
    return cached, member


def load_downloaded_source(out_dir: Path, url: str, expected: Expected, *, timeout: float, log: Log) -> SourceBytes:
    cached, member = fetch_verified_zip(out_dir, url, expected, timeout=timeout, log=log)
    return SourceBytes(
        data=member,
        kind="download",
        name=expected.member,
        url=url,
        path=cached.resolve(),
        member=expected.member,
        file_size=None,
        file_mtime_ns=None,
    )


# ----------------------------------------------------------------------------- meta.json


def build_meta(source: SourceBytes, digest: Digest, canonical: bool) -> dict[str, Any]:
    view = memoryview(source.data)
    boundaries = split_boundaries(digest.size)
    splits = {
        name: {"file": f"{name}.bin", "start": start, "end": end, "size": end - start,
               "sha256": hashlib.sha256(view[start:end]).hexdigest()}
        for name, (start, end) in zip(SPLITS, boundaries)
    }
    byte_counts = np.bincount(np.frombuffer(source.data, dtype=np.uint8), minlength=256)
    return {
        "format_version": META_FORMAT_VERSION,
        "dataset": "enwik8",
        "description": describe(source.name, canonical, digest.size),
        "canonical": canonical,
        "source": {
            "kind": source.kind,
            "url": source.url,
            "path": str(source.path) if source.path else None,
            "member": source.member,
            "file_size": source.file_size,
            "file_mtime_ns": source.file_mtime_ns,
            "size": digest.size,
            "sha256": digest.sha256,
            "md5": digest.md5,
        },
        "dtype": "uint8",
        "vocab_size": 256,
        "distinct_bytes": int(np.count_nonzero(byte_counts)),
        "split_boundaries": [0, *(end for _, end in boundaries)],
        "splits": splits,
    }


def read_meta(out_dir: Path) -> dict[str, Any] | None:
    """meta.json if it exists and has the current format, else None (= not prepared)."""
    try:
        meta = json.loads((out_dir / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format_version") != META_FORMAT_VERSION:
        return None
    return meta


# ----------------------------------------------------------------------------- "already prepared?"


def split_size_problem(out_dir: Path, meta: dict[str, Any]) -> str | None:
    for name in SPLITS:
        path = out_dir / f"{name}.bin"
        expected = meta["splits"][name]["size"]
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected:
            return f"{path} is {path.stat().st_size:,} bytes, meta.json says {expected:,}"
    return None


def request_mismatch(
    meta: dict[str, Any], source: Path | None, allow_noncanonical: bool, expected: Expected
) -> str | None:
    """Why the prepared data is not what this invocation asks for, or None when it is."""
    recorded = meta["source"]
    if source is None:
        if meta["canonical"] and recorded["sha256"] == expected.member_sha256:
            return None
        return f"the prepared data is {meta['description']}, not canonical enwik8"
    stat = source.stat()
    recorded_file = (recorded["path"], recorded["file_size"], recorded["file_mtime_ns"])
    if recorded_file != (str(source), stat.st_size, stat.st_mtime_ns):
        return f"the prepared data came from {recorded['path'] or recorded['url']}, not from {source} as it is now"
    if not meta["canonical"] and not allow_noncanonical:
        return "the prepared data is non-canonical and --allow-noncanonical was not given"
    return None


def hash_problem(out_dir: Path, meta: dict[str, Any]) -> str | None:
    """Re-hash the splits: each against meta.json, and their concatenation against the source checksums."""
    whole_sha, whole_md5 = hashlib.sha256(), hashlib.md5()
    for name in SPLITS:
        split_sha = hashlib.sha256()
        with open(out_dir / f"{name}.bin", "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                split_sha.update(chunk)
                whole_sha.update(chunk)
                whole_md5.update(chunk)
        if split_sha.hexdigest() != meta["splits"][name]["sha256"]:
            return f"{name}.bin sha256 {split_sha.hexdigest()} does not match meta.json"
    source = meta["source"]
    if (whole_sha.hexdigest(), whole_md5.hexdigest()) != (source["sha256"], source["md5"]):
        return "the splits together do not hash to the source checksums in meta.json"
    return None


def prepared_problem(
    out_dir: Path, source: Path | None, allow_noncanonical: bool, expected: Expected, verify: bool, log: Log
) -> str | None:
    """None when out_dir already holds what was asked for; otherwise why it must be (re)prepared."""
    meta = read_meta(out_dir)
    if meta is None:
        return f"no valid {META_NAME} in {out_dir}"
    try:
        problem = split_size_problem(out_dir, meta) or request_mismatch(meta, source, allow_noncanonical, expected)
        if problem or not verify:
            return problem
        log(f"verifying {out_dir}: re-hashing the splits")
        return hash_problem(out_dir, meta)
    except (KeyError, TypeError) as error:  # a hand-edited or foreign meta.json
        return f"{META_NAME} is malformed ({error!r})"


# ----------------------------------------------------------------------------- writing


def write_split(path: Path, data: memoryview) -> None:
    with open(path, "wb") as out:
        for start in range(0, len(data), CHUNK_BYTES):
            out.write(data[start : start + CHUNK_BYTES])
        out.flush()
        os.fsync(out.fileno())


def write_json(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w") as out:
        json.dump(value, out, indent=2)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())


def fsync_directory(directory: Path) -> None:
    """Make the renames durable (a crash right after prepare must not lose meta.json's rename)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_prepared(out_dir: Path, data: bytes, meta: dict[str, Any]) -> None:
    """Write the splits, then meta.json, without ever leaving a half-prepared directory.

    Everything goes to *.tmp names first. A previous preparation stays intact until all new files are
    complete; then its meta.json is removed (from here on the directory reads as unprepared), the splits
    are renamed into place and the new meta.json is renamed last. Temp files are removed on any failure.
    """
    view = memoryview(data)
    split_temps = {name: out_dir / f"{name}.bin{TMP_SUFFIX}" for name in SPLITS}
    meta_temp = out_dir / f"{META_NAME}{TMP_SUFFIX}"
    try:
        for name, temp in split_temps.items():
            write_split(temp, view[meta["splits"][name]["start"] : meta["splits"][name]["end"]])
        write_json(meta_temp, meta)
        (out_dir / META_NAME).unlink(missing_ok=True)
        for name, temp in split_temps.items():
            os.replace(temp, out_dir / f"{name}.bin")
        os.replace(meta_temp, out_dir / META_NAME)
        fsync_directory(out_dir)
    finally:
        for temp in [*split_temps.values(), meta_temp]:
            temp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- entry points


def noncanonical_message(origin: str, digest: Digest, expected: Expected) -> str:
    return (
        f"{origin} is not canonical enwik8: expected {expected.member_size:,} bytes with sha256 "
        f"{expected.member_sha256} (md5 {expected.member_md5}), found {digest.size:,} bytes with sha256 "
        f"{digest.sha256} (md5 {digest.md5}); pass --allow-noncanonical to use it anyway"
    )


def report(out_dir: Path, meta: dict[str, Any], log: Log) -> None:
    source = meta["source"]
    canonical = "yes" if meta["canonical"] else "NO (allowed by --allow-noncanonical)"
    log(f"source:    {source['url'] or source['path']} ({source['kind']})")
    log(f"data:      {meta['description']}")
    log(f"size:      {source['size']:,} bytes")
    log(f"sha256:    {source['sha256']}")
    log(f"md5:       {source['md5']}")
    log(f"canonical: {canonical}")
    log(f"distinct bytes: {meta['distinct_bytes']} (vocab_size {meta['vocab_size']})")
    for name in SPLITS:
        split = meta["splits"][name]
        log(f"{name + '.bin':<10} {split['size']:>12,} bytes  [{split['start']:,}, {split['end']:,})")
    log(f"wrote {out_dir}/{{train,val,test}}.bin and {META_NAME}")


def prepare(
    out_dir: Path | str = DEFAULT_OUT_DIR,
    *,
    source: Path | str | None = None,
    allow_noncanonical: bool = False,
    verify: bool = False,
    force: bool = False,
    url: str = URL,
    expected: Expected = CANONICAL,
    timeout: float = 60.0,
    log: Log = print,
) -> dict[str, Any]:
    """Prepare out_dir (download or read `source`, verify, split, write); returns the meta.json dict.

    Does nothing when out_dir already holds what is asked for (checked from meta.json and file sizes;
    `verify` also re-hashes the splits). `url` and `expected` exist so tests can use small files.
    """
    out_dir = Path(out_dir)
    source_path = Path(source).expanduser().resolve() if source is not None else None
    if source_path is not None and not source_path.is_file():
        read_source(source_path, expected.member)  # raises the precise "not found / not a file" error
    out_dir.mkdir(parents=True, exist_ok=True)
    if not force:
        problem = prepared_problem(out_dir, source_path, allow_noncanonical, expected, verify, log)
        if problem is None:
            meta = read_meta(out_dir)
            assert meta is not None
            checked = "re-hashed" if verify else "meta.json and file sizes"
            log(f"already prepared in {out_dir}: {meta['description']} ({checked} OK); nothing to do")
            return meta
        if (out_dir / META_NAME).exists():
            log(f"re-preparing {out_dir}: {problem}")
    if source_path is None:
        corpus = load_downloaded_source(out_dir, url, expected, timeout=timeout, log=log)
    else:
        corpus = load_local_source(source_path, expected.member)
    digest = digest_bytes(corpus.data)
    canonical = is_canonical(digest, expected)
    if not canonical and not allow_noncanonical:
        raise DataError(noncanonical_message(str(source_path or url), digest, expected))
    if len(corpus.data) < 20:  # below 20 bytes the 5% val split would be empty
        raise DataError(f"source {source_path or url} has only {len(corpus.data)} bytes; at least 20 are needed")
    meta = build_meta(corpus, digest, canonical)
    write_prepared(out_dir, corpus.data, meta)
    report(out_dir, meta, log)
    return meta


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Download/verify enwik8 and write byte-level train/val/test splits (90%/5%/5%) plus meta.json.",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                        help="directory for train.bin, val.bin, test.bin, meta.json and the download cache "
                             "(default: %(default)s)")
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument("--source", type=Path, metavar="PATH",
                         help="use a local enwik8 file instead of downloading: a .zip (member 'enwik8'), "
                              "a .gz, or the raw file")
    sources.add_argument("--sample", action="store_true",
                         help=f"offline shorthand for --source {SAMPLE_SOURCE} --allow-noncanonical "
                              "(the first 4,154,064 bytes of enwik8)")
    parser.add_argument("--allow-noncanonical", action="store_true",
                        help="accept a --source whose size or checksums differ from enwik8's; it is split "
                             "90/5/5 in proportion and marked canonical=false in meta.json")
    parser.add_argument("--verify", action="store_true",
                        help="if already prepared, re-hash the splits against meta.json instead of trusting "
                             "file sizes (re-prepares on mismatch)")
    parser.add_argument("--force", action="store_true",
                        help="re-prepare even if the output directory is already prepared")
    return parser


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup code, unlike the default SIGTERM action


def main(argv: list[str] | None = None, *, url: str = URL, expected: Expected = CANONICAL) -> int:
    """CLI entry point; `url`/`expected` are for tests only and deliberately not command-line flags."""
    args = build_parser().parse_args(argv)
    source = SAMPLE_SOURCE if args.sample else args.source
    allow_noncanonical = args.sample or args.allow_noncanonical
    in_main_thread = threading.current_thread() is threading.main_thread()  # signal() only works there
    previous_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main_thread else None
    try:
        prepare(args.out_dir, source=source, allow_noncanonical=allow_noncanonical, verify=args.verify,
                force=args.force, url=url, expected=expected)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no partial split was left behind (a partial download is kept for resuming)",
              file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
