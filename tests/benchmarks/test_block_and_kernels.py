"""The block and kernels sections: what they build, measure and judge, on CPU (fla's kernels are CUDA
only; their rows are skipped with the reason, and the comparisons are checked on given records)."""
import pytest
import torch

import linattn
from benchmarks import block, kernels, methods, sections
from benchmarks.sections import lm_config

TINY = {"device": "cpu", "threads": 0, "dim": 32, "heads": 2, "num_features": 16, "repeats": 2, "warmup": 1}


@pytest.mark.parametrize("name", [n for n in methods.block_names() if n not in methods.SOFTMAX_BLOCKS] + ["softmax"])
def test_every_block_name_builds_the_block_a_user_would(name):
    built = methods.build_block(name, 32, 2, 16)
    if name == "softmax":
        assert isinstance(built, linattn.SoftmaxAttention) and built.rope is not None
        return
    feature_map, rope, backend = methods.linear_parts(name)
    assert name == f"{feature_map}-{rope}" + ("" if backend == "auto" else f"-{backend}")
    assert isinstance(built, linattn.LinearAttention) and built.rope == rope and built.backend == backend
    assert type(built.feature_map) is linattn.feature_map_class(feature_map)
    if "num_features" in linattn.feature_map_options(feature_map):
        assert built.feature_map.num_features == 16


def test_a_blocks_name_gives_its_window_and_decay_as_the_training_harness_names_them():
    built = methods.build_block("favor-pre+window=8+decay=retnet", 32, 2, 16)
    assert built.window == 8 and built.decay == (1 - 2 ** -5, 1 - 2 ** -6) and built.rope == "pre"   # RetNet's
    assert methods.build_block("elu-post-torch+decay=0.5_0.25", 32, 2, 16).decay == (0.5, 0.25)
    control = methods.build_block("softmax+window=8", 32, 2, 16)
    assert isinstance(control, linattn.SoftmaxAttention) and control.window == 8
    assert methods.is_softmax("softmax+window=8") and not methods.is_softmax("favor-pre+window=8")
    config = lm_config("favor-post+window=64+decay=retnet", 256, 64)
    assert (config.window, config.decay, config.feature_map, config.rope) == (64, "retnet", "favor", "post")
    assert lm_config("softmax+window=64", 256, 64).window == 64
    assert methods.build_block("softmax+window=8+short_conv=3", 32, 2, 16).short_conv.kernel_size == 3   # the library's table
    assert methods.build_block("favor-post+short_conv=3", 32, 2, 16).short_conv.kernel_size == 3


@pytest.mark.parametrize("name, dtype", [("favor-post", "fp32"), ("elu-post", "bf16"), ("softmax", "bf16"),
                                         ("favor-pre+window=8+decay=retnet", "fp32"), ("softmax+window=8", "fp32")])
def test_a_block_task_times_forward_and_backward_and_reports_first_call_and_peak(name, dtype):
    result = block.block_task({**TINY, "block": name, "dtype": dtype, "n": 64})
    assert result["train_s"] > 0 and result["first_call_s"] > 0 and result["train_repeats"] == 2
    assert result["train_peak_bytes"] > 0 and result["page_faults_per_call"] >= 0


def test_rounds_give_each_config_its_median_and_do_not_rerun_a_skipped_one():
    """--rounds 3: the sweep runs three times, each config's record holds the median of each value over
    the rounds (its times kept); a config that failed in the first round is not run again."""
    from benchmarks.report import Report
    from benchmarks.settings import Settings
    times = {"favor-pre": iter([3.0, 1.0, 2.0]), "elu-pre": iter([5.0])}

    class Runner:
        calls = []

        def run(self, run_task, task, timeout_s):
            self.calls.append(task["block"])
            if task["block"] == "elu-pre":
                return {"error": "RuntimeError: out of memory"}
            seconds = next(times[task["block"]])
            return {"train_s": seconds, "train_peak_bytes": 10 * seconds, "page_faults_per_call": 0.0,
                    "first_call_s": 0.1, "train_repeats": 2, "elapsed_s": 1.0}

    settings = Settings(device="cpu", lengths=(64,), rounds=3, block_methods=("favor-pre", "elu-pre"))
    runner = Runner()
    records = {r["block"]: r for r in block.block_sweep(settings, torch.device("cpu"), runner, Report())}
    assert runner.calls == ["favor-pre", "elu-pre", "favor-pre", "favor-pre"]
    assert records["favor-pre"]["train_s"] == 2.0 and records["favor-pre"]["train_peak_bytes"] == 20.0
    assert records["favor-pre"]["train_s_rounds"] == [3.0, 1.0, 2.0] and "error" in records["elu-pre"]


