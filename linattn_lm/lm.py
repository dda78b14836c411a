"""A decoder-only byte-level Transformer language model (vocab 256) on linattn's attention blocks.

    config = ModelConfig(attention="linear", feature_map="favor", rope="post")
    model = ByteLM(config)
    logits = model(idx)                                   # (B, N) int64 -> (B, N, 256)
    ids = model.generate(prompt, max_new_tokens=100)      # parallel prefill, then O(1)-per-token steps

Pre-LayerNorm blocks (x + attn(ln(x)), x + mlp(ln(x))) with a GELU MLP.  The input embedding and the
output projection are NOT tied: with 256 bytes tying saves almost nothing (256 * d_model weights) and
keeps input and output roles separate.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import linattn

ATTENTIONS = ("softmax", "linear")
SOFTMAX_ROPE = ("post", "none")     # softmax has no feature map: "post" = RoPE on q and k
SOFTMAX_BACKENDS = ("auto",) + linattn.attention.SOFTMAX_BACKENDS   # auto = sdpa
ATTENTION_BACKENDS = {"linear": linattn.functional.BACKENDS, "softmax": SOFTMAX_BACKENDS}
INIT_STD = 0.02
PLAIN_OPTION_TYPES = (bool, int, float, str, type(None))


def setting(default: Any = dataclasses.MISSING, help: str = "", *, resumable: bool = False,
            variant: bool = False, **kwargs: Any) -> Any:
    """A config field with its flag's help text.  `resumable`: may change on --resume (it never
    changes what the optimiser computes); `variant`: picks the attention variant (grid.py sets it)."""
    metadata = {"help": help, "resumable": resumable, "variant": variant}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kwargs)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_finite(config: Any) -> None:
    """Every float field of a config is finite, and within float32's range, where torch uses it
    (nan and inf pass range checks silently)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not abs(value) <= FLOAT32_MAX:
            raise ValueError(f"{f.name} must be a finite number within float32's range "
                             f"(|x| <= {FLOAT32_MAX:.3g}), got {value}")


def check_types(config: Any) -> None:
    """Every field holds its declared type (a checkpoint or a preset may hold anything)."""
    for f in dataclasses.fields(config):
        value, expected = getattr(config, f.name), FIELD_TYPES[f.type]
        ok = isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(config, f.name, float(value))
        elif not ok:
            raise ValueError(f"{f.name} must be {expected.__name__}, got {value!r}")


FIELD_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "dict[str, Any]": dict, "list[str]": list}


