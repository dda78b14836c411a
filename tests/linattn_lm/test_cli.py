"""The command-line parser every script shares."""
import pytest

from linattn_lm import evaluate, grid, training
from linattn_lm.cli import Parser


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
