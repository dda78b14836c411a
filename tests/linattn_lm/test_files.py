"""Files written whole (linattn_lm/files.py), shared by training, evaluation, data preparation and benchmarks."""
import os

import pytest
import torch

from linattn_lm.files import WriteFailed, write_atomically, write_together
from linattn_lm.errors import EXIT_ERROR
from linattn_lm.training import run_reporting_errors


def test_write_atomically_gives_the_permissions_open_would_and_leaves_no_temporary(tmp_path):
    previous = os.umask(0o022)
    try:
        write_atomically(tmp_path / "split.bin", lambda tmp: tmp.write_bytes(b"abc"))
    finally:
        os.umask(previous)
    assert (tmp_path / "split.bin").read_bytes() == b"abc"
    assert (tmp_path / "split.bin").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split.bin"]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_write_that_fails_keeps_the_old_file_and_says_why_in_one_line(tmp_path, capsys):
    """torch.save reports a full disk as a RuntimeError; training then stops with one line, exit 1."""
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")

    def full_disk(tmp):   # what torch.save raises on a full disk (/dev/full has no space at all)
        tmp.write_bytes(b"par")
        torch.save(torch.zeros(1000), "/dev/full")

    with pytest.raises(WriteFailed, match="the file already there, if any, is kept"):
        write_atomically(target, full_disk)
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]

    def save():
        write_atomically(target, full_disk)
    assert run_reporting_errors(save) == EXIT_ERROR
    message = capsys.readouterr().err
    assert message.startswith("error: cannot write") and message.count("\n") == 1 and "Traceback" not in message


def test_a_bug_while_writing_is_not_taken_for_a_full_disk(tmp_path):
    """Only torch's archive writer's errors mean the write failed; any other error keeps its traceback."""
    def buggy(tmp):
        tmp.write_bytes(b"par")
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        write_atomically(tmp_path / "ckpt.pt", buggy)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_where_one_of_several_files_goes_replaces_none_of_them_and_leaves_no_temporary(tmp_path):
    """The renames ran one by one, so a folder in the way of the second left the first replaced, and
    the rest's temporaries behind, with an IsADirectoryError traceback."""
    (tmp_path / "results.csv").write_text("old")
    (tmp_path / "val_bpc.png").mkdir()
    names = ("results.csv", "results.md", "val_bpc.png")
    writes = {tmp_path / name: (lambda path: path.write_text("new")) for name in names}
    with pytest.raises(WriteFailed, match="val_bpc.png: a folder of that name is in the way"):
        write_together(writes)
    assert (tmp_path / "results.csv").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "val_bpc.png"]
