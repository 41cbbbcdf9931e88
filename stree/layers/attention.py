"""Attention layers over a token tree: every tree node attends to its row's committed prefix and to
its own ancestors (tree mask), at rotary position ``committed length + depth``.

The tree's K/V are written as scratch right after each row's committed prefix, so attention reads
one contiguous key range; ``TreeCache.commit`` later compacts the accepted nodes' K/V in place.
Works for mamba_ssm's ``MHA`` (hybrids built with ``attn_layer_idx``) and for the Llama attention
of ``stree.hybrid`` through a small adapter.
"""
from __future__ import annotations

import math

import torch

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.modules.mha import MHA

from stree.cache import AttentionActivations, AttentionLayerCache
from stree.layers import sdpa


class _MHAView:
    """mamba_ssm ``MHA`` seen through the interface of ``stree.hybrid``'s attention."""

    def __init__(self, m: MHA):
        if m.d_conv > 0:
            raise ValueError("MHA with d_conv > 0 (a conv over qkv) is not supported over trees")
        if m.mlp_dim > 0:
            raise ValueError("MHA with mlp_dim > 0 (a fused MLP branch) is not supported over trees")
        if not m.causal:
            raise ValueError("MHA layers of a causal LM must be built with causal=True")
        self.m = m
        self.num_heads, self.num_key_value_heads, self.head_dim = m.num_heads, m.num_heads_kv, m.head_dim
        self.scale = m.softmax_scale if m.softmax_scale is not None else 1.0 / math.sqrt(m.head_dim)

    def project_qkv(self, h):
        hkv = self.num_key_value_heads
        heads = self.m.in_proj(h).unflatten(-1, (-1, self.head_dim))  # q's, then k's, then v's
        return heads.split((self.num_heads, hkv, hkv), dim=2)

    def apply_rotary(self, q, k, positions):
        dim = self.m.rotary_emb_dim
        if dim == 0:
            return q, k
        rot = self.m.rotary_emb
        inv_freq = 1.0 / (rot.base ** (torch.arange(0, dim, 2, device=q.device, dtype=torch.float32) / dim))
        ang = positions.float()[..., None] * inv_freq  # (b, l, dim/2)
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
        return (_rotate(q, cos, sin, dim, rot.interleaved), _rotate(k, cos, sin, dim, rot.interleaved))

    def o_proj(self, out):
        return self.m.out_proj(out)


def _rotate(x, cos, sin, dim, interleaved):
    """flash-attn's rotary convention on the first ``dim`` channels (GPT-NeoX halves, or pairs)."""
    xr, rest = x[..., :dim].float(), x[..., dim:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def view(module):
    """The attention adapter for a supported module, or None."""
    if isinstance(module, MHA):
        return _MHAView(module)
    if hasattr(module, "project_qkv"):
        return module
    return None


def scale_of(a) -> float:
    return getattr(a, "scale", None) or getattr(a, "softmax_scale", None) or 1.0 / math.sqrt(a.head_dim)


def allocate(a, batch_size: int, max_seqlen: int, dtype, device) -> AttentionLayerCache:
    return AttentionLayerCache.zeros(batch_size, a.num_key_value_heads, max_seqlen, a.head_dim,
                                     dtype=dtype, device=device)


def tree_mask(ancestors: torch.Tensor, lengths: torch.Tensor, span: int) -> torch.Tensor:
    """``(b, 1, n, span)`` bool: key j visible to node i iff j < lengths[b] (committed prefix) or
    j = lengths[b] + a for an ancestor-or-self a of i (``ancestors``: the tree's ``mask (b, n, n)``).
    Built once per tree, shared by all layers."""
    b, n, _ = ancestors.shape
    j = torch.arange(span, device=lengths.device)
    rel = j[None, :] - lengths[:, None]  # (b, span) offset into the tree scratch
    in_tree = (rel >= 0) & (rel < n)
    anc = ancestors.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, span))
    visible = (rel[:, None, :] < 0) | (in_tree[:, None, :] & anc)
    return visible[:, None]


def _attend(a, q, cache: AttentionLayerCache, span: int, mask: torch.Tensor | None = None,
            start: int | None = None):
    """Attention of ``q (b, l, hq, d)`` over the rows' keys ``[0, span)`` -> ``(b, l, hq * d)``:
    with ``mask`` (additive in the cache's dtype, folded for the layer's query groups;
    :func:`sdpa.attention`), or causal after ``start`` committed positions
    (:func:`sdpa.causal_after`)."""
    k, v = cache.keys(span)  # the rows' positions [0, span)
    q = q.transpose(1, 2)
    q = q if q.dtype == k.dtype else q.to(k.dtype)
    if mask is None:
        return sdpa.causal_after(q, k, v, scale_of(a), start)
    return sdpa.attention(q, k, v, scale_of(a), mask=mask)


def _groups(a) -> int:
    """Query heads per K/V head."""
    return a.num_heads // a.num_key_value_heads


