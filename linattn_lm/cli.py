"""Command-line plumbing shared by train.py, grid.py and eval.py: user code loaded by --import before
the flags are resolved (the flags themselves: linattn_lm.flags, from the settings' fields)."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

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
