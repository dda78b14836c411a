import importlib.util

import pytest

from benchmarks.settings import DEFAULT_LENGTHS, parse_settings


def test_a_preset_is_the_flags_it_stands_for_and_flags_override_it(tmp_path):
    out = ["--out", str(tmp_path / "bench")]
    explicit = parse_settings(["--sections", "attention", "--device", "cpu", "--threads", "2", "--methods",
                               "sdpa,favor-post,favor-none", "--masks", "causal", "--passes", "fwd+bwd",
                               "--lengths", "2048,8192,16384", "--budget-s", "600"] + out)
    assert parse_settings(["--preset", "cpu-targets"] + out) == explicit
    assert parse_settings(["--preset", "cpu-targets", "--threads", "1"] + out).threads == 1
    # a preset's values for sections left out are no flags given: quick sets the model section's, too
    assert parse_settings(["--preset", "quick", "--sections", "decode"] + out).model_steps == 2


def test_lengths_default_to_the_device_and_run_small_to_large(tmp_path):
    out = ["--out", str(tmp_path / "bench")]
    assert parse_settings(["--device", "cpu"] + out).lengths == DEFAULT_LENGTHS["cpu"]
    assert parse_settings(["--lengths", "1024,256,1024"] + out).lengths == (256, 1024)


