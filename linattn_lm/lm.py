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

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import linattn

ATTENTIONS = ("softmax", "linear")
SOFTMAX_ROPE = ("post", "none")     # softmax has no feature map: "post" = RoPE on q and k
INIT_STD = 0.02


@dataclass
class ModelConfig:
    """Everything needed to rebuild a model; only str/int/float/bool so checkpoints load with
    `torch.load(weights_only=True)`.  Fields that do not apply to a variant hold "" or 0."""

    vocab_size: int = 256
    n_layer: int = 4
    d_model: int = 128
    n_head: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    seq_len: int = 256              # training context; learned absolute positions cover exactly this
    attention: str = "linear"       # "softmax" or "linear"
    feature_map: str = "favor"      # linear only: a registered feature map ("" for softmax)
    rope: str = "post"              # linear: post/pre/none; softmax: post (= RoPE on q, k) or none
    abs_pos: bool = False           # add learned absolute position embeddings
    num_features: int = 64          # FAVOR+ random features M (0 for other maps)
    redraw_interval: int = 1000     # FAVOR+ projection redraw period in training steps (0 for other maps)
    chunk_size: int = 64            # causal linear attention block size (speed only, same maths)
    seed: int = 0                   # FAVOR+ layer seeds derive from it

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "n_layer", "d_model", "n_head", "seq_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be positive, got {self.mlp_ratio}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.attention == "softmax":
            self._validate_softmax()
        elif self.attention == "linear":
            self._validate_linear()
        else:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        self._validate_rope_pairs()

    def _validate_softmax(self) -> None:
        if self.rope not in SOFTMAX_ROPE:
            raise ValueError(f"softmax attention has no feature map, so rope is 'post' (RoPE on q and k) "
                             f"or 'none', got {self.rope!r}; 'pre' applies to linear attention only")
        if self.feature_map or self.num_features or self.redraw_interval:
            raise ValueError("softmax attention takes no feature map: feature_map must be '' and "
                             "num_features, redraw_interval 0")

    def _validate_linear(self) -> None:
        if self.feature_map not in linattn.available_feature_maps():
            raise ValueError(f"unknown feature map {self.feature_map!r}; registered: "
                             f"{', '.join(linattn.available_feature_maps())}")
        if self.rope not in linattn.ROPE_PLACEMENTS:
            raise ValueError(f"rope must be one of {linattn.ROPE_PLACEMENTS}, got {self.rope!r}")
        if self.feature_map == "favor":
            if self.num_features < 1 or self.redraw_interval < 0:
                raise ValueError(f"favor needs num_features >= 1 and redraw_interval >= 0, got "
                                 f"{self.num_features} and {self.redraw_interval}")
        elif self.num_features or self.redraw_interval:
            raise ValueError(f"num_features and redraw_interval apply to the favor map only; "
                             f"{self.feature_map!r} must have both 0")

    def _validate_rope_pairs(self) -> None:
        """RoPE rotates coordinate pairs: after a FAVOR+ map it rotates M features (the other
        maps keep M = head_dim), otherwise the head_dim coordinates of q and k."""
        if self.rope == "none":
            return
        rotates_favor = self.attention == "linear" and self.rope == "post" and self.feature_map == "favor"
        size, name = (self.num_features, "num_features") if rotates_favor else (self.head_dim, "head_dim")
        if size % 2:
            raise ValueError(f"rope={self.rope!r} rotates pairs of coordinates, so {name} must be even, "
                             f"got {size}; pick an even value or rope='none'")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def variant(self) -> str:
        """Short name of the attention variant, e.g. softmax-rope, linear-favor-post-M256."""
        if self.attention == "softmax":
            parts = ["rope"] * (self.rope == "post") + ["abs"] * self.abs_pos
            return "-".join(["softmax", *(parts or ["none"])])
        name = f"linear-{self.feature_map}-{self.rope}"
        if self.feature_map == "favor":
            name += f"-M{self.num_features}"
        return name + ("-abs" if self.abs_pos else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
        """The model fields of `values` (a checkpoint's config may hold training fields too)."""
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def favor_layer_seed(run_seed: int, layer: int) -> int:
    """Distinct, reproducible FAVOR+ seed per layer: layers differ, every DDP rank agrees."""
    return run_seed * 1_000_003 + layer


def make_attention(config: ModelConfig, layer: int) -> nn.Module:
    if config.attention == "softmax":
        return linattn.SoftmaxAttention(config.d_model, config.n_head, rope=config.rope == "post")
    options = {}
    if config.feature_map == "favor":
        options = {"num_features": config.num_features, "redraw_interval": config.redraw_interval,
                   "seed": favor_layer_seed(config.seed, layer)}
    return linattn.LinearAttention(config.d_model, config.n_head, feature_map=config.feature_map,
                                   rope=config.rope, feature_map_options=options,
                                   chunk_size=config.chunk_size)


class Block(nn.Module):
    """Pre-LayerNorm Transformer block; `forward` for sequences, `step` for one token."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        hidden = int(config.mlp_ratio * config.d_model)
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
    logits = logits.float() / temperature
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
