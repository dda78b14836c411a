"""A decoder-only byte-level Transformer language model (vocab 256) on linattn's attention blocks.

    config = ModelConfig(attention="linear", feature_map="favor", rope="post")   # linattn_lm.settings
    model = ByteLM(config)
    logits = model(idx)                                   # (B, N) int64 -> (B, N, 256)
    ids = model.generate(prompt, max_new_tokens=100)      # parallel prefill, then O(1)-per-token steps

Pre-LayerNorm blocks (x + attn(ln(x)), x + mlp(ln(x))) with a GELU MLP.  The input embedding and the
output projection are NOT tied: with 256 bytes tying saves almost nothing (256 * d_model weights) and
keeps input and output roles separate.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import linattn

from .settings import ModelConfig

INIT_STD = 0.02


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
