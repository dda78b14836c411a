"""Checkpoints: written atomically, read with `torch.load(weights_only=True)`, checked before use.

A checkpoint is a dict: format, version, config (a dict per settings section, plain values),
step, model, optimizer, scaler (fp16's loss scale), precision (fp32, bf16 or fp16: --dtype as it
resolved when the run started), loader (RandomWindows state), rng (per-rank torch states), stats,
log_window (the open train/loss average), data (description).

The file is torch.save's zip archive with its sha256 in the archive's comment (`seal`): every load
re-hashes the file and refuses one whose bytes changed (docs/checkpoints.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import pickle
import reprlib
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

import linattn

from .cli import import_user_code
from .fields import check_types
from .settings import MAX_STEPS, SECTIONS, TrainConfig
from .lm import ByteLM
from .device import PRECISIONS, precision_key, resolve_device
from .errors import UsageError, first_line
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
    """Written to a temporary file, sealed with its digest, fsynced, then renamed: a crash never leaves
    a half-written ckpt.pt."""
    checkpoint = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, **payload}
    write_atomically(Path(path), lambda tmp: (torch.save(checkpoint, tmp), seal(tmp)))


# The digest lives in the zip archive's comment, the last bytes of the file: torch.load reads the
# archive as it is, and the digest covers every byte before its own hex digits.
ZIP_START = b"PK\x03\x04"     # a zip archive's first bytes (its first entry's header)
EOCD = b"PK\x05\x06"          # the end-of-central-directory record: 22 bytes, the comment's length last
EOCD_SIZE = 22
DIGEST_PREFIX = b"linattn-sha256:"
COMMENT_SIZE = len(DIGEST_PREFIX) + 64


def seal(path: Path) -> None:
    """Write the sha256 of the file into its zip comment (torch.save writes none)."""
    with open(path, "r+b") as file:
        file.seek(-EOCD_SIZE, 2)
        record = file.read(EOCD_SIZE)
        if record[:4] != EOCD or record[-2:] != b"\0\0":   # torch.save changed how it writes: a bug here
            raise RuntimeError(f"{path}: torch.save wrote no plain zip end record to seal")
        file.seek(-2, 2)
        file.write(COMMENT_SIZE.to_bytes(2, "little") + DIGEST_PREFIX)
    digest = file_sha256(path, path.stat().st_size)
    with open(path, "ab") as file:
        file.write(digest.encode("ascii"))


def file_sha256(path: Path, size: int) -> str:
    """sha256 of the first `size` bytes of the file, read in blocks."""
    digest, left = hashlib.sha256(), size
    with open(path, "rb") as file:
        while left:
            block = file.read(min(left, 1 << 24))
            if not block:
                break
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def recorded_digest(path: Path) -> str | None:
    """The sha256 a checkpoint was sealed with; None for one written before checkpoints were sealed
    (a zip without a comment), or for a file that is no zip at all (torch.load says what it is).  A
    zip whose end is neither is damage."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        start = file.read(4)
        file.seek(max(0, size - EOCD_SIZE - COMMENT_SIZE))
        tail = file.read()
    if start != ZIP_START or (tail[-EOCD_SIZE:-EOCD_SIZE + 4] == EOCD and tail[-2:] == b"\0\0"):
        return None
    record, comment = tail[:EOCD_SIZE], tail[EOCD_SIZE:]
    hex_digits = comment[len(DIGEST_PREFIX):]
    if (record[:4] != EOCD or record[-2:] != COMMENT_SIZE.to_bytes(2, "little")
            or not comment.startswith(DIGEST_PREFIX) or len(hex_digits) != 64
            or not all(chr(c) in "0123456789abcdef" for c in hex_digits)):
        raise CheckpointError(f"cannot read checkpoint {path}: it does not end as a checkpoint train.py writes "
                              f"(truncated, changed, or another kind of file); {REPLACE_HINT}")
    return hex_digits.decode("ascii")


REPLACE_HINT = "train.py keeps one checkpoint per run: use a copy of it, or start the run again"
unsealed_warned: set[Path] = set()


def verify_digest(path: Path) -> bool:
    """Refuse a checkpoint whose bytes differ from those it was sealed with.

    Returns: True for a sealed checkpoint whose bytes match; False for one written before checkpoints
        were sealed (read unverified, as it always was)."""
    recorded = recorded_digest(path)
    if recorded is None:
        return False
    if file_sha256(path, path.stat().st_size - 64) != recorded:
        raise CheckpointError(f"{path} is damaged: its bytes no longer match the sha256 it was written with (a "
                              f"changed byte, a disk error or an edit); {REPLACE_HINT}")
    return True


