#!/usr/bin/env python3
"""Prepare enwik8 as raw-byte splits (uint8, vocab 256) for the linattn LM harness.

    python data/enwik8/prepare.py                 # download and verify enwik8; offline: the bundled sample, loudly
    python data/enwik8/prepare.py --sample        # the bundled sample (first 4,154,064 bytes), non-canonical
    python data/enwik8/prepare.py --source PATH   # a local enwik8 .zip, .gz or raw file
    python data/enwik8/prepare.py --verify        # re-hash what is prepared; downloads and writes nothing

Splits 90/5/5 (90M/5M/5M on enwik8, the standard split) into train.bin, val.bin and test.bin, then writes
meta.json last, each under a temporary name renamed when complete, into --out-dir (default: this
script's directory). The bundled sample was made with `head -c 4154064 enwik8 | gzip -9 -n`.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import signal
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import numpy as np
import pooch

# Run as a script from data/enwik8/, as train.py runs from the root: the repository's packages import
# without an install too (their dependencies installed).
sys.path.append(str(Path(__file__).resolve().parents[2]))
from linattn_lm.data import (ENWIK8_SHA256, ENWIK8_SIZE, META_FORMAT_VERSION, META_NAME, SPLITS, VOCAB_SIZE,
                             DataError, DataNotFoundError, load_meta, load_split, shown)
from linattn_lm.errors import EXIT_USAGE, Parser
from linattn_lm.files import missing_directories, remove_empty_directories, remove_stale_temporaries, write_together

DEFAULT_OUT_DIR = Path(__file__).resolve().parent
SPLIT_END_PERCENTS = (90, 95, 100)
MIN_SOURCE_BYTES = 20  # below this the 5% val split would be empty
DOWNLOAD_TIMEOUT_S = 60

Log = Callable[[str], None]


@dataclass(frozen=True)
class Digest:
    """What identifies a corpus: its uncompressed size and checksums."""

    size: int
    sha256: str
    md5: str

    @classmethod
    def of(cls, data: bytes) -> Digest:
        return cls(len(data), hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest())

    def __str__(self) -> str:
        return f"{self.size:,} bytes with sha256 {self.sha256} (md5 {self.md5})"


@dataclass(frozen=True)
class Download:
    """Where the canonical corpus comes from and what it hashes to (tests substitute a small local one)."""

    url: str
    zip_sha256: str
    member: str
    corpus: Digest


ENWIK8 = Download(
    url="http://mattmahoney.net/dc/enwik8.zip",
    zip_sha256="547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
    member="enwik8",
    corpus=Digest(ENWIK8_SIZE, ENWIK8_SHA256, "a1fa5ffddb56f4953e226637dabbb36a"),
)
SAMPLE = DEFAULT_OUT_DIR / "enwik8-sample.gz"
SAMPLE_DIGEST = Digest(4_154_064, "d8b3b95fb4993726ea7dcc93ae3c9e08a1a04cc540d05d7656fd267cc8ab5d6a",
                       "caa8f32ee38f60417a622579d80ca54c")


# ----------------------------------------------------------------------------- reading a corpus


def read_source(path: Path, member: str = ENWIK8.member) -> bytes:
    """Uncompressed bytes of a local .zip (its `member`), .gz or raw file."""
    if not path.is_file():
        raise DataError(f"source not found: {path}" if not path.exists() else f"source is not a regular file: {path}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                if member not in archive.namelist():
                    listing = ", ".join(archive.namelist()) or "no members"
                    raise DataError(f"zip file {path} has no member {member!r} (it has: {listing})")
                return archive.read(member)
        data = path.read_bytes()
        return gzip.decompress(data) if suffix == ".gz" else data
    except (zipfile.BadZipFile, gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"corrupt {suffix.lstrip('.')} file {path}: {error or 'truncated stream'}") from None
    except OSError as error:
        raise DataError(f"cannot read source {path}: {error.strerror or error}") from None


def download_corpus(out_dir: Path, download: Download) -> "Corpus":
    """The corpus inside the zip at download.url, cached as out_dir/<name>.zip once its sha256 matches.

    pooch downloads to a temporary name, checks the hash and only then renames; a cached zip that
    matches is not downloaded again.
    """
    try:
        zip_path = pooch.retrieve(
            download.url, known_hash=f"sha256:{download.zip_sha256}", fname=f"{download.member}.zip", path=out_dir,
            downloader=pooch.HTTPDownloader(progressbar=sys.stderr.isatty(), timeout=DOWNLOAD_TIMEOUT_S),
        )
    except (OSError, ValueError) as error:  # requests' errors are OSErrors; a hash mismatch is a ValueError
        raise DataError(f"downloading {download.url} failed: {error}") from None
    try:
        data = read_source(Path(zip_path), download.member)
        digest = Digest.of(data)
        if digest != download.corpus:
            raise DataError(f"member {download.member!r} of {zip_path} is {digest}, expected {download.corpus}")
    except DataError:
        Path(zip_path).unlink()  # the next run downloads again rather than trusting this zip
        raise
    return Corpus(data, download.member, {"kind": "download", "url": download.url, "path": None}, digest)


def fallback_warning(error: DataError, download: Download) -> str:
    rule = "!" * 100
    return "\n".join([
        rule,
        f"WARNING: could not get the canonical enwik8: {error}",
        f"Falling back to the sample bundled with the repository, {SAMPLE.name}: the first "
        f"{SAMPLE_DIGEST.size:,} bytes of enwik8.",
        "Everything trained or evaluated on it is NON-CANONICAL, not comparable with published enwik8 results",
        "(meta.json, the training logs, TensorBoard and eval reports say so).",
        f"To get the real data: run this again with network access, or download {download.url} elsewhere",
        f"and run: python {shown(Path(__file__))} --source PATH/TO/{download.member}.zip",
        rule,
    ])


@dataclass(frozen=True)
class Corpus:
    data: bytes
    name: str  # names a non-canonical corpus in its description
    origin: dict[str, Any]  # kind, url and path, recorded in meta.json
    digest: Digest  # hashed once, where the data is read


def local_corpus(path: Path, download: Download) -> Corpus:
    path = path.expanduser().resolve()
    if path == SAMPLE and not path.exists():
        raise DataError(f"the bundled sample {path} is missing: restore it with git checkout -- data/enwik8/{path.name}")
    data = read_source(path, download.member)
    digest = Digest.of(data)
    if path == SAMPLE and digest != SAMPLE_DIGEST:
        raise DataError(f"the bundled sample {path} is damaged (expected {SAMPLE_DIGEST}): restore it with "
                        f"git checkout -- data/enwik8/{path.name}")
    kind = {".zip": "zip", ".gz": "gz"}.get(path.suffix.lower(), "raw")
    return Corpus(data, path.name, {"kind": kind, "url": None, "path": str(path)}, digest)


def downloaded_or_sample(out_dir: Path, download: Download, warn: Log) -> Corpus:
    """The download or, when it fails, the bundled sample after a loud warning; never the sample over
    other data already prepared in out_dir."""
    try:
        return download_corpus(out_dir, download)
    except DataError as error:
        existing = prepared_meta(out_dir, log=lambda message: None)
        if existing and existing["source"]["sha256"] != SAMPLE_DIGEST.sha256:
            raise DataError(f"{error}; kept the data prepared in {out_dir} ({existing['description']})") from None
        warn(fallback_warning(error, download))
        return local_corpus(SAMPLE, download)


# ----------------------------------------------------------------------------- the prepared directory


def split_boundaries(total: int) -> list[tuple[int, int]]:
    """(start, end) per split: floor boundaries at 90% and 95%, exact integer arithmetic."""
    ends = [total * percent // 100 for percent in SPLIT_END_PERCENTS]
    return list(zip([0, *ends[:-1]], ends))


def build_meta(corpus: Corpus, digest: Digest, canonical: bool) -> dict[str, Any]:
    data, view = corpus.data, memoryview(corpus.data)
    size = f"{digest.size:,} bytes"
    description = f"enwik8 (canonical, {size})" if canonical else f"{corpus.name} (NON-CANONICAL, {size})"
    boundaries = split_boundaries(digest.size)
    return {
        "format_version": META_FORMAT_VERSION,
        "dataset": "enwik8",
        "description": description,  # what training logs, TensorBoard and eval reports print
        "canonical": canonical,
        "source": {**corpus.origin, "size": digest.size, "sha256": digest.sha256, "md5": digest.md5},
        "dtype": "uint8",
        "vocab_size": VOCAB_SIZE,
        "distinct_bytes": int(np.count_nonzero(np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256))),
        "split_boundaries": [0, *(end for _, end in boundaries)],
        "splits": {
            split: {"file": f"{split}.bin", "start": start, "end": end, "size": end - start,
                    "sha256": hashlib.sha256(view[start:end]).hexdigest()}
            for split, (start, end) in zip(SPLITS, boundaries)
        },
    }


def prepared_meta(out_dir: Path, log: Log) -> dict[str, Any] | None:
    """meta.json when out_dir holds a complete preparation (meta.json valid, split sizes match), else None."""
    try:
        meta = load_meta(out_dir)
        for split in SPLITS:
            load_split(out_dir, split)
        return meta
    except DataNotFoundError:
        return None
    except DataError as error:
        log(f"re-preparing: {error}")
        return None


def write_prepared(out_dir: Path, data: bytes, meta: dict[str, Any]) -> None:
    """Every new file is written under a temporary name first, and the old preparation stays whole
    until all are on disk. Then the old meta.json goes, the splits take their names and meta.json
    comes last, so even a run stopped among the renames leaves a directory that reads as
    unprepared, never a mix of old and new splits."""
    writes: dict[Path, Callable[[Path], Any]] = {}
    for split in SPLITS:
        part = memoryview(data)[meta["splits"][split]["start"]:meta["splits"][split]["end"]]
        writes[out_dir / f"{split}.bin"] = lambda tmp, part=part: tmp.write_bytes(part)
    writes[out_dir / META_NAME] = lambda tmp: tmp.write_text(json.dumps(meta, indent=2) + "\n")
    write_together(writes, before_renames=lambda: (out_dir / META_NAME).unlink(missing_ok=True))


def usable_out_dir(out_dir: Path) -> Path:
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out-dir {out_dir} is a file, not a directory: pass a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(f"cannot create --out-dir {out_dir}: {error.strerror or error}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise DataError(f"cannot write to --out-dir {out_dir}: permission denied")
    for name in [*(f"{split}.bin" for split in SPLITS), META_NAME]:
        remove_stale_temporaries(out_dir / name)  # left by a run that was killed
    return out_dir


# ----------------------------------------------------------------------------- entry points


def report(out_dir: Path, meta: dict[str, Any], log: Log) -> None:
    source = meta["source"]
    log(f"source:    {source['url'] or source['path']} ({source['kind']})")
    log(f"data:      {meta['description']}")
    log(f"sha256:    {source['sha256']}")
    log(f"md5:       {source['md5']}")
    log(f"distinct bytes: {meta['distinct_bytes']} (vocab_size {meta['vocab_size']})")
    for split in SPLITS:
        entry = meta["splits"][split]
        log(f"{split + '.bin':<10} {entry['size']:>12,} bytes  [{entry['start']:,}, {entry['end']:,})")
    log(f"wrote {out_dir}/{{train,val,test}}.bin and {META_NAME}")


def prepare(
    out_dir: Path | str = DEFAULT_OUT_DIR,
    *,
    source: Path | str | None = None,
    allow_noncanonical: bool = False,
    force: bool = False,
    download: Download = ENWIK8,
    log: Log = print,
    warn: Log = lambda message: print(message, file=sys.stderr),
) -> dict[str, Any]:
    """Prepare out_dir from `source`, or from the download (the bundled sample when that fails);
    returns meta.json. Does nothing when out_dir already holds that corpus, unless `force`."""
    out_dir = usable_out_dir(Path(out_dir))
    prepared = None if force else prepared_meta(out_dir, log)
    if source is None and prepared and prepared["canonical"]:
        return already_prepared(out_dir, prepared, log)
    corpus = downloaded_or_sample(out_dir, download, warn) if source is None else local_corpus(Path(source), download)
    digest = corpus.digest
    canonical = digest == download.corpus
    if not (canonical or allow_noncanonical or corpus.origin["path"] == str(SAMPLE)):
        raise DataError(f"{corpus.name} is not canonical enwik8: expected {download.corpus}, found {digest}; "
                        "pass --allow-noncanonical to use it anyway")
    if digest.size < MIN_SOURCE_BYTES:
        raise DataError(f"{corpus.name} has only {digest.size} bytes; at least {MIN_SOURCE_BYTES} are needed")
    if prepared and (prepared["source"]["sha256"], prepared["canonical"]) == (digest.sha256, canonical):
        return already_prepared(out_dir, prepared, log)
    if prepared and prepared["canonical"] and not canonical:
        raise DataError(f"{out_dir} holds the real enwik8, which {corpus.name} would replace: pass --force to "
                        "replace it, or --out-dir DIR to prepare it elsewhere")
    meta = build_meta(corpus, digest, canonical)
    write_prepared(out_dir, corpus.data, meta)
    report(out_dir, meta, log)
    return meta


def already_prepared(out_dir: Path, meta: dict[str, Any], log: Log) -> dict[str, Any]:
    log(f"already prepared in {out_dir}: {meta['description']}; nothing to do")
    return meta


def verify(out_dir: Path | str, log: Log = print) -> dict[str, Any]:
    """Re-hash each prepared split against meta.json, and all of them against the source checksums.
    Reads only: whatever is found wrong is reported, never replaced."""
    meta = load_meta(out_dir)
    whole_sha256, whole_md5 = hashlib.sha256(), hashlib.md5()
    for split in SPLITS:
        data = load_split(out_dir, split).data  # its size and sha256 checked against meta.json
        whole_sha256.update(data)
        whole_md5.update(data)
    if (whole_sha256.hexdigest(), whole_md5.hexdigest()) != (meta["source"]["sha256"], meta["source"]["md5"]):
        raise DataError(f"the splits in {out_dir} do not hash to the source checksums in {META_NAME}: "
                        "re-prepare them with --force")
    log(f"verified {out_dir}: {meta['description']}; every split re-hashed and matches {META_NAME}")
    return meta


def nonempty_path(text: str) -> Path:
    """A path flag's value; '' (an unset shell variable) would be Path('.'), the current directory."""
    if not text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r} (for the current directory, pass .)")
    return Path(text)


