"""The command-line parser every script shares."""
import pytest

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
