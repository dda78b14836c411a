"""How the commands report failure: exit statuses, one-line messages, and an argument parser whose
usage errors are one line."""
from __future__ import annotations

import argparse
import signal

import torch

EXIT_ERROR, EXIT_USAGE = 1, 2
EXIT_SIGNAL_BASE = 128   # a run stopped by signal S exits 128 + S, as shells report it
EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + signal.SIGINT


class UsageError(ValueError):
    """A run that cannot start as asked (reported as `error: ...`, exit status 2)."""


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage is long): what was wrong, then where to look.  Flags
    are never abbreviated: --feature-map must not pass for a prefix of --feature-map-option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False} | kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


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
