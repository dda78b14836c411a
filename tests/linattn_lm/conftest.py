"""Fixtures for the LM harness tests: small model configs, in-process runs of the commands and
TensorBoard scalars (the prepared data slice, `data_dir`, is in tests/conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from linattn_lm import ModelConfig, training

@pytest.fixture(scope="session")
def tiny() -> list[str]:
    """Flags every test run of train.py / grid.py uses: tiny sizes, one thread (CPU is shared)."""
    return ["--preset", "tiny", "--threads", "1"]


@pytest.fixture(scope="session")
def small_config() -> Callable[..., ModelConfig]:
    """A 2-layer, 32-wide model config; favor + post unless overridden."""
    def make(**overrides: Any) -> ModelConfig:
        values = dict(n_layer=2, d_model=32, n_head=2, seq_len=16, chunk_size=8,
                      feature_map_options={"num_features": 16, "redraw_interval": 1000})
        values.update(overrides)
        if values.get("attention") == "softmax":
            values.update(feature_map="", feature_map_options={})
        elif values.get("feature_map", "favor") != "favor" and "feature_map_options" not in overrides:
            values.update(feature_map_options={})
        config = ModelConfig(**values)
        config.validate()
        return config
    return make


@pytest.fixture
def run_main(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """(exit status, stdout, stderr) of an in-process main(argv), argparse exits included."""
    def run(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture(scope="session")
def scalars() -> Callable[[Path, str], list[tuple[int, float]]]:
    """(step, value) of a TensorBoard scalar tag as TensorBoard shows it (purged steps dropped)."""
    def read(run_dir: Path, tag: str) -> list[tuple[int, float]]:
        events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        events.Reload()
        return [(event.step, event.value) for event in events.Scalars(tag)]
    return read


@pytest.fixture
def signal_at_the_last_step(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Send this process a signal during each run's final evaluation, after its last optimiser step."""
    def arrange(signum: int) -> None:
        evaluate_and_sample = training.Trainer.evaluate_and_sample

        def late(self: training.Trainer) -> None:
            evaluate_and_sample(self)
            if self.step == self.config.optim.steps:
                os.kill(os.getpid(), signum)
        monkeypatch.setattr(training.Trainer, "evaluate_and_sample", late)
    return arrange
