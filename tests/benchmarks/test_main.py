"""The entry command end to end: `python -m benchmarks --preset quick`, narrowed to a few seconds."""
import json
import subprocess
import sys

import pytest

from benchmarks.__main__ import main
from benchmarks.methods import KERNEL_METHODS, OURS

QUICK = ["--preset", "quick", "--lengths", "128,256", "--methods", "sdpa,favor-post", "--masks", "causal",
         "--decode-contexts", "128", "--model-contexts", "64", "--threads", "1"]
RESULT_COLUMNS = "| method | mask | dtype | N | fwd ms | fwd+bwd ms | fwd peak MB | fwd+bwd peak MB | saved MB | note |"


@pytest.mark.slow
def test_quick_smoke_prints_every_table_and_writes_json_markdown_and_plot(tmp_path):
    out = tmp_path / "bench"
    run = subprocess.run([sys.executable, "-m", "benchmarks", *QUICK, "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    for heading in ("## Attention", "## Targets of issue 8", "## Log-log slopes", "## Speed-up over sdpa",
                    "## Efficiency", "## Decoding", "## Model"):
        assert heading in run.stdout
    assert RESULT_COLUMNS in run.stdout
    results = json.loads(out.with_suffix(".json").read_text())
    measured = {(r["method"], r["n"]) for r in results["attention"]["records"] if "train_s" in r}
    assert measured == {(m, n) for m in ("sdpa", "favor-post") for n in (128, 256)}
    assert {"forward_s", "train_s", "forward_peak_bytes", "train_peak_bytes", "saved_bytes",
            "forward_baseline_bytes", "train_baseline_bytes"} <= set(results["attention"]["records"][0])
    # Each config's fresh process sees its own peak: favor-post's features alone are MBs at N=256.
    assert all(r["train_peak_bytes"] > 2**20 for r in results["attention"]["records"] if r["method"] == "favor-post")
    assert results["efficiency"]["matmul_peak"]["gflops"] > 0
    assert all("step_s" in r for r in results["decode"]) and all("tokens_per_s" in r for r in results["model"])
    assert RESULT_COLUMNS in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_bad_input_to_the_command_is_one_line_and_exit_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks", "--lengths", "abc", "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and "--lengths" in run.stderr.strip().splitlines()[-1]


def test_overwrite_removes_the_earlier_runs_plot_when_this_run_draws_none(tmp_path, monkeypatch):
    """Every attention config skipped but the decode section measured: the new JSON and report must
    not sit beside a plot of the earlier run's measurements."""
    skipped = {"method": "sdpa", "mask": "causal", "dtype": "fp32", "label": "sdpa causal fp32", "linear": False,
               "n": 128, "skipped": "over budget"}
    monkeypatch.setattr("benchmarks.__main__.run_attention", lambda *args: {"records": [skipped]})
    monkeypatch.setattr("benchmarks.__main__.run_decode", lambda *args: [{"n": 128, "step_s": 0.01}])
    out = tmp_path / "bench"
    for suffix in (".json", ".md", ".png"):
        out.with_suffix(suffix).write_text("earlier")
    main(["--sections", "attention,decode", "--device", "cpu", "--lengths", "128", "--out", str(out), "--overwrite"])
    assert not out.with_suffix(".png").exists()
    assert json.loads(out.with_suffix(".json").read_text())["settings"]["sections"] == ["attention", "decode"]


@pytest.mark.gpu
def test_cuda_path_measures_with_events_and_max_memory_allocated(tmp_path, fla_autotuned):
    out = tmp_path / "bench-gpu"
    results = main(["--device", "cuda", "--sections", "attention", "--lengths", "256,512", "--dtypes", "fp32,bf16",
                    "--backends", "torch,fla", "--methods", "sdpa*,xformers,favor-post*,fla-chunk",
                    "--masks", "causal", "--repeats", "2", "--out", str(out)])
    measured = {(r["method"], r["dtype"]) for r in results["attention"]["records"] if "train_s" in r}
    assert {("sdpa", "fp32"), ("sdpa-flash", "bf16"), ("favor-post-torch", "bf16")} <= measured
    assert all(r["train_peak_bytes"] > 0 for r in results["attention"]["records"] if "train_s" in r)
    assert results["machine"]["device"].startswith("cuda")
    for suffix in (".json", ".md", ".png"):
        assert out.with_suffix(suffix).stat().st_size > 0


@pytest.mark.gpu
def test_cuda_block_and_kernel_sections_measure_every_method_and_judge_the_targets(tmp_path):
    """The gpu-targets preset's sections, shortened: every block and op runs (fla's when installed),
    and the comparisons the targets come from are filled in."""
    import importlib.util
    results = main(["--preset", "gpu-targets", "--sections", "block,kernels", "--lengths", "4096",
                    "--kernel-features", "64", "--repeats", "2", "--out", str(tmp_path / "bench")])
    blocks = {r["block"] for r in results["block"]["records"] if "train_s" in r}
    assert blocks == {"softmax", "favor-post", "elu-post"}
    assert [t["n"] for t in results["block"]["targets"]] == [4096]
    timed = {r["method"] for r in results["kernels"]["records"] if "train_s" in r}
    fla = importlib.util.find_spec("fla") is not None
    assert timed == (set(KERNEL_METHODS) if fla else {"linattn-log", "linattn-plain"})
    assert len(results["kernels"]["comparisons"]) == (len(OURS) if fla else 0)
    assert all(r["bandwidth_share"] > 0 for r in results["kernels"]["records"] if "train_s" in r)


@pytest.mark.parametrize("outcome", [{"error": "RuntimeError: can't allocate memory"}, {"skipped": "over budget"}])
def test_a_run_that_measured_nothing_exits_1_and_keeps_the_earlier_results(outcome, tmp_path, monkeypatch, capsys):
    """Every configuration failed (or was skipped): exit 1, and the earlier results at --out stay as they were."""
    record = {"method": "sdpa", "mask": "causal", "dtype": "fp32", "label": "sdpa causal fp32", "linear": False,
              "n": 128, **outcome}
    monkeypatch.setattr("benchmarks.__main__.run_attention", lambda *args: {"records": [record]})
    out = tmp_path / "bench"
    for suffix in (".json", ".md", ".png"):
        out.with_suffix(suffix).write_text("earlier")
    with pytest.raises(SystemExit) as exit_info:
        main(["--sections", "attention", "--device", "cpu", "--lengths", "128", "--out", str(out), "--overwrite"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "nothing was written" in err[-1]
    assert ("can't allocate memory" in err[-1]) == ("error" in outcome)
    assert all(out.with_suffix(suffix).read_text() == "earlier" for suffix in (".json", ".md", ".png"))


def test_a_method_asked_for_that_cannot_run_here_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """The cpp backend unable to build (as with CXX=/bin/false): exit 2 naming the method, and the earlier
    results at --out kept, rather than an sdpa-only run written over them with exit 0."""
    monkeypatch.setattr("benchmarks.__main__.run_attention", lambda *args: pytest.fail("the sweep started"))
    out = tmp_path / "bench"
    for suffix in (".json", ".md", ".png"):
        out.with_suffix(suffix).write_text("earlier")
    import benchmarks.settings
    monkeypatch.setattr(benchmarks.settings, "unavailable",
                        lambda method, device: "building the cpp backend failed" if method.backend == "cpp" else None)
    with pytest.raises(SystemExit) as exit_info:
        main(["--sections", "attention", "--device", "cpu", "--lengths", "128", "--methods", "sdpa,favor-post-cpp",
              "--backends", "cpp", "--out", str(out), "--overwrite"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "favor-post-cpp cannot run here (building the cpp" in err[0]
    assert all(out.with_suffix(suffix).read_text() == "earlier" for suffix in (".json", ".md", ".png"))
