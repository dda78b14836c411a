"""The flags generator both the harness and the benchmarks use (linattn_lm/flags.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import pytest

from linattn_lm.flags import add_flags, build_parser, config_from_argv
from linattn_lm.variants import option
from linattn_lm.presets import PRESETS


def halves(text: str) -> float:
    value = float(text)
    if value not in (0.5, 1.5):
        raise ValueError(f"expected 0.5 or 1.5, got {text}")
    return value


@dataclass
class Example:
    ratio: float = field(default=0.5, metadata={"help": "a ratio", "parse": halves})
    quiet: bool = field(default=False, metadata={"help": "say less", "parse": bool})
    pair: list = field(default=None, metadata={"help": "KEY=VALUE", "flag": dict(
        name="--pair", type=option, action="append", metavar="KEY=VALUE")})


def parser(**keywords) -> argparse.ArgumentParser:
    made = argparse.ArgumentParser()
    add_flags(made, fields(Example), **keywords)
    return made


def test_a_flag_per_field_with_its_parser_switch_and_keywords() -> None:
    args = parser().parse_args(["--ratio", "1.5", "--no-quiet", "--pair", "a=1", "--pair", "b=x"])
    assert (args.ratio, args.quiet, args.pair) == (1.5, False, [("a", 1), ("b", "x")])
    assert parser().parse_args([]).ratio == 0.5
    assert parser(default=lambda spec: None).parse_args([]).ratio is None
    assert not hasattr(parser(skip={"ratio"}).parse_args([]), "ratio")


def test_a_parsers_value_error_is_argparses_message(capsys) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--ratio", "2"])
    assert "expected 0.5 or 1.5, got 2" in capsys.readouterr().err


def test_a_flag_reaches_its_setting_in_config_from_argv() -> None:
    """train.py -> training.main -> flags.config_from_argv -> the trainer: the config holds it."""
    args, config = config_from_argv(build_parser(), ["--preset", "tiny", "--lr", "0.002"])
    assert config.optim.lr == 0.002 and config.optim.warmup == PRESETS["tiny"]["warmup"] and not args.resume


def test_a_feature_map_option_given_twice_is_refused() -> None:
    """The last of two --feature-map-option num_features=... would win without a word."""
    argv = ["--preset", "tiny", "--feature-map-option", "num_features=16", "--feature-map-option", "num_features=32"]
    with pytest.raises(ValueError, match="more than once"):
        config_from_argv(build_parser(), argv)
    _, config = config_from_argv(build_parser(), argv[:4])
    assert config.model.feature_map_options["num_features"] == 16
