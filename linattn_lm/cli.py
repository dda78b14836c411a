"""Command-line plumbing shared by train.py, grid.py and eval.py: flags generated from the config
fields, user code loaded by --import before the flags are resolved, and one way to report errors."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Callable

from .config import FIELDS, PRESETS, VARIANT
from .device import DTYPES
from .errors import UsageError, first_line

class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or its help already says what it is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def comma_items(text: str) -> list[str]:
    """The items of a comma-separated flag, stripped; none at all when one is empty ('a,,b', 'a,'):
    an empty item is a typo more often than not, and may hide a missing value, so the callers refuse
    it as they refuse an empty list."""
    items = [item.strip() for item in text.split(",")]
    return items if all(items) else []


def option(text: str) -> tuple[str, Any]:
    """KEY=VALUE; VALUE is a Python literal (64, 0.5, True, None, 'text') or else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY a Python name, got {text!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = raw
    return key, value


FLAG_TYPES: dict[str, Callable[[str], Any]] = {"int": integer, "float": finite_float, "str": str}


def add_config_flags(parser: argparse.ArgumentParser, *, skip: set[str] = frozenset()) -> None:
    """One flag per config field, grouped by section.  Every flag defaults to None, so only flags
    given explicitly override the preset."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name, (section, field) in FIELDS.items():
        if name in skip:
            continue
        group = groups.setdefault(section, parser.add_argument_group(f"{section} settings"))
        help_text = field.metadata["help"]
        if name == "feature_map_options":
            group.add_argument("--feature-map-option", dest=name, metavar="KEY=VALUE", type=option,
                               action="append", help=help_text)
        elif name == "imports":
            group.add_argument("--import", dest=name, metavar="MODULE_OR_FILE", action="append", help=help_text)
        elif field.type == "bool":
            group.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction,
                               help=f"{help_text} (default {field.default})")
        else:
            choices = list(PRESETS) if name == "preset" else list(DTYPES) if name == "dtype" else None
            metavar = {"int": "N", "float": "X"}.get(field.type)
            default = "" if field.default in ("", dataclasses.MISSING) else f" (default {field.default})"
            group.add_argument(f"--{name.replace('_', '-')}", type=FLAG_TYPES[field.type], choices=choices,
                               metavar=metavar, help=help_text + default)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields given explicitly, options as a dict."""
    given = {key: value for key, value in vars(args).items() if key in FIELDS and value is not None}
    if "feature_map_options" in given:
        given["feature_map_options"] = dict(given["feature_map_options"])
    return given


def pre_parse_imports(argv: list[str] | None) -> list[str]:
    """The --import values, read before the full parser exists (user maps become choices)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--import", dest="imports", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    return known.imports


def import_user_code(names: list[str]) -> list[str]:
    """Import each module name or .py file; returns them as recorded (files as absolute paths)."""
    recorded = []
    for name in names:
        path = Path(name).expanduser()
        if not name.strip():
            raise UsageError(f"--import takes a module name or a .py file, got {name!r}")
        if path.is_file() and not name.endswith(".py"):
            raise UsageError(f"--import {name}: a file to import must be Python source ending in .py; rename it, or "
                             "pass a module name on the Python path")
        try:
            if name.endswith(".py"):
                path = path.resolve()
                if not path.is_file():
                    raise FileNotFoundError(f"no such file {path}")
                spec = importlib.util.spec_from_file_location(f"linattn_user_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module   # dataclasses and pickling look modules up here
                spec.loader.exec_module(module)
                recorded.append(str(path))
            else:
                importlib.import_module(name)
                recorded.append(name)
        except (Exception, SystemExit) as error:  # user code may raise anything while it loads, or exit
            hint = ("pass a module name on the Python path or a .py file" if isinstance(error, (ImportError, OSError))
                    else "fix that code: importing it must only define and register things")
            raise UsageError(f"--import {name}: cannot import it ({type(error).__name__}: "
                             f"{first_line(error)}); {hint}") from None
    return recorded


def variant_skip() -> set[str]:
    """The flags grid.py leaves out: the variant comes from --variants."""
    return set(VARIANT) - {"feature_map_options"}
