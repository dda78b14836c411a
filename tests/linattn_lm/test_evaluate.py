"""eval.py: bpc equals a hand computation over non-overlapping windows, length-extrapolation table,
sampling, and clear errors for bad checkpoints and missing data."""
from __future__ import annotations

import math
import pickle
import re
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from linattn_lm.data import load_split
from linattn_lm import ByteLM, RunConfig, TrainConfig, evaluate, load_checkpoint, ngram, save_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def write_checkpoint(path: Path, model: ByteLM, data_dir: Path, data: str = "test") -> Path:
    """A checkpoint as train.py writes it, for a model built here (`data`: what it says it trained on)."""
    config = TrainConfig(model=model.config, run=RunConfig(data_dir=str(data_dir), run_name="test"))
    config.optim.decay_steps = config.optim.steps   # as config_from_flags resolves it
    save_checkpoint(path, dict(config=asdict(config), step=0, model=model.state_dict(), optimizer={},
                               loader={}, rng=[], stats={}, data=data, log_window={}))
    return path


@pytest.fixture
def make_model(small_config):
    def make(**overrides) -> ByteLM:
        torch.manual_seed(0)
        return ByteLM(small_config(**overrides)).eval()
    return make


def hand_bpc(model: ByteLM, data: np.ndarray, seq_len: int) -> float:
    """Window k: inputs data[kL : kL+L], targets data[kL+1 : kL+L+1], cut at the end of the data."""
    total, count = 0.0, 0
    for start in range(0, len(data) - 1, seq_len):
        window = torch.from_numpy(data[start:start + seq_len + 1].astype(np.int64))
        with torch.no_grad():
            log_probs = model(window[None, :-1])[0].double().log_softmax(-1)
        total -= log_probs.gather(1, window[1:, None]).sum().item()
        count += len(window) - 1
    assert count == len(data) - 1
    return total / count / math.log(2)


def table(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^\s+(\d+)\s+(\S+)", out, flags=re.MULTILINE)}


def test_bpc_equals_hand_computation(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    model = make_model(seq_len=16)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, data_dir)
    val = load_split(data_dir, "val").data[:1234]          # 1233 targets: 77 windows of 16 + 1 of 1
    expected = hand_bpc(model, val, 16)
    bpc, _ = evaluate.evaluate_bpc(model, val, 16, batch_size=5, device=torch.device("cpu"))
    assert bpc == pytest.approx(expected, abs=1e-5)   # float32 logits vs float64 by hand
    code, out, _ = run_main(evaluate.main, [str(ckpt), "--max-bytes", "1234", "--seq-len", "16", "40"])
    assert code == 0 and "NON-CANONICAL" in out and "val split, 1,234 of 20,000 bytes" in out
    rows = table(out)
    assert float(rows[16]) == pytest.approx(expected, abs=1e-4)
    assert float(rows[40]) == pytest.approx(hand_bpc(model, val, 40), abs=1e-4)
    lines = ngram.reference_bpc(data_dir, "val", max_bytes=1234)      # the reference on the same bytes
    assert ngram.format_reference(lines) in out


def test_scoring_on_other_data_than_the_run_trained_on_says_so(data_dir: Path, tmp_path: Path, run_main,
                                                               make_model) -> None:
    model = make_model(seq_len=16)
    argv = ["--max-bytes", "200", "--seq-len", "16"]
    ckpt = write_checkpoint(tmp_path / "same.pt", model, data_dir, data=load_split(data_dir, "train").description)
    code, out, _ = run_main(evaluate.main, [str(ckpt), *argv])
    assert code == 0 and "note:" not in out
    ckpt = write_checkpoint(tmp_path / "other.pt", model, data_dir, data="enwik8 (100,000,000 bytes)")
    code, out, _ = run_main(evaluate.main, [str(ckpt), *argv])
    assert code == 0 and "note: the run trained on enwik8 (100,000,000 bytes), not on these data" in out


def test_uniform_model_scores_eight_bits(data_dir: Path, make_model) -> None:
    model = make_model()
    torch.nn.init.zeros_(model.head.weight)   # all logits 0: every byte has probability 1/256
    bpc, _ = evaluate.evaluate_bpc(model, load_split(data_dir, "test").data[:500], 16, 4, torch.device("cpu"))
    assert bpc == pytest.approx(8.0, abs=1e-5)     # log(256) in float32


def test_extrapolation_table_marks_learned_positions(data_dir: Path, tmp_path: Path,
                                                     run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "abs.pt", make_model(attention="softmax", rope="none", abs_pos=True), data_dir)
    code, out, _ = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "16", "32"])
    rows = table(out)
    assert code == 0 and rows[32] == "n/a" and float(rows[16]) > 0
    assert "learned absolute positions cover 16 bytes only" in out
    code, _, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "32", "64"])
    assert code == 2 and "at most 16" in err and len(err.strip().splitlines()) == 1, err   # nothing scorable


