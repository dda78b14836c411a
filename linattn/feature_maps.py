"""Feature maps phi: (B, H, N, D) -> (B, H, N, M), registered by name.  Features are non-negative,
except for maps that declare `nonnegative_features = False` and guarantee a positive kernel
phi(q) . phi(k) instead (taylor).

A map is called as `fm(x, is_query=...)`, so queries and keys may be mapped differently.  All the
randomness of a map (FAVOR+'s projection) lives inside it, drawn reproducibly from its own seed.
A map with weights of its own per head (hedgehog, taylor) takes a keyword-only `heads` in its
constructor: `make_feature_map` and LinearAttention pass the block's head count to such maps.  The
user's options travel as a dict (`options=`), apart from the structural head_dim and heads, so an
option can never take the place of what the block sets.  Writing a map: docs/feature-maps.md.
"""
from __future__ import annotations

import inspect
import math

import torch
from performer_pytorch.performer_pytorch import gaussian_orthogonal_random_matrix
from torch import nn

from .checks import check_positive_integer, is_integer
from .ops.linear_attention.common import LogProjection
from .ops.linear_attention.memory import check_fits
from .ops.pointwise import POINTWISE, elu_plus_one

FEATURE_MAPS: dict[str, type["FeatureMap"]] = {}


def register_feature_map(name: str):
    """Class decorator that makes a `FeatureMap` selectable by `name` (e.g. `--feature-map name`).
    Both are checked here, where the mistake is made: a bad entry would otherwise fail only when a
    block asks for it by name, far from the registration."""
    check_map_name(name)

    def register(cls: type[FeatureMap]) -> type[FeatureMap]:
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise ValueError(f"register_feature_map({name!r}) registers FeatureMap subclasses, got {cls!r}; "
                             f"derive the class from linattn.FeatureMap")
        if name in FEATURE_MAPS and FEATURE_MAPS[name] is not cls:
            raise ValueError(f"feature map name {name!r} is already registered to "
                             f"{FEATURE_MAPS[name].__name__}; choose another name")
        FEATURE_MAPS[name] = cls
        return cls
    return register


def check_map_name(name) -> None:
    """A name that a command line can pass as one word (`--feature-map name`)."""
    if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
        raise ValueError(f"a feature map's name must be a non-empty string without spaces, such as 'relu', "
                         f"got {name!r}")


def available_feature_maps() -> list[str]:
    return sorted(FEATURE_MAPS)


def feature_map_class(name: str) -> type["FeatureMap"]:
    """The map class registered as `name`, or a ValueError that lists the registered names."""
    if isinstance(name, type) and issubclass(name, FeatureMap):
        raise ValueError(f"pass a feature map by its registered name or as an instance ({name.__name__}(head_dim, ...)), "
                         f"not the class {name.__name__}")
    if not isinstance(name, str) or name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; registered feature maps: "
                         f"{', '.join(available_feature_maps())} (add one with @register_feature_map)")
    return FEATURE_MAPS[name]


# Constructor parameters that the block supplies, never options.
STRUCTURAL_PARAMETERS = ("self", "head_dim", "heads")


def feature_map_options(feature_map: str | type["FeatureMap"]) -> list[str]:
    """The option names a map takes (its constructor's parameters, the structural ones left out),
    for a registered name or a map class."""
    if isinstance(feature_map, type) and issubclass(feature_map, FeatureMap):
        cls = feature_map
    elif isinstance(feature_map, str):
        cls = feature_map_class(feature_map)
    else:
        raise ValueError(f"feature_map_options takes a registered map name or a FeatureMap subclass, got {feature_map!r}")
    return [p for p in inspect.signature(cls.__init__).parameters if p not in STRUCTURAL_PARAMETERS]


def takes_heads(cls: type["FeatureMap"]) -> bool:
    """Whether the map has weights per head, so its constructor takes `heads`."""
    return "heads" in inspect.signature(cls.__init__).parameters


def check_option_names(feature_map: str | FeatureMap, options: dict) -> None:
    """Options never name what the block sets (head_dim, heads).  `make_feature_map` checks this
    itself, once; call it only to ask before building anything."""
    if isinstance(feature_map, str):
        feature_map_class(feature_map)   # a name that is not registered is the first mistake to report
    check_options_dict(options)
    structural = sorted(set(options) & set(STRUCTURAL_PARAMETERS))
    if structural:
        raise ValueError(f"feature map {feature_map!r}: {structural} are set by the attention block (dim / heads), "
                         "not given as options; drop them")


