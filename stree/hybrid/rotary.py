"""Llama rotary position embedding (RoPE) with HF ``rope_scaling`` ("linear" and Llama-3.1 "llama3").

Positions are explicit ``(batch, length)`` tensors so that callers (autoregressive decoding, tree
verification) can place tokens anywhere; nothing here tracks an offset.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies ``(head_dim // 2,)`` fp32, as HF ``modeling_rope_utils`` computes them.

    scaling: None, ``{"rope_type": "linear", "factor"}`` or ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}`` (validated by the config).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type is None:
        return inv_freq
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate in between.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions.

    ``inv_freq`` is deliberately not a buffer: ``model.to(bfloat16)`` would round it (positions of a few
    thousand then rotate by visibly wrong angles) and a meta-device build would leave it empty. It is
    computed once per device in fp32 instead.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """(head_dim // 2,) fp32 on ``device``."""
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (batch, length) int -> cos, sin: (batch, length, head_dim) fp32."""
        freqs = positions.float()[..., None] * self.inv_freq(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: (batch, length, heads, head_dim)`` by ``cos, sin: (batch, length, head_dim)``.

    Non-interleaved (GPT-NeoX / HF Llama ``rotate_half``) layout; computed in fp32, returned in x.dtype.
    """
    return rotate(x, signed_tables(cos, sin))


def signed_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin with its first half negated)``, each ``(batch, length, 1, head_dim)``: with them
    ``rotate_half(x) * sin == roll(x, head_dim / 2) * signed_sin``, so a rotation is three ops.
    Built once per set of positions and shared by every attention layer."""
    half = sin.shape[-1] // 2
    return cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x (b, l, heads, head_dim)`` rotated by :func:`signed_tables`; fp32 compute, x's dtype out."""
    cos, sin = tables
    xf = x if x.dtype == torch.float32 else x.float()
    out = torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, dims=-1), sin)
    return out if out.dtype == x.dtype else out.to(x.dtype)