@dataclass
class ModelConfig:
    """Everything needed to rebuild a model, as plain values (feature_map_options too), so
    checkpoints load with `torch.load(weights_only=True)`.  Defaults are the cpu preset's."""

    vocab_size: int = setting(256, "vocabulary size (bytes)")
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
        "a preset's options apply to its own map only", variant=True)
    rope: str = setting("post", "linear: RoPE after the map (post), before it (pre) or none; "
                                "softmax: post = RoPE on q,k, none = no RoPE", variant=True)
    abs_pos: bool = setting(False, "add learned absolute position embeddings", variant=True)
    normalization: str = setting("denominator", "linear attention's normalisation: denominator (divide by "
                                                "sum phi(q).phi(k)) or rmsnorm (a per-head RMSNorm of the "
                                                "output instead; linear only)", variant=True)
    chunk_size: int = setting(64, "causal linear attention block size (speed only; linear only)")
    backend: str = setting("auto", "attention kernels (speed only): linear auto, torch, triton or cpp (auto = "
                                   "triton on CUDA when installed, cpp on CPU where it builds); softmax auto "
                                   "(= sdpa), sdpa or xformers",
                           resumable=True)
    seed: int = setting(0, "seed for init, data order and feature-map draws")

    def validate(self) -> None:
        """The field checks, then the parameter memory, then the feature map built once with its
        options (so bad option names, types and values get the map's own message) and run on a
        probe input (so a broken map is refused before any work)."""
        from .map_check import checked_feature_map   # here: map_check -> runtime -> lm would be circular
        self.check_fields()
        check_memory(self.parameter_bytes(), "the model's parameters and buffers")
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
        if self.vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256 (one id per byte), got {self.vocab_size}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
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
        if self.backend not in SOFTMAX_BACKENDS:
            raise ValueError(f"softmax attention's backend must be one of {SOFTMAX_BACKENDS}, "
                             f"got {self.backend!r}")

    def _validate_linear(self) -> None:
        if self.rope not in linattn.ROPE_PLACEMENTS:
            raise ValueError(f"rope must be one of {linattn.ROPE_PLACEMENTS}, got {self.rope!r}")
        if self.backend not in linattn.functional.BACKENDS:
            raise ValueError(f"linear attention's backend must be one of {linattn.functional.BACKENDS}, "
                             f"got {self.backend!r}")
        if self.normalization not in linattn.attention.NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {linattn.attention.NORMALIZATIONS}, "
                             f"got {self.normalization!r}")
        for key, value in self.feature_map_options.items():
            if not isinstance(key, str) or not isinstance(value, PLAIN_OPTION_TYPES):
                raise ValueError(f"feature-map option {key}={value!r} is not a plain value: options are "
                                 "str, int, float, bool or None")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"feature-map option {key} must be finite, got {value}")
        if self.feature_map not in linattn.available_feature_maps():
            linattn.make_feature_map(self.feature_map, self.head_dim)   # its error lists the maps

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
        """Layer `layer`'s map; a map that takes a `seed` gets one per layer unless the options fix it,
        a map with weights per head gets n_head."""
        options = dict(self.feature_map_options)
        if "seed" in feature_map_parameters(self.feature_map):
            options.setdefault("seed", layer_seed(self.seed, layer))
        return linattn.make_feature_map(self.feature_map, self.head_dim, heads=self.n_head, **options)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        return int(self.mlp_ratio * self.d_model)

    @property
    def num_features(self) -> int:
        """M of the feature map: its `num_features` option when it has one, else head_dim (an
        estimate made before the map is built; the map itself is the authority)."""
        value = self.feature_map_options.get("num_features")
        return value if isinstance(value, int) and not isinstance(value, bool) else self.head_dim

    def parameter_bytes(self) -> int:
        """float32 parameters and feature-map buffers (an M x head_dim projection per layer)."""
        d, hidden = self.d_model, self.mlp_hidden
        per_layer = 4 * d * d + 2 * d * hidden + hidden + d + 4 * d
        if self.attention == "linear":
            per_layer += self.num_features * self.head_dim
        count = 2 * self.vocab_size * d + self.n_layer * per_layer + 2 * d + self.abs_pos * self.seq_len * d
        return 4 * count

    def activation_bytes(self, batch_size: int) -> int:
        """A rough float32 estimate of what one training step keeps for backward."""
        tokens, d, heads = batch_size * self.seq_len, self.d_model, self.n_head
        per_token = 10 * d + 2 * self.mlp_hidden + 3 * self.vocab_size
        if self.attention == "softmax":
            per_token += heads * self.seq_len                       # the weights of the math kernel
        else:
            chunk = self.chunk_size
            padded = -(-self.seq_len // chunk) * chunk
            per_token += 4 * heads * self.num_features             # phi(q), phi(k), rotated copies
            per_token += heads * chunk * padded // self.seq_len    # masked chunk scores
            per_token += heads * self.num_features * self.head_dim * padded // (chunk * self.seq_len)
        return 4 * tokens * per_token * self.n_layer

    @property
    def variant(self) -> str:
        """Short name of the attention variant, e.g. softmax-rope, linear-favor-post-M256,
        linear-favor-post-rmsnorm-M64."""
        if self.attention == "softmax":
            parts = ["rope"] * (self.rope == "post") + ["abs"] * self.abs_pos
            return "-".join(["softmax", *(parts or ["none"])])
        name = f"linear-{self.feature_map}-{self.rope}"
        if self.normalization != "denominator":
            name += f"-{self.normalization}"
        if "num_features" in self.feature_map_options:
            name += f"-M{self.feature_map_options['num_features']}"
        return name + ("-abs" if self.abs_pos else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """The config of a plain dict, checked; unknown keys are errors (a typo is never ignored)."""
        return from_plain_dict(cls, values, "model")


def from_plain_dict(cls: type, values: Any, section: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"the {section} settings must be a dict, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {section} setting(s) {unknown}; known: {sorted(known)}")
    config = cls(**values)
    check_types(config)
    return config


def feature_map_parameters(name: str) -> list[str]:
    """The option names a registered map's constructor takes."""
    cls = linattn.feature_maps.FEATURE_MAPS.get(name)
    return [] if cls is None else linattn.feature_maps.feature_map_options(cls)


def available_memory_bytes(device: torch.device | None = None) -> int:
    """The device's total memory: a CUDA GPU's, else the machine's physical memory."""
    if device is not None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(needed: int, what: str, device: torch.device | None = None) -> None:
    """Refuse before allocating when an estimate is beyond the device's memory."""
    available = available_memory_bytes(device)
    if needed > available:
        raise ValueError(f"{what} would need about {needed / 2**30:,.1f} GiB, more than the "
                         f"{available / 2**30:,.1f} GiB this machine has; choose smaller sizes")


def layer_seed(run_seed: int, layer: int) -> int:
    """Distinct, reproducible feature-map seed per layer: layers differ, every DDP rank agrees."""
    return run_seed * 1_000_003 + layer


def make_attention(config: ModelConfig, layer: int) -> nn.Module:
    if config.attention == "softmax":
        backend = "sdpa" if config.backend == "auto" else config.backend
        return linattn.SoftmaxAttention(config.d_model, config.n_head, rope=config.rope == "post",
                                        backend=backend)
    return linattn.LinearAttention(config.d_model, config.n_head, feature_map=config.build_feature_map(layer),
                                   rope=config.rope, chunk_size=config.chunk_size, backend=config.backend,
                                   normalization=config.normalization)


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
        config.validate()
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


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-byte cross-entropy in nats (float32 even under autocast)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


BITS_PER_NAT = 1 / math.log(2)


def bits_per_byte(nats: float) -> float:
    return nats * BITS_PER_NAT