def check_options_dict(options) -> None:
    if not isinstance(options, dict):
        raise ValueError(f"feature-map options must be a dict of option name to value, got {type(options).__name__}")


def make_feature_map(feature_map: str | FeatureMap, head_dim: int, *, heads: int | None = None,
                     options: dict | None = None, **misplaced) -> FeatureMap:
    """A feature map from its registered name (or an instance, returned as is).  `heads`: the
    block's head count, passed to maps with weights per head (and checked against an instance's).
    `options`: the map's own options by name (`feature_map_options` lists them), validated here.
    Options given as keywords (the form before `options=`) are refused with the form to use."""
    if misplaced:
        raise ValueError(f"make_feature_map takes the map's options as a dict: options={misplaced!r} "
                         f"rather than {', '.join(f'{k}=...' for k in misplaced)}")
    head_dim = check_positive_integer("head_dim", head_dim)   # before a map derives its M from it
    heads = None if heads is None else check_positive_integer("heads", heads)
    options = {} if options is None else options
    check_options_dict(options)
    if isinstance(feature_map, FeatureMap):
        if options:
            raise ValueError("feature-map options apply only when the map is given by name, "
                             f"got an instance together with {sorted(options)}")
        return check_feature_map(feature_map, head_dim, heads=heads)
    cls = feature_map_class(feature_map)
    accepted = feature_map_options(cls)
    check_option_names(feature_map, options)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"feature map {feature_map!r} does not take option(s) {unknown}; "
                         f"it accepts: {accepted or 'no options'}")
    structural = {"heads": heads} if takes_heads(cls) and heads is not None else {}
    check_weights_fit(cls, feature_map, head_dim, heads, options)
    try:
        return cls(head_dim, **options, **structural)
    except (TypeError, ValueError, OverflowError) as error:
        raise ValueError(f"feature map {feature_map!r} rejected options {options}: {error}") from None


def check_weights_fit(cls: type, name, head_dim: int, heads: int | None, options: dict) -> None:
    """The map's weights, M x head_dim float32 numbers (per head, for a map with heads), fit this
    machine's memory: refused before they are allocated (num_features=10**12 would allocate until the
    process is killed).  Options the map refuses are left to its constructor."""
    try:
        num_features = cls.num_features_for(head_dim, options)
    except Exception:   # a registered map's num_features_for is user code
        return
    if is_integer(num_features):
        check_fits(f"feature map {name!r} with num_features={num_features} and head_dim {head_dim}",
                   4 * num_features * head_dim * (heads or 1), torch.device("cpu"), "choose a smaller num_features")


PROBE_TOKENS = 8            # the probe input of `check_feature_map`: (1, heads, PROBE_TOKENS, head_dim)
LOG_TOLERANCE = 1e-3        # how far log(forward) - log_features may vary along a row (float32)
SMALLEST_COMPARED = 1e-30   # features below this underflow in log(); they are left out of that comparison


def check_feature_map(feature_map, head_dim: int | None = None, *, heads: int | None = None):
    """A map checked once where it enters (a block's constructor, `make_feature_map` given an instance,
    the harness's config): made for `head_dim` (and `heads`, for a map with weights per head), and on a
    small probe input its forward (and, for a log-space map, log_features and log_projection) gives
    finite (..., num_features) floats that are not all zero, non-negative (or, where the map sets
    `nonnegative_features = False`, a non-negative kernel phi(q).phi(k)), with log_features equal to
    log(forward) up to a per-row constant.  The probe runs in eval mode without gradients, from a
    generator of its own: it moves no redraw schedule and draws nothing from torch's global generator.
    The map's calls are not checked after this.

    Args:
        feature_map: the FeatureMap instance.
        head_dim: the head dimension its inputs have (None: the map's own).
        heads: the block's head count, or None.

    Returns:
        feature_map, unchanged.

    Raises:
        ValueError: one line naming the map's class, the call and what was wrong; an exception the
            map's own code raises is the cause of one that names the call.
    """
    name = type(feature_map).__name__
    if not isinstance(feature_map, FeatureMap):
        raise ValueError(f"a feature map must be a linattn.FeatureMap, got {name}")
    head_dim = feature_map.head_dim if head_dim is None else head_dim
    if feature_map.head_dim != head_dim:
        raise ValueError(f"the feature map was made for head_dim {feature_map.head_dim} but this block's "
                         f"heads have head_dim {head_dim} (dim / heads); make it with {head_dim}")
    map_heads = getattr(feature_map, "heads", None)
    if heads is not None and map_heads is not None and map_heads != heads:
        raise ValueError(f"the feature map has weights for {map_heads} heads but this block has {heads}; "
                         f"make it with heads={heads}")
    if not is_integer(feature_map.num_features) or feature_map.num_features < 1:
        raise ValueError(f"{name} declares num_features = {feature_map.num_features!r}; set self.num_features "
                         "in its __init__ to the positive number of features it computes")
    x = torch.randn(1, map_heads or heads or 1, PROBE_TOKENS, head_dim, generator=torch.Generator().manual_seed(0))
    x = x.to(next(iter((*feature_map.parameters(), *feature_map.buffers())), x).device)
    was_training = feature_map.training
    feature_map.eval()
    try:
        with torch.no_grad():
            features = {is_query: probed(feature_map, "forward", x, is_query) for is_query in (True, False)}
            check_signs(feature_map, features)
            check_pointwise(feature_map, x, features)
            if feature_map.log_space:
                for is_query in (True, False):
                    check_logs_match(feature_map, features[is_query], probed(feature_map, "log_features", x, is_query),
                                     is_query)
                    probed(feature_map, "log_projection", x, is_query)
    finally:
        feature_map.train(was_training)
    return feature_map