@pytest.mark.parametrize("flags, message", [
    (["--lengths", "0,256"], "positive integers"),
    (["--lengths", ""], "positive integers, got ''"),
    (["--lengths", "128,,256"], "positive integers, got '128,,256'"),
    (["--masks", "causal,"], "causal,full, got 'causal,'"),
    (["--len", "256"], "unrecognized arguments: --len"),
    (["--repeats", "two"], "positive integer"),
    (["--budget-s", "inf"], "positive number of seconds"),
    (["--masks", "sliding"], "causal,full"),
    (["--methods", "favor-*,flash3"], "flash3 matches no method"),
    (["--backends", "cuda"], "auto,torch,cpp,fla"),
    (["--device", "tpu"], "one of auto, cpu, cuda"),
    (["--methods", "favor-post", "--num-features", "7"], "method favor-post (causal) cannot run"),
    (["--methods", "elu-*", "--head-dim", "5"], "method elu-post (causal) cannot run"),
    (["--sections", "decode", "--num-features", "255"], "method favor-post (causal) cannot run"),
    (["--sections", "attention", "--block-methods", "softmax"], "--block-methods is read only by the block section"),
    (["--sections", "decode,model", "--lengths", "256"], "the attention, efficiency, block or kernels section"),
    (["--sections", "block", "--rounds", "2", "--model-steps", "2"], "--model-steps is read only by the model section"),
    (["--sections", "model", "--model-contexts", "96,128", "--model-tokens", "128"],
     "--model-tokens 128 is not a whole number of sequences at context(s) 96"),
    (["--sections", "block", "--block-methods", "softmax,favor-sideways"],
     "unknown name(s) favor-sideways: expected softmax, softmax-xformers or <map>-<rope>[-<backend>]"),
    (["--sections", "model", "--device", "cpu", "--model-methods", "favor-post-fla"],
     "--model-methods favor-post-fla cannot run with these settings: backend='fla' "),   # needs fla, or runs on CUDA only
    (["--sections", "block", "--block-methods", "favor-post", "--num-features", "7"], "--block-methods favor-post cannot run"),
    (["--block-methods", "softmax+decay=retnet"], "+window"),   # softmax takes the window only
    (["--block-methods", "favor-pre+window=wide"], "whole number"),
    (["--model-methods", "favor-pre+window=8+window=8"], "once"),
    (["--sections", "block", "--block-methods", "softmax-xformers+window=8"], "cannot run"),   # sdpa only
    (["--sections", "block", "--block-methods", "elu-pre+decay=0.9"], "cannot run"),   # one factor per head
    (["--block-methods", "favor-pre+decay=abc"], "decay"),
    (["--sections", "model", "--model-methods", "elu-pre+decay=0.9_0.9_0.9_0.9_0.9_0.9_0.9_0.9"], "cannot run"),
    (["--sections", "model", "--model-size", "eleuther", "--model-methods", "elu-pre+decay=0.9_0.9_0.9_0.9"],
     "--model-methods elu-pre+decay=0.9_0.9_0.9_0.9 cannot run"),   # the LM's 8 heads, not --heads
    (["--sections", "kernels", "--kernel-features", "64,7"], "--kernel-features 7: the kernels section"),
    (["--model-size", "huge"], "--model-size"),
    (["--kernel-methods", "fla-delta"], "--kernel-methods"),
    (["--kernel-features", "0"], "--kernel-features"),
    (["--lengths", "100000000000"], "--lengths up to 100,000,000,000 with b=1, h=8, D=64, M=256: the inputs alone need"),
    (["--num-features", "100000000", "--lengths", "32"], "choose shorter --lengths or smaller sizes"),
    (["--threads", "100000"], "--threads"),
    (["--repeats", "1000000000"], "--repeats"),
    (["--warmup", "1001"], "--warmup"),
    (["--decode-steps", "1000000000"], "--decode-steps"),
    (["--model-steps", "10001"], "--model-steps"),
    (["--model-contexts", "128,1000000000"], "--model-contexts"),
    (["--decode-contexts", "1000000000"], "--decode-contexts"),
    (["--batch", "1000000000"], "--batch"),
    (["--budget-s", "1e9"], "--budget-s"),
])
def test_bad_flags_exit_2_with_one_line_that_names_the_flag(flags, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(flags + ["--out", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines   # the one line, without the 22-line usage block


def test_the_model_sections_names_are_checked_with_the_lms_heads(tmp_path):
    settings = parse_settings(["--sections", "model", "--model-methods", "elu-pre+decay=0.9_0.9_0.9_0.9",
                               "--out", str(tmp_path / "bench")])   # the small LM: 4 heads (the block section: 8)
    assert settings.model_methods == ("elu-pre+decay=0.9_0.9_0.9_0.9",)


def test_a_softmax_block_whose_package_is_missing_is_refused_in_one_line(capsys, tmp_path):
    if importlib.util.find_spec("xformers"):
        pytest.skip("xformers is installed here")
    with pytest.raises(SystemExit):
        parse_settings(["--sections", "block", "--block-methods", "softmax-xformers", "--out", str(tmp_path / "b")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "xformers" in lines[0], lines


def test_a_method_too_large_to_build_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """--head-dim 1000000 (now above the flag's bound) made the FAVOR+ projection's QR ask for 4 TB: torch's RuntimeError was a
    traceback.  (Raised here rather than asked of the allocator: a failed 4 TB request leaves glibc's
    heap so that test_timing's peak measurement in the same process reads 0.)"""
    def too_large(*args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory\nmore")
    monkeypatch.setattr("benchmarks.settings.build_attention", too_large)
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--methods", "favor-post", "--head-dim", "60000", "--lengths", "32",
                        "--out", str(tmp_path / "bench")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1, lines
    assert "method favor-post (causal) cannot run with these settings: [enforce fail" in lines[0]


def test_an_output_prefix_that_cannot_be_written_is_refused_before_any_run(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out, why in ((blocker / "bench", "is a file, not a folder"), (blocker / "deeper" / "bench", "is a file"),
                     (tmp_path, "is a folder")):
        with pytest.raises(SystemExit):
            parse_settings(["--out", str(out)])
        err = capsys.readouterr().err
        assert "--out" in err and why in err, err


def test_results_of_an_earlier_run_are_replaced_only_with_overwrite(tmp_path, capsys):
    (tmp_path / "bench.md").write_text("earlier")
    with pytest.raises(SystemExit):
        parse_settings(["--out", str(tmp_path / "bench")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "bench.md from an earlier run would be replaced; pass --overwrite" in lines[0], lines
    assert parse_settings(["--out", str(tmp_path / "bench"), "--overwrite"]).overwrite
    assert (tmp_path / "bench.md").read_text() == "earlier"


def test_the_gpu_targets_preset_is_the_flags_it_stands_for(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.settings.resolve_device", lambda name: __import__("torch").device(name))
    monkeypatch.setattr("linattn.device_memory", lambda device: 80 * 2**30)   # an H100's
    out = ["--out", str(tmp_path / "bench")]
    explicit = parse_settings(["--sections", "block,kernels,model", "--device", "cuda", "--dtypes", "bf16",
                               "--lengths", "4096,16384,65536", "--model-size", "eleuther", "--model-contexts",
                               "1024,8192", "--model-tokens", "32768", "--model-methods", "softmax,favor-post,elu-post",
                               "--budget-s", "60"] + out)
    assert parse_settings(["--preset", "gpu-targets"] + out) == explicit


def test_an_unknown_block_name_is_answered_with_the_pattern_not_every_name(capsys, tmp_path):
    with pytest.raises(SystemExit):
        parse_settings(["--block-methods", "favor-sideways", "--out", str(tmp_path / "bench")])
    assert len(capsys.readouterr().err) < 400   # the 77 names took 1,317 characters


def test_a_folder_where_an_output_goes_is_refused_before_any_measurement(tmp_path, capsys):
    """It was found only when the results were written, after the whole run, as a traceback."""
    (tmp_path / "bench.json").mkdir()
    with pytest.raises(SystemExit):
        parse_settings(["--out", str(tmp_path / "bench"), "--overwrite"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "bench.json is a folder, where the results would be written" in lines[0], lines
