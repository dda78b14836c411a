"""Scaling tests: how time and memory grow with N, never absolute speed.

Ratios are measured within one run with the benchmark's own measurement functions: the causal
favor-post path must grow like N (time ratio 8192/2048 ~ 4, under 6; memory ratio <= 4.4) while
causal SDPA grows like N^2 (ratio ~ 16), clearly faster.  One head keeps the file fast; at N=2048
the per-token work still dominates the per-call overheads (the linear ratio measures ~4.2, not ~1).
"""
from __future__ import annotations

import statistics

import pytest
import torch

from benchmarks.methods import Shape, build_attention, make_inputs, method_table, train_call
from benchmarks.timing import interleaved_samples, saved_tensor_bytes

SHAPE = Shape(batch=1, heads=1, head_dim=64, num_features=256)
SHORT, LONG = 2048, 8192
CPU = torch.device("cpu")
METHODS = {m.name: m for m in method_table(("auto",))}
CAUSAL_LINEAR, CAUSAL_SOFTMAX = METHODS["favor-post"], METHODS["sdpa"]


def attend(method):
    return build_attention(method, SHAPE, CPU, causal=True, chunk_size=64)


def fwd_bwd_time_ratio(method) -> float:
    """Median fwd+bwd time at LONG over SHORT, the two lengths interleaved run by run so that a
    slow spell of the shared machine slows both alike."""
    run = attend(method)
    calls = {n: train_call(run, *make_inputs(SHAPE, n, CPU)) for n in (SHORT, LONG)}
    samples = interleaved_samples(calls, repeats=5, warmup=1, device=CPU)
    return statistics.median(samples[LONG]) / statistics.median(samples[SHORT])


@pytest.fixture(scope="module")
def time_ratios() -> dict[str, float]:
    # One thread: on a busy 2-core machine two OpenMP threads wait for each other's time slice at
    # every op, which adds a per-op cost unrelated to N and swamps the ratio.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {method.name: fwd_bwd_time_ratio(method) for method in (CAUSAL_LINEAR, CAUSAL_SOFTMAX)}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_causal_linear_time_grows_linearly(time_ratios):
    ratio = time_ratios[CAUSAL_LINEAR.name]
    assert ratio < 6, (f"causal {CAUSAL_LINEAR.name} fwd+bwd time grew {ratio:.2f}x from N={SHORT} to "
                       f"N={LONG}: linear gives 4, quadratic 16")


@pytest.mark.slow
def test_softmax_time_grows_clearly_faster_than_linear(time_ratios):
    linear, softmax = time_ratios[CAUSAL_LINEAR.name], time_ratios[CAUSAL_SOFTMAX.name]
    assert softmax > 1.5 * linear, (f"causal {CAUSAL_SOFTMAX.name} grew {softmax:.2f}x, "
                                    f"{CAUSAL_LINEAR.name} {linear:.2f}x: expected a clear contrast")


def test_causal_linear_memory_grows_linearly():
    run = attend(CAUSAL_LINEAR)
    saved = {n: saved_tensor_bytes(lambda q=q, k=k, v=v: run(q, k, v))
             for n in (SHORT, LONG) for q, k, v, _ in [make_inputs(SHAPE, n, CPU)]}
    ratio = saved[LONG] / saved[SHORT]
    assert saved[SHORT] > 0
    assert ratio <= 4.4, (f"memory saved for backward grew {ratio:.2f}x from N={SHORT} to N={LONG} "
                          f"({saved[SHORT] / 2**20:.1f} -> {saved[LONG] / 2**20:.1f} MB): not linear")
