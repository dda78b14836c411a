"""Rotary position embedding (RoPE) over adjacent coordinate pairs (2i, 2i+1).

Pair i at position p is rotated by the angle p * theta_i with theta_i = base^(-2i/dim), so a dot
product of two rotated vectors depends only on their relative position.  This one function is used
for every placement: on q and k (softmax, `pre`) and on feature maps phi(q), phi(k) (`post`, Eq. 19).
Each pair is treated as a complex number and multiplied by e^(i p theta): one pass over memory.
"""
from __future__ import annotations

import torch

DEFAULT_BASE = 10000.0

# (dim, base, device) -> e^(i p theta) as complex128 (positions, dim/2); grown on demand.
_ANGLE_CACHE: dict[tuple[int, float, str], torch.Tensor] = {}


def _check_dim(dim: int) -> None:
    if dim % 2:
        raise ValueError(
            f"rotary embedding rotates pairs (2i, 2i+1), so the rotated dimension must be even, "
            f"got {dim}; use an even head_dim / num_features (M) or turn rotation off")


def rotary_phases(length: int, dim: int, *, offset: int = 0, base: float = DEFAULT_BASE,
                  device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e^(i p theta_j) of shape (length, dim/2) for positions offset..offset+length-1, complex of
    `dtype`'s precision.  Angles are computed in float64 and cached."""
    _check_dim(dim)
    if offset < 0:
        raise ValueError(f"rotary offset must be >= 0, got {offset}")
    key, needed = (dim, float(base), str(torch.device(device))), offset + length
    cached = _ANGLE_CACHE.get(key)
    if cached is None or cached.shape[0] < needed:
        size = max(needed, 2 * cached.shape[0] if cached is not None else 1024)
        theta = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
        angles = torch.outer(torch.arange(size, dtype=torch.float64, device=device), theta)
        cached = _ANGLE_CACHE[key] = torch.polar(torch.ones_like(angles), angles)
    complex_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return cached[offset:needed].to(complex_dtype)


def apply_rotary(x: torch.Tensor, *, offset: int = 0, base: float = DEFAULT_BASE) -> torch.Tensor:
    """Rotate the last dimension of x (..., N, dim) at positions offset..offset+N-1."""
    real_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    phases = rotary_phases(x.shape[-2], x.shape[-1], offset=offset, base=base, device=x.device,
                           dtype=real_dtype)
    pairs = torch.view_as_complex(x.to(real_dtype).contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * phases).flatten(-2).to(x.dtype)
