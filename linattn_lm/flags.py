"""Command-line flags generated from dataclass fields: the one generator behind the harness's settings
(linattn_lm/settings.py; the model's, ModelConfig, in linattn_lm/lm.py) and the benchmark's
(benchmarks/settings.py), its number and list parsers, and the harness's flags: one per settings
field, parsed, and the settings they give: explicit flags over the preset over the defaults.

A field's metadata holds its help text and how a flag's text becomes its value: `parse` (text ->
value; a ValueError says what was expected; `bool` makes a --name/--no-name switch), by default
the parser of the field's type (FLAG_PARSERS), and, for the few flags that are not one value,
`flag`: argparse keywords that replace the generated ones ("name" for another flag name).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any, Callable, Iterable

from .cli import load_imports, one_line_warnings
from .errors import Parser
from .presets import DEFAULT_PRESET, TASK_PRESETS, is_preset_file, preset_changes, preset_file
from .fields import FIELD_TYPES, PLAIN_OPTION_TYPES
from .settings import FIELDS, SECTIONS, VARIANT, TrainConfig, field_default
from .variants import LINEAR_BLOCK_OPTIONS


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field], *,
              skip: Iterable[str] = (), group: Callable[[dataclasses.Field], str] | None = None,
              default: Callable[[dataclasses.Field], Any] = lambda field: field.default,
              note: Callable[[dataclasses.Field], str] = lambda field: "") -> None:
    """One flag per field, --name-with-dashes into dest `name`.

    Args:
        parser: where the flags go.
        fields: dataclass fields whose metadata holds help, optionally parse (default: FLAG_PARSERS' for
            the default's type) and flag.
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
        if "parse" not in meta:   # the parser of the default's type
            meta = {**dict(zip(("parse", "metavar"), FLAG_PARSERS.get(type(field.default), ()))), **meta}
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


def add_config_flags(parser: Any, *, skip: set[str] = frozenset()) -> None:
    """One flag per config field, grouped by section.  Every flag defaults to None, so only flags
    given explicitly override the preset."""
    add_flags(parser, (field for _, field in FIELDS.values()), skip=skip,
              group=lambda field: f"{FIELDS[field.name][0]} settings", default=lambda field: None,
              note=lambda field: "" if field.default in ("", dataclasses.MISSING) else f" (default {field.default})")


def config_from_argv(parser: Any, argv: list[str] | None, imports: list[str] = (), *,
                     resolve: Callable[[dict[str, Any], Any], Any] | None = None,
                     resume: Callable[[dict[str, Any]], "TrainConfig"] | None = None) -> tuple[Any, Any]:
    """A command's flags, parsed, and the settings they give: explicit flags over the preset over the
    defaults (`config_from_flags`, validated); with --resume, `resume(given)` (the run's record);
    `resolve(given, args)` instead, where a command makes something else of them (grid.py's grid).

    Args: parser: one with add_config_flags' flags; argv: the arguments (None: sys.argv's);
        imports: the --import values already imported (recorded in the config).
    Returns: (argparse's namespace, the settings)."""
    args = parser.parse_args(argv)
    given = given_settings(args)
    if imports:
        given["imports"] = imports
    if resolve is not None:
        return args, resolve(given, args)
    if resume is not None and args.resume:
        return args, resume(given)
    return args, config_from_flags(given)


def given_settings(args: Any) -> dict[str, Any]:
    """The config fields given explicitly (an argparse Namespace's), options as a dict."""
    given = {key: value for key, value in vars(args).items() if key in FIELDS and value is not None}
    if "feature_map_options" in given:
        pairs = given["feature_map_options"]
        given["feature_map_options"] = dict(pairs)
        keys = [key for key, _ in pairs]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:   # the last would win unseen: a typo in one of them, more often than a choice
            raise ValueError(f"--feature-map-option {', '.join(repeated)} given more than once; give each key once")
    if is_preset_file(given.get("preset", "")):   # recorded absolute, as data_dir is: found from any directory
        given["preset"] = str(Path(given["preset"]).expanduser().resolve())
    return given


def variant_skip() -> set[str]:
    """The flags grid.py leaves out: the variant comes from --variants."""
    return set(VARIANT) - {"feature_map_options"}


LINEAR_ONLY = ("feature_map", "feature_map_options", "chunk_size", *LINEAR_BLOCK_OPTIONS)


PRESET_SECTIONS = ("model", "optim", "log", "task")   # sizes and schedule; "run" is where and how a command runs


def preset_settings(preset: str) -> dict[str, Any]:
    """Every setting a preset gives (its changes over the defaults), by field name.

    Args: preset: a preset's name (linattn_lm/models/NAME.toml) or a path to a .toml file of that form.
    Returns: a fresh dict, safe to change.
    Raises: ValueError naming the file and the key of a setting it cannot hold."""
    path = preset_file(preset)
    changes = {key: preset_value(path, key, value) for key, value in preset_changes(preset).items()}
    defaults = {key: field_default(key) for key in FIELDS}
    return copy.deepcopy({**defaults, **changes})


def preset_value(path: Path, key: str, value: Any) -> Any:
    """A preset file's value for `key`, as the settings hold it (an integer where a float goes: that float)."""
    if key not in FIELDS or FIELDS[key][0] not in PRESET_SECTIONS:
        what = f"a run setting: give it as {flag_name(key)}" if key in FIELDS else "no setting of train.py --help"
        raise ValueError(f"{path}: {key!r} is {what}; a preset holds model, optim, log and task settings")
    expected = FIELD_TYPES[FIELDS[key][1].type]
    if expected is float and type(value) is int:
        return float(value)
    if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool) or (
            expected is dict and not all(isinstance(option, PLAIN_OPTION_TYPES) for option in value.values())):
        shown = "a table of str, int, float or bool values" if expected is dict else expected.__name__
        raise ValueError(f"{path}: {key} must be {shown}, got {value!r}")
    return value


