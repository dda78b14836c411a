"""Checkpoints: written atomically, read with `torch.load(weights_only=True)`, checked before use.

A checkpoint is a dict: format, version, config (a dict per settings section, plain values),
step, model, optimizer, scaler (fp16's loss scale), precision (fp32, bf16 or fp16: --dtype as it
resolved when the run started), loader (RandomWindows state), rng (per-rank torch states), stats,
log_window (the open train/loss average), data (description).
"""
from __future__ import annotations

import math
import pickle
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from linattn import is_real

from .config import MAX_STEPS, TrainConfig
from .lm import ByteLM
from .device import PRECISIONS
from .errors import first_line
from .files import write_atomically

CHECKPOINT_NAME = "ckpt.pt"
CHECKPOINT_FORMAT = "linattn-byte-lm"
CHECKPOINT_VERSION = 2
# What each entry must be; load_for_resume needs them all, eval.py the first four.
ENTRIES: dict[str, type] = {"config": dict, "step": int, "model": dict, "data": str, "optimizer": dict,
                            "loader": dict, "rng": list, "stats": dict, "log_window": dict}


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, of another format or incompatible with the run."""


def checkpoint_path(path: Path | str) -> Path:
    """A checkpoint file, or a run directory holding ckpt.pt (a directory itself named ckpt.pt is
    neither: load_checkpoint says so)."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() and path.name != CHECKPOINT_NAME else path


def save_checkpoint(path: Path | str, payload: dict[str, Any]) -> None:
    """Written to a temporary file, fsynced, then renamed: a crash never leaves a half-written ckpt.pt."""
    checkpoint = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **payload}
    write_atomically(Path(path), lambda tmp: torch.save(checkpoint, tmp))


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = checkpoint_path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file: move it away or give another run")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        with warnings.catch_warnings():   # a foreign pickle's protocol warning would precede the error below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"cannot read checkpoint {path}: not a weights-only torch checkpoint "
                              "(corrupt, or written by something other than train.py)") from None
    except Exception as error:  # torch raises many types for truncated or foreign files
        raise CheckpointError(f"cannot read checkpoint {path}: corrupt or truncated ({first_line(error)})") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a linattn LM checkpoint (written by train.py)")
    if checkpoint.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint version {checkpoint.get('version')!r}, "
                              f"this code reads version {CHECKPOINT_VERSION}")
    return checkpoint


def checkpoint_entries(checkpoint: dict[str, Any], path: Path | str, names=tuple(ENTRIES)) -> None:
    """Refuse a checkpoint that lacks an entry or holds one of the wrong type, naming it."""
    for name in names:
        expected = ENTRIES[name]
        value = checkpoint.get(name)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            found = "missing" if name not in checkpoint else f"a {type(value).__name__}"
            raise CheckpointError(f"{path} is damaged: its {name!r} entry should be a {expected.__name__}, "
                                  f"found {found}; use another checkpoint (or, for --resume, start a new run)")
    if not 0 <= checkpoint["step"] < MAX_STEPS:
        raise CheckpointError(f"{path} is damaged: step {checkpoint['step']} is not in [0, 2**63)")


def saved_precision(checkpoint: dict[str, Any], path: Path | str) -> str | None:
    """The precision the run computed in, fp32, bf16 or fp16 (--dtype auto resolved where it ran);
    None for checkpoints written before it was saved."""
    precision = checkpoint.get("precision")
    if precision is not None and (not isinstance(precision, str) or precision not in PRECISIONS):
        raise CheckpointError(f"{path} is damaged: its 'precision' entry is {precision!r}, not one of "
                              f"{', '.join(PRECISIONS)}; use another checkpoint (or, for --resume, start a new run)")
    return precision


def load_state(path: Path | str, name: str, load: Callable[[], Any]) -> None:
    """Run `load` (a load_state_dict and the like), turning its errors into a CheckpointError."""
    try:
        load()
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as error:
        raise CheckpointError(f"{path}: its {name!r} entry does not fit this run ({first_line(error)})") from None


def check_finite_weights(state: dict[str, Any], path: Path | str) -> None:
    """A model whose weights hold NaN or inf scores and samples nonsense: refuse it (and weights in
    another layout, sparse say, which the check cannot read and the model never writes)."""
    for key, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            raise CheckpointError(f"{path} is damaged: weight {key!r} is stored as {tensor.layout}, the model's "
                                  "weights are dense (torch.strided); use another checkpoint")
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            raise CheckpointError(f"{path} is damaged: weight {key!r} is a meta tensor, which holds no values; "
                                  "use another checkpoint")
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path}: weight {key!r} holds NaN or inf values; the run diverged before "
                                  "this checkpoint was written, so use an earlier checkpoint")


