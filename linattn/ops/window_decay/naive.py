"""The explicit N x N definition of the window and the decay, for tests and as a readable specification."""
from __future__ import annotations

import torch

from ...rotary import DEFAULT_BASE, rotate


def window_decay_reference(q_hat: torch.Tensor, k_hat: torch.Tensor, phi_q: torch.Tensor, phi_k: torch.Tensor,
                           v: torch.Tensor, *, window: int, log_decay: torch.Tensor | None,
                           log_gain: torch.Tensor | None, rotary: bool, log_space: bool, offset: int = 0,
                           rope_base: float = DEFAULT_BASE) -> torch.Tensor:
    """Causal attention with weights, for query m and key n <= m at d = m - n,

        w_mn = gamma^d e^(s_mn)      (d < window),     gamma^d g nu_mn      (d >= window)
        u_mn = gamma^d e^(s_mn)      (d < window),     gamma^d g kappa_mn   (d >= window)
        out_m = sum_n w_mn v_n / sum_n u_mn,

    in float64, unstabilised (moderate inputs only).  q_hat, k_hat (B, H, N, D): what the scores
    s = q_hat . k_hat / sqrt(D) take; phi_q, phi_k (B, H, N, M): features (log-features if `log_space`);
    kappa = phi_q . phi_k, nu = (R_m phi_q) . (R_n phi_k) if `rotary` else kappa; log_decay, log_gain (H,):
    log gamma and log g (None: 0)."""
    q_hat, k_hat, phi_q, phi_k, v = (t.double() for t in (q_hat, k_hat, phi_q, phi_k, v))
    if log_space:
        phi_q, phi_k = phi_q.exp(), phi_k.exp()
    n, heads = v.shape[-2], v.shape[1]
    kappa = phi_q @ phi_k.transpose(-1, -2)
    nu = kappa
    if rotary:
        nu = rotate(phi_q, offset=offset, base=rope_base) @ rotate(phi_k, offset=offset,
                                                                             base=rope_base).transpose(-1, -2)
    scores = torch.exp(q_hat @ k_hat.transpose(-1, -2) * q_hat.shape[-1] ** -0.5)
    positions = torch.arange(n, dtype=torch.float64)
    distance = positions[:, None] - positions[None, :]
    in_window = distance < window
    rate = torch.zeros(heads, dtype=torch.float64) if log_decay is None else log_decay.double()
    gain = torch.ones(heads, dtype=torch.float64) if log_gain is None else log_gain.double().exp()
    decay = torch.exp(distance.clamp_min(0) * rate[:, None, None]) * (distance >= 0)   # (H, N, N)
    gain = gain[:, None, None]
    numerator = torch.where(in_window, scores, gain * nu) * decay
    denominator = torch.where(in_window, scores, gain * kappa) * decay
    return (numerator @ v) / denominator.sum(-1, keepdim=True)
