"""A feature map checked once, before any work: built, then probed by `linattn.check_feature_map`.

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


def map_origin(name: str) -> str:
    """The file that defines the registered map `name` (its module when there is no file)."""
    cls = linattn.feature_map_class(name)
    try:
        return inspect.getsourcefile(cls) or cls.__module__
    except TypeError:   # a class defined without a source file
        return cls.__module__


def checked_feature_map(name: str, build: Callable[[], linattn.FeatureMap]) -> linattn.FeatureMap:
    """build()'s map once it passed the library's probe; a ValueError that says what was wrong
    otherwise.  A ValueError from build() passes as it is: make_feature_map's messages name the bad
    option.  The build and the probe run on a fork of torch's generator, so a check changes no weights
    a seed gives (maps such as taylor's and hedgehog's initialise from that generator)."""
    where = f"feature map {name!r} (from {map_origin(name)})"
    with torch.random.fork_rng(devices=[]):
        try:
            feature_map = build()
        except ValueError:
            raise
        except (Exception, SystemExit) as error:   # user code may raise anything, or exit
            raise ValueError(f"{where} cannot be built: {described(error)}") from None
        try:
            return linattn.check_feature_map(feature_map)
        except ValueError as error:
            raise ValueError(f"{where}: {first_line(error)}") from None
        except (Exception, SystemExit) as error:   # the map's own code, beyond what the probe catches
            raise ValueError(f"{where}: its probe raised {described(error)}") from None


def described(error: BaseException) -> str:
    return f"{type(error).__name__}: {first_line(error)}"
