"""Command-line plumbing shared by train.py, grid.py, eval.py and the benchmark: flags generated from
dataclass fields, the list, number and KEY=VALUE parsers, and user code loaded by --import before the
flags are resolved (the harness's flags themselves: linattn_lm.flags).

A field's metadata holds its help text and how a flag's text becomes its value: `parse` (text ->
value; a ValueError says what was expected; `bool` makes a --name/--no-name switch) and, for the few
flags that are not one value, `flag`: argparse keywords that replace the generated ones ("name" for
another flag name).  Imports nothing of the packages but errors, so all of them import it without a circle.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, UsageError, first_line


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or its help already says what it is."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def one_line_warnings() -> None:
    """Warnings printed as one line each ("warning: ..."), not Python's two with the source line that
    warned: what the commands print is read by people, not by a debugger."""
    warnings.formatwarning = lambda message, category, *_, **__: f"warning: {' '.join(str(message).split())}\n"


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


def load_imports(argv: list[str] | None) -> list[str]:
    """The --import code of a command line, loaded before its flags are parsed (user maps become
    choices), as recorded; a one-line error and exit status 2 where it fails, 130 on Ctrl-C."""
    try:
        return import_user_code(pre_parse_imports(argv))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    except KeyboardInterrupt:
        print("error: interrupted while importing the --import code", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field], *,
              skip: Iterable[str] = (), group: Callable[[dataclasses.Field], str] | None = None,
              default: Callable[[dataclasses.Field], Any] = lambda field: field.default,
              note: Callable[[dataclasses.Field], str] = lambda field: "") -> None:
    """One flag per field, --name-with-dashes into dest `name`.

    Args:
        parser: where the flags go.
        fields: dataclass fields whose metadata holds help, parse and optionally flag.
        skip: field names that get no flag.
        group: a field's argument-group title (None: no groups).
        default: a field's flag default (the harness: None, so only given flags count).
        note: text after a field's help (how it shows its default)."""
    groups: dict[str, Any] = {}
    for field in fields:
        if field.name in skip:
            continue
        title = group(field) if group else None
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        target = groups.get(title, parser)
        meta = field.metadata
        keywords = dict(dest=field.name, default=default(field), help=meta["help"] + note(field))
        if meta.get("parse") is bool:
            keywords["action"] = argparse.BooleanOptionalAction
        elif "parse" in meta:
            keywords.update(type=argparse_type(meta["parse"]), metavar=meta.get("metavar"))
        keywords.update(meta.get("flag", {}))
        target.add_argument(keywords.pop("name", flag_name(field.name)), **keywords)


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse reports an ArgumentTypeError's message; a ValueError's would be lost."""
    def wrapped(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


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


FLAG_PARSERS = {bool: (bool, None), int: (integer, "N"), float: (finite_float, "X"), str: (str, None)}
