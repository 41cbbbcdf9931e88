"""Gated RMSNorm off the GPU: ``rmsnorm(y * silu(z))`` (or ``rmsnorm(y) * silu(z)``) per group, in
a few torch ops (mamba_ssm's ``rms_norm_ref`` takes a dozen, most of them casts that do nothing in
fp32). Same math: fp32 compute, ``x * rsqrt(mean(x^2) + eps) * weight (+ bias)`` per group of
``group_size`` channels, cast back to y's dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor | None, eps: float, group_size: int,
                   norm_before_gate: bool = False) -> torch.Tensor:
    """y, z: ``(..., d)``; weight, bias: ``(d,)``. Returns ``(..., d)`` in y's dtype."""
    out = y if y.dtype == torch.float32 else y.float()
    if z is not None and not norm_before_gate:
        out = out * F.silu(z if z.dtype == torch.float32 else z.float())
    out = F.rms_norm(out.unflatten(-1, (-1, group_size)), (group_size,), eps=eps).flatten(-2)
    out = out * weight if bias is None else torch.addcmul(bias, out, weight)
    if z is not None and norm_before_gate:
        out = out * F.silu(z if z.dtype == torch.float32 else z.float())
    return out if out.dtype == y.dtype else out.to(y.dtype)
