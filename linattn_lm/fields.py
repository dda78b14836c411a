"""How a settings dataclass declares its fields and the checks every one runs on them: shared by
`ModelConfig` (lm.py, beside the model) and the run's other sections (settings.py).

A field's metadata holds its help text, whether it may change on --resume, whether it picks the
attention variant, and argparse keywords of its own; linattn_lm.flags makes its flag from them.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict[str, Any]": dict, "list[str]": list}
PLAIN_OPTION_TYPES = (bool, int, float, str, type(None))   # what a dict setting's values may be
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, resumable: bool = False,
            variant: bool = False, flag: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A config field with its flag (linattn_lm.flags, which parses it by the default's type): help
    text, `flag` for argparse keywords of its own.  `resumable`: may change on --resume (it never changes
    what the optimiser computes); `variant`: picks the attention variant (grid.py sets it)."""
    metadata = {"help": help, "resumable": resumable, "variant": variant, "flag": flag or {}}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def default_value(field: dataclasses.Field) -> Any:
    """A field's default (a fresh copy where the default is a dict or a list)."""
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def check_finite(config: Any) -> None:
    """Every float field of a config is finite, and within float32's range, where torch uses it
    (nan and inf pass range checks silently)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
            raise ValueError(f"{f.name} must be a finite number within float32's range "
                             f"(|x| <= {FLOAT32_MAX:.3g}), got {value}")


def check_types(config: Any) -> None:
    """Every field holds its declared type (a checkpoint or a preset may hold anything)."""
    for f in dataclasses.fields(config):
        value, expected = getattr(config, f.name), FIELD_TYPES[f.type]
        ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
        elif not ok:
            raise ValueError(f"{f.name} must be {expected.__name__}, got {value!r}")