def build_parser() -> Parser:
    parser = Parser(description="Download and verify enwik8 (the bundled sample when that fails) and write "
                                "byte-level train/val/test splits (90%/5%/5%) plus meta.json.")
    parser.add_argument("--out-dir", type=nonempty_path, default=DEFAULT_OUT_DIR,
                        help="directory for the splits, meta.json and the download cache (default: %(default)s)")
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument("--source", type=nonempty_path, metavar="PATH",
                         help="a local enwik8 instead of the download: a .zip (member 'enwik8'), a .gz or the raw file")
    sources.add_argument("--sample", action="store_true",
                         help=f"the bundled sample {SAMPLE.name} (the first {SAMPLE_DIGEST.size:,} bytes of enwik8), "
                              "offline; marked NON-CANONICAL")
    sources.add_argument("--verify", action="store_true",
                         help="re-hash the prepared splits against meta.json; downloads and writes nothing")
    parser.add_argument("--allow-noncanonical", action="store_true",
                        help="accept a --source whose size or checksums differ from enwik8's; it is split 90/5/5 "
                             "in proportion and marked canonical=false (NON-CANONICAL) in meta.json")
    parser.add_argument("--force", action="store_true", help="re-prepare even if --out-dir is already prepared")
    return parser


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through write_staged, which removes its temporary


def main(argv: list[str] | None = None, *, download: Download = ENWIK8) -> int:
    """The command; `download` is for tests only and deliberately not a flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verify and (args.force or args.allow_noncanonical):
        parser.error("--verify checks the prepared data as it is: it takes no --force or --allow-noncanonical")
    if args.allow_noncanonical and args.source is None:
        parser.error("--allow-noncanonical applies to a --source file (the download is checked against enwik8's "
                     "hash, and the bundled sample is always accepted): add --source PATH or drop it")
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    created, prepared = missing_directories(args.out_dir), False   # a failed run removes them while empty
    try:
        if args.verify:
            verify(args.out_dir)
        else:
            prepare(args.out_dir, source=SAMPLE if args.sample else args.source,
                    allow_noncanonical=args.allow_noncanonical, force=args.force, download=download)
        prepared = True
    except (DataError, OSError) as error:  # OSError: a write failed (WriteFailed: disk full, read-only)
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted: no partial split was left behind", file=sys.stderr)
        return 130
    finally:   # SIGTERM's SystemExit (_exit_on_sigterm) comes through here too
        if not prepared:
            remove_empty_directories(created)
        signal.signal(signal.SIGTERM, previous_sigterm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
