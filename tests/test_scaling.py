"""Scaling tests: how time and memory grow with N, never absolute speed.

Ratios are measured within one run with bench.py's own measurement functions: the causal favor+post
path must grow like N (time ratio 8192/2048 ~ 4, under 6; memory ratio <= 4.4) while causal SDPA
grows like N^2 (ratio ~ 16), clearly faster.  One head keeps the file fast; at N=2048 the per-token
work still dominates the per-call overheads (the linear ratio measures ~4.2, not ~1).
"""
from __future__ import annotations

import json
import statistics

import pytest
import torch

import bench

SHAPE = bench.Shape(batch=1, heads=1, head_dim=64, num_features=256)
SHORT, LONG = 2048, 8192
CPU = torch.device("cpu")
CAUSAL_LINEAR = bench.linear_method("favor", "post", causal=True)
CAUSAL_SOFTMAX = bench.Method("sdpa", causal=True)


def fwd_bwd_time_ratio(method: bench.Method) -> float:
    """Median fwd+bwd time at LONG over SHORT, the two lengths interleaved run by run so that a
    slow spell of the shared machine slows both alike."""
    attend = bench.build_attention(method, SHAPE, CPU)
    calls = {n: bench.train_call(attend, *bench.make_inputs(SHAPE, n, CPU)) for n in (SHORT, LONG)}
    samples = bench.interleaved_samples(calls, repeats=5, warmup=1, device=CPU)
    return statistics.median(samples[LONG]) / statistics.median(samples[SHORT])


@pytest.fixture(scope="module")
def time_ratios() -> dict[str, float]:
    # One thread: on a busy 2-core machine two OpenMP threads wait for each other's time slice at
    # every op, which adds a per-op cost unrelated to N and swamps the ratio.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {method.label: fwd_bwd_time_ratio(method) for method in (CAUSAL_LINEAR, CAUSAL_SOFTMAX)}
    finally:
        torch.set_num_threads(threads)


def test_causal_linear_time_grows_linearly(time_ratios):
    ratio = time_ratios[CAUSAL_LINEAR.label]
    assert ratio < 6, (f"{CAUSAL_LINEAR.label} fwd+bwd time grew {ratio:.2f}x from N={SHORT} to "
                       f"N={LONG}: linear gives 4, quadratic 16")


def test_causal_linear_memory_grows_linearly():
    attend = bench.build_attention(CAUSAL_LINEAR, SHAPE, CPU)
    saved = {n: bench.saved_tensor_bytes(lambda q=q, k=k, v=v: attend(q, k, v))
             for n in (SHORT, LONG) for q, k, v, _ in [bench.make_inputs(SHAPE, n, CPU)]}
    ratio = saved[LONG] / saved[SHORT]
    assert saved[SHORT] > 0
    assert ratio <= 4.4, (f"memory saved for backward grew {ratio:.2f}x from N={SHORT} to N={LONG} "
                          f"({saved[SHORT] / 2**20:.1f} -> {saved[LONG] / 2**20:.1f} MB): not linear")


def test_softmax_time_grows_clearly_faster_than_linear(time_ratios):
    linear, softmax = time_ratios[CAUSAL_LINEAR.label], time_ratios[CAUSAL_SOFTMAX.label]
    assert softmax > 1.5 * linear, (f"{CAUSAL_SOFTMAX.label} grew {softmax:.2f}x, "
                                    f"{CAUSAL_LINEAR.label} {linear:.2f}x: expected a clear contrast")


def test_loglog_slope_recovers_power_laws():
    ns = [1024, 2048, 4096]
    assert bench.loglog_slope(ns, [3e-3 * n for n in ns]) == pytest.approx(1.0)
    assert bench.loglog_slope(ns, [1e-7 * n * n for n in ns]) == pytest.approx(2.0)
    assert bench.loglog_slope([1024], [1.0]) is None


def test_budget_skips_a_config_predicted_too_slow():
    quadratic = bench.History(assume_quadratic=True, points=[(1024, 2.0, 1e6)])
    assert bench.skip_reason(quadratic, 2048, budget_s=10, free_bytes=2**40) is None     # 8 s
    assert bench.skip_reason(quadratic, 4096, budget_s=10, free_bytes=2**40) == \
        "skipped: predicted 32.0 s > budget 10 s"
    # A linear method extrapolates with its measured slope, at least 1.
    linear = bench.History(assume_quadratic=False, points=[(1024, 1.0, 1e6), (2048, 1.5, 2e6)])
    assert linear.predict(4096) == pytest.approx((3.0, 4e6))
    assert "available" in bench.skip_reason(linear, 4096, budget_s=10, free_bytes=5 * 10**6)


def test_crossover_is_interpolated_between_bracketing_lengths():
    def records(times: dict[int, float]) -> list[dict]:
        return [{"n": n, "train_s": t} for n, t in times.items()]

    linear = records({1024: 4.0, 2048: 4.0, 4096: 8.0})
    softmax = records({1024: 1.0, 2048: 8.0, 4096: 32.0})
    assert bench.crossover(linear, softmax)["n"] == pytest.approx(2 ** (10 + 2 / 3), rel=1e-3)
    assert bench.crossover(linear, records({1024: 1.0, 2048: 1.0, 4096: 1.0}))["n"] is None


def test_bench_runs_end_to_end(tmp_path):
    """A tiny sweep through the real child processes, tables, JSON and plot."""
    json_path, plot_path = tmp_path / "attention.json", tmp_path / "scaling.png"
    bench.main(["--sections", "attention,efficiency", "--lengths", "128,256", "--repeats", "1",
                "--methods", "favor+post causal,sdpa causal", "--json", str(json_path),
                "--plot", str(plot_path), "--threads", "1"])
    results = json.loads(json_path.read_text())
    measured = [r for r in results["attention"]["records"] if "train_s" in r]
    assert {r["label"] for r in measured} == {CAUSAL_LINEAR.label, CAUSAL_SOFTMAX.label}
    assert results["efficiency"]["matmul_peak"]["gflops"] > 0
    assert plot_path.stat().st_size > 0
