"""n-gram reference lines: exact bpc on hand-made corpora, back-off for the first bytes, train-only
alpha, and the cache in the data directory."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from linattn_lm import ngram
from linattn_lm.files import WriteFailed


def test_order_0_equals_the_hand_computation():
    train = np.frombuffer(b"aab" * 10, dtype=np.uint8)          # 20 a, 10 b
    data = np.frombuffer(b"xab", dtype=np.uint8)                 # scores 'a' and 'b' (byte 0 is context)
    lines = ngram.ngram_bpc(train, data, max_order=0)
    alpha = lines[0]["alpha"]
    hand = -(math.log2((20 + alpha) / (30 + 256 * alpha)) + math.log2((10 + alpha) / (30 + 256 * alpha))) / 2
    assert lines[0]["bpc"] == pytest.approx(hand, rel=1e-12)


def test_first_bytes_back_off_to_the_context_they_have():
    train = np.frombuffer(b"abcabcabcabc", dtype=np.uint8)
    data = np.frombuffer(b"abca", dtype=np.uint8)
    lines = ngram.ngram_bpc(train, data, max_order=2)
    one, alpha = ngram.order_log2_probs(train, data, 1)
    two, _ = ngram.order_log2_probs(train, data, 2)
    # order 2: byte 1 from its one byte before (order 1), bytes 2 and 3 from two bytes
    assert lines[2]["bpc"] == pytest.approx(-(one[0] + two[0] + two[1]) / 3, rel=1e-12)


def test_a_periodic_sequence_costs_nothing_at_its_period():
    pattern = np.random.default_rng(0).permutation(256)[:7].astype(np.uint8)
    train, data = np.tile(pattern, 400), np.tile(pattern, 30)[3:]
    lines = ngram.ngram_bpc(train, data, max_order=2)
    assert lines[0]["bpc"] == pytest.approx(math.log2(7), abs=0.01)   # 7 equally frequent bytes
    assert lines[1]["bpc"] < 0.01 and lines[2]["bpc"] < 0.01             # one byte fixes the next


def test_alpha_comes_from_train_alone():
    train = np.frombuffer(b"the cat sat on the mat " * 50, dtype=np.uint8)
    alphas = {ngram.ngram_bpc(train, np.frombuffer(text, dtype=np.uint8), 2)[2]["alpha"]
              for text in (b"the cat", b"zzzzzzzz", b"\x00\x01\x02")}
    assert len(alphas) == 1 and alphas <= set(ngram.ALPHAS)


def test_reference_lines_are_cached_and_reused(data_dir, monkeypatch):
    cache = data_dir / ngram.CACHE_NAME
    cache.unlink(missing_ok=True)
    lines = ngram.reference_bpc(data_dir, "val", max_order=2, max_bytes=5000)
    assert list(lines) == [0, 1, 2] and lines[0] > lines[1] > lines[2] > 0
    assert len(json.loads(cache.read_text())) == 1

    def no_recompute(*args, **kwargs):
        raise AssertionError("recomputed a cached line")
    monkeypatch.setattr(ngram, "ngram_bpc", no_recompute)
    assert ngram.reference_bpc(data_dir, "val", max_order=2, max_bytes=5000) == lines


def test_a_damaged_cache_is_recomputed(data_dir):
    cache = data_dir / ngram.CACHE_NAME
    lines = ngram.reference_bpc(data_dir, "val", max_order=1, max_bytes=3000)
    cache.write_text("{not json")
    assert ngram.reference_bpc(data_dir, "val", max_order=1, max_bytes=3000) == lines
    entry = next(iter(json.loads(cache.read_text()).values()))
    cache.write_text(json.dumps({key: {"0": {"bpc": "x"}} for key in json.loads(cache.read_text())}))
    assert ngram.reference_bpc(data_dir, "val", max_order=1, max_bytes=3000) == lines
    assert next(iter(json.loads(cache.read_text()).values())) == entry


def test_a_cache_that_cannot_be_written_still_gives_the_lines(data_dir, monkeypatch):
    """A read-only data directory: the lines are computed, only not kept (as a WriteFailed says)."""
    (data_dir / ngram.CACHE_NAME).unlink(missing_ok=True)
    expected = ngram.reference_bpc(data_dir, "val", max_order=1, max_bytes=2000)
    (data_dir / ngram.CACHE_NAME).unlink()

    def read_only(path, write):
        raise WriteFailed(f"cannot write {path}: Read-only file system")
    monkeypatch.setattr(ngram, "write_atomically", read_only)
    assert ngram.reference_bpc(data_dir, "val", max_order=1, max_bytes=2000) == expected
    assert not (data_dir / ngram.CACHE_NAME).exists()
