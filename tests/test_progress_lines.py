"""conftest.py's `say`: the progress lines of long GPU tests reach the terminal while the test runs,
not in its captured output after it (on an H200 a silent `pytest -m gpu` showed nothing for 200 s)."""
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")


def test_a_line_said_in_setup_reaches_the_terminal_while_the_test_output_stays_captured(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("repo_conftest", {str(CONFTEST)!r})
        repo = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(repo)

        def pytest_runtest_setup(item):
            repo.say(item.config, "PROGRESS-LINE")
        """))
    (tmp_path / "test_slow.py").write_text("def test_prints():\n    print('CAPTURED-OUTPUT')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-o", "addopts=", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PROGRESS-LINE" in run.stdout
    assert "CAPTURED-OUTPUT" not in run.stdout   # the test's own output stays captured
