"""Checkpoints: written atomically, read with `torch.load(weights_only=True)`, checked before use.

A checkpoint is a dict: format, version, config (flat dict of str/int/float/bool), step, model,
optimizer, loader (RandomWindows state), rng (per-rank torch states), stats, data (description).
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from .lm import ByteLM, ModelConfig
from .runtime import write_atomically

CHECKPOINT_NAME = "ckpt.pt"
CHECKPOINT_FORMAT = "linattn-byte-lm"
CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, of another format or incompatible with the run."""


def checkpoint_path(path: Path | str) -> Path:
    """A checkpoint file, or a run directory holding ckpt.pt."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def save_checkpoint(path: Path | str, payload: dict[str, Any]) -> None:
    """Written to a temporary file, fsynced, then renamed: a crash never leaves a half-written ckpt.pt."""
    checkpoint = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **payload}
    write_atomically(Path(path), lambda tmp: torch.save(checkpoint, tmp))


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = checkpoint_path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"cannot read checkpoint {path}: not a weights-only torch checkpoint "
                              "(corrupt, or written by something other than train.py)") from None
    except Exception as error:  # torch raises many types for truncated or foreign files
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise CheckpointError(f"cannot read checkpoint {path}: corrupt or truncated ({reason})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a linattn LM checkpoint (written by train.py)")
    if checkpoint.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {checkpoint.get('version')}, "
                              f"this code reads version {CHECKPOINT_VERSION}")
    return checkpoint


def config_differences(saved: dict[str, Any], current: dict[str, Any], ignore: set[str]) -> list[str]:
    """'key: checkpoint A, now B' for every differing key not in `ignore`."""
    keys = sorted((set(saved) | set(current)) - ignore)
    return [f"{key}: checkpoint {saved.get(key, '<absent>')!r}, now {current.get(key, '<absent>')!r}"
            for key in keys if saved.get(key) != current.get(key)]


def model_from_checkpoint(checkpoint: dict[str, Any], device: torch.device | str = "cpu") -> ByteLM:
    """Rebuild the model from the checkpoint's config and load its weights (and FAVOR+ state)."""
    try:
        model = ByteLM(ModelConfig.from_dict(checkpoint["config"]))
        model.load_state_dict(checkpoint["model"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint does not match this code's model: {error}") from None
    return model.to(device)
