"""This process: its place in a torchrun job (joining the process group), and the signals that stop it."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from tqdm import tqdm

from .device import resolve_device
from .errors import UsageError


@dataclass
class Distributed:
    """This process's place in a torchrun job (rank 0 of 1 without torchrun)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def any(self, flag: bool | torch.Tensor) -> bool:
        """True on every rank if it is True on any rank (so all ranks stop at the same step)."""
        if self.world_size == 1:
            return bool(flag)
        return bool(self.sum(torch.as_tensor(flag, dtype=torch.float32, device=self.device)).item())

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


def launch_environment() -> tuple[int, int, int]:
    """(rank, local rank, world size) of a torchrun job, read from the variables torchrun sets; (0, 0, 1)
    without them.  Values that are not counts, a rank outside the job, or a job of several processes
    without torchrun's rendezvous address are a UsageError here, not torch's traceback later."""
    def count(name: str, default: str | None = None) -> int:
        text = os.environ.get(name, default)
        if text is None:
            return -1   # not set: reported with the rendezvous variables below
        if not (text.strip().isascii() and text.strip().isdigit()):
            raise UsageError(f"environment variable {name}={text!r} is not a count: torchrun sets it; unset "
                             "WORLD_SIZE, RANK and LOCAL_RANK to train in one process")
        return int(text)
    world_size = count("WORLD_SIZE", "1")
    if world_size == 0:
        raise UsageError("environment variable WORLD_SIZE=0: a job has at least one process; unset it to train in one")
    if world_size == 1:
        return 0, 0, 1
    rank, local_rank = count("RANK"), count("LOCAL_RANK")
    missing = [name for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if rank >= world_size or missing:
        problem = f"RANK={rank} is not below it" if rank >= world_size else f"{' and '.join(missing)} not set"
        raise UsageError(f"environment variable WORLD_SIZE={world_size}, but {problem}: launch several processes "
                         "with torchrun (torchrun --nproc-per-node N train.py ...), or unset WORLD_SIZE")
    return rank, local_rank, world_size


def launched_rank() -> int:
    """This process's rank in a torchrun job (0 without torchrun), known before the group is joined."""
    return launch_environment()[0]


def data_parallel(model: torch.nn.Module) -> DistributedDataParallel:
    """DDP that syncs no buffers in forward: every rank draws identical feature-map projections from the
    seeds.  torch 2.13 deprecates broadcast_buffers=False, with a warning to every user, for
    forward_sync_buffers=False (which syncs buffers once at construction: values the ranks share
    anyway); older torch has only the former."""
    try:
        return DistributedDataParallel(model, forward_sync_buffers=False)
    except TypeError:   # an unexpected keyword, raised before any collective: torch before 2.13
        return DistributedDataParallel(model, broadcast_buffers=False)


@contextlib.contextmanager
def distributed(device_name: str) -> Iterator[Distributed]:
    """Join the torchrun process group when RANK/WORLD_SIZE are set: nccl on CUDA, gloo on CPU."""
    rank, local_rank, world_size = launch_environment()
    device = resolve_device(device_name)
    if world_size == 1:
        yield Distributed(0, 1, device)
        return
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield Distributed(rank, world_size, device)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- pieces of the loop


class StopRequest:
    """Ctrl-C / SIGTERM ask to stop after the current step (then a checkpoint is saved).  A signal
    within REPEAT_SECONDS of the first is the same request (a scheduler's or a shell's group kill
    and direct kill arrive milliseconds apart), and so is one during a save, which completes: only a
    later one, between saves, aborts at once.  `signum` is the first signal received."""

    REPEAT_SECONDS = 2.0

    def __init__(self) -> None:
        self.signum = 0
        self.first_at = 0.0
        self.saving = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return bool(self.signum)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            if self.saving or time.monotonic() - self.first_at < self.REPEAT_SECONDS:
                return   # the same request: the stop it asked for is under way
            raise KeyboardInterrupt
        self.signum, self.first_at = signum, time.monotonic()
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint after this step (Ctrl-C again, "
                   f"{self.REPEAT_SECONDS:g} s on and not while saving, to abort without saving)")

    @contextlib.contextmanager
    def whole_save(self) -> Iterator[None]:
        """A save that a repeated signal does not abort."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():   # signal() works there only
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