def load_weights(model: torch.nn.Module, state: dict[str, Any], path: Path | str) -> None:
    """The checkpoint's weights into `model`, refused unless each has the model's dtype:
    load_state_dict would cast integer weights (truncated values) without a word."""
    for key, expected in model.state_dict().items():
        saved = state.get(key)
        if isinstance(expected, torch.Tensor) and isinstance(saved, torch.Tensor) and saved.dtype != expected.dtype:
            raise CheckpointError(f"{path} is damaged: weight {key!r} is {saved.dtype}, the model's is "
                                  f"{expected.dtype}; use another checkpoint")
    load_state(path, "model", lambda: model.load_state_dict(state))


def check_optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                          path: Path | str, step: int) -> None:
    """Each parameter's saved optimiser state has its shape and dtype and is finite: load_state_dict
    compares only how many parameters each group has, and casts what it loads.  After a step
    (`step` > 0) the state is not empty and is keyed by the saved parameter indices: load_state_dict
    would otherwise drop it silently and restart AdamW's moments."""
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        raise CheckpointError(f"{path} is damaged: its 'optimizer' entry lacks param_groups or state")
    saved_ids = [index for group in groups for index in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if len(saved_ids) != len(params):
        raise CheckpointError(f"{path}: its 'optimizer' entry holds {len(saved_ids)} parameters, the model has "
                              f"{len(params)}; it belongs to another model")
    stray = [key for key in state if key not in saved_ids]
    if stray or (step > 0 and not state):
        found = f"entries under keys {stray[:3]!r} that name no parameter" if stray else "no entries"
        raise CheckpointError(f"{path} is damaged: its optimiser state has {found} after step {step}, so the "
                              "resume would restart AdamW's moments; use another checkpoint")
    for number, group in enumerate(groups):
        problem = hyperparameter_problem(group)
        if problem:
            raise CheckpointError(f"{path} is damaged: its optimiser's param group {number} has {problem}")
    names = {id(param): name for name, param in model.named_parameters()}
    for index, param in zip(saved_ids, params):
        entry = state.get(index, {})
        for key, value in (entry.items() if isinstance(entry, dict) else [("state", entry)]):
            if not fits_parameter(key, value, param):
                found = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                         else type(value).__name__)
                raise CheckpointError(f"{path} is damaged: its optimiser state {key!r} of {names[id(param)]!r} is "
                                      f"{found} (or not finite), the parameter is {tuple(param.shape)} {param.dtype}")


def hyperparameter_problem(group: dict[str, Any]) -> str | None:
    """AdamW's settings in a saved param group, which load_state_dict takes as they are (the learning
    rate is set by the schedule every step): betas in [0, 1), eps > 0, weight decay >= 0, finite."""
    betas, eps, decay = group.get("betas"), group.get("eps"), group.get("weight_decay")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_real(b) and 0 <= b < 1 for b in betas)):
        return f"betas {betas!r}, not two numbers in [0, 1)"
    if not (is_real(eps) and eps > 0):
        return f"eps {eps!r}, not a finite number > 0"
    if not (is_real(decay) and decay >= 0):
        return f"weight_decay {decay!r}, not a finite number >= 0"
    return None


def fits_parameter(key: str, value: Any, param: torch.Tensor) -> bool:
    """A finite tensor of the parameter's shape and dtype; the step count a finite scalar >= 0."""
    if key == "step":   # AdamW keeps it as a one-element float tensor
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        return isinstance(number, (int, float)) and not isinstance(number, bool) and 0 <= number < math.inf
    return (isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == param.dtype
            and bool(value.isfinite().all()))


def model_from_checkpoint(checkpoint: dict[str, Any], path: Path | str = "checkpoint",
                          backend: str | None = None) -> ByteLM:
    """Rebuild the model from the checkpoint's config and load its weights (and feature-map state).
    `backend`: the attention kernels to run it with instead of the run's (speed only: a run trained
    with backend='fla' on a GPU, evaluated on a CPU)."""
    checkpoint_entries(checkpoint, path, ("config", "step", "model", "data"))
    check_finite_weights(checkpoint["model"], path)
    try:
        config = TrainConfig.saved_section(checkpoint["config"], "model")
    except ValueError as error:
        raise CheckpointError(f"{path}: its saved configuration is not valid ({first_line(error)})") from None
    try:
        config.validate()
    except ValueError as error:
        raise CheckpointError(f"{path}: its model settings are not usable ({first_line(error)})") from None
    if backend is not None:
        config = replace(config, backend=backend)
        config.validate()   # a backend this attention has not: a usage error, not a damaged checkpoint
    model = ByteLM(config)
    load_weights(model, checkpoint["model"], path)
    return model
