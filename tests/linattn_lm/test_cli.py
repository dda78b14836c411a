"""The command-line parser every script shares."""
import pytest

from linattn_lm import evaluate, grid, training
from linattn_lm.errors import Parser


def test_a_flag_is_never_taken_for_a_prefix_of_another(capsys):
    """grid.py has --feature-map-option but no --feature-map: that must be an unknown flag, not the
    option's abbreviation given 'elu' as KEY=VALUE."""
    parser = Parser(prog="grid.py")
    parser.add_argument("--feature-map-option")
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--feature-map", "elu"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --feature-map elu (see --help)" in capsys.readouterr().err


def test_an_import_file_that_exits_is_a_usage_error_not_a_silent_exit(tmp_path, run_main):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    for main in (training.main, grid.main, evaluate.main):
        code, out, err = run_main(main, ["--import", str(exits)])
        assert code == 2 and out == "", err
        assert err == (f"error: --import {exits}: cannot import it (SystemExit: 0); fix that code: importing it "
                       "must only define and register things\n")


def test_ctrl_c_while_importing_is_one_line_and_the_interrupted_status(tmp_path, run_main):
    slow = tmp_path / "slow.py"
    slow.write_text("raise KeyboardInterrupt   # as Ctrl-C during a slow import\n")
    for main in (training.main, grid.main, evaluate.main):
        code, out, err = run_main(main, ["--import", str(slow)])
        assert (code, out, err) == (130, "", "error: interrupted while importing the --import code\n")


@pytest.mark.parametrize("name, message", [
    ("", "--import takes a module name or a .py file, got ''"),
    (" ", "--import takes a module name or a .py file, got ' '"),
    ("afile", "--import {path}: a file to import must be Python source ending in .py; rename it, or pass a module "
              "name on the Python path"),
])
def test_an_import_name_that_names_no_module_is_refused_for_the_name(name, message, tmp_path, run_main,
                                                                    monkeypatch):
    """Before: 'cannot import it (ValueError: Empty module name); fix that code', blaming code never read."""
    (tmp_path / "afile").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(training.main, ["--import", name])
    assert code == 2 and err == f"error: {message.format(path=name)}\n", err