def probed(feature_map: FeatureMap, method: str, x: torch.Tensor, is_query: bool):
    """One call of the map's `method` on the probe input, its result checked: forward and log_features
    give finite (..., M) float tensors, log_projection a LogProjection of M or None."""
    call = f"{type(feature_map).__name__}.{method}(x, is_query={is_query})"
    try:
        result = getattr(feature_map, method)(x, is_query=is_query)
    except Exception as error:   # the map's own code: the cause is kept for its traceback
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        raise ValueError(f"{call} raised {type(error).__name__}" + (f": {first}" if first else "")) from error
    if result is None and method == "log_projection":
        return result
    kind = LogProjection if method == "log_projection" else torch.Tensor
    if not isinstance(result, kind) or (kind is torch.Tensor and not result.is_floating_point()):
        found = result.dtype if isinstance(result, torch.Tensor) else type(result).__name__
        expected = "a LogProjection" if kind is LogProjection else "a floating-point tensor"
        raise ValueError(f"{call} returned {found}, not {expected}")
    if result.shape[-1] != feature_map.num_features:
        raise ValueError(f"{call} gave {result.shape[-1]} features but the map declares num_features="
                         f"{feature_map.num_features}; set self.num_features in its __init__ to the M it computes")
    if kind is torch.Tensor:
        if result.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"{call} returned shape {tuple(result.shape)} for inputs of shape {tuple(x.shape)}: "
                             "return (..., num_features) with the inputs' leading dimensions")
        # log-features may be -inf (a feature of exactly 0, which the op takes); nothing else may be infinite
        allowed = torch.isfinite(result) | ((result == -torch.inf) if method == "log_features" else False)
        if not allowed.all():
            raise ValueError(f"{call} returned NaN or inf values for a standard normal input")
    return result


def check_signs(feature_map: FeatureMap, features: dict[bool, torch.Tensor]) -> None:
    """Linear attention divides by sum_n phi(q).phi(k_n): it must be made of non-negative terms."""
    name = type(feature_map).__name__
    for is_query, values in features.items():
        if not values.any():
            raise ValueError(f"{name}.forward(x, is_query={is_query}) returned all zeros, so attention has "
                             "nothing to weigh")
        if feature_map.nonnegative_features and values.min() < 0:
            raise ValueError(f"{name}.forward(x, is_query={is_query}) returned negative features (down to "
                             f"{values.min().item():.3g}); features must be >= 0, or the map sets "
                             "nonnegative_features = False and keeps phi(q).phi(k) >= 0")
    if not feature_map.nonnegative_features:
        kernel = torch.einsum("bhnm,bhkm->bhnk", features[True], features[False])
        if kernel.min() < 0:
            raise ValueError(f"{name} sets nonnegative_features = False, but phi(q).phi(k) is negative (down to "
                             f"{kernel.min().item():.3g}); the kernel must be >= 0")


