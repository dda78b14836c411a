"""train.py --task mqar: the sequences Zoology's MQAR defines, seeded streams, the query-position
scorer, a run with its TensorBoard accuracy and exact resume, and a grid's recall table."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from linattn_lm import config_from_flags, evaluate, grid, load_checkpoint, training
from linattn_lm.checkpoint import save_checkpoint
from linattn_lm.settings import check_mqar_settings
from linattn_lm.mqar import IGNORED, MqarBatches, draw_batch, position_only_accuracy, query_scores

VOCAB, SEQ_LEN, PAIRS = 256, 64, 6


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def test_sequences_are_pairs_then_one_query_per_key() -> None:
    x, y = draw_batch(np.random.default_rng(0), 50, VOCAB, SEQ_LEN, PAIRS)
    assert x.shape == y.shape == (50, SEQ_LEN) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0:2 * PAIRS:2], row_x[1:2 * PAIRS:2]
        assert len(set(keys)) == PAIRS and all(1 <= key < VOCAB // 2 for key in keys)
        assert len(set(values)) == PAIRS and all(VOCAB // 2 <= value < VOCAB for value in values)
        queries = [position for position, target in enumerate(row_y) if target != IGNORED]
        assert len(queries) == PAIRS and all(p >= 2 * PAIRS and (p - 2 * PAIRS) % 2 == 0 for p in queries)
        answers = dict(zip(keys, values))
        assert sorted(row_x[p] for p in queries) == sorted(keys)          # each key queried once
        assert all(row_y[p] == answers[row_x[p]] for p in queries)        # and answered by its value
        assert all(0 <= token < VOCAB for token in row_x)


def test_the_zeros_filler_changes_only_the_positions_between_pairs_and_queries() -> None:
    """Zoology's published configurations: token 0 (never a key) where the default draws random tokens,
    with the same pairs and queries."""
    random_x, random_y = draw_batch(np.random.default_rng(0), 50, VOCAB, SEQ_LEN, PAIRS)
    zeros_x, zeros_y = draw_batch(np.random.default_rng(0), 50, VOCAB, SEQ_LEN, PAIRS, "zeros")
    assert torch.equal(random_y, zeros_y)
    kept = zeros_y != IGNORED
    kept[:, :2 * PAIRS] = True
    assert torch.equal(zeros_x[kept], random_x[kept]) and (zeros_x[~kept] == 0).all()
    assert (random_x[~kept] != 0).any()
    zeros, random = (MqarBatches(VOCAB, SEQ_LEN, PAIRS, 4, seed=3, stream="val", filler=filler).batch_at(1)
                     for filler in ("zeros", "random"))
    assert torch.equal(zeros[1], random[1]) and (zeros[0] == 0).any() and not (random[0] == 0).any()


def test_queries_come_mostly_soon_after_the_pairs() -> None:
    """Zoology's power law (a = 0.01): the first query slot is drawn far more often than the last."""
    _, y = draw_batch(np.random.default_rng(1), 2000, VOCAB, SEQ_LEN, PAIRS)
    slots = ((y != IGNORED).nonzero()[:, 1] - 2 * PAIRS) // 2
    counts = torch.bincount(slots, minlength=(SEQ_LEN - 2 * PAIRS) // 2)
    assert counts[0] > 2 * counts[-1]


def test_streams_are_seeded_and_split_across_ranks() -> None:
    make = lambda **kw: MqarBatches(VOCAB, SEQ_LEN, PAIRS, 4, **{"seed": 3, "stream": "train", "filler": "random",
                                                                  **kw})
    a, b = make(), make()
    assert all(torch.equal(u, v) for u, v in zip(next(a), next(b)))
    assert not torch.equal(make().batch_at(0)[0], make(stream="val").batch_at(0)[0])
    assert not torch.equal(make().batch_at(0)[0], make(seed=4).batch_at(0)[0])
    whole = MqarBatches(VOCAB, SEQ_LEN, PAIRS, 8, seed=3, stream="train", filler="random").batch_at(5)[0]
    ranks = [make(rank=r, world_size=2).batch_at(5)[0] for r in (0, 1)]
    assert torch.equal(torch.cat(ranks), whole)
    resumed = make()
    resumed.load_state_dict(a.state_dict())
    assert torch.equal(next(resumed)[0], next(a)[0])
    with pytest.raises(ValueError, match="stream"):
        make(stream="val").load_state_dict(a.state_dict())


@pytest.mark.parametrize("vocab, seq_len, pairs, message", [
    (256, 64, 17, "seq_len"), (256, 1024, 128, "vocab_size >= 258"), (256, 64, 0, "at least 1"),
    (2, 64, 4, r"needs vocab_size >= 10 \(")])   # a vocabulary too small for any pair: the real bound
def test_settings_that_do_not_fit_are_refused(vocab: int, seq_len: int, pairs: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_mqar_settings(vocab, seq_len, pairs)
    with pytest.raises(ValueError, match=message):
        config_from_flags({"preset": "mqar", "vocab_size": vocab, "seq_len": seq_len, "mqar_kv_pairs": pairs})


def test_the_task_takes_any_vocabulary_its_pairs_fit_and_enwik8_one_id_per_byte() -> None:
    assert config_from_flags({"preset": "mqar", "vocab_size": 64}).model.vocab_size == 64
    with pytest.raises(ValueError, match="per byte"):
        config_from_flags({"preset": "cpu", "vocab_size": 64})


def test_a_filler_is_one_of_two_and_given_for_mqar_only() -> None:
    assert config_from_flags({"preset": "mqar"}).task.mqar_filler == "random"
    with pytest.raises(ValueError, match="mqar_filler"):
        config_from_flags({"preset": "mqar", "mqar_filler": "noise"})
    with pytest.raises(ValueError, match="--mqar-filler"):
        config_from_flags({"preset": "cpu", "mqar_filler": "zeros"})


class Oracle(nn.Module):
    """Logits that name each key's value from the pairs at the start of the row (uniform elsewhere)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, VOCAB)
        for row, tokens in enumerate(x.tolist()):
            answers = dict(zip(tokens[0:2 * PAIRS:2], tokens[1:2 * PAIRS:2]))
            for position, token in enumerate(tokens[2 * PAIRS:], 2 * PAIRS):
                if token in answers:
                    logits[row, position, answers[token]] = 100.0
        return logits


class Uniform(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*x.shape, VOCAB)


def test_the_scorer_counts_the_query_positions_only() -> None:
    batches = [draw_batch(np.random.default_rng(i), 4, VOCAB, SEQ_LEN, PAIRS) for i in range(3)]
    nats, correct, count = query_scores(Oracle(), batches, torch.device("cpu"))
    assert count == 3 * 4 * PAIRS and correct == count and nats < 1e-6
    nats, correct, count = query_scores(Uniform(), batches, torch.device("cpu"))
    assert nats / count == pytest.approx(math.log(VOCAB)) and correct == 0   # argmax 0 is never a value


class ByPosition(nn.Module):
    """Answers every query with the value of a fixed pair per position (`pairs[p]`), never reading the key."""

    def __init__(self, pairs: dict[int, int]):
        super().__init__()
        self.pairs = pairs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, VOCAB)
        for position, pair in self.pairs.items():
            logits[torch.arange(len(x)), position, x[:, 2 * pair + 1]] = 100.0
        return logits


def test_position_only_accuracy_is_what_answering_by_position_scores() -> None:
    """The pair each query position most often asks for, counted on one draw, scores on other sequences
    what position_only_accuracy says, above the 1/P of a random value."""
    seq_len, pairs = 32, 4
    x, y = draw_batch(np.random.default_rng(5), 4000, VOCAB, seq_len, pairs)
    asked = {}
    for row, position in (y != IGNORED).nonzero().tolist():
        pair = x[row, 0:2 * pairs:2].tolist().index(x[row, position].item())
        asked.setdefault(position, [0] * pairs)[pair] += 1
    model = ByPosition({position: counts.index(max(counts)) for position, counts in asked.items()})
    batches = [draw_batch(np.random.default_rng(100 + i), 500, VOCAB, seq_len, pairs) for i in range(4)]
    _, correct, count = query_scores(model, batches, torch.device("cpu"))
    expected = position_only_accuracy(VOCAB, seq_len, pairs)
    assert expected > 1 / pairs + 0.03 and correct / count == pytest.approx(expected, abs=0.02)
    assert position_only_accuracy(VOCAB, seq_len, 1) == 1.0


def test_a_run_logs_accuracy_and_resumes_exactly(tmp_path: Path, run_main, scalars) -> None:
    common = ["--preset", "mqar-tiny", "--threads", "1", "--out-dir", str(tmp_path), "--eval-interval", "6",
              "--ckpt-interval", "0", "--decay-steps", "12"]
    code, out, err = run_main(training.main, [*common, "--steps", "12", "--run-name", "whole"])
    assert code == 0, err
    assert "MQAR (synthetic): 4 key-value pairs" in out and "at the queries, last estimate (state 16 x 16)" in out
    assert [step for step, _ in scalars(tmp_path / "whole", "val/accuracy")] == [6, 12]
    assert run_main(training.main, [*common, "--steps", "7", "--run-name", "split"])[0] == 0
    assert run_main(training.main, [*common, "--steps", "12", "--run-name", "split", "--resume"])[0] == 0
    a, b = (load_checkpoint(tmp_path / name) for name in ("whole", "split"))
    by_step = lambda checkpoint: dict(zip(checkpoint["stats"]["val_steps"], checkpoint["stats"]["val_accuracy"]))
    assert a["loader"] == b["loader"] and by_step(a).items() <= by_step(b).items()   # b also scored step 7
    for key, value in a["model"].items():   # tensors, and the feature maps' extra state
        assert torch.equal(value, b["model"][key]) if isinstance(value, torch.Tensor) else value == b["model"][key]
    assert scalars(tmp_path / "whole", "val/accuracy")[-1] == scalars(tmp_path / "split", "val/accuracy")[-1]
    code, out, _ = run_main(evaluate.main, [str(tmp_path / "whole"), "--threads", "1"])
    assert code == 0 and "test: accuracy" in out and "decoding state 16 x 16" in out
    for mode in (["--ar-split"], ["--generate", "hi"]):   # its tokens are MQAR ids, not bytes to print
        code, _, err = run_main(evaluate.main, [str(tmp_path / "whole"), "--threads", "1", *mode])
        assert code == 2 and "mqar run" in err and mode[0] in err, err


def test_a_zeros_run_names_its_filler_and_an_edited_filler_is_refused(tmp_path: Path, run_main) -> None:
    argv = ["--preset", "mqar-tiny", "--threads", "1", "--out-dir", str(tmp_path), "--run-name", "z", "--steps", "2",
            "--eval-interval", "2", "--mqar-filler", "zeros"]
    code, out, err = run_main(training.main, argv)
    assert code == 0 and "32 tokens, zeros between" in out, err
    code, out, err = run_main(evaluate.main, [str(tmp_path / "z"), "--threads", "1"])
    assert code == 0 and "zeros between" in out, err
    checkpoint = load_checkpoint(tmp_path / "z")
    checkpoint["config"]["task"]["mqar_filler"] = "noise"
    save_checkpoint(tmp_path / "z" / "ckpt.pt", {k: v for k, v in checkpoint.items() if k not in ("format", "version")})
    for main, args in ((evaluate.main, [str(tmp_path / "z"), "--threads", "1"]),
                       (training.main, [*argv, "--resume", "--steps", "4"])):
        code, _, err = run_main(main, args)
        assert code != 0 and "mqar_filler" in err and len(err.strip().splitlines()) == 1, err


def test_a_grid_of_the_task_reports_recall_beside_the_state(tmp_path: Path, run_main) -> None:
    argv = ["--preset", "mqar-tiny", "--threads", "1", "--out-dir", str(tmp_path), "--run-name", "g", "--steps", "4",
            "--eval-interval", "4", "--variants", "softmax-rope,linear-favor-pre+softmax_layers=1"]
    code, out, err = run_main(grid.main, argv)
    assert code == 0, err
    record = json.loads((tmp_path / "g" / "softmax-rope" / "seed-0" / "result.json").read_text())
    assert 0 <= record["mqar"]["test"]["accuracy"] <= 1 and "train_bytes" not in record
    # the held-out scores the report takes are printed, beside the training's last estimate
    assert f"softmax-rope/seed-0: val: accuracy {record['mqar']['val']['accuracy']:.1%} at the queries" in out
    assert "at the queries, last estimate" in out
    assert record["scores"]["val"]["32"] == record["mqar"]["val"]["bits"]
    report = (tmp_path / "g" / "results.md").read_text()
    assert "## Multi-query associative recall" in report and "n-gram" not in report
    assert "scores 1/4 = 25.0%" in report   # mqar-tiny's 4 pairs: copying any of the sequence's values
    assert "position alone" in report and "held-out val stream, bits per query" in report and "bpc" not in report
    hybrid = json.loads((tmp_path / "g" / "linear-favor-pre+softmax_layers=1" / "seed-0" / "result.json").read_text())
    gain = hybrid["mqar"]["val"]["accuracy"] - record["mqar"]["val"]["accuracy"]
    assert "Paired differences in val accuracy" in report
    assert f"| linear-favor-pre+softmax_layers=1 | softmax-rope | attention | {gain:+.3f} (s0) |" in report
    assert "| linear-favor-pre+softmax_layers=1 | 0 |" in report and "| 16 x 16; 32 x 2 x 16 KV cache |" in report
    code, _, err = run_main(grid.main, [*argv, "--resume"])   # finished: kept as it is
    assert code == 0, err
    code, _, err = run_main(grid.main, [*argv, "--resume", "--mqar-filler", "zeros"])   # other data: refused
    assert code == 2 and "--mqar-filler" in err, err
    code, _, err = run_main(grid.main, [*argv[:-2], "--run-name", "h", "--eval-multiples", "1,2",
                                        "--variants", "softmax-rope"])
    assert code == 2 and "--eval-multiples" in err


def test_a_grid_of_the_task_is_named_by_its_preset() -> None:
    assert grid.grid_name({"task": "mqar"}) == "grid-mqar" and grid.grid_name({}) == "grid-cpu"
    assert grid.grid_name({"task": "mqar", "preset": "mqar-tiny"}) == "grid-mqar-tiny"
