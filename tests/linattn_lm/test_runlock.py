"""The run-directory lock: one holder at a time, across processes, released by the kernel when the
holder dies (kill -9 included); train.py and grid.py hold it for the whole run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from linattn_lm import grid, runlock, training
from linattn_lm.errors import UsageError
from linattn_lm.runlock import LOCK_NAME, DirectoryBusy, DirectoryLock

HOLD = "import sys, time; from linattn_lm.runlock import DirectoryLock; lock = DirectoryLock(sys.argv[1]); " \
       "print('locked', flush=True); time.sleep(600)"


def start_holder(directory: Path) -> subprocess.Popen:
    """Another process that takes the lock on `directory` and keeps it (until killed)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_process_is_refused_with_the_holders_pid_and_kill_9_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = start_holder(tmp_path / "run")
    try:
        with pytest.raises(DirectoryBusy, match=rf"in use by another run \(pid {holder.pid}\)"):
            DirectoryLock(tmp_path / "run")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / "run" / LOCK_NAME).exists()   # the file stays, the lock does not
    with DirectoryLock(tmp_path / "run"):
        assert (tmp_path / "run" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    with DirectoryLock(tmp_path / "run"):   # released at the end of the block
        pass


def test_an_unusable_directory_is_a_one_line_usage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="a file stands where a directory"):
        DirectoryLock(tmp_path / "file" / "run")


def test_train_refuses_a_run_directory_in_use_and_keeps_it_untouched(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                                      run_main) -> None:
    holder = start_holder(tmp_path / "busy")
    try:
        argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "busy"]
        for resume in ([], ["--resume"]):
            code, out, err = run_main(training.main, [*argv, *resume])
            assert code == 2 and "in use by another run" in err and err.count("\n") == 1, err
        assert sorted(path.name for path in (tmp_path / "busy").iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()


def test_grid_refuses_a_grid_directory_in_use(data_dir: Path, tiny: list[str], tmp_path: Path, run_main) -> None:
    holder = start_holder(tmp_path / "grid-tiny")
    try:
        argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--variants", "linear-elu-post",
                "--steps", "2"]
        code, _, err = run_main(grid.main, argv)
        assert code == 2 and f"{tmp_path / 'grid-tiny'} is in use by another run (pid {holder.pid})" in err, err
        assert len(err.strip().splitlines()) == 1
        assert sorted(path.name for path in (tmp_path / "grid-tiny").iterdir()) == [LOCK_NAME]
    finally:
        holder.kill()
        holder.wait()


def test_a_run_lets_go_of_its_directory_when_it_stops_on_an_error(data_dir: Path, tiny: list[str], tmp_path: Path,
                                                                   run_main) -> None:
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path), "--run-name", "r"]
    code, _, err = run_main(training.main, [*argv, "--resume"])
    assert code == 2 and "checkpoint not found" in err
    with DirectoryLock(tmp_path / "r"):   # would raise DirectoryBusy if the failed run still held it
        pass


def test_a_run_that_fails_to_start_removes_the_directories_it_created_and_no_other(data_dir: Path, tiny: list[str],
                                                                                   tmp_path: Path, run_main) -> None:
    out = tmp_path / "out"
    argv = [*tiny, "--data-dir", str(data_dir), "--out-dir", str(out), "--resume"]
    for name in ("never", "study/x/seed-0"):
        code, _, err = run_main(training.main, [*argv, "--run-name", name])
        assert code == 2 and "checkpoint not found" in err, err
    assert not out.exists()   # --out-dir too: this run created it, and wrote nothing
    (out / "study" / "other").mkdir(parents=True)   # another run's
    (out / "there-before").mkdir()
    for name in ("study/x/seed-0", "there-before"):
        code, _, err = run_main(training.main, [*argv, "--run-name", name])
        assert code == 2 and "checkpoint not found" in err, err
    assert sorted(path.relative_to(out).as_posix() for path in out.rglob("*")) == [
        "study", "study/other", "there-before", f"there-before/{LOCK_NAME}"]


def test_a_lock_whose_block_fails_removes_its_new_directory_unless_something_was_written(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), DirectoryLock(tmp_path / "grid" / "sub"):
        raise RuntimeError("failed before writing")
    assert not (tmp_path / "grid").exists()
    with pytest.raises(RuntimeError), DirectoryLock(tmp_path / "grid" / "sub"):
        (tmp_path / "grid" / "sub" / "results.md").write_text("")
        raise RuntimeError("failed after writing")
    assert (tmp_path / "grid" / "sub" / "results.md").exists()


@pytest.mark.skipif(runlock.fcntl is None, reason="runs are not locked without fcntl")
@pytest.mark.parametrize("moment", ["open", "flock"])
def test_a_failed_start_beside_a_second_one_leaves_the_second_a_lock_others_see(moment: str, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """The first start fails and removes the directory it made just as a second start opens the lock
    file (the open finds no directory) or locks the file it opened: the second must end up holding
    the lock file at the path (a third start is refused), not fail nor hold a removed file."""
    run = tmp_path / "new" / "run"
    first = DirectoryLock(run)
    module, name = (os, "open") if moment == "open" else (runlock.fcntl, "flock")
    real = getattr(module, name)

    def first_fails_now(*args, **kwargs):
        monkeypatch.setattr(module, name, real)
        first.discard()
        assert not run.exists()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, first_fails_now)
    second = DirectoryLock(run)
    assert (run / LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(DirectoryBusy):
        DirectoryLock(run)
    second.release()


@pytest.mark.skipif(runlock.fcntl is None, reason="runs are not locked without fcntl")
def test_a_lock_that_fails_after_locking_lets_go_of_the_file(tmp_path: Path, monkeypatch) -> None:
    """An error between the lock and its pid (here the check that the file is still at the path)
    is a one-line usage error and closes the descriptor: the same process can lock it next."""
    run = tmp_path / "run"
    real_stat = os.stat

    def stat_fails_on_the_lock(path, *args, **kwargs):
        if str(path).endswith(LOCK_NAME):
            raise PermissionError(13, "Permission denied")
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_fails_on_the_lock)
    with pytest.raises(UsageError, match="cannot lock the directory .*Permission denied"):
        DirectoryLock(run)
    monkeypatch.setattr(os, "stat", real_stat)
    DirectoryLock(run).release()