def check_pointwise(feature_map: FeatureMap, x: torch.Tensor, features: dict[bool, torch.Tensor]) -> None:
    """A map that names a pointwise formula gives its features: the fla route computes them from the name."""
    name, formula = type(feature_map).__name__, feature_map.pointwise
    if formula is None:
        return
    if formula not in POINTWISE:
        raise ValueError(f"{name} declares pointwise = {formula!r}; set it to one of {sorted(POINTWISE)} or None")
    for is_query, values in features.items():
        if not torch.allclose(values, POINTWISE[formula](_float(x)).to(values.dtype)):
            raise ValueError(f"{name}.forward(x, is_query={is_query}) is not its pointwise formula {formula!r}; "
                             "set pointwise = None in a map whose forward computes something else")


def check_logs_match(feature_map: FeatureMap, values: torch.Tensor, logs: torch.Tensor, is_query: bool) -> None:
    """log_features = log(forward) up to a per-row constant (FeatureMap's contract)."""
    compared = values > SMALLEST_COMPARED
    difference = torch.where(compared, values.clamp_min(SMALLEST_COMPARED).log() - logs, torch.nan)
    spread = difference.nan_to_num(-torch.inf).amax(-1) - difference.nan_to_num(torch.inf).amin(-1)
    spread = spread[compared.sum(-1) > 1]
    if spread.numel() and spread.max() > LOG_TOLERANCE:
        raise ValueError(f"{type(feature_map).__name__}.log_features(x, is_query={is_query}) is not log(forward(x)) "
                         f"up to a per-row constant (it differs by up to {spread.max().item():.3g} within a row)")


class FeatureMap(nn.Module):
    """Base class.  Subclasses implement `forward(x, *, is_query)` and set `num_features` (M)
    when it differs from the head dimension.

    A map whose features are exponentials may also give their logarithms: it sets `log_space = True`
    and implements `log_features(x, *, is_query)`, so that `forward` = exp(log_features) up to a
    per-row constant.  LinearAttention then runs the stabilised log-space algorithm, exact at any
    input scale (ops/linear_attention/stable.py).

    `nonnegative_features = False` declares a map whose single features may be negative while its
    kernel phi(q) . phi(k) is positive for every q, k (taylor's 1 + s + s^2/2 >= 1/2): the
    per-feature check of the plain path is then skipped, and the denominator stays positive because
    each of its terms is.  Checks that probe a map for non-negative features read this attribute.

    `pointwise` names the formula of ops/pointwise (POINTWISE) that gives a plain map's features from
    each input entry, queries and keys alike (elu's "elu"), or is None.  The fla route then computes
    them and their cast to fla's dtype in one Triton kernel instead of calling forward; a subclass whose
    forward computes something else sets it to None (`check_feature_map` checks the two agree)."""

    log_space = False
    nonnegative_features = True
    pointwise: str | None = None

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = check_positive_integer("head_dim", head_dim)
        self.num_features = self.head_dim

    @classmethod
    def num_features_for(cls, head_dim: int, options: dict) -> int:
        """M of this map for `head_dim` and `options`, known before it is built (memory estimates):
        head_dim here; a map whose M differs overrides it, and its constructor takes M from it, so
        the two agree.  Options the constructor would refuse may give any value."""
        return head_dim

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
    """elu(x) + 1 (Katharopoulos et al., 2020).  Input bound: none past float's own (the op computes
    plain features at any scale); below x = -17.3 a float32 feature rounds to exactly 0 (e^x on the
    fla route, whose kernel computes it: ops/pointwise/kernels.py)."""

    pointwise = "elu"

    def forward(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            return elu_plus_one(_float(x))


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
    (docs/results/study.md): a model adapted to one projection loses that fit at each redraw.

    Large inputs still underflow plain features (|x| = 100 gives logits near -6000), so
    LinearAttention uses `log_features`, log phi = w^T x - |x|^2/2 - log(M)/2, and the log-space
    algorithm, exact at any scale."""

    KEY_LOGIT_CEILING = 40.0
    log_space = True

    def __init__(self, head_dim: int, num_features: int | None = None, redraw_interval: int = 0,
                 seed: int | None = None):
        super().__init__(head_dim)
        self.num_features = self.num_features_for(head_dim, {"num_features": num_features})
        if not is_integer(self.num_features) or self.num_features < 1:
            raise ValueError(f"num_features must be a positive integer, got {self.num_features!r}")
        if not is_integer(redraw_interval) or redraw_interval < 0:
            raise ValueError(f"redraw_interval must be an integer >= 0 (0 never redraws), got {redraw_interval!r}")
        if seed is not None and not (is_integer(seed) and 0 <= seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) (what a checkpoint can restore), got {seed!r}")
        self.redraw_interval = redraw_interval
        # Without an explicit seed, take one from torch's generator: torch.manual_seed then fixes
        # every map, and two maps in one model still differ.
        self.seed = int(torch.randint(2**62, ())) if seed is None else int(seed)
        self.draws = 0            # projections drawn so far after the first
        self.training_calls = 0   # training forward passes seen, for the redraw schedule
        self.register_buffer("projection", self._draw(0))

    @classmethod
    def num_features_for(cls, head_dim: int, options: dict) -> int:
        """The `num_features` option, default 4 * head_dim."""
        num_features = options.get("num_features")
        return 4 * head_dim if num_features is None else num_features

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
        # Compiled with no redraws, the count is skipped: it is a graph break (it changes the module),
        # and it only schedules redraws.
        if self.training and is_query and (self.redraw_interval or not torch.compiler.is_compiling()):
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
        keys = ("seed", "draws", "training_calls")
        if (not isinstance(state, dict) or set(state) != set(keys)
                or not all(is_integer(state[key]) and 0 <= state[key] < 2**63 for key in keys)):
            raise ValueError(f"the FAVOR+ map's saved redraw state should be integers in [0, 2**63) {', '.join(keys)}, "
                             f"got {state!r}")
        self.seed, self.draws, self.training_calls = (int(state[key]) for key in keys)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, redraw_interval={self.redraw_interval}, seed={self.seed}"


def per_head_projection(heads: int, head_dim: int, out_dim: int) -> nn.Parameter:
    """A (heads, head_dim, out_dim) weight, each head's slice the identity where out_dim = head_dim,
    else a random semi-orthogonal matrix drawn from torch's generator (torch.manual_seed fixes it).
    Why: an orthogonal start keeps the dot products of the head's own q and k (exactly when
    out_dim >= head_dim), so the map starts from the attention pattern the q/k projections make,
    as the identity start of Hedgehog does; a small random start would begin near uniform weights.
    A plain Parameter, not an nn.Linear, so that a model's init of its Linear layers leaves it be."""
    weight = torch.empty(heads, head_dim, out_dim)
    for head in weight:
        if out_dim == head_dim:
            nn.init.eye_(head)
        else:
            nn.init.orthogonal_(head)
    return nn.Parameter(weight)