def warn_unsealed(path: Path) -> None:
    """Once per file: a checkpoint of train.py's format that carries no digest."""
    if path not in unsealed_warned:
        unsealed_warned.add(path)
        print(f"warning: {path} carries no digest (written before checkpoints were sealed), so it is read "
              "unverified; its next save seals it", file=sys.stderr)


def load_checkpoint(path: Path | str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint's dict, its digest verified first (`verify_digest`), its format and version checked."""
    path = checkpoint_path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file: move it away or give another run")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    sealed = verify_digest(path)
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
        version = checkpoint.get("version")
        kind = "" if type(version) is int else f" (a {type(version).__name__}, not a number)"
        raise CheckpointError(f"{path} has checkpoint version {version!r}{kind}; this code reads version "
                              f"{CHECKPOINT_VERSION}: read it with the linattn that wrote it, or start a new run")
    if not sealed:   # warned only now: a foreign file's one line is its error
        warn_unsealed(path)
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
    if "step" in names and not 0 <= checkpoint["step"] < MAX_STEPS:
        raise CheckpointError(f"{path} is damaged: step {checkpoint['step']} is not in [0, 2**63)")


def saved_precision(checkpoint: dict[str, Any], path: Path | str) -> str | None:
    """The precision the run computed in, fp32, bf16 or fp16 (--dtype auto resolved where it ran);
    None for checkpoints written before it was saved."""
    precision = checkpoint.get("precision")
    if precision is not None and (not isinstance(precision, str) or precision not in PRECISIONS):
        raise CheckpointError(f"{path} is damaged: its 'precision' entry is {precision!r}, not one of "
                              f"{', '.join(PRECISIONS)}; use another checkpoint (or, for --resume, start a new run)")
    return precision


def same_precision(dtype: str, checkpoint: dict[str, Any], path: Path | str, device: str) -> bool:
    """Whether --dtype `dtype`, on `device`, computes in the precision the run computed in (--dtype fp32 on a
    run whose auto resolved to fp32): on --resume that flag says what the record says."""
    saved = saved_precision(checkpoint, path)
    try:
        return saved is not None and precision_key(dtype, resolve_device(device)) == saved
    except ValueError:   # an unknown dtype or device: the settings' own checks name it
        return False


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
    """The saved optimiser state is what `optimizer` (built for this run's settings) would hold:
    each param group has its settings (load_state_dict takes a saved group's as they are: amsgrad,
    say, then fails at the first step), and each parameter's state has the keys this optimiser keeps
    for them, each with the parameter's shape and dtype, finite.  After a step (`step` > 0) the state
    is not empty and is keyed by the saved parameter indices: load_state_dict would otherwise drop
    it silently and restart AdamW's moments."""
    groups, state = saved.get("param_groups"), saved.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(
            isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
        raise CheckpointError(f"{path} is damaged: its 'optimizer' entry lacks param_groups or state")
    saved_ids = [index for group in groups for index in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if len(saved_ids) != len(params) or len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: its 'optimizer' entry holds {len(saved_ids)} parameters in {len(groups)} "
                              f"groups, the model has {len(params)} in {len(optimizer.param_groups)}; it belongs "
                              "to another model")
    stray = [key for key in state if key not in saved_ids]
    if stray or (step > 0 and not state):
        found = f"entries under keys {stray[:3]!r} that name no parameter" if stray else "no entries"
        raise CheckpointError(f"{path} is damaged: its optimiser state has {found} after step {step}, so the "
                              "resume would restart AdamW's moments; use another checkpoint")
    names = {id(param): name for name, param in model.named_parameters()}
    for number, (group, fresh) in enumerate(zip(groups, optimizer.param_groups)):
        differences = group_differences(group, fresh)
        if differences:
            raise CheckpointError(f"{path} is damaged: its optimiser's param group {number} differs from the one "
                                  f"these settings build ({'; '.join(differences)})")
        expected = state_keys(optimizer, fresh)
        for index, param in zip(group["params"], fresh["params"]):
            entry = state.get(index, {})
            keys = set(entry) if isinstance(entry, dict) else {"<not a dict>"}
            if entry and keys != expected:
                raise CheckpointError(f"{path} is damaged: its optimiser state of {names[id(param)]!r} holds "
                                      f"{sorted(keys)}, this optimiser keeps {sorted(expected)}")
            for key, value in entry.items():
                if not fits_parameter(key, value, param):
                    found = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                             else type(value).__name__)
                    raise CheckpointError(f"{path} is damaged: its optimiser state {key!r} of {names[id(param)]!r} "
                                          f"is {found} (or not finite), the parameter is {tuple(param.shape)} "
                                          f"{param.dtype}")


# How a param group's step runs, not what it computes: these follow the device (fused on CUDA) and
# may differ on --resume; the learning rate is set by the schedule before every step.
UNCOMPARED_SETTINGS = ("params", "lr", "initial_lr", "fused", "foreach", "capturable")


def group_differences(saved: dict[str, Any], fresh: dict[str, Any]) -> list[str]:
    """'key: checkpoint A, this run B' for each setting of a saved param group that differs from the
    fresh one's.  A setting the saved group lacks (saved by an older torch) takes its default when
    loaded, as in the fresh group."""
    def plain(value: Any) -> Any:   # a tuple comes back from torch.load as a list, and vice versa
        return tuple(value) if isinstance(value, (list, tuple)) else value
    keys = sorted(set(saved) - set(UNCOMPARED_SETTINGS))
    return [f"{key}: checkpoint {saved[key]!r}, this run {fresh.get(key, '<absent>')!r}"
            for key in keys if plain(saved[key]) != plain(fresh.get(key, "<absent>"))]


def state_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> set[str]:
    """The state keys `optimizer`'s class keeps per parameter with `group`'s settings, learned from one
    step of a twin on a one-element parameter (AdamW: step, exp_avg, exp_avg_sq; with amsgrad also
    max_exp_avg_sq)."""
    probe = torch.nn.Parameter(torch.zeros(1))
    probe.grad = torch.zeros(1)
    twin = type(optimizer)([probe])
    twin.param_groups[0].update({key: value for key, value in group.items()   # as load_state_dict sets them
                                 if key not in (*UNCOMPARED_SETTINGS, "param_names")})
    twin.step()
    return set(twin.state[probe])


def fits_parameter(key: str, value: Any, param: torch.Tensor) -> bool:
    """A finite tensor of the parameter's shape and dtype; the step count a finite scalar >= 0."""
    if key == "step":   # AdamW keeps it as a one-element float tensor
        number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        return isinstance(number, (int, float)) and not isinstance(number, bool) and 0 <= number < math.inf
    return (isinstance(value, torch.Tensor) and value.shape == param.shape and value.dtype == param.dtype
            and bool(value.isfinite().all()))


def check_progress(checkpoint: dict[str, Any], config: TrainConfig, path: Path | str) -> None:
    """The data position agrees with the step and the seed (one batch drawn per step), and the
    recorded val estimates are finite and taken at or before the step: an edited step or loader seed
    would otherwise change the resumed run without a word, and a NaN estimate become its best."""
    loader, step, stats = checkpoint["loader"], checkpoint["step"], checkpoint["stats"]
    position = (loader.get("seed"), loader.get("batches_drawn"))
    if position != (config.model.seed, step):
        raise CheckpointError(f"{path} is damaged: its data position (seed, batches drawn) is {position}, a run "
                              f"of seed {config.model.seed} at step {step} is at {(config.model.seed, step)}; "
                              f"{REPLACE_HINT}")
    steps, values = stats.get("val_steps"), stats.get("val_bpc")
    if not (isinstance(steps, list) and isinstance(values, list) and all(isinstance(n, int) and 0 <= n <= step
                                                                          for n in steps)
            and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
        raise CheckpointError(f"{path} is damaged: its recorded val estimates (steps {reprlib.repr(steps)}, bpc "
                              f"{reprlib.repr(values)}) are not finite numbers at steps up to {step}; {REPLACE_HINT}")


def check_own_run(saved: TrainConfig, run_name: str, path: Path | str) -> None:
    """A checkpoint resumes only in the run directory it was written for: one copied or linked into another
    run's directory would train on under that run's name, into its logs.  The record names its run
    (--run-name, relative to --out-dir, so a whole --out-dir may move); records without one cannot tell."""
    recorded = saved.run.run_name
    if recorded and recorded != run_name:
        raise CheckpointError(f"{path} is the checkpoint of run {recorded!r}, not of {run_name!r} where it was "
                              f"found (copied or linked here?); resume it as --run-name {recorded} in its own "
                              "directory, or start this run afresh without it")


def saved_config(checkpoint: dict[str, Any], path: Path | str) -> TrainConfig:
    """The checkpoint's configuration, checked as every command that reads one checks it (eval.py,
    --resume, grid.py): `recorded_config`."""
    try:
        return recorded_config(checkpoint["config"])
    except ValueError as error:
        raise CheckpointError(f"{path}: its saved configuration is not valid ({first_line(error)}); "
                              f"{REPLACE_HINT}") from None


def import_recorded(checkpoint: dict[str, Any], path: Path | str) -> None:
    """The run's own --import values, when its feature map is not registered yet."""
    config = checkpoint.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    run = config.get("run") if isinstance(config, dict) else None
    if not isinstance(model, dict) or model.get("feature_map") in ("", None, *linattn.available_feature_maps()):
        return
    recorded = run.get("imports", []) if isinstance(run, dict) else []
    if not isinstance(recorded, list):
        raise CheckpointError(f"{path} is damaged: its recorded imports are {type(recorded).__name__}, not a list; "
                              "pass --import MODULE_OR_FILE to give feature map "
                              f"{model['feature_map']!r}'s code")
    try:
        import_user_code([str(name) for name in recorded])
    except UsageError as error:
        raise CheckpointError(f"{path} needs feature map {model['feature_map']!r} from its recorded imports, "
                              f"which failed: {error}; pass --import MODULE_OR_FILE to give its new place") from None


def model_from_checkpoint(checkpoint: dict[str, Any], path: Path | str = "checkpoint",
                          backend: str | None = None) -> ByteLM:
    """Rebuild the model from the checkpoint's config and load its weights (and feature-map state).
    `backend`: the attention kernels to run it with instead of the run's (speed only: a run trained
    with backend='fla' on a GPU, evaluated on a CPU)."""
    checkpoint_entries(checkpoint, path, ("config", "step", "model", "data"))
    check_finite_weights(checkpoint["model"], path)
    config = saved_config(checkpoint, path).model
    if backend is not None:
        config = replace(config, backend=backend)
        config.validate()   # a backend this attention has not: a usage error, not a damaged checkpoint
    model = ByteLM(config)
    load_weights(model, checkpoint["model"], path)
    return model


def check_setting_names(cls: type, values: Any, section: str) -> None:
    if not isinstance(values, dict):
        raise ValueError(f"the {section} settings must be a dict, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} setting(s) {unknown}; known: {sorted(known)}")


def from_plain_dict(cls: type, values: Any, section: str) -> Any:
    check_setting_names(cls, values, section)
    config = cls(**values)
    check_types(config)
    return config


def parsed_record(values: Any) -> TrainConfig:
    """A checkpoint's config as sections, the one way every command reads one (--resume, eval.py and
    grid.py through `recorded_config`): unknown sections and settings are errors, each setting has its
    type, and a section or setting it lacks (written before that setting existed) takes the
    default.  Not validated: settings of the machine it ran on (device, paths) may not fit this one."""
    return TrainConfig(**{name: saved_section(values, name) for name in SECTIONS})


def saved_section(values: Any, name: str) -> Any:
    """One section of a checkpoint's config, read as `parsed_record` reads it, for commands that need
    only that section (eval.py: the model).  Every section's names are checked, unknown ones
    refused; only this one's values are typed (the run section's paths and device name another
    machine's, and eval.py takes its own)."""
    if not isinstance(values, dict):
        raise ValueError(f"the config must be a dict of sections, got {type(values).__name__}")
    unknown = sorted(set(values) - set(SECTIONS), key=str)
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; known: {sorted(SECTIONS)}")
    for section, cls in SECTIONS.items():
        check_setting_names(cls, values.get(section, {}), section)
    return from_plain_dict(SECTIONS[name], values.get(name, {}), name)


def recorded_config(values: Any) -> TrainConfig:
    """A checkpoint's config as every command that reads one takes it (eval.py, --resume, grid.py):
    `parsed_record` with every section present, then every check that holds on any machine (this
    machine's device, memory and kernels are the command's to check)."""
    missing = [name for name in SECTIONS if isinstance(values, dict) and name not in values]
    if missing:
        raise ValueError(f"the config lacks section(s) {missing}")
    if isinstance(values, dict) and isinstance(values["model"], dict) and values["model"].get("backend") == "triton":
        # the retired Triton kernels: a speed-only setting, so a run saved with it goes on with auto's choice
        values = {**values, "model": {**values["model"], "backend": "auto"}}
    config = parsed_record(values)
    config.optim.validate()
    config.log.validate()
    config.run.check_fields()
    config.task.validate()
    config.model.validate()
    return config
