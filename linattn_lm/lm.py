"""A decoder-only byte-level Transformer language model (vocab 256) on linattn's attention blocks, and
its settings (`ModelConfig`, with their checks) beside it, as nanoGPT keeps GPTConfig in model.py.

    config = ModelConfig(attention="linear", feature_map="favor", rope="post")
    model = ByteLM(config)
    logits = model(idx)                                   # (B, N) int64 -> (B, N, 256)
    ids = model.generate(prompt, max_new_tokens=100)      # parallel prefill, then O(1)-per-token steps

Pre-LayerNorm blocks (x + attn(ln(x)), x + mlp(ln(x))) with a GELU MLP.  The input embedding and the
output projection are NOT tied: with 256 bytes tying saves almost nothing (256 * d_model weights) and
keeps input and output roles separate.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import linattn

from .fields import PLAIN_OPTION_TYPES, check_finite, check_types, default_value, setting
from .map_check import checked_feature_map
from .preflight import check_memory, parameter_bytes
from .variants import LINEAR_BLOCK_OPTIONS, option, variant_name

INIT_STD = 0.02
ATTENTIONS = ("softmax", "linear")
SOFTMAX_ROPE = ("post", "none")     # softmax has no feature map: "post" = RoPE on q and k
SOFTMAX_BACKENDS = linattn.SOFTMAX_BACKENDS   # the library's: auto (= sdpa), sdpa, xformers
ATTENTION_BACKENDS = {"linear": linattn.functional.BACKENDS, "softmax": SOFTMAX_BACKENDS}


@dataclass
class ModelConfig:
    """Everything needed to rebuild a model, as plain values (feature_map_options too), so
    checkpoints load with `torch.load(weights_only=True)`.  Defaults are the cpu preset's."""

    vocab_size: int = setting(256, "vocabulary size: at least 256 for enwik8 (one id per byte); any that its "
                                   "key-value pairs fit for mqar")
    n_layer: int = setting(4, "number of Transformer blocks")
    d_model: int = setting(128, "model width")
    n_head: int = setting(4, "attention heads (must divide d-model)")
    mlp_ratio: float = setting(4.0, "MLP hidden width / d-model")
    dropout: float = setting(0.0, "residual and embedding dropout probability")
    seq_len: int = setting(256, "training context length in bytes (learned positions cover exactly this)")
    attention: str = setting("linear", "attention type: softmax or linear", variant=True)
    feature_map: str = setting("favor", "linear attention feature map: a registered name, including "
                                        "maps registered by --import (linear only)", variant=True)
    feature_map_options: dict[str, Any] = setting(
        {"num_features": 64, "redraw_interval": 0},
        "an option of the feature map, KEY=VALUE with VALUE a Python literal (repeatable; linear only); "
        "a preset's options apply to its own map only", variant=True,
        flag=dict(name="--feature-map-option", metavar="KEY=VALUE", type=option, action="append"))
    rope: str = setting("post", "linear: RoPE after the map (post), before it (pre) or none; "
                                "softmax: post = RoPE on q,k, none = no RoPE", variant=True)
    abs_pos: bool = setting(False, "add learned absolute position embeddings", variant=True)
    normalization: str = setting("denominator", "linear attention's normalisation: denominator (divide by "
                                                "sum phi(q).phi(k)) or rmsnorm (a per-head RMSNorm of the "
                                                "output instead; linear only)", variant=True)
    window: int = setting(0, "linear: keys fewer than N positions back get the exact softmax weight e^s, older ones "
                             "the feature map's, under one normaliser; softmax: attend to those keys only (the "
                             "window-only control); 0 = no window", variant=True)
    decay: str = setting("", "linear: every attention weight times gamma_h^(distance): retnet (gamma_h = "
                             "1 - 2^(-5-h)) or one value in (0, 1] per head, separated by commas ('' = none)",
                         variant=True)
    softmax_layers: str = setting("", "linear: these layers are softmax + RoPE blocks instead (a hybrid): 0-based "
                                      "layer indices in increasing order separated by commas, e.g. 1 or 1,3 "
                                      "('' = none)", variant=True)
    short_conv: int = setting(0, "a depthwise causal convolution of K tokens on q, k and v before the attention "
                                 "(H3's and Based's short convolution; linear and softmax); 0 = none", variant=True)
    chunk_size: int = setting(64, "causal linear attention block size (speed only; linear only)")
    backend: str = setting("auto", "attention kernels (speed only): linear auto, torch, cpp or fla (auto = "
                                   "fla on CUDA when installed, cpp on CPU where it builds); softmax auto "
                                   "(= sdpa), sdpa or xformers",
                           resumable=True)
    seed: int = setting(0, "seed for init, data order and feature-map draws")

    def validate(self) -> None:
        """The field checks, then the parameter memory, then the feature map (`check_map`)."""
        self.check_fields()
        check_memory(parameter_bytes(self), "the model's parameters and buffers")
        self.check_map()

    def check_map(self) -> None:
        """Layer 0's feature map, built by `build_feature_map` as the model builds its maps (so bad
        option names, types and values get the map's own message) and run on a probe input (so a
        broken map is refused before any work), then RoPE's pairs.  Needs `check_fields` first."""
        num_features = 0
        if self.attention == "linear":
            num_features = checked_feature_map(self.feature_map, lambda: self.build_feature_map(0)).num_features
        self._validate_rope_pairs(num_features)

    def check_fields(self) -> None:
        """Checks that allocate nothing."""
        check_types(self)
        check_finite(self)
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "seq_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("window", "short_conv"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = none), got {getattr(self, name)}")
        if self.short_conv > self.seq_len:   # its taps beyond the context only ever see the zero padding
            raise ValueError(f"short_conv {self.short_conv} is longer than seq_len {self.seq_len}: the causal "
                             f"convolution's kernel must fit the context; use a short_conv of at most {self.seq_len} "
                             "(3 in Based)")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.mlp_ratio <= 0 or self.mlp_hidden < 1:
            raise ValueError(f"mlp_ratio {self.mlp_ratio} gives an MLP {self.mlp_hidden} wide for "
                             f"d_model {self.d_model}; use mlp_ratio >= {1 / self.d_model:.3g}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention == "softmax":
            self._validate_softmax()
        elif self.attention == "linear":
            self._validate_linear()
        else:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")

    def _validate_softmax(self) -> None:
        if self.normalization != "denominator":
            raise ValueError(f"normalization={self.normalization!r} applies to linear attention only; softmax "
                             "attention normalises its weights itself: leave it 'denominator'")
        if self.rope not in SOFTMAX_ROPE:
            raise ValueError(f"softmax attention has no feature map, so rope is 'post' (RoPE on q and k) "
                             f"or 'none', got {self.rope!r}; 'pre' applies to linear attention only")
        if self.feature_map or self.feature_map_options:
            raise ValueError("softmax attention takes no feature map: feature_map must be '' and "
                             "feature_map_options empty")
        defaults = {f.name: default_value(f) for f in dataclasses.fields(self)}
        for name in LINEAR_BLOCK_OPTIONS:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"{name} applies to linear attention only (softmax attends to every key "
                                 f"exactly), got {getattr(self, name)!r}; leave it {defaults[name]!r}")
        if self.backend not in SOFTMAX_BACKENDS:
            raise ValueError(f"softmax attention's backend must be one of {SOFTMAX_BACKENDS}, "
                             f"got {self.backend!r}")

    def _validate_linear(self) -> None:
        if self.rope not in linattn.ROPE_PLACEMENTS:
            raise ValueError(f"rope must be one of {linattn.ROPE_PLACEMENTS}, got {self.rope!r}")
        if self.backend not in linattn.functional.BACKENDS:
            raise ValueError(f"linear attention's backend must be one of {linattn.functional.BACKENDS}, "
                             f"got {self.backend!r}")
        if self.normalization not in linattn.NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {linattn.NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        for key, value in self.feature_map_options.items():
            if not isinstance(key, str) or not isinstance(value, PLAIN_OPTION_TYPES):
                raise ValueError(f"feature-map option {key}={value!r} is not a plain value: options are "
                                 "str, int, float, bool or None")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"feature-map option {key} must be finite, got {value}")
        linattn.feature_map_class(self.feature_map)   # an unknown name: the error lists the maps
        self.decay_option, self.softmax_layer_indices   # each parses its text, or says what is wrong

    def _validate_rope_pairs(self, num_features: int) -> None:
        """RoPE rotates coordinate pairs: after the feature map it rotates its M features,
        otherwise the head_dim coordinates of q and k."""
        if self.rope == "none":
            return
        post_map = self.attention == "linear" and self.rope == "post"
        size, name = (num_features, "the feature map's num_features") if post_map else (self.head_dim, "head_dim")
        if size % 2:
            raise ValueError(f"rope={self.rope!r} rotates pairs of coordinates, so {name} must be even, "
                             f"got {size}; pick an even value or rope='none'")

    def build_feature_map(self, layer: int) -> linattn.FeatureMap:
        """Layer `layer`'s map: the one way from the feature-map settings to a map (validation and the
        model both build with it).  A map that takes a `seed` gets one per layer unless the options fix
        it, a map with weights per head gets n_head."""
        options = dict(self.feature_map_options)
        if "seed" in linattn.feature_map_options(self.feature_map):
            options.setdefault("seed", layer_seed(self.seed, layer))
        return linattn.make_feature_map(self.feature_map, self.head_dim, heads=self.n_head, options=options)

    @property
    def decay_option(self) -> str | tuple[float, ...] | None:
        """LinearAttention's decay: None, "retnet" or one factor per head."""
        if self.decay in ("", "retnet"):
            return self.decay or None
        try:   # no spaces: the text goes into the run's name as it is
            factors = () if any(char.isspace() for char in self.decay) else tuple(map(float, self.decay.split(",")))
        except ValueError:
            factors = ()
        if len(factors) != self.n_head or not all(0 < factor <= 1 for factor in factors):
            raise ValueError(f"decay must be retnet or {self.n_head} numbers in (0, 1] separated by commas (one per "
                             f"head; in a variant name joined with '_', +decay=0.9_0.99), got {self.decay!r}")
        # One spelling per value: the text names the run (and a grid's variant), so 1,0.5 and 1.0,0.50 would be
        # two runs of one model; and a factor 1 for every head is no decay, the default, named without it.
        canonical = ",".join(map(str, factors))
        if all(factor == 1 for factor in factors):
            raise ValueError(f"decay {self.decay!r} is 1 for every head, which is no decay: leave --decay out")
        if self.decay != canonical:
            raise ValueError(f"decay {self.decay!r} must be spelled as Python writes its numbers: {canonical!r}")
        return factors

    @property
    def softmax_layer_indices(self) -> tuple[int, ...]:
        """The layers that are softmax + RoPE blocks (a linear model's hybrid layers)."""
        if not self.softmax_layers:
            return ()
        try:
            layers = tuple(int(item) for item in self.softmax_layers.split(","))
        except ValueError:
            layers = ()
        if ",".join(map(str, layers)) != self.softmax_layers or list(layers) != sorted(set(layers)) or not all(
                0 <= layer < self.n_layer for layer in layers):
            raise ValueError(f"softmax_layers must list 0-based layer indices below n_layer {self.n_layer} in "
                             f"increasing order, each once, separated by commas (e.g. 1 or 1,3), got "
                             f"{self.softmax_layers!r}")
        if len(layers) == self.n_layer:   # no linear layer is left: a softmax model, not a linear hybrid
            raise ValueError(f"softmax_layers {self.softmax_layers!r} makes every layer softmax: that is a softmax "
                             "model, so use --attention softmax instead")
        return layers

    @property
    def block_backend(self) -> str:
        """The backend the attention block takes: softmax's "auto" is sdpa."""
        return "sdpa" if self.attention == "softmax" and self.backend == "auto" else self.backend

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)

    @property
    def num_features(self) -> int:
        """M of the feature map as its class gives it for these options, before anything is built
        (memory estimates).  Options the map refuses give head_dim: building the map then says what
        was wrong."""
        try:
            value = linattn.feature_map_class(self.feature_map).num_features_for(self.head_dim,
                                                                                self.feature_map_options)
        except Exception:   # a map registered by --import is user code: it may raise anything
            return self.head_dim
        return value if linattn.is_integer(value) and value >= 1 else self.head_dim

    @property
    def variant(self) -> str:
        """Short name of the attention variant (linattn_lm.variants builds and parses them)."""
        return variant_name(self)