def record(name, n, seconds, peak, dtype="bf16"):
    return {"block": name, "dtype": dtype, "n": n, "train_s": seconds, "train_peak_bytes": peak}


def test_block_comparisons_pair_each_linear_block_with_softmax_at_its_n_and_dtype():
    records = [record("softmax", 4096, 2.0, 100), record("favor-post", 4096, 1.0, 300),
               record("softmax", 16384, 8.0, 400), record("favor-post", 16384, 5.0, 500),
               record("favor-post", 32768, 1.0, 1), {"block": "softmax", "dtype": "bf16", "n": 32768,
                                                     "skipped": "skipped: predicted 90 s"},
               record("softmax", 65536, 10.0, 1000), record("elu-post", 65536, 4.0, 2000)]
    rows = block.comparisons(records)
    assert [(r["block"], r["n"], r["speedup"], r["memory_ratio"]) for r in rows] == [
        ("favor-post", 4096, 2.0, 3.0), ("favor-post", 16384, 1.6, 1.25), ("elu-post", 65536, 2.5, 2.0)]
    judged = block.judge(rows)   # issue 34: favor-post >= 1x at 16k, peak <= 2x from 4096; elu-post >= 3x at 64k
    assert [(t["speed_met"], t["memory_met"]) for t in judged] == [(None, False), (True, True), (False, None)]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_each_option_is_judged_against_the_same_block_without_it(device_type):
    """Issue 45: time <= 1.3x and peak <= 1.5x the plain block's at 8k on CPU (and a 4k-16k slope <= 1.1),
    time <= 1.3x at every N on CUDA; the window-only control's ratios to softmax are shown, not judged."""
    records = [record("favor-pre", 4096, 1.0, 100), record("favor-pre+window=64", 4096, 1.2, 120),
               record("favor-pre", 8192, 2.0, 200), record("favor-pre+window=64", 8192, 2.8, 250),
               record("favor-pre", 16384, 4.0, 400), record("favor-pre+window=64", 16384, 4.8, 700),
               record("softmax", 8192, 3.0, 300), record("softmax+window=64", 8192, 0.6, 290)]
    rows = {(r["block"], r["n"]): r for r in block.option_rows(records, device_type)}
    assert set(rows) == {("favor-pre+window=64", n) for n in (4096, 8192, 16384)} | {("softmax+window=64", 8192)}
    windowed = rows["favor-pre+window=64", 8192]
    assert windowed["time_ratio"] == pytest.approx(1.4) and windowed["peak_ratio"] == pytest.approx(1.25)
    assert windowed["slope"] == pytest.approx(1.0) and windowed["plain_slope"] == pytest.approx(1.0)
    verdicts = {key: (r["time_met"], r["peak_met"], r["slope_met"]) for key, r in rows.items()}
    if device_type == "cpu":
        assert verdicts["favor-pre+window=64", 8192] == (False, True, True)
        assert verdicts["favor-pre+window=64", 4096] == (None, None, None)   # judged once, at 8k
        assert verdicts["softmax+window=64", 8192] == (None, None, None)     # judged against softmax
    else:
        assert [verdicts["favor-pre+window=64", n][0] for n in (4096, 8192, 16384)] == [True, False, True]
        assert verdicts["softmax+window=64", 8192] == (None, None, None)
        assert {v[1:] for v in verdicts.values()} == {(None, None)}


