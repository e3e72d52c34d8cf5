"""Shared layers of the lab target: RoPE tables and rotation, RMSNorm (torch, any float dtype).

Used by training (:mod:`dsv41.engine.weights`) and inference (:mod:`dsv41.engine.model`) so
both run the same math.
"""

from __future__ import annotations


def rope_tables(positions, head_dim: int, theta: float, dtype):
    """cos/sin tables ``[T, head_dim/2]`` for integer positions (RoFormer, Su et al. 2021)."""
    import torch

    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def apply_rope(x, cos, sin):
    """Rotate pairs (even, odd) of the last dim; x ``[..., T, D]``, cos/sin ``[T, D/2]``."""
    import torch

    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def rms_norm(x, w, eps: float):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w`` over the last dim."""
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