def layer_seed(run_seed: int, layer: int) -> int:
    """Distinct, reproducible feature-map seed per layer: layers differ, every DDP rank agrees."""
    return run_seed * 1_000_003 + layer


def make_attention(config: ModelConfig, layer: int) -> nn.Module:
    if config.attention == "softmax":   # the window-only control takes the window and short_conv only
        return linattn.SoftmaxAttention(config.d_model, config.n_head, rope=config.rope == "post",
                                        backend=config.block_backend, window=config.window,
                                        short_conv=config.short_conv)
    if layer in config.softmax_layer_indices:   # a hybrid's softmax + RoPE layer (sdpa runs on every device)
        return linattn.SoftmaxAttention(config.d_model, config.n_head, rope=True, backend="sdpa")
    return linattn.LinearAttention(config.d_model, config.n_head, feature_map=config.build_feature_map(layer),
                                   rope=config.rope, chunk_size=config.chunk_size, backend=config.block_backend,
                                   normalization=config.normalization, window=config.window,
                                   decay=config.decay_option, short_conv=config.short_conv)


class Block(nn.Module):
    """Pre-LayerNorm Transformer block; `forward` for sequences, `step` for one token."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        hidden = config.mlp_hidden
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = make_attention(config, layer)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, hidden), nn.GELU(),
                                 nn.Linear(hidden, config.d_model))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, *, return_state: bool = False):
        attended = self.attn(self.ln_attn(x), return_state=return_state)
        attended, state = attended if return_state else (attended, None)
        x = x + self.dropout(attended)
        x = x + self.dropout(self.mlp(self.ln_mlp(x)))
        return (x, state) if return_state else x

    def step(self, x_t: torch.Tensor, state):
        attended, state = self.attn.step(self.ln_attn(x_t), state)
        x_t = x_t + self.dropout(attended)
        return x_t + self.dropout(self.mlp(self.ln_mlp(x_t))), state


class DecodeState(NamedTuple):
    """Per-layer attention states (LinearState or KVCache) and the position of the next token."""
    layers: list
    position: int


class ByteLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # The config was validated where it was built (config_from_flags, recorded_config, or a
        # caller's config.validate()): the model trusts it.
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.seq_len, config.d_model) if config.abs_pos else None
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_final = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by depth.
        residual_std = INIT_STD / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.to_out.weight, std=residual_std)
            nn.init.normal_(block.mlp[2].weight, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def feature_maps(self) -> list[nn.Module]:
        """Each linear-attention layer's feature map (empty for softmax attention)."""
        return [block.attn.feature_map for block in self.blocks if hasattr(block.attn, "feature_map")]

    def _check_positions(self, end: int) -> None:
        if self.position_embedding is not None and end > self.config.seq_len:
            raise ValueError(
                f"this model has learned absolute positions for {self.config.seq_len} tokens only, "
                f"but position {end - 1} was requested; models with RoPE or no positions extrapolate")

    def _embed(self, idx: torch.Tensor, offset: int) -> torch.Tensor:
        x = self.token_embedding(idx)
        if self.position_embedding is not None:
            self._check_positions(offset + idx.shape[1])
            positions = torch.arange(offset, offset + idx.shape[1], device=idx.device)
            x = x + self.position_embedding(positions)
        return self.dropout(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, N) byte ids -> (B, N, vocab) next-byte logits."""
        x = self._embed(idx, 0)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def prefill(self, idx: torch.Tensor) -> tuple[torch.Tensor, DecodeState]:
        """One parallel pass over a prompt (B, N): its logits and the state to continue from."""
        x = self._embed(idx, 0)
        states = []
        for block in self.blocks:
            x, state = block(x, return_state=True)
            states.append(state)
        return self.head(self.ln_final(x)), DecodeState(states, idx.shape[1])

    def step(self, token: torch.Tensor, state: DecodeState) -> tuple[torch.Tensor, DecodeState]:
        """Logits (B, vocab) after one more token (B,): O(1) for linear attention, a KV-cache
        lookup for softmax."""
        x = self._embed(token[:, None], state.position)[:, 0]
        layers = []
        for block, layer_state in zip(self.blocks, state.layers):
            x, layer_state = block.step(x, layer_state)
            layers.append(layer_state)
        return self.head(self.ln_final(x)), DecodeState(layers, state.position + 1)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample continuations of (B, N) or (N,) prompt ids; returns only the new ids.

        temperature 0 picks the most likely byte; top_k keeps the k most likely bytes.  Runs in
        eval mode (no dropout, no FAVOR+ redraw counting) and restores the previous mode."""
        if prompt_ids.dim() == 1:
            return self.generate(prompt_ids[None], max_new_tokens, temperature, top_k, generator)[0]
        if prompt_ids.shape[1] < 1:
            raise ValueError("generate needs a prompt of at least one token")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k < 1):
            raise ValueError("max_new_tokens and temperature must be >= 0 and top_k >= 1")
        self._check_positions(prompt_ids.shape[1] + max_new_tokens - 1)
        was_training = self.training
        self.eval()
        try:
            logits, state = self.prefill(prompt_ids)
            logits, new_ids = logits[:, -1], []
            for index in range(max_new_tokens):
                new_ids.append(sample_next(logits, temperature, top_k, generator))
                if index + 1 < max_new_tokens:
                    logits, state = self.step(new_ids[-1], state)
        finally:
            self.train(was_training)
        return torch.stack(new_ids, dim=1) if new_ids else prompt_ids.new_empty(prompt_ids.shape[0], 0)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """(B, vocab) logits -> (B,) sampled ids."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    # the max first and float64 so that any temperature > 0 works: (<= 0) / tiny is -inf or 0, never nan
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def state_size(config: ModelConfig) -> str:
    """The decoding state of each head in each kind of layer, as Zoology reports it beside recall:
    'M x head_dim' for linear attention (plus the window's keys and values), a KV cache of seq_len
    keys and values for softmax attention (at the training length: it grows with the sequence; the
    window's W with a window)."""
    head_dim, kinds = config.head_dim, []
    if config.attention == "linear" and len(config.softmax_layer_indices) < config.n_layer:
        window = f" + {config.window} x 2 x {head_dim} window" if config.window else ""
        kinds.append(f"{config.num_features} x {head_dim}{window}")
    if config.attention == "softmax" and config.window:
        kinds.append(f"{min(config.window, config.seq_len)} x 2 x {head_dim} KV cache")
    elif config.attention == "softmax" or config.softmax_layer_indices:
        kinds.append(f"{config.seq_len} x 2 x {head_dim} KV cache")
    if config.short_conv > 1:   # the model's own attention layers' (a hybrid's softmax layers have none)
        kinds[0] += f" + {config.short_conv - 1} x 3 x {head_dim} conv"
    return "; ".join(kinds)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-byte cross-entropy in nats (float32 even under autocast)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


BITS_PER_NAT = 1 / math.log(2)


def bits_per_byte(nats: float) -> float:
    return nats * BITS_PER_NAT
