"""Feature maps checked once, before any work: every way a plug-in map can be wrong is one line
that names the map, its file and what was wrong; train.py refuses it before loading data."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
import torch

from linattn import FeatureMap, register_feature_map
from linattn.feature_maps import FEATURE_MAPS
from linattn_lm import ByteLM, ModelConfig, training


@contextlib.contextmanager
def registered(cls: type[FeatureMap]) -> Iterator[str]:
    """`cls` under a test name for the block only (other tests list every registered map)."""
    name = f"test-{cls.__name__.lower()}"
    register_feature_map(name)(cls)
    try:
        yield name
    finally:
        del FEATURE_MAPS[name]


class ExtraFeatures(FeatureMap):
    def forward(self, x, *, is_query):
        return torch.relu(torch.cat([x, x[..., :5]], -1)) + 1e-6


class Negative(FeatureMap):
    def forward(self, x, *, is_query):
        return x.float()


class NotANumber(FeatureMap):
    def forward(self, x, *, is_query):
        return torch.full_like(x, float("nan"))


class RaisesInForward(FeatureMap):
    def forward(self, x, *, is_query):
        raise RuntimeError("boom")


class ExitsInForward(FeatureMap):
    def forward(self, x, *, is_query):
        raise SystemExit(0)


class KeyErrorInInit(FeatureMap):
    def __init__(self, head_dim):
        super().__init__(head_dim)
        {}["missing"]


class ReturnsAList(FeatureMap):
    def forward(self, x, *, is_query):
        return [x]


class AllZero(FeatureMap):
    def forward(self, x, *, is_query):
        return torch.zeros_like(x)


class LogSpaceWithoutLogs(FeatureMap):
    log_space = True

    def forward(self, x, *, is_query):
        return x.exp()


class LogsThatDoNotMatch(FeatureMap):
    log_space = True

    def forward(self, x, *, is_query):
        return x.exp()

    def log_features(self, x, *, is_query):
        return 2 * x


class NegativeKernel(FeatureMap):
    nonnegative_features = False

    def forward(self, x, *, is_query):
        return x


class TaylorLike(FeatureMap):
    """1 + q.k + (q.k)^2 / 2 >= 1/2: single features are negative, the kernel is not."""
    nonnegative_features = False

    def __init__(self, head_dim):
        super().__init__(head_dim)
        self.num_features = 1 + head_dim + head_dim ** 2

    def forward(self, x, *, is_query):
        squares = (x[..., :, None] * x[..., None, :]).flatten(-2) / 2 ** 0.5
        return torch.cat([torch.ones_like(x[..., :1]), x, squares], -1)


class ShiftedLogs(FeatureMap):
    """log_features = log(forward) + a per-row constant: what FeatureMap's contract allows."""
    log_space = True

    def forward(self, x, *, is_query):
        return x.exp()

    def log_features(self, x, *, is_query):
        return x + x.sum(-1, keepdim=True)


@pytest.mark.parametrize("cls, message", [
    (ExtraFeatures, "num_features"),
    (Negative, "forward(x, is_query=True) returned negative features"),
    (NotANumber, "forward(x, is_query=True) returned NaN or inf values"),
    (RaisesInForward, "forward(x, is_query=True) raised RuntimeError: boom"),
    (ExitsInForward, "its probe raised SystemExit: 0"),
    (KeyErrorInInit, "cannot be built: KeyError: 'missing'"),
    (ReturnsAList, "forward(x, is_query=True) returned list, not a floating-point tensor"),
    (AllZero, "forward(x, is_query=True) returned all zeros"),
    (LogSpaceWithoutLogs, "log_features(x, is_query=True) raised NotImplementedError: LogSpaceWithoutLogs sets "
                          "log_space = True, so it must implement log_features"),
    (LogsThatDoNotMatch, "log_features(x, is_query=True) is not log(forward(x)) up to a per-row constant"),
    (NegativeKernel, "sets nonnegative_features = False, but phi(q).phi(k) is negative"),
])
def test_a_broken_map_is_one_line_naming_it_its_file_and_the_fault(cls, message: str, small_config) -> None:
    with registered(cls) as name, pytest.raises(ValueError) as error:
        small_config(feature_map=name)
    text = str(error.value)
    assert text.startswith(f"feature map {name!r} (from {__file__})") and message in text, text
    assert "\n" not in text and "rotary" not in text


@pytest.mark.parametrize("cls", [TaylorLike, ShiftedLogs])
def test_maps_that_keep_the_contract_pass(cls, small_config) -> None:
    with registered(cls) as name:
        assert small_config(feature_map=name, rope="pre").feature_map == name   # Taylor's M is odd


def test_every_registered_map_passes(small_config) -> None:
    for name in sorted(FEATURE_MAPS):
        small_config(feature_map=name, feature_map_options={})


def test_train_refuses_a_broken_map_before_loading_data(tmp_path: Path, tiny: list[str], run_main) -> None:
    with registered(AllZero) as name:
        code, out, err = run_main(training.main, [*tiny, "--data-dir", str(tmp_path / "no-data"), "--out-dir",
                                                  str(tmp_path), "--feature-map", name])
    assert code == 2 and out == "" and "returned all zeros" in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.iterdir())


class NanOnLongInputs(FeatureMap):
    """Passes the probe (a few tokens), gives NaN on the model's sequences."""

    def forward(self, x, *, is_query):
        return (torch.relu(x) + 1e-6) * (torch.nan if x.shape[-2] > 8 else 1.0)


def test_a_map_that_is_non_finite_at_the_first_step_is_not_a_learning_rate_problem(
        data_dir: Path, tiny: list[str], tmp_path: Path, run_main) -> None:
    with registered(NanOnLongInputs) as name:
        code, _, err = run_main(training.main, [*tiny, "--data-dir", str(data_dir), "--out-dir", str(tmp_path),
                                                "--feature-map", name, "--eval-iters", "1"])
    assert code == 1 and "training stopped at step 1" in err and "lower --lr" not in err, err
    assert f"the learning rate is not the cause: feature map {name!r} likely gives non-finite values" in err


def test_validation_draws_nothing_from_torchs_generator() -> None:
    """The map's check builds taylor's projection (dim != head_dim, drawn from torch's generator) on a
    fork of it: checking a config leaves the weights a seed gives as they were."""
    config = ModelConfig(n_layer=2, d_model=32, n_head=2, feature_map="taylor", feature_map_options={"dim": 4})
    torch.manual_seed(0)
    config.validate()
    drawn = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(4))


def test_the_model_trusts_a_validated_config(monkeypatch) -> None:
    """ByteLM checks nothing again: the config was validated where it was built."""
    config = ModelConfig(n_layer=2, d_model=32, n_head=2, feature_map_options={"num_features": 16})
    config.validate()
    calls = []
    monkeypatch.setattr(ModelConfig, "check_fields", lambda self: calls.append(self))
    monkeypatch.setattr(ModelConfig, "check_map", lambda self: calls.append(self))
    ByteLM(config)
    assert calls == []
