"""What every backend of linear attention shares: input checks, compute dtype, the guarded division
and the numerator's rotation."""
from __future__ import annotations

import torch

from ...rotary import apply_rotary


def check_features(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, rank: int) -> None:
    names = "(B, H, N, M) features and (B, H, N, Dv) values" if rank == 4 else \
        "(B, H, M) features and (B, H, Dv) values for one token"
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}; integer inputs would give "
                             f"truncated outputs: convert with .float()")
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}; "
                             f"linear attention takes {names}")
    if phi_q.shape != phi_k.shape:
        raise ValueError(f"phi_q and phi_k must have the same shape, got {tuple(phi_q.shape)} and "
                         f"{tuple(phi_k.shape)}; map queries and keys with the same feature map")
    if phi_q.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"features {tuple(phi_q.shape)} and values {tuple(v.shape)} disagree before "
                         f"the last dimension; expected {names}")


def check_projections(q_proj, k_proj, v: torch.Tensor) -> None:
    """Log-features given as LogProjection(inputs, weight, shift): (B, H, N, D) inputs, (M, D) weight,
    (B, H, N, 1) shift, for queries and keys alike."""
    for name, proj in (("phi_q", q_proj), ("phi_k", k_proj)):
        if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in proj):
            raise ValueError(f"{name}: a LogProjection holds floating tensors (inputs, weight, shift)")
        inputs, weight, shift = proj
        if inputs.dim() != 4 or weight.dim() != 2 or weight.shape[-1] != inputs.shape[-1] \
                or tuple(shift.shape) != (*inputs.shape[:-1], 1):
            raise ValueError(f"{name}: a LogProjection takes (B, H, N, D) inputs, an (M, D) weight and a "
                             f"(B, H, N, 1) shift, got {tuple(inputs.shape)}, {tuple(weight.shape)} and "
                             f"{tuple(shift.shape)}")
        if inputs.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"{name}: inputs {tuple(inputs.shape)} and values {tuple(v.shape)} disagree "
                             f"before the last dimension")
    if q_proj.weight.shape[0] != k_proj.weight.shape[0]:
        raise ValueError(f"phi_q and phi_k project to {q_proj.weight.shape[0]} and {k_proj.weight.shape[0]} "
                         f"features; map queries and keys with the same feature map")


def check_nonnegative(phi_q: torch.Tensor, phi_k: torch.Tensor) -> None:
    """The denominator sums phi_q . phi_k and is only safe to divide by when every term is >= 0.
    One min() per tensor: a read of N x M against the op's O(N M (Dv + chunk)) work (measured on
    2 CPU cores at N=8192, M=256: ~13 ms, a few % of the causal forward, ~1% of forward+backward)."""
    for name, t in (("phi_q", phi_q), ("phi_k", phi_k)):
        if t.numel() and (low := t.detach().amin()) < 0:
            raise ValueError(f"{name} has negative entries (min {low.item():.3g}); linear attention needs "
                             f"non-negative features, since the denominator is a sum of phi_q . phi_k: "
                             f"use a feature map such as elu(x)+1 or favor")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # Features are non-negative, so the denominator is >= 0.  Clamp it only where (nearly) every
    # key feature underflowed; sqrt(tiny) keeps 1/den^2 finite in the backward pass.
    guard = torch.finfo(denominator.dtype).tiny ** 0.5
    return numerator / denominator.clamp_min(guard).unsqueeze(-1)


def output_gradients(grad: torch.Tensor, out: torch.Tensor, denominator: torch.Tensor):
    """d loss / d numerator and d loss / d denominator of out = `divide`(numerator, denominator),
    given g = d loss / d out: g / den and -(g . out) / den, none where the denominator was clamped."""
    guard = torch.finfo(denominator.dtype).tiny ** 0.5
    clamped, denominator = denominator < guard, denominator.clamp_min(guard)
    g_num = grad / denominator.unsqueeze(-1)
    g_den = (-(grad * out).sum(-1) / denominator).masked_fill_(clamped, 0)
    return g_num, g_den


def numerator_features(phi_q, phi_k, *, rotary: bool, offset: int, base: float):
    if not rotary:
        return phi_q, phi_k
    return apply_rotary(phi_q, offset=offset, base=base), apply_rotary(phi_k, offset=offset, base=base)