def test_the_model_table_judges_favor_posts_tokens_per_second_against_softmaxs():
    def lm(kind, context, tokens):
        return {"model": kind, "n": context, "tokens_per_s": tokens, "batch": 4, "peak_bytes": 2 ** 20}
    records = [lm("softmax", 1024, 1000.0), lm("favor-post", 1024, 400.0), lm("elu-post", 1024, 900.0),
               lm("softmax", 8192, 100.0), lm("favor-post", 8192, 150.0), lm("elu-post", 8192, 90.0)]
    rows = sections.model_rows(records, ["softmax", "favor-post", "elu-post"], [1024, 8192])
    verdicts = {(row[0], row[1]): row[-1] for row in rows}   # issue 34: >= 0.5x at 1024, >= 1x at 8192
    assert verdicts[1024, "favor-post"] == "≥ 0.5× **missed**" and verdicts[8192, "favor-post"] == "≥ 1× met"
    assert verdicts[1024, "softmax"] == verdicts[8192, "elu-post"] == "—"


def test_judging_leaves_out_lengths_without_a_target():
    records = [record("softmax", 1024, 1.0, 10), record("favor-post", 1024, 2.0, 10),
               record("softmax", 4096, 1.0, 10), record("elu-post", 4096, 2.0, 10)]
    assert block.judge(block.comparisons(records)) == []


@pytest.mark.parametrize("method", [m for m in methods.OURS if kernels.unavailable(m, torch.device("cpu")) is None])
def test_a_kernel_task_runs_every_length_of_our_op_in_one_process(method):
    task = {**TINY, "method": method, "m": 16, "dtype": "fp32", "lengths": (64, 128), "batch": 1, "dv": 8,
            "budget_s": 60.0}
    rows = kernels.kernel_task(task)["rows"]
    assert [r["n"] for r in rows] == [64, 128] and all(r["train_s"] > 0 for r in rows)
    # 2 heads of float32 features (M=16) and values (Dv=8): each input read twice and its gradient
    # written; the output written and its gradient read
    inputs = 2 * (2 * 64 * 16 * 4 + 64 * 8 * 4)
    assert rows[0]["traffic_bytes"] == 3 * inputs + 2 * (2 * 64 * 8 * 4)


def test_a_kernel_task_stops_at_the_length_predicted_over_budget():
    task = {**TINY, "method": "linattn-plain", "m": 16, "dtype": "fp32", "lengths": (64, 2 ** 40), "batch": 1,
            "dv": 8, "budget_s": 1e-9}
    rows = kernels.kernel_task(task)["rows"]
    assert "train_s" in rows[0] and rows[1]["skipped"].startswith("skipped: predicted over")


def test_fla_kernels_say_why_they_cannot_run_on_cpu():
    for method in kernels.NEEDS_FLA:
        assert kernels.unavailable(method, torch.device("cpu")) is not None
    assert kernels.unavailable("linattn-log", torch.device("cpu")) is None


def test_fla_kernels_take_its_layout_and_the_gate():
    inputs = kernels.make_inputs("fla-gla", (1, 2, 32, 16, 8), torch.device("cpu"), torch.bfloat16)
    assert [tuple(t.shape) for t in inputs] == [(1, 32, 2, 16), (1, 32, 2, 16), (1, 32, 2, 8), (1, 32, 2, 16)]
    assert inputs[0].dtype == torch.bfloat16 and inputs[3].dtype == torch.float32 and (inputs[3] <= 0).all()


