"""Files written whole: each output is written under a temporary name and renamed when complete; and the
directories a command creates, removed again when it fails."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

from .errors import UsageError, first_line


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) fills a temporary file next to `path`, which then replaces `path` at once: readers
    never see a half-written file, and a failed write leaves the old one in place."""
    write_together({path: write})


def write_together(writes: dict[Path, Callable[[Path], None]], *,
                   before_renames: Callable[[], None] | None = None) -> None:
    """Several files from one source (a report's tables and plot, a dataset's splits and meta): every
    one is written under a temporary name (write_staged) before any takes its name, so a failure
    while building them leaves the files already there as they were, never a mix of old and new.
    The renames follow in `writes`' order, after `before_renames` (prepare.py removes its meta.json
    there, so that a stop among the renames leaves a directory that reads as unprepared)."""
    staged: list[tuple[Path, Path]] = []
    renamed = 0   # the staged files before this one have their names: only the rest are cleaned up
    try:
        for path, write in writes.items():
            staged.append((write_staged(path, write), path))
        in_the_way = [path for _, path in staged if path.is_dir()]
        if in_the_way:   # found before any rename, so nothing is replaced
            raise WriteFailed(f"cannot write {in_the_way[0]}: a folder of that name is in the way; move it "
                              "or choose another output")
        if before_renames is not None:
            before_renames()
        for tmp, path in staged:
            try:
                os.replace(tmp, path)
            except OSError as error:
                raise WriteFailed(f"cannot write {path} ({error.strerror or error})") from None
            renamed += 1
    except BaseException:
        for tmp, _ in staged[renamed:]:
            tmp.unlink(missing_ok=True)
        raise


class WriteFailed(OSError):
    """An output could not be written (disk full, no permission); what was there is kept.  An
    OSError, so that code which tolerates a failed write (a cache) or reports one (prepare.py)
    catches it as it catches the error it replaces."""


def write_staged(path: Path, write: Callable[[Path], None]) -> Path:
    """write(tmp) fills a temporary file next to `path`, on disk and with the permissions open()
    would give; returns it for the caller to rename onto `path` (several files can be staged first
    and then renamed together).  A failed write leaves nothing behind and raises WriteFailed (torch
    reports a full disk as a RuntimeError from its archive writer)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise WriteFailed(f"cannot write {path}: {error.strerror or error}") from None
    os.close(handle)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as written:    # on disk before it takes the real name
            os.fsync(written.fileno())
        os.chmod(tmp, 0o666 & ~_umask())      # mkstemp makes 0600; give what open() would
    except BaseException as error:
        os.unlink(tmp)
        if isinstance(error, OSError) or _torch_write_error(error):
            reason = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)
            raise WriteFailed(f"cannot write {path} ({reason}); the file already there, if any, is kept: "
                              f"free some space or choose a writable --out-dir") from None
        raise
    return Path(tmp)


def _torch_write_error(error: BaseException) -> bool:
    """torch.save's archive writer (inline_container.cc) reports a failed write, a full disk for one,
    as a RuntimeError; any other RuntimeError is a bug and keeps its traceback."""
    return isinstance(error, RuntimeError) and "inline_container" in str(error)


def remove_stale_temporaries(path: Path) -> None:
    """Temporaries of `path` left by a write that was killed (write_atomically's name pattern)."""
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        stale.unlink(missing_ok=True)


def missing_directories(directory: Path) -> list[Path]:
    """`directory` and those of its parents that do not exist yet, deepest first: what
    mkdir(parents=True) is about to create."""
    missing = []
    for path in (directory, *directory.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
    return missing


def remove_empty_directories(created: list[Path]) -> None:
    """`created` (missing_directories' list, deepest first) removed while each is empty: rmdir refuses
    one that is not, and the removal stops there, so whatever something else put inside stays."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return


NAME_MAX = 255   # bytes in one file name (Linux, macOS and Windows file systems)


def check_utf8(name: str, path: str) -> None:
    """A path the logs can name: bytes that are not UTF-8 reach Python as surrogates, which
    TensorBoard's writer and the JSON records cannot encode."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid UTF-8 text, got {path!r}; rename it") from None


def check_run_name(name: str) -> None:
    """A directory inside --out-dir named by its parts, nested or not (grid.py's runs are
    <grid>/<variant>/seed-<s>).  A part that names no new directory ('', '.': the run would write
    into its parent) or leaves it ('..'), or has spaces around it (invisible in listings), is refused."""
    parts = name.split("/")
    if name.startswith("/") or any(part in ("", ".", "..") or part != part.strip() for part in parts):
        raise ValueError(f"run_name must be a relative name inside --out-dir, such as favor or study/favor/seed-0, "
                         f"whose parts are not empty, '.' or '..' and have no spaces around them; got {name!r}")
    if any(ord(char) < 32 or ord(char) == 127 for char in name):
        raise ValueError(f"run_name must not hold control characters (a newline, a tab), got {name!r}")
    check_utf8("run_name", name)
    long = [part for part in parts if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX]
    if long:
        raise ValueError(f"run_name's parts must be at most {NAME_MAX} bytes (a file name's limit), got one of "
                         f"{len(long[0].encode('utf-8', 'surrogateescape'))}; choose a shorter --run-name")


def check_writable(run_dir: Path) -> None:
    """An unusable --out-dir fails before any work (a lock file can open in a directory that takes
    no new files)."""
    try:
        probe = run_dir / f".write-test-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write the run directory {run_dir} ({error.strerror or error}); "
                         "choose a writable --out-dir") from None

