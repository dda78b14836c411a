"""Runtime helpers shared by training, evaluation, data preparation and benchmarks."""
import os
import subprocess
import sys

import pytest
import torch

from linattn_lm.runtime import WriteFailed, write_atomically, write_together
from linattn_lm.training import EXIT_ERROR, run_reporting_errors


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

    with pytest.raises(WriteFailed, match=r"cannot write .*ckpt.pt \(\[enforce fail at inline_container.* "
                                          r"unexpected pos .*\); the file already there, if any, is kept"):
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
    with pytest.raises(WriteFailed, match=r"cannot write .*val_bpc.png: a folder of that name is in the way"):
        write_together(writes)
    assert (tmp_path / "results.csv").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv", "val_bpc.png"]


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                                                "allocate memory: you tried to allocate 83072000000 bytes"),
                                   MemoryError(), torch.OutOfMemoryError("CUDA out of memory")])
def test_running_out_of_memory_on_any_device_is_one_line(error, capsys):
    """On CPU torch reports a failed allocation as a plain RuntimeError, which gave a traceback."""
    def run():
        raise error
    assert run_reporting_errors(run) == EXIT_ERROR
    assert capsys.readouterr().err == "error: out of memory: choose a smaller --batch-size, --seq-len or model\n"


def test_other_runtime_errors_keep_their_traceback():
    def run():
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_reporting_errors(run)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's VmHWM reset")
def test_each_run_measures_its_own_peak_after_earlier_ones_freed_memory():
    """keep_freed_memory() keeps freed heap resident; a grid's next run first hands it back, so
    its peak is not the earlier runs' (it was 512, 629, 634 MB for three identical runs)."""
    code = ("import torch\n"
            "from linattn_lm.runtime import keep_freed_memory, peak_memory_mb, release_free_memory, "
            "reset_peak_memory\n"
            "cpu = torch.device('cpu')\n"
            "keep_freed_memory()\n"
            "before = peak_memory_mb(cpu)\n"
            "x = torch.ones(2 ** 26)\n"       # 256 MiB
            "del x\n"
            "release_free_memory()\n"
            "reset_peak_memory(cpu)\n"
            "print(peak_memory_mb(cpu) - before)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(result.stdout) < 64, result.stdout
