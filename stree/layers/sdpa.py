"""Grouped-query attention through PyTorch's SDPA without repeating K/V and without the math fallback.

SDPA takes GQA (``enable_gqa``) only in its flash kernel on CUDA, and flash takes no mask: a
masked GQA call falls back to the math kernel, which repeats K/V for every query head and
materialises the scores in fp32 (the tree's mask made every tree step such a call). So:

* without a mask (a one-token decoding step, or causal attention from position 0):
  ``enable_gqa`` / ``is_causal``, which flash serves;
* with a mask (a tree, or a prompt appended after a committed prefix): the ``rep = hq / hkv``
  query heads that read one K/V head are folded into the query length, ``(b, hkv, rep * l,
  d)``, so SDPA sees plain multi-head attention over the K/V as stored, and the mask is
  repeated per folded group (:func:`fold_mask`; a tree step builds it once for all layers),
  which the memory-efficient kernel takes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["attention", "causal_after", "fold_mask"]


def fold_mask(mask: torch.Tensor, rep: int) -> torch.Tensor:
    """``mask (..., l, s)`` (bool or additive) as the mask of :func:`attention`'s folded queries,
    ``(..., rep * l, s)``: folded row ``r * l + i`` is query ``i`` of the group's ``r``-th head."""
    if rep == 1:
        return mask
    *lead, l, s = mask.shape
    return mask.unsqueeze(-3).expand(*lead, rep, l, s).reshape(*lead, rep * l, s)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """``q (b, hq, l, d)`` over ``k, v (b, hkv, s, d)`` (query head ``h`` reads K/V head
    ``h // (hq / hkv)``) -> ``(b, l, hq * d)``.

    ``mask``: bool (True = visible) or additive, broadcastable to ``(b, 1, rep * l, s)``, i.e.
    already :func:`fold_mask`-ed; or ``causal`` (no mask, ``l == s``).
    """
    b, hq, l, d = q.shape
    hkv = k.shape[1]
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=hq != hkv)
        return out.transpose(1, 2).flatten(2)
    if causal:
        raise ValueError("attention takes a mask or causal=True, not both")
    rep = hq // hkv
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, rep * l, d), k, v, attn_mask=mask,
                                         scale=scale)
    # (b, hkv, rep * l, d) -> (b, l, hkv, rep, d): heads back in the order h = g * rep + r
    return out.view(b, hkv, rep, l, d).permute(0, 3, 1, 2, 4).reshape(b, l, hq * d)


def causal_after(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 start: int = 0) -> torch.Tensor:
    """Causal attention of ``q (b, hq, l, d)``, positions ``start .. start + l - 1``, over
    ``k, v (b, hkv, start + l, d)``: each query sees the keys up to its own position ->
    ``(b, l, hq * d)``. From position 0 SDPA's ``is_causal``; one query needs no mask; otherwise
    a bottom-right aligned mask (``is_causal`` is top-left aligned when ``l != s``)."""
    l = q.shape[2]
    if start == 0:
        return attention(q, k, v, scale, causal=True)
    if l == 1:
        return attention(q, k, v, scale)
    mask = torch.ones(l, start + l, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return attention(q, k, v, scale, mask=fold_mask(mask, q.shape[1] // k.shape[1]))