def test_kernel_comparisons_judge_our_time_against_the_fla_peer():
    def row(method, m, n, seconds):
        return {"method": method, "m": m, "dtype": "bf16", "n": n, "train_s": seconds, "train_peak_bytes": 10}
    records = [row("linattn-log", 64, 4096, 3.9), row("fla-gla", 64, 4096, 2.0),   # issue 34: <= 2x, <= 1.5x
               row("linattn-plain", 64, 4096, 1.6), row("fla-linear", 64, 4096, 1.0),
               row("linattn-plain", 256, 4096, 1.0)]
    rows = {(r["method"], r["m"]): r for r in kernels.comparisons(records)}
    assert set(rows) == {("linattn-log", 64), ("linattn-plain", 64)}
    assert rows[("linattn-log", 64)]["met"] and not rows[("linattn-plain", 64)]["met"]


def test_bandwidth_is_the_least_traffic_over_time_and_its_share_of_a_known_peak():
    records = kernels.with_bandwidth([{"train_s": 0.5, "traffic_bytes": 10 ** 12}], "NVIDIA H100 80GB HBM3")
    assert records[0]["bandwidth"] == 2e12 and records[0]["bandwidth_share"] == pytest.approx(2 / 3.35)
    assert kernels.with_bandwidth([{"train_s": 1.0, "traffic_bytes": 1}], "cpu")[0]["bandwidth_share"] is None


def test_the_model_section_builds_a_training_presets_lm_with_any_map():
    config = lm_config("hedgehog-pre", 1024, 64, "eleuther")
    assert (config.n_layer, config.d_model, config.n_head) == (8, 512, 8)
    assert config.feature_map == "hedgehog" and config.rope == "pre" and config.feature_map_options == {"num_features": 64}
    assert lm_config("taylor-none", 256, 64).feature_map_options == {}
    assert lm_config("favor-post", 256, 64).feature_map_options == {"num_features": 64}
    assert lm_config("softmax", 256, 64, "small").attention == "softmax"


def test_a_kernel_task_that_fails_at_a_length_keeps_the_lengths_measured_before(monkeypatch):
    run = kernels.measure

    def fail_at_128(call, inputs, task):
        if inputs[0].shape[-2] == 128:
            raise RuntimeError("CUDA out of memory (pretend)")
        return run(call, inputs, task)
    monkeypatch.setattr(kernels, "measure", fail_at_128)
    task = {**TINY, "method": "linattn-plain", "m": 16, "dtype": "fp32", "lengths": (64, 128, 256), "batch": 1,
            "dv": 8, "budget_s": 60.0}
    rows = kernels.kernel_task(task)["rows"]
    assert "train_s" in rows[0]
    assert rows[1] == {"n": 128, "error": "RuntimeError: CUDA out of memory (pretend)"}
    assert rows[2] == {"n": 256, "skipped": "skipped: failed at N=128"}


def test_fla_backend_kernels_take_our_inputs_and_call_the_fla_backend(monkeypatch):
    """linattn-fla-*: linattn's public call with backend="fla" on linattn's (B, H, N, M) inputs."""
    log_inputs = kernels.make_inputs("linattn-fla-log", (1, 2, 32, 16, 8), torch.device("cpu"), torch.bfloat16)
    assert [t.dtype for t in log_inputs] == [torch.float32, torch.float32, torch.bfloat16]
    plain_inputs = kernels.make_inputs("linattn-fla-plain", (1, 2, 32, 16, 8), torch.device("cpu"), torch.bfloat16)
    assert [tuple(t.shape) for t in plain_inputs] == [(1, 2, 32, 16), (1, 2, 32, 16), (1, 2, 32, 8)]
    calls = []
    monkeypatch.setattr(kernels.linattn, "linear_attention", lambda *t, **options: calls.append(options))
    kernels.attend("linattn-fla-log")(*log_inputs)
    kernels.attend("linattn-fla-plain")(*plain_inputs)
    kernels.attend("linattn-plain")(*plain_inputs)
    assert [(c["backend"], c["log_space"]) for c in calls] == [("fla", True), ("fla", False), ("auto", False)]
    assert kernels.TARGETS["linattn-fla-log"] == 2.0 and kernels.TARGETS["linattn-fla-plain"] == 1.5