def additive(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A bool mask (True = visible) as SDPA's additive float mask (0 / -inf) in ``dtype``: built
    once per tree and dtype, where SDPA would convert a bool mask in every layer."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _write(cache: AttentionLayerCache, index: tuple[torch.Tensor, torch.Tensor], k, v):
    """Write ``k, v (b, l, hkv, d)`` at the flat indices ``index`` (K's and V's ``(b, l, hkv)``,
    :meth:`AttentionLayerCache.flat_index` unbound)."""
    flat = cache.kv.view(-1, cache.kv.shape[-1])
    for i, x in zip(index, (k, v)):
        flat.index_put_((i,), x if x.dtype == flat.dtype else x.to(flat.dtype))


def tree_tables(ancestors: torch.Tensor, depth: torch.Tensor, lengths: torch.Tensor, span: int,
                adapters, caches, nodes=None) -> dict:
    """What every attention layer of one tree forward reuses, built once per tree from its
    ancestor ``mask (b, n, n)`` and ``depth (b, n)``: rotary positions ``lengths + depth``, the
    key ``span``, one set of rotation matrices per rotary configuration among ``adapters`` (the
    model's attention adapters) and, per layer kind among ``adapters`` and ``caches`` (their
    :class:`AttentionLayerCache`, in the same order), the additive mask (:func:`tree_mask`, per
    dtype and query group size, folded by :func:`sdpa.fold_mask`) and the flat indices of the
    scratch slots ``lengths + i`` (:meth:`AttentionLayerCache.flat_index`, per cache shape).

    ``nodes (b, w)``: only these nodes are queried (level-by-level drafting): their mask rows,
    positions and slots; the K/V of their ancestors must already sit in the scratch."""
    rows = torch.arange(depth.shape[0], device=lengths.device)[:, None]
    mask = tree_mask(ancestors, lengths, span)
    if nodes is None:
        nodes = torch.arange(depth.shape[1], device=lengths.device)[None]
    else:
        mask = mask.gather(2, nodes[:, None, :, None].expand(-1, 1, -1, span))
        depth = depth.gather(1, nodes)
    positions = lengths[:, None] + depth
    tables = dict(positions=positions, span=span)
    for a in adapters:
        if hasattr(a, "rotary_tables") and a.rotary_key not in tables:
            tables[a.rotary_key] = rotation_matrices(*a.rotary_tables(positions))
    for a, c in zip(adapters, caches):
        if _mask_key(a, c) not in tables:
            tables[_mask_key(a, c)] = sdpa.fold_mask(additive(mask, c.kv.dtype), _groups(a))
        if _slots_key(c) not in tables:
            tables[_slots_key(c)] = c.flat_index(rows, lengths[:, None] + nodes).unbind(2)
    return tables


def _mask_key(a, cache: AttentionLayerCache):
    return ("mask", cache.kv.dtype, _groups(a))


def _slots_key(cache: AttentionLayerCache):
    return ("slots", cache.layout)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``(b * l, d, d)`` with ``x @ R == x * cos + roll(x, d/2) * sin`` for each of the ``b * l``
    positions (rotate-half RoPE; ``sin`` with its first half negated, both ``(b, l, 1, d)``): a
    tree's nodes are few, so one matmul replaces three elementwise ops per tensor in every layer."""
    d = cos.shape[-1]
    rot = torch.diag_embed(cos[:, :, 0]) + torch.diag_embed(sin[:, :, 0]).roll(d // 2, dims=-2)
    return rot.flatten(0, 1)


def _rotate_by(x, rot):
    """``x (b, l, heads, d) @ rot (b * l, d, d)`` in fp32, returned in x's dtype (one 3-D bmm:
    matmul's broadcasting over (b, l) dispatches several times more ops)."""
    b, l, heads, d = x.shape
    out = torch.bmm((x if x.dtype == torch.float32 else x.float()).flatten(0, 1), rot)
    out = out.view(b, l, heads, d)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _qkv(a, h):
    """The adapter's ``project_qkv(h)``: ``q, k, v`` and its output gate, or None. An adapter with
    a gated output (Qwen3.5's and Qwen3-Next's attention) returns the gate as a fourth tensor and
    takes it back in ``o_proj(out, gate)``."""
    parts = a.project_qkv(h)
    return (*parts, None) if len(parts) == 3 else parts


def _output(a, out, gate):
    return a.o_proj(out) if gate is None else a.o_proj(out, gate)


def _project(a, h, shared: dict):
    """``q (b, n, hq, d)``, ``k, v (b, n, hkv, d)`` of the tree nodes ``h``, q and k rotated, and
    the output gate (or None). Adapters with rotation matrices (``rotary_tables``) have a fused
    projection (``project_heads``): their q and k heads are adjacent, so one product rotates both."""
    if not hasattr(a, "rotary_tables"):
        q, k, v, gate = _qkv(a, h)
        return (*a.apply_rotary(q, k, shared["positions"]), v, gate)
    hq, hkv = a.num_heads, a.num_key_value_heads
    heads = a.project_heads(h)
    q, k = _rotate_by(heads[:, :, :hq + hkv], shared[a.rotary_key]).split((hq, hkv), dim=2)
    return q, k, heads[:, :, hq + hkv:], None


def tree_forward(a, h, cache: AttentionLayerCache, shared: dict):
    """Attention output ``(b, n, d_model)`` for the tree nodes ``h (b, n, d_model)``.

    ``shared`` = :func:`tree_tables` of the tree; its ``span`` (keys read) is the max committed
    length + n, or ``max_seqlen`` for a static-shape step (the mask hides the rest).
    """
    q, k, v, gate = _project(a, h, shared)
    _write(cache, shared[_slots_key(cache)], k, v)  # at the scratch slots lengths + i
    out = _attend(a, q, cache, shared["span"], shared[_mask_key(a, cache)])
    return _output(a, out, gate), AttentionActivations()


def prefill(a, h, cache: AttentionLayerCache, start: int):
    """Causal attention for ``h (b, l, d_model)`` appended after the committed prefix of length
    ``start`` (shared by all rows); writes the K/V."""
    b, l, _ = h.shape
    q, k, v, gate = _qkv(a, h)
    pos = start + torch.arange(l, device=h.device).expand(b, l)
    q, k = a.apply_rotary(q, k, pos)
    _write(cache, cache.flat_index(torch.arange(b, device=h.device)[:, None], pos).unbind(2), k, v)
    return _output(a, _attend(a, q, cache, start + l, start=start), gate)
