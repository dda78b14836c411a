"""Model presets: one TOML file per preset in linattn_lm/models/ (`--preset NAME` reads NAME.toml),
holding the settings it changes from the defaults under their field names, after a comment line that
says what the preset is for.  `--preset path/to/file.toml` reads a file of the user's of that form.

The files are package data, in the package itself: a clone and an installed package read the same
files from the same place (`MODELS_DIR`)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10: the backport (pyproject.toml requires it there)
    import tomli as tomllib

MODELS_DIR = Path(__file__).with_name("models")
PRESET_SUFFIX = ".toml"
DEFAULT_PRESET = "cpu"
TASK_PRESETS = {"enwik8": DEFAULT_PRESET, "mqar": "mqar"}   # the preset a task defaults to


def is_preset_file(preset: str) -> bool:
    """Whether --preset names a file of the user's (path/to/file.toml) rather than a preset."""
    return preset.endswith(PRESET_SUFFIX)


def read_preset_file(path: Path) -> dict[str, Any]:
    """A preset file's settings as TOML gives them; a ValueError naming the file where it cannot be read."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ValueError(f"--preset {path}: cannot read it ({error.strerror or error}); pass a preset's name "
                         f"or a readable {PRESET_SUFFIX} file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a TOML file ({error}); write one KEY = VALUE per line, as in "
                         f"{MODELS_DIR / 'tiny'}{PRESET_SUFFIX}") from None


PRESETS: dict[str, dict[str, Any]] = {
    path.stem: read_preset_file(path) for path in sorted(MODELS_DIR.glob(f"*{PRESET_SUFFIX}"), key=lambda path: path.stem)}


def preset_file(preset: str) -> Path:
    """The file a --preset value reads: a file of the user's, or NAME.toml of linattn_lm/models/."""
    if is_preset_file(preset):
        return Path(preset).expanduser()
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}, or pass a "
                         f"{PRESET_SUFFIX} file")
    return MODELS_DIR / f"{preset}{PRESET_SUFFIX}"


def preset_changes(preset: str) -> dict[str, Any]:
    """The settings a preset changes from the defaults, as its file holds them (unchecked)."""
    return PRESETS[preset] if preset in PRESETS else read_preset_file(preset_file(preset))
