import pytest

from benchmarks.report import crossover, crossover_summary, loglog_slope, target_summary, targets_table


def test_loglog_slope_recovers_power_laws():
    ns = [1024, 2048, 4096]
    assert loglog_slope(ns, [3e-3 * n for n in ns]) == pytest.approx(1.0)
    assert loglog_slope(ns, [1e-7 * n * n for n in ns]) == pytest.approx(2.0)
    assert loglog_slope([1024], [1.0]) is None


def test_crossover_is_interpolated_between_bracketing_lengths():
    def records(times: dict[int, float]) -> list[dict]:
        return [{"n": n, "train_s": t} for n, t in times.items()]

    linear = records({1024: 4.0, 2048: 4.0, 4096: 8.0})
    softmax = records({1024: 1.0, 2048: 8.0, 4096: 32.0})
    assert crossover(linear, softmax)["n"] == pytest.approx(2 ** (10 + 2 / 3), rel=1e-3)
    assert crossover(linear, records({1024: 1.0, 2048: 1.0, 4096: 1.0}))["n"] is None


def record(method: str, n: int, seconds: float, peak: int) -> dict:
    return {"method": method, "mask": "causal", "dtype": "fp32", "label": f"{method} causal fp32",
            "linear": method.startswith("favor"), "n": n, "train_s": seconds, "train_peak_bytes": peak,
            "elapsed_s": 1.0}


def test_cpu_targets_are_ratios_of_this_runs_records():
    records = [record("sdpa", 2048, 0.2, 80), record("sdpa", 8192, 2.5, 280),
               record("favor-post", 2048, 0.15, 300), record("favor-post", 8192, 0.5, 700),
               record("favor-none", 2048, 0.14, 300), record("favor-none", 8192, 0.48, 650)]
    rows = {row["target"]: row for row in target_summary(records, "cpu")}
    speedup = rows["fwd+bwd speed-up over sdpa at N=8192"]
    assert speedup["ratio"] == pytest.approx(5.0) and speedup["met"] is True
    assert rows["fwd+bwd time growth N=2048→8192"]["ratio"] == pytest.approx(0.5 / 0.15)
    memory = rows["fwd+bwd peak memory / sdpa's at N=8192"]
    assert memory["ratio"] == pytest.approx(2.5) and memory["met"] is False
    assert rows["fwd+bwd time rope=post / rope=none at N=8192"]["ratio"] == pytest.approx(0.5 / 0.48)


def test_a_target_without_its_lengths_is_named_as_not_measured():
    rows = target_summary([record("sdpa", 256, 0.01, 8), record("favor-post", 256, 0.02, 9)], "cpu")
    assert rows and all(row["ratio"] is None and row["met"] is None for row in rows)
    assert targets_table(rows).startswith("Not measured in this run") and "N=8192" in targets_table(rows)


def test_cuda_worst_ratio_takes_every_common_length():
    records = [record("fla-chunk", n, 1.0, 1) for n in (1024, 4096)]
    records += [record("favor-post", 1024, 1.2, 1), record("favor-post", 4096, 1.6, 1)]
    rows = {row["target"]: row for row in target_summary(records, "cuda")}
    assert rows["fwd+bwd time / fla-chunk's, worst N"]["ratio"] == pytest.approx(1.6)
    assert rows["fwd+bwd time / fla-chunk's, worst N"]["met"] is False


def test_a_target_measured_by_some_rows_is_not_named_as_not_measured():
    rows = [{"label": "favor-post causal bf16", "target": "speed-up over sdpa-flash", "ratio": 2.0, "bound": "≥ 1",
             "met": True},
            {"label": "favor-post causal fp32", "target": "speed-up over sdpa-flash", "ratio": None, "bound": "≥ 1",
             "met": None}]
    assert "Not measured" not in targets_table(rows)


def test_a_peer_is_not_compared_with_itself():
    records = [record(method, n, 1.0, 1) | {"linear": True} for method in ("fla-chunk", "favor-post")
               for n in (1024, 4096)]
    assert [row["label"] for row in crossover_summary(records, "fla-chunk")] == ["favor-post causal fp32"]