def test_generate_is_reproducible(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    sample = lambda seed: run_main(evaluate.main, [str(ckpt), "--generate", "The ", "--max-new-tokens", "30",
                                    "--top-k", "20", "--seed", str(seed)])[1].split("\n", 1)[1]
    assert sample(1) == sample(1) != sample(2)
    assert sample(1).startswith("The ")


def test_errors_are_clear(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    code, _, err = run_main(evaluate.main, [str(tmp_path / "missing.pt")])
    assert code == 2 and "checkpoint not found" in err
    (tmp_path / "run" / "ckpt.pt").mkdir(parents=True)
    for given in (tmp_path / "run", tmp_path / "run" / "ckpt.pt"):
        code, _, err = run_main(evaluate.main, [str(given)])
        assert code == 2 and "run/ckpt.pt is a directory, not a checkpoint file" in err, err
    (tmp_path / "corrupt.pt").write_bytes(b"\x00not a checkpoint" * 10)
    code, _, err = run_main(evaluate.main, [str(tmp_path / "corrupt.pt")])
    assert code == 2 and "cannot read checkpoint" in err
    torch.save({"weights": torch.zeros(2)}, tmp_path / "foreign.pt")
    code, _, err = run_main(evaluate.main, [str(tmp_path / "foreign.pt")])
    assert code == 2 and "not a linattn LM checkpoint" in err
    (tmp_path / "pickle.pt").write_bytes(pickle.dumps({"format": "x"}, protocol=4))
    with warnings.catch_warnings(record=True) as caught:   # torch warns about the protocol first
        warnings.simplefilter("always")
        code, _, err = run_main(evaluate.main, [str(tmp_path / "pickle.pt")])
    assert code == 2 and "not a weights-only torch checkpoint" in err and not caught, [str(w.message) for w in caught]
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, _, err = run_main(evaluate.main, [str(ckpt), "--data-dir", str(tmp_path / "nodata")])
    assert code == 2 and "data not found" in err and "prepare.py" in err
    code, _, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "10", "--seq-len", "16"])
    assert code == 2 and "only 10 bytes" in err


