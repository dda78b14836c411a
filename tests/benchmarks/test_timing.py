import multiprocessing
import resource
import sys

import pytest
import torch

from benchmarks import timing
from benchmarks.timing import History, skip_reason

CPU = torch.device("cpu")


def test_budget_skips_a_config_predicted_too_slow():
    quadratic = History(assume_quadratic=True, points=[(1024, 2.0, 1e6)])
    assert skip_reason(quadratic, 2048, budget_s=10, free_bytes=2**40) is None     # 8 s
    assert skip_reason(quadratic, 4096, budget_s=10, free_bytes=2**40) == "skipped: predicted 32.0 s > budget 10 s"
    # A linear method extrapolates with its measured slope, at least 1.
    linear = History(assume_quadratic=False, points=[(1024, 1.0, 1e6), (2048, 1.5, 2e6)])
    assert linear.predict(4096) == pytest.approx((3.0, 4e6))
    assert "available" in skip_reason(linear, 4096, budget_s=10, free_bytes=5 * 10**6)


def test_slow_runs_are_timed_at_most_three_times(monkeypatch):
    """A warm-up over a second caps the timed runs at 3; the median of what was timed is kept."""
    durations = iter([2.0, 3.0, 1.0, 2.5, 9.0, 9.0])
    monkeypatch.setattr(timing, "time_call", lambda call, device: next(durations))
    assert timing.median_time(lambda: None, repeats=5, warmup=1, device=CPU) == (2.5, 3)
    assert next(durations) == 9.0      # runs 4 and 5 were never timed


def test_without_warm_up_the_first_timed_run_caps_slow_runs(monkeypatch):
    durations = iter([2.0, 3.0, 1.0, 9.0, 9.0])
    monkeypatch.setattr(timing, "time_call", lambda call, device: next(durations))
    assert timing.median_time(lambda: None, repeats=5, warmup=0, device=CPU) == (2.0, 3)


def test_the_budget_extrapolates_the_timed_calls_not_one_time_costs():
    """fla-chunk's first call compiles for 90 s; 3 ms calls must not be predicted to take minutes."""
    result = {"elapsed_s": 92.2, "train_s": 0.003, "train_repeats": 5}
    seconds = timing.scaling_seconds(result, {"repeats": 5, "warmup": 1})
    assert seconds == pytest.approx(0.003 * 8)
    history = History(assume_quadratic=False, points=[(1024, seconds, 1e6)])
    assert skip_reason(history, 65536, budget_s=60, free_bytes=2**40) is None


def test_one_call_peak_is_not_hidden_by_what_earlier_calls_left_in_the_heap():
    """After glibc's first free of an 8 MiB block its mmap threshold rises, and later 8 MiB blocks
    stay resident in the heap when freed: the next call reuses them and VmHWM would not rise at all."""
    def make_and_free():
        torch.ones(2 ** 21).add_(1)   # 8 MiB
    for _ in range(3):
        make_and_free()
    baseline, peak = timing.one_call_peak(make_and_free, CPU)
    assert baseline > 0 and 7 * 2 ** 20 < peak < 40 * 2 ** 20


def test_saved_bytes_count_what_backward_still_keeps():
    """exp's node keeps its output, but only as long as that output is referred to: forward drops it,
    so only sin's saved input (x) is kept for backward."""
    x = torch.randn(64, 32, requires_grad=True)
    assert timing.saved_tensor_bytes(lambda: (x.exp(), x.sin())[1]) == x.nbytes


def refill_faults(task: dict) -> dict:
    """Minor page faults of filling a 48 MiB tensor allocated after a 64 MiB one was freed."""
    torch.empty(2 ** 24).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(3 * 2 ** 22).fill_(1.0)
    return {"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and minor-fault counts")
@pytest.mark.parametrize("keep_freed", [False, True])
def test_keep_freed_memory_stops_a_large_temporary_page_faulting_afresh(keep_freed):
    """--keep-freed-memory reaches the measuring process: a freed 64 MiB block is reused, where glibc's
    default gives it back to the OS and the next large temporary faults in afresh (12,288 pages of 4 KiB)."""
    receiver, sender = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=timing.child_main, args=(refill_faults, {"threads": 1}, sender, keep_freed))
    child.start()
    result = receiver.recv()
    child.join()
    assert (result["faults"] < 1000) if keep_freed else (result["faults"] > 10_000), result
