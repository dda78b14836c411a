"""A feature map checked once, before any work: built, then run on a small probe input.

A map registered by --import is user code, and what it gets wrong (the number of features, their
sign, NaN, an exception in __init__ or forward, a log_space map without log_features) would
otherwise surface inside the attention op after training has started, as a traceback or a message
about the rotary embedding.  Every failure here is a one-line ValueError naming the map, the file it
comes from and what was wrong.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

import linattn

from .errors import first_line

PROBE_SHAPE = (2, 2, 5)        # batch, heads, tokens
LOG_TOLERANCE = 1e-3           # how far log(forward) - log_features may vary along a row (float32)
SMALLEST_COMPARED = 1e-30      # features below this underflow in log(); they are left out of that comparison


def map_origin(name: str) -> str:
    """The file that defines the registered map `name` (its module when there is no file)."""
    cls = linattn.feature_map_class(name)
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:   # a class defined without a source file
        return cls.__module__


def checked_feature_map(name: str, build: Callable[[], linattn.FeatureMap]) -> linattn.FeatureMap:
    """build()'s map once it passed the probe; a ValueError that says what was wrong otherwise.  A
    ValueError from build() passes as it is: make_feature_map's messages name the bad option.  The
    build and the probe run on a fork of torch's generator, so a check changes no weights a seed gives
    (maps such as taylor's and hedgehog's initialise from that generator)."""
    with torch.random.fork_rng(devices=[]):
        return built_and_probed(name, build)


def built_and_probed(name: str, build: Callable[[], linattn.FeatureMap]) -> linattn.FeatureMap:
    where = f"feature map {name!r} (from {map_origin(name)})"
    try:
        feature_map = build()
    except ValueError:
        raise
    except (Exception, SystemExit) as error:   # user code may raise anything, or exit
        raise ValueError(f"{where} cannot be built: {described(error)}") from None
    if not isinstance(feature_map, linattn.FeatureMap):
        raise ValueError(f"{where} built a {type(feature_map).__name__}, not a linattn.FeatureMap")
    was_training = feature_map.training
    feature_map.eval()   # a probe is not a training call (FAVOR+ counts those for its redraws)
    try:
        with torch.no_grad():
            probe(feature_map, where)
    finally:
        feature_map.train(was_training)
    return feature_map


def described(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"


def probe(feature_map: linattn.FeatureMap, where: str) -> None:
    """Features and log-features of a random probe input: shape, finite, non-negative (or, for a map
    whose single features may be negative, a non-negative kernel), not all zero, consistent logs."""
    num_features = feature_map.num_features
    if not linattn.is_integer(num_features) or num_features < 1:
        raise ValueError(f"{where} declares num_features = {num_features!r}; it must be a positive integer")
    batch, heads, tokens = PROBE_SHAPE
    heads = getattr(feature_map, "heads", heads)   # a map with weights per head takes its own head count
    x = torch.randn(batch, heads, tokens, feature_map.head_dim, generator=torch.Generator().manual_seed(0))
    expected = (batch, heads, tokens, num_features)

    def run(method: str, is_query: bool) -> torch.Tensor:
        try:
            out = getattr(feature_map, method)(x, is_query=is_query)
        except (Exception, SystemExit) as error:
            raise ValueError(f"{where}: {method}(x, is_query={is_query}) raised {described(error)}") from None
        return checked_tensor(out, f"{where}: {method}(x, is_query={is_query})", expected)

    features = {is_query: run("forward", is_query) for is_query in (True, False)}
    check_sign(feature_map, features, where)
    if feature_map.log_space:
        logs = {is_query: run("log_features", is_query) for is_query in (True, False)}
        check_logs_match(features, logs, where)


def checked_tensor(out: object, what: str, expected: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        found = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{what} returned {found}, not a floating-point tensor")
    if tuple(out.shape) != expected:
        raise ValueError(f"{what} returned shape {tuple(out.shape)} for inputs of shape {(*expected[:-1], 'D')}, "
                         f"but the map declares num_features = {expected[-1]}: return (B, H, N, num_features) "
                         "or set self.num_features to what it returns")
    if not torch.isfinite(out).all():
        raise ValueError(f"{what} returned NaN or inf values for a standard normal input")
    return out


def check_sign(feature_map: linattn.FeatureMap, features: dict[bool, torch.Tensor], where: str) -> None:
    """Linear attention divides by sum_n phi(q).phi(k_n): it must be made of non-negative terms."""
    for is_query, values in features.items():
        if not values.any():
            raise ValueError(f"{where}: forward(x, is_query={is_query}) returned all zeros, so attention has "
                             "nothing to weigh")
    if getattr(feature_map, "nonnegative_features", True):
        for is_query, values in features.items():
            if values.min() < 0:
                raise ValueError(f"{where}: forward(x, is_query={is_query}) returned negative features (down to "
                                 f"{values.min().item():.3g}); features must be >= 0, or the map sets "
                                 "nonnegative_features = False and keeps phi(q).phi(k) >= 0")
        return
    kernel = torch.einsum("bhnm,bhkm->bhnk", features[True], features[False])
    if kernel.min() < 0:
        raise ValueError(f"{where} sets nonnegative_features = False, but phi(q).phi(k) is negative (down to "
                         f"{kernel.min().item():.3g}); the kernel must be >= 0")


def check_logs_match(features: dict[bool, torch.Tensor], logs: dict[bool, torch.Tensor], where: str) -> None:
    """log_features = log(forward) up to a per-row constant (FeatureMap's contract)."""
    for is_query, values in features.items():
        compared = values > SMALLEST_COMPARED
        difference = torch.where(compared, values.clamp_min(SMALLEST_COMPARED).log() - logs[is_query], torch.nan)
        spread = (difference.nan_to_num(-torch.inf).amax(-1) - difference.nan_to_num(torch.inf).amin(-1))
        spread = spread[compared.sum(-1) > 1]
        if spread.numel() and spread.max() > LOG_TOLERANCE:
            raise ValueError(f"{where}: log_features(x, is_query={is_query}) is not log(forward(x)) up to a "
                             f"per-row constant (it differs by up to {spread.max().item():.3g} within a row)")
