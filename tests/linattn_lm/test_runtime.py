"""Runtime helpers shared by training, evaluation, data preparation and benchmarks."""
import os

from linattn_lm.runtime import write_atomically


def test_write_atomically_gives_the_permissions_open_would_and_leaves_no_temporary(tmp_path):
    previous = os.umask(0o022)
    try:
        write_atomically(tmp_path / "split.bin", lambda tmp: tmp.write_bytes(b"abc"))
    finally:
        os.umask(previous)
    assert (tmp_path / "split.bin").read_bytes() == b"abc"
    assert (tmp_path / "split.bin").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split.bin"]
