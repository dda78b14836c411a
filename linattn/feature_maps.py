"""Feature maps phi: (B, H, N, D) -> non-negative (B, H, N, M), registered by name.

A map is called as `fm(x, is_query=...)`, so queries and keys may be mapped differently.  All the
randomness of a map (FAVOR+'s projection) lives inside it, drawn reproducibly from its own seed.

Add a map in a few lines:

    @register_feature_map("relu")
    class ReluFeatureMap(FeatureMap):
        def forward(self, x, *, is_query):
            return torch.relu(x)
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from performer_pytorch.performer_pytorch import gaussian_orthogonal_random_matrix
from torch import nn

from .checks import is_integer
from .ops.linear_attention.common import LogProjection

FEATURE_MAPS: dict[str, type["FeatureMap"]] = {}


def register_feature_map(name: str):
    """Class decorator that makes a `FeatureMap` selectable by `name` (e.g. `--feature-map name`)."""
    def register(cls: type[FeatureMap]) -> type[FeatureMap]:
        if name in FEATURE_MAPS and FEATURE_MAPS[name] is not cls:
            raise ValueError(f"feature map name {name!r} is already registered to "
                             f"{FEATURE_MAPS[name].__name__}; choose another name")
        FEATURE_MAPS[name] = cls
        return cls
    return register


def available_feature_maps() -> list[str]:
    return sorted(FEATURE_MAPS)


def make_feature_map(feature_map: str | FeatureMap, head_dim: int, **options) -> FeatureMap:
    """A feature map from its registered name (or an instance, returned as is)."""
    if isinstance(feature_map, FeatureMap):
        if options:
            raise ValueError("feature-map options apply only when the map is given by name, "
                             f"got an instance together with {sorted(options)}")
        if feature_map.head_dim != head_dim:
            raise ValueError(f"the feature map was made for head_dim {feature_map.head_dim} but this block's "
                             f"heads have head_dim {head_dim} (dim / heads); make it with {head_dim}")
        return feature_map
    if feature_map not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {feature_map!r}; registered feature maps: "
                         f"{', '.join(available_feature_maps())} (add one with @register_feature_map)")
    cls = FEATURE_MAPS[feature_map]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "head_dim")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"feature map {feature_map!r} does not take option(s) {unknown}; "
                         f"it accepts: {accepted or 'no options'}")
    try:
        return cls(head_dim, **options)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"feature map {feature_map!r} rejected options {options}: {error}") from None


class FeatureMap(nn.Module):
    """Base class.  Subclasses implement `forward(x, *, is_query)` and set `num_features` (M)
    when it differs from the head dimension.

    A map whose features are exponentials may also give their logarithms: it sets `log_space = True`
    and implements `log_features(x, *, is_query)`, so that `forward` = exp(log_features) up to a
    per-row constant.  LinearAttention then runs the stabilised log-space algorithm, exact at any
    input scale (ops/linear_attention/stable.py)."""

    log_space = False

    def __init__(self, head_dim: int):
        super().__init__()
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")
        self.head_dim = head_dim
        self.num_features = head_dim

    def forward(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement forward(x, *, is_query)")

    def log_features(self, x: torch.Tensor, *, is_query: bool) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} sets log_space = True, so it must implement "
                                  "log_features(x, *, is_query)")

    def log_projection(self, x: torch.Tensor, *, is_query: bool) -> LogProjection | None:
        """Optionally, the log-features as LogProjection(inputs, weight, shift), log_features =
        inputs @ weight^T + shift: the causal op then projects chunk by chunk and never holds the
        (B, H, N, M) log-features or their gradient.  None (the default): not available."""
        return None

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_features={self.num_features}"


def _float(x: torch.Tensor) -> torch.Tensor:
    """Feature maps compute in float32 (float64 stays float64), whatever autocast says."""
    return x.double() if x.dtype == torch.float64 else x.float()


@register_feature_map("elu")
class EluFeatureMap(FeatureMap):
    """elu(x) + 1 (Katharopoulos et al., 2020)."""

    def forward(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            return F.elu(_float(x)) + 1


@register_feature_map("softmax")
class SoftmaxFeatureMap(FeatureMap):
    """Softmax-normalised map of Shen et al.: phi(q) = softmax(q) over features, phi(k) = exp(k).

    exp(k) overflows float32 past k = 88, so LinearAttention uses the log-features (log_softmax(q)
    and k), which the log-space algorithm takes at any scale without changing the weights."""

    log_space = True

    def forward(self, x, *, is_query):
        return self.log_features(x, is_query=is_query).exp()

    def log_features(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            x = _float(x)
            return x.log_softmax(dim=-1) if is_query else x


@register_feature_map("favor")
class FavorFeatureMap(FeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al., 2020):

        phi(x) = exp(w^T x - |x|^2 / 2) / sqrt(M),   x = input * D^(-1/4),

    so that E[phi(q)^T phi(k)] = exp(q^T k / sqrt(D)).  The rows of the (M, D) buffer `projection`
    are orthogonal within blocks of D, with chi-distributed norms (performer-pytorch's draw).

    Stabilisers, both exact because they cancel between numerator and denominator:
    * queries subtract their own max logit (a per-query constant);
    * keys subtract one constant that depends only on the projection, since
      w^T x - |x|^2/2 <= |w|^2/2: every key feature is then <= e^40 / sqrt(M).  Nothing is taken
      from other positions, so causal attention stays strictly causal.

    The projection is redrawn every `redraw_interval` training forward passes (0, the default: never;
    never in eval), draw r from the seed (seed, r), so every DDP rank holds the same projection.
    Never is the default because redraws cost more than they brought in the RoPE-placement study
    (docs/results/study-cpu.md): a model adapted to one projection loses that fit at each redraw.

    Large inputs still underflow plain features (|x| = 100 gives logits near -6000), so
    LinearAttention uses `log_features`, log phi = w^T x - |x|^2/2 - log(M)/2, and the log-space
    algorithm, exact at any scale."""

    KEY_LOGIT_CEILING = 40.0
    log_space = True

    def __init__(self, head_dim: int, num_features: int | None = None, redraw_interval: int = 0,
                 seed: int | None = None):
        super().__init__(head_dim)
        self.num_features = 4 * head_dim if num_features is None else num_features
        if not is_integer(self.num_features) or self.num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {self.num_features!r}")
        if not is_integer(redraw_interval) or redraw_interval < 0:
            raise ValueError(f"redraw_interval must be an integer >= 0 (0 never redraws), got {redraw_interval!r}")
        if seed is not None and not is_integer(seed):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self.redraw_interval = redraw_interval
        # Without an explicit seed, take one from torch's generator: torch.manual_seed then fixes
        # every map, and two maps in one model still differ.
        self.seed = int(torch.randint(2**62, ())) if seed is None else int(seed)
        self.draws = 0            # projections drawn so far after the first
        self.training_calls = 0   # training forward passes seen, for the redraw schedule
        self.register_buffer("projection", self._draw(0))

    def _draw(self, index: int) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((self.seed * 1_000_003 + index) % 2**63)
            return gaussian_orthogonal_random_matrix(self.num_features, self.head_dim, scaling=0)

    @torch.no_grad()
    def redraw(self) -> None:
        """A new projection, as a new tensor: a graph that still holds the old one (a second call
        before backward) keeps it."""
        self.draws += 1
        self.projection = self._draw(self.draws).to(self.projection)

    @torch.compiler.disable
    def _count_training_call(self) -> None:
        self.training_calls += 1
        if self.redraw_interval and self.training_calls % self.redraw_interval == 0:
            self.redraw()

    def _input(self, x, is_query):
        """x in float32 (float64 stays); counts the training calls."""
        if self.training and is_query:
            self._count_training_call()
        return _float(x)

    def _scaled(self, x, is_query):
        """x scaled by D^(-1/4), in float32 (float64 stays); counts the training calls."""
        return self._input(x, is_query) * self.head_dim ** -0.25

    def _logits(self, x, is_query):
        """(w^T x, x), x scaled."""
        x = self._scaled(x, is_query)
        return x @ self.projection.to(x.dtype).T, x

    def forward(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            logits, x = self._logits(x, is_query)
            # One per-row shift holds the stabiliser and the 1/sqrt(M) factor: a single pass.
            log_ratio = -0.5 * math.log(self.num_features)
            if is_query:
                shift = logits.detach().amax(dim=-1, keepdim=True) - log_ratio
            else:
                ceiling = (self.projection.to(x.dtype).square().sum(-1).amax() / 2
                           - self.KEY_LOGIT_CEILING).clamp_min(0)
                shift = x.square().sum(-1, keepdim=True) / 2 + (ceiling - log_ratio)
            return logits.sub_(shift).exp_()

    def log_features(self, x, *, is_query):
        return self.log_projection(x, is_query=is_query).materialize()

    def log_projection(self, x, *, is_query):
        """log phi = w^T x - |x|^2 / 2 - log(M) / 2 with x = input D^(-1/4): the scale goes into the
        weight and the squared norm's factor, so the op reads the inputs as they are (no scaled copy
        of them is made or kept for backward)."""
        with torch.autocast(x.device.type, enabled=False):
            x = self._input(x, is_query)
            scale = self.head_dim ** -0.25
            return LogProjection(x, self.projection.to(x.dtype) * scale, -0.5 * math.log(self.num_features),
                                 -0.5 * scale ** 2)

    # The redraw schedule travels in checkpoints (state_dict), so a resumed run redraws on time.
    def get_extra_state(self):
        return {"seed": self.seed, "draws": self.draws, "training_calls": self.training_calls}

    def set_extra_state(self, state):
        self.seed, self.draws, self.training_calls = state["seed"], state["draws"], state["training_calls"]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, redraw_interval={self.redraw_interval}, seed={self.seed}"
