"""Machine checks before a run starts: the memory an estimate needs, and kernels for the device."""
from __future__ import annotations

from typing import Any

import torch

import linattn


def check_memory(needed: int, what: str, device: torch.device | None = None) -> None:
    """Refuse before allocating when an estimate is beyond the device's memory (the library's
    `device_memory`: a CUDA GPU's, the machine's physical memory on CPU; unknown elsewhere, not checked)."""
    available = linattn.device_memory(device if device is not None else torch.device("cpu"))
    if available is not None and needed > available:
        raise ValueError(f"{what} would need about {needed / 2**30:,.1f} GiB, more than the "
                         f"{available / 2**30:,.1f} GiB this machine has; choose smaller sizes")


def check_backend_runs_on(model: Any, device: torch.device) -> None:
    """The attention kernels asked for exist for the device (each error says what to do instead)."""
    log_space = model.attention == "linear" and linattn.feature_map_class(model.feature_map).log_space
    linattn.resolve_backend(model.block_backend, device, attention=model.attention, log_space=log_space)


def parameter_bytes(model: Any) -> int:
    """A model config's float32 parameters and feature-map buffers (an M x head_dim projection per layer)."""
    d, hidden = model.d_model, model.mlp_hidden
    per_layer = 4 * d * d + 2 * d * hidden + hidden + d + 4 * d
    if model.attention == "linear":
        per_layer += model.num_features * model.head_dim
    per_layer += 3 * d * model.short_conv   # the depthwise convolution on q, k and v, no bias
    count = 2 * model.vocab_size * d + model.n_layer * per_layer + 2 * d + model.abs_pos * model.seq_len * d
    return 4 * count


def activation_bytes(model: Any, batch_size: int) -> int:
    """A rough float32 estimate of what one training step keeps for backward."""
    tokens, d, heads = batch_size * model.seq_len, model.d_model, model.n_head
    per_token = 10 * d + 2 * model.mlp_hidden + 3 * model.vocab_size
    if model.attention == "softmax":
        per_token += heads * model.seq_len                       # the weights of the math kernel
    else:
        chunk = model.chunk_size
        padded = -(-model.seq_len // chunk) * chunk
        per_token += 4 * heads * model.num_features             # phi(q), phi(k), rotated copies
        per_token += heads * chunk * padded // model.seq_len    # masked chunk scores
        per_token += heads * model.num_features * model.head_dim * padded // (chunk * model.seq_len)
    return 4 * tokens * per_token * model.n_layer
