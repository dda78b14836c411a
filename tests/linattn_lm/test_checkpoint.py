"""linattn_lm.checkpoint: the digest every load verifies (any changed byte is caught), checkpoints
from before the digest, and the optimiser state and data position checked against the run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linattn_lm.checkpoint import (CheckpointError, check_optimizer_state, check_progress, load_checkpoint,
                                   save_checkpoint)
from linattn_lm.flags import config_from_flags


def small_payload() -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    """A model and AdamW after one step: state with exp_avg and exp_avg_sq tensors."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    payload = {"config": {}, "step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
               "data": "test data", "loader": {"seed": 0, "batches_drawn": 1}}
    return payload, model, optimizer


def tensor_offset(data: bytes, tensor: torch.Tensor) -> int:
    """Where a tensor's bytes lie in a checkpoint file."""
    offset = data.find(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    assert offset > 0
    return offset


def test_every_single_changed_byte_is_caught_naming_the_file(tmp_path: Path) -> None:
    payload, _, optimizer = small_payload()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, payload)
    good = path.read_bytes()
    assert load_checkpoint(path)["step"] == 1
    exp_avg = tensor_offset(good, optimizer.state_dict()["state"][0]["exp_avg"])
    offsets = sorted({*range(len(good)), exp_avg + 5})   # every byte, one inside AdamW's exp_avg among them
    for offset in offsets:
        for change in (0x01, 0xFF):
            damaged = bytearray(good)
            damaged[offset] ^= change
            path.write_bytes(bytes(damaged))
            with pytest.raises(CheckpointError, match="ckpt.pt") as error:
                load_checkpoint(path)
            assert "\n" not in str(error.value)
    path.write_bytes(good + b"x")   # and a byte appended, or the last one cut
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(path)
    path.write_bytes(good[:-1])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(path)


def test_a_checkpoint_from_before_the_digest_loads_with_a_one_line_warning(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    payload, _, _ = small_payload()
    path = tmp_path / "ckpt.pt"
    torch.save({"format": "linattn-byte-lm", "version": 2, **payload}, path)   # what train.py wrote before
    assert load_checkpoint(path)["step"] == 1
    load_checkpoint(path)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "no digest" in warning[0] and str(path) in warning[0]   # once per file
    save_checkpoint(path, payload)   # sealed by the next save
    load_checkpoint(path)
    assert capsys.readouterr().err == ""
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)   # unsealed too, but no checkpoint of train.py's
    with pytest.raises(CheckpointError, match="not a linattn"):
        load_checkpoint(foreign)
    assert capsys.readouterr().err == ""   # its error alone, no warning line before it


def test_an_optimiser_state_this_optimiser_would_not_keep_is_refused(tmp_path: Path) -> None:
    payload, model, optimizer = small_payload()
    saved = optimizer.state_dict()
    check_optimizer_state(saved, optimizer, model, "ckpt.pt", step=1)
    amsgrad = {**saved, "param_groups": [{**group, "amsgrad": True} for group in saved["param_groups"]]}
    with pytest.raises(CheckpointError, match="amsgrad: checkpoint True, this run False"):
        check_optimizer_state(amsgrad, optimizer, model, "ckpt.pt", step=1)
    extra = {**saved, "state": {index: {**entry, "max_exp_avg_sq": entry["exp_avg_sq"]}
                                for index, entry in saved["state"].items()}}
    with pytest.raises(CheckpointError, match="max_exp_avg_sq"):
        check_optimizer_state(extra, optimizer, model, "ckpt.pt", step=1)
    betas = {**saved, "param_groups": [{**group, "betas": (0.9, 1.5)} for group in saved["param_groups"]]}
    with pytest.raises(CheckpointError, match="betas"):
        check_optimizer_state(betas, optimizer, model, "ckpt.pt", step=1)


@pytest.mark.parametrize("change, problem", [
    (lambda c: c["loader"].update(seed=7), "data position"),
    (lambda c: c.update(step=5), "data position"),
    (lambda c: c["stats"]["val_bpc"].__setitem__(0, float("nan")), "val estimates"),
    (lambda c: c["stats"]["val_steps"].__setitem__(0, 99), "val estimates"),
])
def test_a_record_that_disagrees_with_itself_is_refused(change, problem) -> None:
    config = config_from_flags({"preset": "tiny", "data_dir": "/nonexistent"})
    checkpoint = {"step": 10, "loader": {"seed": 0, "batches_drawn": 10},
                  "stats": {"val_steps": [10], "val_bpc": [4.5]}}
    check_progress(checkpoint, config, "ckpt.pt")
    change(checkpoint)
    with pytest.raises(CheckpointError, match=problem):
        check_progress(checkpoint, config, "ckpt.pt")


@pytest.mark.parametrize("version", ["2", 1, None])
def test_a_checkpoint_of_another_version_is_refused_naming_both(tmp_path: Path, version) -> None:
    payload, _, _ = small_payload()
    path = tmp_path / "ckpt.pt"
    torch.save({"format": "linattn-byte-lm", "version": version, **payload}, path)
    with pytest.raises(CheckpointError, match=rf"version {version!r}.*reads version 2") as refused:
        load_checkpoint(path)
    assert ("not a number" in str(refused.value)) != isinstance(version, int)   # a str or None is explained