class PerHeadFeatureMap(FeatureMap):
    """A map whose first step is a trainable linear layer per head, head_dim -> `out_dim`:
    `weight` (heads, head_dim, out_dim), applied as x @ weight[h] to head h."""

    def __init__(self, head_dim: int, out_dim: int, heads: int):
        super().__init__(head_dim)
        self.heads = check_positive_integer("heads", heads)
        self.weight = per_head_projection(self.heads, head_dim, out_dim)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """(B, heads, N, head_dim) -> (B, heads, N, out_dim), in float32 (float64 stays)."""
        x = _float(x)
        return x @ self.weight.to(x.dtype).unsqueeze(0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, heads={self.heads}"


HEDGEHOG_ACTIVATIONS = ("softmax", "exp")


@register_feature_map("hedgehog")
class HedgehogFeatureMap(PerHeadFeatureMap):
    """Hedgehog (Zhang et al. 2024, "The Hedgehog & the Porcupine"): a trainable linear layer per
    head, z = x W_h (head_dim -> M/2), then the M features of [z, -z] through

    * activation="softmax" (the default, as in the paper): softmax over the M features;
    * activation="exp": exp([z, -z]).

    Both are exponentials, so LinearAttention takes the log-features (log_softmax([z, -z]) or
    [z, -z] itself) and runs the exact log-space algorithm (the C++ kernel on CPU).  `num_features`
    M is even, default 2 * head_dim (W_h square, initialised to the identity as in the paper).
    The weights train with the model; they take no weight decay in linattn_lm (see make_optimizer)."""

    log_space = True

    def __init__(self, head_dim: int, num_features: int | None = None, activation: str = "softmax", *,
                 heads: int = 1):
        head_dim = check_positive_integer("head_dim", head_dim)   # M derives from it before the base checks it
        num_features = self.num_features_for(head_dim, {"num_features": num_features})
        if not is_integer(num_features) or num_features < 2 or num_features % 2:
            raise ValueError(f"num_features must be an even integer >= 2 (features over [z, -z]), "
                             f"got {num_features!r}")
        if activation not in HEDGEHOG_ACTIVATIONS:
            raise ValueError(f"activation must be one of {HEDGEHOG_ACTIVATIONS}, got {activation!r}")
        super().__init__(head_dim, num_features // 2, heads)
        self.num_features, self.activation = int(num_features), activation

    @classmethod
    def num_features_for(cls, head_dim: int, options: dict) -> int:
        """The `num_features` option, default 2 * head_dim."""
        num_features = options.get("num_features")
        return 2 * head_dim if num_features is None else num_features

    def forward(self, x, *, is_query):
        return self.log_features(x, is_query=is_query).exp()

    def log_features(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            z = self.project(x)
            logits = torch.cat((z, -z), dim=-1)
            return logits.log_softmax(dim=-1) if self.activation == "softmax" else logits

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"


TAYLOR_DIM = 16   # Based's d'


@register_feature_map("taylor")
class TaylorFeatureMap(PerHeadFeatureMap):
    """The second-order Taylor map of exp(q . k) (Based, Arora et al. 2024).  A trainable linear
    layer per head projects to `dim` = d' coordinates (Based projects q and k to d' = 16 with the
    model's own projections; a trainable per-head layer after them is the faithful counterpart
    here), scaled x = x W_h / d'^(1/4), and

        phi(x) = [1, x, u(x), padding],   u(x) = the upper triangle of x x^T, its diagonal / sqrt(2),

    so that phi(q) . phi(k) = 1 + s + s^2 / 2 with s = x_q . x_k = q' . k' / sqrt(d'): exp(s) to
    second order.  M = 1 + d' + d'(d'+1)/2 (153 for d' = 16), plus one zero feature when that is
    odd (M = 154), so that rope="post" can rotate pairs.

    Single features are negative (x may be), but the kernel 1 + s + s^2/2 = (1 + s)^2/2 + 1/2 is
    >= 1/2, so the denominator, a sum of such terms, is positive: the map declares
    `nonnegative_features = False` and takes the plain (not log-space) path, since features that
    are not positive have no logarithm.  With rope="post" (Eq. 19) the numerator's features are
    rotated pair by pair, an orthogonal map per position pair, so the numerator's weights are a
    rotated Taylor kernel (which may be negative, as Eq. 19's always may), and the denominator keeps
    the positive unrotated kernel.

    Input bound: the quadratic features overflow once a projected coordinate passes about 1.8e19
    (float32; 1.3e154 in float64); beyond it the outputs are NaN, below it exact at any input scale.
    """

    nonnegative_features = False

    def __init__(self, head_dim: int, dim: int = TAYLOR_DIM, *, heads: int = 1):
        if not is_integer(dim) or dim < 1:
            raise ValueError(f"dim must be a positive integer (the projected size d'), got {dim!r}")
        super().__init__(head_dim, int(dim), heads)
        self.dim = int(dim)
        rows, cols = torch.triu_indices(self.dim, self.dim)
        self.register_buffer("upper_diagonal", rows == cols, persistent=False)
        self.num_features = self.num_features_for(head_dim, {"dim": self.dim})
        self.padding = self.num_features - (1 + self.dim + len(rows))

    @classmethod
    def num_features_for(cls, head_dim: int, options: dict) -> int:
        """1 + d' + d'(d'+1)/2, padded to even (154 for the default d' = 16)."""
        dim = options.get("dim", TAYLOR_DIM)
        taylor_features = 1 + dim + dim * (dim + 1) // 2
        return taylor_features + taylor_features % 2

    def forward(self, x, *, is_query):
        with torch.autocast(x.device.type, enabled=False):
            x = self.project(x) * self.dim ** -0.25
            # (x.y)^2 = sum_i x_i^2 y_i^2 + 2 sum_{i<j} x_i x_j y_i y_j: halved, the diagonal products
            # take 1/sqrt(2) and the off-diagonal ones 1 (a Python float: exact in float64 too).
            # Row by row (x_i x_j for j >= i, triu_indices' order), from slices: gathering the 136 pairs by
            # index took 74 ms forward and backward against 49 ms (one CPU thread, 16 x 4 heads x 256
            # rows, d' = 16), the backward's scatter-add being the slow part.  The same bits forward.
            quadratic = torch.cat([x[..., i, None] * x[..., i:] for i in range(self.dim)], dim=-1)
            quadratic = torch.where(self.upper_diagonal, quadratic * 0.5 ** 0.5, quadratic)
            ones = x.new_ones(*x.shape[:-1], 1)
            return torch.cat((ones, x, quadratic, x.new_zeros(*x.shape[:-1], self.padding)), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}"