def resolve_variant(given: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """The attention fields from explicit flags.  A preset's feature-map options belong to the
    preset's map; flags that do not apply to the variant are errors."""
    attention = given.get("attention", "linear")
    if attention == "softmax":
        for name in LINEAR_ONLY:
            if name in given:
                flag = "--feature-map-option" if name == "feature_map_options" else f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} applies to linear attention only, not --attention softmax")
        if given.get("rope") == "pre":
            raise ValueError("--rope pre rotates q, k before a feature map, which softmax attention "
                             "lacks: use --rope post (RoPE on q, k) or --rope none")
        return dict(attention=attention, feature_map="", feature_map_options={})
    feature_map = given.get("feature_map", preset["feature_map"])
    options = dict(preset["feature_map_options"]) if feature_map == preset["feature_map"] else {}
    return dict(attention=attention, feature_map=feature_map,
                feature_map_options={**options, **given.get("feature_map_options", {})})


def config_from_flags(given: dict[str, Any]) -> TrainConfig:
    """Merge: dataclass defaults < preset < explicit flags (by field name); validated."""
    config = merged_flags(given)
    config.validate()
    return config


# The settings that one task reads and the other ignores: given for the other task, a flag is a mistake.
TASK_ONLY = {"mqar_kv_pairs": "mqar", "mqar_filler": "mqar", "data_dir": "enwik8", "sample_interval": "enwik8"}


def check_task_flags(given: dict[str, Any], task: str) -> None:
    """Refuse a flag given explicitly that the run's task does not read (--mqar-kv-pairs on enwik8;
    --data-dir or --sample-interval on mqar, whose data is drawn from the seed and has no text)."""
    for name, only in TASK_ONLY.items():
        if name in given and task != only:
            raise ValueError(f"{flag_name(name)} applies to --task {only} only, not --task {task}: drop it")


def merged_flags(given: dict[str, Any]) -> TrainConfig:
    """`config_from_flags` before its validation (--resume takes only the run's name from it)."""
    given = {key: value for key, value in given.items() if value is not None}
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}")
    if given.get("data_dir") == "":   # '' is what the default is stored as: given, it is a mistake (an unset variable)
        raise ValueError("data_dir must name a directory, got ''; leave --data-dir out for the repository's "
                         "data/enwik8")
    preset_name = given.get("preset", TASK_PRESETS.get(given.get("task"), DEFAULT_PRESET))
    preset = preset_settings(preset_name)
    values = {**preset, **given, **resolve_variant(given, preset), "preset": preset_name}
    check_task_flags(given, values["task"])
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        sections[FIELDS[key][0]][key] = value
    config = TrainConfig(**{name: SECTIONS[name](**fields) for name, fields in sections.items()})
    config.optim.decay_steps = config.optim.decay_steps or config.optim.steps
    if "run_name" not in given:   # an explicit --run-name "" is refused by validate(), not replaced
        config.run.run_name = config.model.variant
    return config


def build_parser(description: str = "Train a byte-level LM on enwik8.", *, skip: set[str] = frozenset(),
                 resume_help: str = "continue from <out-dir>/<run-name>/ckpt.pt") -> argparse.ArgumentParser:
    parser = Parser(description=description)
    add_config_flags(parser, skip=skip)
    parser.add_argument("--resume", action="store_true", help=resume_help)
    return parser


def parse_config(parser: argparse.ArgumentParser, argv: list[str] | None,
                 resolve: Callable[[dict[str, Any], argparse.Namespace], Any] | None = None,
                 resume: Callable[[dict[str, Any]], TrainConfig] | None = None) -> tuple[argparse.Namespace, Any]:
    """User code first (--import), then the flags (`config_from_argv`); any bad setting is a usage
    error (exit 2)."""
    one_line_warnings()
    imports = load_imports(argv)
    try:
        return config_from_argv(parser, argv, imports, resolve=resolve, resume=resume)
    except ValueError as error:
        parser.error(str(error))


