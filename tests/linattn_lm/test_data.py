"""linattn_lm.data: the prepared splits (meta.json checked once, in load_meta), the window loaders and
the default data directory. `data_dir` (tests/conftest.py) is a 400,000-byte slice of the bundled sample:
train 360,000, val 20,000 and test 20,000 bytes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import linattn_lm.data
from linattn_lm.data import (ByteSplit, DataError, DataNotFoundError, RandomWindows, SequentialWindows, default_data_dir,
                             load_meta, load_split)

REPO_ROOT = Path(__file__).resolve().parents[2]


def copy_of(data_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    return copy


def test_load_split(data_dir: Path) -> None:
    split = load_split(data_dir, "val")
    assert isinstance(split, ByteSplit) and isinstance(split.data, np.memmap)
    assert split.data.dtype == np.uint8 and split.vocab_size == 256
    whole = (data_dir / "enwik8-slice").read_bytes()
    assert split.data.tobytes() == whole[360_000:380_000] and len(whole) == 400_000
    assert split.description == "enwik8-slice (NON-CANONICAL, 400,000 bytes)" and split.canonical is False


def test_random_windows_shapes_shift_and_seed(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    batches = RandomWindows(train, batch_size=4, seq_len=64, seed=7)
    x, y = next(batches)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = np.asarray(train.data)
    for row, start in zip(x.numpy(), batches.window_starts(0)):
        assert row.tobytes() == data[start : start + 64].astype(np.int64).tobytes()
    again = RandomWindows(train, batch_size=4, seq_len=64, seed=7)
    other = RandomWindows(train, batch_size=4, seq_len=64, seed=8)
    assert torch.equal(next(again)[0], x)
    assert not torch.equal(next(other)[0], x)


def test_random_windows_resume_exactly(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    original = RandomWindows(train, batch_size=3, seq_len=32, seed=11)
    for _ in range(5):
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(4)]

    resumed = RandomWindows(train, batch_size=3, seq_len=32, seed=0)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (next(resumed) for _ in range(4))):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    with pytest.raises(ValueError, match="saved seq_len is 32, this stream's is 16"):
        RandomWindows(train, batch_size=3, seq_len=16).load_state_dict(state)


def test_random_windows_ranks_split_the_global_batch(data_dir: Path) -> None:
    train = load_split(data_dir, "train")
    single = RandomWindows(train, batch_size=4, seq_len=16, seed=3)
    ranks = [RandomWindows(train, batch_size=2, seq_len=16, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        x, _ = next(single)
        parts = [next(r)[0] for r in ranks]
        assert not torch.equal(parts[0], parts[1])
        assert torch.equal(torch.cat(parts), x)


def test_sequential_windows_cover_every_target_once(data_dir: Path) -> None:
    val = load_split(data_dir, "val")
    data = np.asarray(val.data).astype(np.int64)
    windows = SequentialWindows(val, batch_size=3, seq_len=64)
    batches = list(windows)
    assert len(batches) == len(windows)
    assert windows.remainder == (len(val) - 1) % 64 != 0  # the test exercises the shorter last window
    assert batches[-1][0].shape == (1, windows.remainder)
    inputs = torch.cat([x.reshape(-1) for x, _ in batches]).numpy()
    targets = torch.cat([y.reshape(-1) for _, y in batches]).numpy()
    assert windows.num_targets == len(targets) == len(val) - 1
    assert np.array_equal(inputs, data[:-1]) and np.array_equal(targets, data[1:])


def test_seq_len_longer_than_split(data_dir: Path) -> None:
    val = load_split(data_dir, "val")
    message = f"seq_len 30,000 needs windows of 30,001 bytes .* only {len(val):,} bytes; pass a smaller --seq-len"
    with pytest.raises(DataError, match=message):
        RandomWindows(val, batch_size=1, seq_len=30_000)
    with pytest.raises(DataError, match=message):
        SequentialWindows(val, batch_size=1, seq_len=30_000)


def test_missing_data_names_the_prepare_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # outside the repository: the command names the script by its full path
    with pytest.raises(DataNotFoundError, match=r"prepare\.py --out-dir nowhere"):
        load_split("nowhere", "train")
    monkeypatch.chdir(REPO_ROOT)
    message = str(pytest.raises(DataNotFoundError, load_split, tmp_path, "val").value)
    assert f"run python data/enwik8/prepare.py --out-dir {tmp_path} " in message


def test_size_mismatch_with_meta_is_detected(data_dir: Path, tmp_path: Path) -> None:
    copy = copy_of(data_dir, tmp_path)
    with open(copy / "test.bin", "ab") as f:
        f.write(b"extra")
    with pytest.raises(DataError, match=r"20,005 bytes but .*meta\.json says 20,000"):
        load_split(copy, "test")
    (copy / "meta.json").unlink()
    with pytest.raises(DataNotFoundError, match="incompletely prepared"):
        load_split(copy, "train")


def test_a_split_overwritten_at_its_size_is_detected_by_its_hash(data_dir: Path, tmp_path: Path) -> None:
    """Zeros at the right size trained without a word: only --verify re-hashed the splits."""
    copy = copy_of(data_dir, tmp_path)
    (copy / "train.bin").write_bytes(bytes((copy / "train.bin").stat().st_size))
    with pytest.raises(DataError, match=r"train\.bin does not hash to the sha256"):
        load_split(copy, "train")
    assert len(load_split(copy, "val")) == (copy / "val.bin").stat().st_size


def edited(meta: dict, path: tuple[str, ...], value: object) -> dict:
    """`meta` with the entry at `path` replaced by `value` (or removed, for the REMOVE marker)."""
    meta = json.loads(json.dumps(meta))
    *parents, last = path
    entry = meta
    for key in parents:
        entry = entry[key]
    entry.pop(last) if value is REMOVE else entry.__setitem__(last, value)
    return meta


REMOVE = object()


@pytest.mark.parametrize("path, value, problem", [
    (("splits",), {}, "splits lacks 'train'"),
    (("splits", "val", "size"), "20000", "splits['val']['size'] is '20000', not an integer"),
    (("splits", "val", "size"), 20000.0, "splits['val']['size'] is 20000.0, not an integer"),
    (("splits", "val", "size"), True, "splits['val']['size'] is True, not an integer"),
    (("splits", "test"), REMOVE, "splits lacks 'test'"),
    (("splits", "train", "sha256"), REMOVE, "splits['train'] lacks 'sha256'"),
    (("splits", "val", "start"), 0, "does not continue the previous split at 360000"),
    (("splits", "val", "size"), 19_999, "does not continue the previous split"),
    (("source", "size"), 1, "the splits end at 400000, but the source has 1 bytes"),
    (("source",), "enwik8", "meta.json['source'] is 'enwik8', not dict"),
    (("canonical",), "no", "meta.json['canonical'] is 'no', not bool"),
    (("description",), REMOVE, "meta.json lacks 'description'"),
    (("vocab_size",), 255, "vocab_size is 255"),
    (("format_version",), 2, "format_version is 2"),
    (("dtype",), "uint16", "dtype is 'uint16'"),
    (("dtype",), REMOVE, "meta.json lacks 'dtype'"),
    (("split_boundaries",), [0, 5, 10, 15], "split_boundaries is [0, 5, 10, 15]"),
    (("canonical",), True, "canonical is True, but the source's sha256"),
])
def test_a_hand_edited_meta_json_is_one_clear_error(path: tuple[str, ...], value: object, problem: str,
                                                     data_dir: Path, tmp_path: Path) -> None:
    copy = copy_of(data_dir, tmp_path)
    meta = json.loads((copy / "meta.json").read_text())
    (copy / "meta.json").write_text(json.dumps(edited(meta, path, value)))
    for split in ("train", "val", "test"):
        with pytest.raises(DataError, match="meta.json is malformed: ") as error:
            load_split(copy, split)
        assert problem in str(error.value) and "prepare.py" in str(error.value)


@pytest.mark.parametrize("text, problem", [("{ not json", "is not valid JSON"), ("[1, 2]", "meta.json is list"),
                                           ("\xff\xfe", "cannot read"),
                                           ("[" * 200000 + "]" * 200000, "is not valid JSON")])   # a RecursionError
def test_unreadable_meta_json(text: str, problem: str, data_dir: Path, tmp_path: Path) -> None:
    copy = copy_of(data_dir, tmp_path)
    (copy / "meta.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(DataError, match=problem):
        load_meta(copy)


def test_default_data_dir_is_the_repositorys_from_any_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_data_dir() == REPO_ROOT / "data" / "enwik8"
    monkeypatch.setattr(linattn_lm.data, "__file__", str(tmp_path / "site-packages" / "linattn_lm" / "data.py"))
    with pytest.raises(DataNotFoundError, match="a non-editable install.*pass --data-dir DIR"):
        default_data_dir()
