"""Command-line flags generated from dataclass fields: the one generator behind the harness's settings
(linattn_lm/config.py) and the benchmark's (benchmarks/settings.py), and the list and KEY=VALUE parsers
both use.

A field's metadata holds its help text and how a flag's text becomes its value: `parse` (text ->
value; a ValueError says what was expected; `bool` makes a --name/--no-name switch) and, for the few
flags that are not one value, `flag`: argparse keywords that replace the generated ones ("name" for
another flag name).  Imports nothing of the packages, so both import it without a circle.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from typing import Any, Callable, Iterable


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
