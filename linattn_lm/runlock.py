"""An exclusive lock on a run (or grid) directory, held for the whole run, so that two runs never
write the same directory.

The lock is an OS lock (`fcntl.flock`) on the file `.lock` in the directory: the kernel releases it
when the holder exits, however it exits (kill -9 included), so no stale lock is ever left behind.
The holder writes its pid into the file, for the message that refuses a second run.  The file
itself stays: deleting it on release would let a waiting process lock a file that is already gone.
Only a run that failed to start in a directory it created, before writing anything there, removes it
with the directory (`discard`): nothing is left of it, and no earlier run's directory is touched.  A
second start may have opened that file just before it went; so a lock counts only once the locked
file is still the one at the path, and is taken again otherwise.

Where fcntl does not exist (Windows), runs are not locked; a warning says so once.
"""
from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

from .errors import UsageError
from .files import missing_directories, remove_empty_directories

try:
    import fcntl
except ImportError:   # Windows
    fcntl = None

LOCK_NAME = ".lock"
GRID_MARKER = ".linattn-grid"   # in every grid directory grid.py starts: --resume continues only those
RUN_FILES = ("ckpt.pt", "events.out.tfevents.*")   # a run's checkpoint (checkpoint.CHECKPOINT_NAME) or its logs
LOCK_ATTEMPTS = 100   # each retry needs another start to fail and remove the directory meanwhile


def directory_advice(error: OSError) -> str:
    """What to change when a run directory cannot be made: a file in its place is not a permission
    problem of --out-dir."""
    if error.errno in (errno.EEXIST, errno.ENOTDIR):
        return "a file stands where a directory of that path would go; choose another --run-name or --out-dir"
    if error.errno == errno.ENAMETOOLONG:
        return "choose a shorter --run-name or --out-dir"
    return "choose a writable --out-dir"


class DirectoryBusy(UsageError):
    """Another process holds the directory's lock (reported as `error: ...`, exit status 2)."""


class DirectoryLock:
    """Held from construction until release() or discard() (or the end of a `with` block, which
    discards on an error, or the process).  `created`: the directories the caller made for this
    run, when it made them before locking (by default, those this lock makes)."""

    def __init__(self, directory: Path | str, *, created: list[Path] | None = None):
        self.directory = Path(directory)
        self.created = missing_directories(self.directory) if created is None else created
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = None if fcntl is None else self._acquire_live()
        except OSError as error:   # not BlockingIOError: _acquire turns that into DirectoryBusy
            raise UsageError(f"cannot lock the directory {self.directory} ({error.strerror or error}); "
                             f"{directory_advice(error)}") from None
        if fcntl is None:
            warnings.warn("fcntl is not available on this platform: run directories are not locked, so "
                          "make sure no two runs use the same --out-dir/--run-name", stacklevel=2)

    def _acquire_live(self) -> int:
        """A lock on the lock file that is at the path now: a failed start beside this one may remove
        the file and its directory between our mkdir and our open (the open fails), or between our
        open and our lock (we would hold the lock of a file nobody else can see); either way, make
        the directory again and lock the file that is there."""
        for _ in range(LOCK_ATTEMPTS):
            try:
                fd = self._acquire()
            except FileNotFoundError:
                self.directory.mkdir(parents=True, exist_ok=True)
                continue
            try:
                if self._is_at_path(fd):
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                    return fd
            except BaseException:
                os.close(fd)   # not left open: an open descriptor would keep the directory locked
                raise
            os.close(fd)
            self.directory.mkdir(parents=True, exist_ok=True)
        raise OSError(f"its lock file kept vanishing ({LOCK_ATTEMPTS} tries): other processes keep removing it")

    def _is_at_path(self, fd: int) -> bool:
        try:
            return os.path.samestat(os.fstat(fd), os.stat(self.directory / LOCK_NAME))
        except FileNotFoundError:
            return False

    def _acquire(self) -> int:
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            raise DirectoryBusy(f"{self.directory} is in use by another run (pid {holder or 'unknown'}); wait "
                                "for it to finish, or choose another --run-name / --out-dir") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)   # closing the last descriptor releases the lock
            self._fd = None

    def discard(self) -> None:
        """Remove what a start that failed before writing anything leaves, then release: the
        directories it created, deepest first, the locked one only while it holds just the lock file,
        each parent only while it is empty (rmdir refuses one that is not, and the removal stops).
        The lock is released last: a start beside this one that already opened the file then finds
        it held, or, once released, gone from the path (and locks the one it makes)."""
        try:
            if self.created and [path.name for path in self.directory.iterdir()] == [LOCK_NAME]:
                (self.directory / LOCK_NAME).unlink()
            remove_empty_directories(self.created)
        except OSError:
            pass   # something else is there: it stays, and so do the directories that hold it
        finally:
            self.release()

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, error_type: type | None, *exc: object) -> None:
        if error_type is None:
            self.release()
        else:
            self.discard()


def owner_kind(directory: Path) -> str | None:
    """'grid' for a directory grid.py marked, 'run' for one that holds a run's checkpoint or logs, else None."""
    if (directory / GRID_MARKER).is_file():
        return "grid"
    return "run" if any(next(directory.glob(pattern), None) for pattern in RUN_FILES) else None


def enclosing_grid(directory: Path | str) -> Path | None:
    """The grid directory a run directory lies in (grid.py's runs do), else None."""
    return next((place for place in Path(directory).expanduser().resolve().parents
                 if owner_kind(place) == "grid"), None)


def check_not_nested(directory: Path | str, *, itself: bool = False) -> None:
    """Refuse to start a run or grid inside another run's or grid's directory (its logs, checkpoint and
    reports would mix with theirs, and a grid would read its runs as its own); `itself`: the directory
    must not be a grid's either (a train.py run).  grid.py's own runs are inside its grid: it starts
    them without this check."""
    directory = Path(directory).expanduser().resolve()
    for place in ([directory] if itself else []) + list(directory.parents):
        kind = owner_kind(place) if place.is_dir() else None
        if kind and (place != directory or kind == "grid"):
            raise UsageError(f"{directory} is {'' if place == directory else 'inside '}the {kind} directory {place}; "
                             "a run or grid writes only into a directory of its own: choose an --out-dir / "
                             "--run-name outside it")
    below = owned_below(directory) if itself and directory.is_dir() else None
    if below:   # its logs would mix with theirs (TensorBoard reads a folder's runs together)
        raise UsageError(f"{directory} holds the {owner_kind(below)} directory {below}; a run writes only into a "
                         "directory of its own: choose an --out-dir / --run-name beside it")


def owned_below(directory: Path, depth: int = 3) -> Path | None:
    """A run's or grid's directory at most `depth` levels below `directory` (a grid's runs lie 2 down), else None."""
    for level in range(1, depth + 1):
        for pattern in (GRID_MARKER, *RUN_FILES):
            found = next(directory.glob("*/" * level + pattern), None)
            if found is not None:
                return found.parent
    return None


def check_can_write(directory: Path | str) -> None:
    """An output directory that cannot be made or written is refused before any work (the data loads,
    the model builds): it is made, a file written and removed there, and what was made is removed again."""
    directory = Path(directory)
    created = missing_directories(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write the directory {directory} ({error.strerror or error}); "
                         f"{directory_advice(error)}") from None
    finally:
        remove_empty_directories(created)