@pytest.mark.parametrize("damage, message", [
    (lambda config: config.update(extra=5),
     "its saved configuration is not valid (unknown config section(s) ['extra']"),
    (lambda config: config["optim"].update(colour="red"),
     "its saved configuration is not valid (unknown optim setting(s) ['colour']"),
    (lambda config: config["run"].update(dtype="fp8"), "dtype must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    (lambda config: config["optim"].update(lr=float("nan")), "lr must be a finite number"),
    (lambda config: config.pop("optim"), "the config lacks section(s) ['optim']"),
    (lambda config: config["optim"].update(batch_size=0), "batch_size must be positive"),
])
def test_a_saved_config_is_read_as_resume_reads_it(damage, message: str, data_dir: Path, tmp_path: Path, run_main,
                                                   make_model) -> None:
    """Unknown sections and settings are refused, with --resume's one-line message."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    checkpoint = torch.load(ckpt, weights_only=True)
    damage(checkpoint["config"])
    save_checkpoint(ckpt, {k: v for k, v in checkpoint.items() if k not in ("format", "version")})
    code, _, err = run_main(evaluate.main, [str(ckpt), "--generate", "The ", "--max-new-tokens", "1"])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "nan"], "must be a finite number"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--device", "tpu"], "not a device name"),
    (["--device", "cuda:abc"], "not a device name"),
    (["--device", ""], "not a device name"),
    (["--seed", "18446744073709551616"], "--seed must be in [0, 2**63), got 18446744073709551616"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--threads", "-3"], "--threads must be in [0, 4096], got -3"),
    (["--max-new-tokens", "100000000000"], "--max-new-tokens must be in [0, 16,777,216], got 100000000000"),
    (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--generate", "\udcff\udcfe"], "--generate: the prompt is not UTF-8 text"),   # bytes 0xff 0xfe from a shell
])
def test_bad_flags_are_clear(argv: list[str], message: str, data_dir: Path, tmp_path: Path, run_main,
                             make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, _, err = run_main(evaluate.main, [str(ckpt), "--generate", "The ", *argv])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_empty_data_dir_is_refused_not_taken_as_the_default(data_dir: Path, tmp_path: Path, run_main,
                                                                make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, _, err = run_main(evaluate.main, [str(ckpt), "--data-dir", ""])
    assert code == 2 and "--data-dir must name a directory, got ''" in err and len(err.strip().splitlines()) == 1, err


def test_nan_weights_are_refused(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    model = make_model()
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, data_dir)
    for argv in ([str(ckpt)], [str(ckpt), "--generate", "The "]):
        code, out, err = run_main(evaluate.main, argv)
        assert code == 2 and "holds NaN or inf" in err and "bpc" not in out


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0.5", "--top-k=5"], "--temperature, --top-k apply only with --generate PROMPT"),
    (["--generate", "The ", "--split", "test"], "--split apply to scoring bits per byte, not to --generate"),
])
def test_flags_of_the_other_mode_are_refused_not_ignored(argv: list[str], message: str, data_dir: Path,
                                                          tmp_path: Path, run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, _, err = run_main(evaluate.main, [str(ckpt), *argv])
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_tiny_temperature_samples_as_greedy(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    outputs = [run_main(evaluate.main, [str(ckpt), "--generate", "The ", "--max-new-tokens", "12",
                                        "--temperature", temperature]) for temperature in ("0", "1e-300")]
    assert [code for code, _, _ in outputs] == [0, 0], outputs[1][2]
    assert outputs[0][1] == outputs[1][1]


def test_a_recorded_data_dir_that_is_not_a_path_is_refused(data_dir: Path, tmp_path: Path, run_main, make_model,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["config"]["run"]["data_dir"] = 5   # hand-edited
    save_checkpoint(ckpt, {k: v for k, v in checkpoint.items() if k not in ("format", "version")})
    monkeypatch.setattr(evaluate, "default_data_dir", lambda: data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "2000"])
    assert code == 2 and "data_dir must be str, got 5" in err, err   # as --resume refuses it


def test_integer_weights_are_refused_not_truncated(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint["model"]["head.weight"] = (checkpoint["model"]["head.weight"] * 100).long()
    save_checkpoint(ckpt, {k: v for k, v in checkpoint.items() if k not in ("format", "version")})
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300"])
    assert code == 2 and "bpc" not in out, err
    assert err == f"error: {ckpt} is damaged: weight 'head.weight' is torch.int64, the model's is torch.float32; " \
                  "use another checkpoint\n"


def test_a_non_finite_score_is_an_error(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    model = make_model()
    with torch.no_grad():
        model.ln_final.weight.fill_(1e30)   # finite weights whose logits overflow
        model.head.weight.fill_(1e30)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "16", "32"])
    assert code == 1 and table(out) == {16: "nan", 32: "nan"}, err
    assert err == (f"error: the model scores non-finite bits per byte (seq_len 16: nan, seq_len 32: nan): its outputs "
                   f"overflow on this data, so {ckpt} may be damaged; evaluate an earlier checkpoint\n")


def test_repeated_seq_len_flags_add_up(data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "8", "16",
                                              "--seq-len", "32"])
    assert code == 0 and list(table(out)) == [8, 16, 32], err
    code, _, err = run_main(evaluate.main, [str(ckpt), "--seq-len", "16", "--seq-len", "8", "16"])
    assert code == 2 and "--seq-len lists 16 more than once; list each length once" in err, err


def test_every_length_is_checked_against_the_data_before_any_is_scored(data_dir: Path, tmp_path: Path, run_main,
                                                                      make_model) -> None:
    """No row for 8, then an error for 512: the whole table or one line that says how to fix it."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "8", "512"])
    assert code == 2 and table(out) == {} and "bpc" not in out, out
    assert err == ("error: --seq-len 512: seq_len 512 needs windows of 513 bytes (inputs plus the shifted target), "
                   "but the split has only 300 bytes; pass a smaller --seq-len or a larger --max-bytes\n"), err
    # Lengths past learned positions score nothing (n/a), so they need no data.
    ckpt = write_checkpoint(tmp_path / "abs.pt", make_model(abs_pos=True, seq_len=16), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--max-bytes", "300", "--seq-len", "16", "512"])
    assert code == 0 and list(table(out)) == [16, 512] and table(out)[512] == "n/a", err



def layer0_weight_sums(model: ByteLM, data: np.ndarray, seq_len: int) -> torch.Tensor:
    """By hand: layer 0's attention input is the LayerNormed byte embedding of each window's inputs
    (bytes [kL, kL + L), the split's last byte being a target only)."""
    sums = []
    for start in range(0, len(data) - 1, seq_len):
        window = torch.from_numpy(data[start:min(start + seq_len, len(data) - 1)].astype(np.int64))[None]
        block = model.blocks[0]
        with torch.no_grad():
            sums.append(block.attn.weight_sums(block.ln_attn(model.token_embedding(window))).flatten())
    return torch.cat(sums)


@pytest.mark.parametrize("rope", ["post", "pre", "none"])
def test_weight_sums_table(rope: str, data_dir: Path, tmp_path: Path, run_main, make_model) -> None:
    """One row per linear layer; 1 everywhere for pre and none; for post, layer 0's mean matches a hand
    computation over the same windows (the last one shorter), and the first position's sum is 1."""
    model = make_model(rope=rope)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--weight-sums", "--max-bytes", "300", "--seq-len", "16"])
    assert code == 0, err
    header, *rows = out.split("sum of attention weights per query at seq_len 16")[1].strip().splitlines()[1:]
    assert header.split() == ["layer", "mean", "std", "p1", "p99", "off>10%", "0", "1-15"] and len(rows) == 2
    cells = [row.split() for row in rows]
    if rope == "post":
        expected = layer0_weight_sums(model, load_split(data_dir, "val").data[:300], 16).mean().item()
        assert float(cells[0][1]) == pytest.approx(expected, abs=1e-4) and abs(expected - 1) > 1e-3
        assert all(float(row[6]) == pytest.approx(1.0, abs=1e-4) for row in cells)
    else:
        assert all(row[1:6] == ["1.0000", "0.0000", "1.0000", "1.0000", "0.0%"] for row in cells), out


def test_weight_sums_refuses_softmax_attention_and_sampling(data_dir: Path, tmp_path: Path, run_main,
                                                            make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "softmax.pt", make_model(attention="softmax", rope="post"), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--weight-sums"])
    assert code == 2 and "has no linear-attention layer" in err and len(err.strip().splitlines()) == 1, err
    assert "data:" not in out   # refused before any data is read
    ckpt = write_checkpoint(tmp_path / "linear.pt", make_model(), data_dir)
    code, _, err = run_main(evaluate.main, [str(ckpt), "--weight-sums", "--generate", "The "])
    assert code == 2 and "pass one of them" in err and len(err.strip().splitlines()) == 1, err


def test_weight_sums_mark_lengths_past_learned_positions_and_name_rmsnorm(data_dir: Path, tmp_path: Path, run_main,
                                                                          make_model) -> None:
    """As the bpc table does: a length past learned positions is n/a, not an error after the first
    table; an rmsnorm run is told that its norm, not these weights' sum, scales its outputs."""
    ckpt = write_checkpoint(tmp_path / "abs.pt", make_model(rope="none", abs_pos=True), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--weight-sums", "--max-bytes", "300", "--seq-len", "8", "32"])
    assert code == 0, err
    assert "at seq_len 8" in out and "seq_len 32: n/a, learned absolute positions cover 16 bytes only" in out
    ckpt = write_checkpoint(tmp_path / "rms.pt", make_model(rope="pre", normalization="rmsnorm"), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--weight-sums", "--max-bytes", "300"])
    assert code == 0 and "this run has normalization=rmsnorm" in out, err


def test_a_run_trained_with_a_gpu_backend_is_evaluated_here_with_backend_override(data_dir: Path, tmp_path: Path,
                                                                                   run_main, make_model) -> None:
    """--backend replaces the run's kernels (speed only): a run trained with fla on a GPU is scored on
    a CPU with --backend auto; without it, or with a backend the attention has not, one line says why."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(seq_len=16, backend="fla"), data_dir)
    argv = [str(ckpt), "--max-bytes", "200", "--device", "cpu"]
    code, out, err = run_main(evaluate.main, argv)
    assert code == 2 and "backend='fla'" in err and len(err.strip().splitlines()) == 1, err
    assert out == ""   # refused before the checkpoint or data lines: nothing is read that the refusal wastes
    code, _, err = run_main(evaluate.main, argv + ["--backend", "sdpa"])
    assert code == 2 and "linear attention's backend must be one of" in err and len(err.strip().splitlines()) == 1, err
    code, out, _ = run_main(evaluate.main, argv + ["--backend", "auto"])
    assert code == 0 and float(table(out)[16]) > 0


@pytest.mark.parametrize("error, code, message", [
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 83072000000 bytes"), 1,
     "error: out of memory: choose a smaller --batch-size or --seq-len\n"),
    (KeyboardInterrupt(), 130, "\ninterrupted\n"),
])
def test_running_out_of_memory_or_ctrl_c_while_scoring_is_one_line(error: BaseException, code: int, message: str,
                                                                   data_dir: Path, tmp_path: Path, run_main,
                                                                   make_model, monkeypatch) -> None:
    """Both gave tracebacks: torch reports a failed CPU allocation as a plain RuntimeError."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(evaluate, "bpc_table", fail)
    assert run_main(evaluate.main, [str(ckpt), "--max-bytes", "300"])[::2] == (code, message)


def test_recorded_imports_that_are_not_a_list_are_a_damaged_checkpoint(data_dir: Path, tmp_path: Path, run_main,
                                                                       make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", make_model(), data_dir)
    checkpoint = load_checkpoint(ckpt)
    checkpoint["config"]["model"]["feature_map"] = "not-registered"
    checkpoint["config"]["run"]["imports"] = 5
    save_checkpoint(ckpt, {k: v for k, v in checkpoint.items() if k not in ("format", "version")})
    code, _, err = run_main(evaluate.main, [str(ckpt)])
    assert code == 2 and "its recorded imports are int, not a list; pass --import MODULE_OR_FILE" in err, err


def test_generating_past_learned_positions_says_which_flag_to_shrink(data_dir: Path, tmp_path: Path, run_main,
                                                                     make_model) -> None:
    ckpt = write_checkpoint(tmp_path / "abs.pt", make_model(rope="none", abs_pos=True, seq_len=16), data_dir)
    code, out, err = run_main(evaluate.main, [str(ckpt), "--generate", "The ", "--max-new-tokens", "13"])
    assert code == 0, err   # feeds positions 0..15: the prompt's 4 and 12 drawn bytes, the 13th never fed back
    code, _, err = run_main(evaluate.main, [str(ckpt), "--generate", "The ", "--max-new-tokens", "14"])
    assert code == 2 and err == ("error: --generate: the prompt (4 bytes) and --max-new-tokens 14 need 17 positions, "
                                 "and this model's learned absolute positions cover 16 bytes only; give a shorter "
                                 "prompt or a smaller --max-new-tokens\n"), err
