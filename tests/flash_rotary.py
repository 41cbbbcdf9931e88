"""A test-only stand-in for flash-attn's ``flash_attn.layers.rotary.RotaryEmbedding`` (which needs
CUDA), written from flash-attn's definition, so mamba_ssm's ``MHA(rotary_emb_dim=...)`` can be
built and decoded on CPU. Nothing here calls stree.

flash-attn's rotary on the first ``dim`` channels of each head, position ``t``, frequencies
``inv_freq[i] = base ** (-2i / dim)``, angle ``t * inv_freq`` (fp32):
* ``interleaved=False`` (GPT-NeoX): ``out = x * cos + rotate_half(x) * sin`` with
  ``rotate_half([x1, x2]) = [-x2, x1]`` over the two halves and cos/sin repeated as ``[c, c]``;
* ``interleaved=True`` (GPT-J): the same with pairs ``(x[2i], x[2i+1])`` and cos/sin repeated
  per pair ``[c0, c0, c1, c1, ...]``.
Channels past ``dim`` pass through.
"""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved: bool):
    """x (b, s, h, d); cos/sin (b or 1, s, dim/2)."""
    ro = cos.shape[-1] * 2
    rep = (lambda c: c.repeat_interleave(2, -1)) if interleaved else (lambda c: torch.cat([c, c], -1))
    cos, sin = rep(cos)[:, :, None], rep(sin)[:, :, None]
    x_rot = x[..., :ro].float()
    out = x_rot * cos + rotate_half(x_rot, interleaved) * sin
    return torch.cat([out.to(x.dtype), x[..., ro:]], dim=-1)


class RotaryEmbedding(nn.Module):
    """Same constructor and ``forward(q, kv, seqlen_offset, max_seqlen)`` as flash-attn's module
    (``scale_base`` / xPos not supported)."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None,
                 pos_idx_in_fp32=True, device=None):
        super().__init__()
        if scale_base is not None:
            raise NotImplementedError("xPos (scale_base) is not part of the stand-in")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        self.register_buffer("inv_freq", 1.0 / (self.base ** (
            torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)), persistent=False)

    def forward(self, q, kv, seqlen_offset=0, max_seqlen=None):
        """q (b, s, h, d), kv (b, s, 2, hkv, d); seqlen_offset int or (b,) -> rotated (q, kv)."""
        s = q.shape[1]
        offset = torch.as_tensor(seqlen_offset, device=q.device).reshape(-1, 1)  # (b or 1, 1)
        t = (offset + torch.arange(s, device=q.device)).float()                  # (b or 1, s)
        ang = t[..., None] * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        k = apply_rotary_emb(kv[:, :, 0], cos, sin, self.interleaved)
        return apply_rotary_emb(q, cos, sin, self.interleaved), torch.stack([k, kv[:, :, 1]], dim=2)
