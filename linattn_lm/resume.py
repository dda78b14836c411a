"""--resume: the checkpoint's record merged with the flags given, and the run's state checked and restored."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .checkpoint import (CHECKPOINT_NAME, CheckpointError, check_finite_weights, check_own_run, check_progress,
                         checkpoint_entries, import_recorded, load_checkpoint, same_precision, saved_config,
                         saved_precision)
from .flags import flag_name, merged_flags
from .process import Distributed
from .runlock import DirectoryLock
from .settings import ABSENT, RESUMABLE, SECTIONS, TrainConfig, field_default


def config_differences(saved: dict[str, Any], current: dict[str, Any], saved_as: str = "checkpoint") -> list[str]:
    """'key: checkpoint A, now B' for every differing setting that may not change on --resume.  A
    setting absent from a config was added after it was written, and it ran with the setting's
    default (normalization, say): checkpoints and results from before still match."""
    keys = sorted((set(saved) | set(current)) - RESUMABLE)
    differing = [(key, saved.get(key, field_default(key)), current.get(key, field_default(key))) for key in keys]
    return [f"{key}: {saved_as} {before!r}, now {now!r}" for key, before, now in differing if before != now]


def contradictions(recorded: dict[str, Any], given: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(flag, recorded value, given value) for every setting given on a resume that may not change
    (not RESUMABLE, or the preset, whose values the record already holds) and differs from the
    record (flat settings); feature-map options one by one.  Values compare as JSON writes them (a
    tuple given against the list a JSON record holds is the same value)."""
    def same(a: Any, b: Any) -> bool:
        return json.loads(json.dumps(a, default=repr)) == json.loads(json.dumps(b, default=repr))

    options = recorded.get("feature_map_options", {})
    found = [(flag_name(key), recorded.get(key, ABSENT), value) for key, value in given.items()
             if key != "feature_map_options" and (key not in RESUMABLE or key == "preset")
             and not same(recorded.get(key, ABSENT), value)]
    return found + [(f"--feature-map-option {key}", options.get(key, ABSENT), value)
                    for key, value in given.get("feature_map_options", {}).items()
                    if not same(options.get(key, ABSENT), value)]


def config_from_record(saved: TrainConfig, given: dict[str, Any]) -> TrainConfig:
    """--resume's settings: the checkpoint's record, with the flags given on resume.  A flag that may
    change on --resume (RESUMABLE: steps, intervals, paths, device, ...) replaces the recorded value;
    any other must repeat it, and one that contradicts the record is refused, every difference named
    (--preset too: the record holds what the preset gave).  Validated like flags, on this machine."""
    given = {key: value for key, value in given.items() if value is not None}
    recorded = saved.flat()
    contradicting = contradictions(recorded, given)
    if contradicting:
        listed = "; ".join(f"{key}: checkpoint {before!r}, given {now!r}" for key, before, now in contradicting)
        raise ValueError(f"--resume continues the run as its checkpoint records it, and these flags contradict the "
                         f"record: {listed}; drop them (the record gives them), or start a new run elsewhere")
    values = {**recorded, **{key: value for key, value in given.items() if key in RESUMABLE}}
    config = TrainConfig(**{name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})
                            for name, cls in SECTIONS.items()})
    config.validate(probe_map=False)
    return config


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng(saved: list[dict[str, torch.Tensor]], ctx: Distributed, seed: int) -> None:
    """Each rank continues its own dropout RNG; a different world size reseeds instead."""
    if len(saved) != ctx.world_size:
        tqdm.write(f"warning: checkpoint holds RNG states for {len(saved)} rank(s), this job has "
                   f"{ctx.world_size}: dropout masks are reseeded, so the run is not bit-identical")
        torch.manual_seed(seed + 1 + ctx.rank)
        return
    torch.set_rng_state(saved[ctx.rank]["torch"])
    if "cuda" in saved[ctx.rank] and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(saved[ctx.rank]["cuda"], ctx.device)


def load_for_resume(path: Path, config: TrainConfig, data: str) -> dict[str, Any]:
    """The run's checkpoint, refused unless it is whole (its digest), holds every entry, agrees with
    itself and has the same configuration (`config` from flags: grid.py; from the record: train.py)."""
    checkpoint = load_checkpoint(path)
    checkpoint_entries(checkpoint, path)
    saved_precision(checkpoint, path)
    check_finite_weights(checkpoint["model"], path)
    saved = saved_config(checkpoint, path)
    check_own_run(saved, config.run.run_name, path)
    check_progress(checkpoint, saved, path)
    differences = config_differences(saved.flat(), config.flat())
    if differences:
        raise CheckpointError(f"cannot resume {path}: it was trained with a different configuration "
                              f"({'; '.join(differences)}); only steps, intervals, paths, device, backend, "
                              "compile, threads, imports and the preset name may change")
    if checkpoint["data"] != data:
        raise CheckpointError(f"cannot resume {path}: it was trained on {checkpoint['data']}, "
                              f"the data directory now holds {data}")
    return checkpoint


def schedule_note(saved_steps: int, config: TrainConfig) -> str:
    """What a longer --steps on resume does to the learning rate: the recorded schedule goes on."""
    optim = config.optim
    if optim.decay_steps <= saved_steps:
        after = (f"the cosine decay ended at step {optim.decay_steps}, so steps {saved_steps + 1}-{optim.steps} run "
                 f"at min_lr {optim.min_lr:g}")
    else:
        after = f"the cosine decay goes on to min_lr {optim.min_lr:g} at step {optim.decay_steps}"
    return (f"--steps {optim.steps} extends the run from {saved_steps} steps with its recorded schedule: {after} "
            "(--decay-steps set at the start decides this)")


def resume_settings(given: dict[str, Any]) -> TrainConfig:
    """--resume's settings: the checkpoint's record, which the flags given may only extend
    (config_from_record).  The run is found by --out-dir and --run-name (its default: the variant the
    flags name, as when it started)."""
    run_name = given.get("run_name") or merged_flags(given).run.run_name
    path = Path(given.get("out_dir", field_default("out_dir"))) / run_name / CHECKPOINT_NAME
    with DirectoryLock(path.parent):   # a run directory in use is refused as such, before its checkpoint is read
        checkpoint = load_checkpoint(path)
    import_recorded(checkpoint, path)
    checkpoint_entries(checkpoint, path, ("config",))
    saved = saved_config(checkpoint, path)
    if "dtype" in given and same_precision(given["dtype"], checkpoint, path, given.get("device", saved.run.device)):
        given = {key: value for key, value in given.items() if key != "dtype"}   # the record's, in effect
    return config_from_record(saved, {**given, "run_name": run_name})

