"""Device, precision, memory, loss-summing and file helpers shared by training, grid, evaluation and
the benchmarks."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

from .lm import lm_loss


def keep_freed_memory() -> bool:
    """Serve every allocation from glibc's heap and keep freed memory there (Linux only).

    PyTorch's CPU allocator is plain malloc/free.  glibc hands blocks over 32 MB to mmap and gives
    them back on free, so each large temporary (67 MB for (8, 8192, 256) float32) page-faults afresh
    on every pass: measured 21 ms just to allocate and fill one.  With mmap off and no trimming,
    freed blocks are reused; the causal favor+post pass at N=8192 went from 1.20 s to 0.90 s.
    The process keeps its peak memory reserved until it exits.  Returns False where unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4          # mallopt parameters from <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


DEVICE_HINT = "use auto, cpu, cuda, cuda:N or mps"


def resolve_device(name: str | None) -> torch.device:
    """'auto' (or None) picks CUDA when available; cpu, cuda[:N] and mps are checked against
    this machine.  An empty name is refused: it is a mistake (an unset shell variable), not a choice."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"device {name!r} is not a device name; {DEVICE_HINT}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {name!r} requested but MPS is not available; use --device cpu")
    elif device.type != "cpu" or device.index not in (None, 0):
        raise ValueError(f"device {name!r} is not supported; {DEVICE_HINT}")
    return device


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPES = ("auto", *PRECISIONS)   # the --dtype choices


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype of --dtype `name` on `device`.  auto: bf16 on CUDA, float32 elsewhere (on
    CPU bf16 autocast works but is slower, and it changes results)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return PRECISIONS[name]


def precision_key(dtype: str, device: torch.device) -> str:
    """--dtype `dtype` resolved on `device`, by name: fp32, bf16 or fp16."""
    resolved = resolve_dtype(dtype, device)
    return next(name for name, value in PRECISIONS.items() if value == resolved)


def autocast(device: torch.device, dtype: str = "auto") -> contextlib.AbstractContextManager:
    """Autocast to --dtype's precision (`resolve_dtype`); nothing for fp32.  The attention kernels
    compute in float32 whatever autocast says, and return the input dtype."""
    precision = resolve_dtype(dtype, device)
    if precision == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=precision)


def precision_name(dtype: str, device: torch.device) -> str:
    """What --dtype means on `device`, for the logs: 'fp32', 'bf16 autocast', 'fp16 autocast + loss scaling'."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast + loss scaling"}
    return names[resolve_dtype(dtype, device)]


def gradient_scaler(device: torch.device, dtype: str) -> torch.amp.GradScaler:
    """A loss scaler for fp16 (its gradients underflow without one); disabled, a no-op, otherwise."""
    return torch.amp.GradScaler(device.type, enabled=resolve_dtype(dtype, device) == torch.float16)


def release_free_memory() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim), so that the resident set is
    what is in use: after keep_freed_memory() a process keeps every earlier peak reserved, and the
    runs of a grid would each measure what the runs before them left behind."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Writing 5 to clear_refs resets this process's VmHWM (Linux), so each grid variant gets its own peak.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max_memory_allocated; CPU: the process's peak resident set (VmHWM, else ru_maxrss)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024   # bytes on macOS, KiB on Linux


@torch.no_grad()
def summed_loss(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device, dtype: str = "auto") -> tuple[float, int]:
    """(total next-byte loss in nats, number of predicted bytes) over (x, y) batches, in eval mode."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    try:
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(device, dtype):
                logits = model(x)
            total += lm_loss(logits, y, reduction="sum").double()
            count += y.numel()
    finally:
        model.train(was_training)
    return total.item(), count


def decode_bytes(ids: torch.Tensor) -> str:
    """Byte ids -> text; invalid UTF-8 (a sample cut mid-character) shows as U+FFFD."""
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_out_of_memory(error: BaseException) -> bool:
    """A failed allocation: torch raises OutOfMemoryError on CUDA, but on CPU a plain RuntimeError
    from its allocator ("DefaultCPUAllocator: can't allocate memory"), and Python a MemoryError."""
    return isinstance(error, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def first_line(error: BaseException) -> str:
    """An error's message as one short line, for messages that must not become tracebacks; a first
    line that only introduces what follows ("Error(s) in loading state_dict for ByteLM:") takes the
    next line with it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    line = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line[:300]


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
