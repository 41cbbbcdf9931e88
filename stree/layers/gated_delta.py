"""Gated delta rule mixers (Gated DeltaNet, Kimi Delta Attention) over a token tree (verification),
over a sequence (prefill) and node by node (drafting), on explicit state.

A mixer is seen through an adapter (``stree/hf/gated_delta.py`` has the transformers ones) with:

- ``num_heads`` (value heads ``H``), ``num_k_heads``, ``head_k_dim``, ``head_v_dim``, ``conv1d``
  (the depthwise short conv over ``[q, k, v]``, silu);
- ``project(h) -> (xbc (..., conv_dim), g, beta, gate)``: the pre-conv ``[q, k, v]`` channels,
  the log-decay ``g (..., H)`` or per key channel ``(..., H, dk)`` (fp32), the write strength
  ``beta (..., H)`` and what the output norm is gated by;
- ``split_qkv(conv_out) -> q, k (..., Hk, dk), v (..., H, dv)``; ``l2norm(x)`` (the family's);
- ``finish(o (..., H, dv), gate) -> (..., d_model)``: gated norm and output projection.

Everything per token is the module's own; only the sequence mixing changes: the short conv runs
along ancestor chains (``tree_conv``, shared with Mamba2) and the rule over the ancestor mask
(``tree_delta``). The committed state is a :class:`~stree.cache.MambaLayerCache` (conv window
plus the ``(H, dk, dv)`` recurrent state, fp32), so pools, level drafting and commits treat it
as they treat a Mamba2 layer's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.cache import DeltaActivations, MambaLayerCache
from stree.kernels import chunk_delta, tree_conv, tree_delta

F32 = torch.float32


def is_gated_delta(module) -> bool:
    return hasattr(module, "split_qkv")


def constants(m) -> dict:
    """Per-module tensors that do not change between steps (the conv weight as ``(c, w)``),
    rebuilt only when the conv's parameters are modified."""
    w = m.conv1d.weight
    key = (w.data_ptr(), 0 if w.is_inference() else w._version)
    cached = getattr(m, "_stree_constants", None)
    if cached is None or cached[0] != key:
        bias = m.conv1d.bias
        cached = (key, dict(conv_weight=w.detach()[:, 0], conv_bias=None if bias is None else bias.detach(),
                            scale=m.head_k_dim ** -0.5, groups=m.num_heads // m.num_k_heads))
        m._stree_constants = cached
    return cached[1]


def conv_width(m) -> int:
    """The taps of the module's short conv: the key of its tree tables."""
    return m.conv1d.weight.shape[-1]


def allocate(m, batch_size: int, dtype=None) -> MambaLayerCache:
    """Zero committed state: the conv window in the conv's dtype, the recurrent state in fp32."""
    w = m.conv1d.weight
    return MambaLayerCache.zeros(batch_size, w.shape[0], w.shape[-1], m.num_heads, m.head_k_dim,
                                 m.head_v_dim, dtype=dtype or w.dtype, device=w.device, state_dtype=F32)


def qkv(m, k: dict, conv_out):
    """Post-conv channels -> ``q`` (normalised, scaled), ``k`` (normalised) with one head per value
    head, in fp32 (where the family's rule computes them), and ``v``."""
    q, key, v = m.split_qkv(conv_out)
    qk = m.l2norm(torch.stack([q, key]).to(F32))  # both at once: half the small ops
    if k["groups"] > 1:  # grouped value heads: each q/k head serves `groups` consecutive value heads
        qk = qk.repeat_interleave(k["groups"], dim=-2)
    return qk[0] * k["scale"], qk[1], v


def tree_forward(m, u, state: MambaLayerCache, tables: dict, impl: str = "auto", k: dict | None = None):
    """Mixer output for every tree node from the committed state, without writing it.

    Args:
        m: the adapter; u: ``(b, n, d_model)`` normalised hidden states of the tree nodes.
        state: the committed conv window ``(b, c, w)`` and recurrent state ``(b, H, dk, dv)``.
        tables: ``TokenTree.conv_scan_tables(width)`` of the tree (conv window, gather index,
            ancestor mask).
        k: :func:`constants` of ``m`` (looked up when None).
    Returns:
        ``(out (b, n, d_model), DeltaActivations)``: the latter is what the commit replays.
    """
    k = constants(m) if k is None else k
    xbc, g, beta, gate = m.project(u)
    conv_out = tree_conv(xbc, state.conv_state, k["conv_weight"], k["conv_bias"], tables["window"],
                         activation="silu", impl=impl, gather_index=tables["gather"])
    q, key, v = qkv(m, k, conv_out)
    o, uu, G = tree_delta(q, key, v, g, beta, tables["mask"], state.ssm_state, impl=impl)
    return m.finish(o, gate), DeltaActivations(xbc=xbc, k=key, u=uu, G=G)


def prefill(m, u, state: MambaLayerCache):
    """Run ``u (b, l, d_model)`` through the mixer from the committed state and commit it: the
    conv continued from its window, the rule in chunks (``chunk_delta``)."""
    k = constants(m)
    xbc, g, beta, gate = m.project(u)
    b, l, c = xbc.shape
    w = conv_width(m)
    conv_state = state.conv_state
    ext = torch.cat([conv_state[:, :, 1:].to(xbc.dtype), xbc.transpose(1, 2)], dim=2)  # (b, c, w-1+l)
    conv_out = F.silu(F.conv1d(ext, m.conv1d.weight.to(xbc.dtype), m.conv1d.bias, groups=c)).transpose(1, 2)
    conv_state.copy_(torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=2)[:, :, -w:])
    q, key, v = qkv(m, k, conv_out)
    o, final = chunk_delta(q, key, v, g, beta, state.ssm_state)
    state.ssm_state.copy_(final)
    return m.finish(o, gate)


def node_step(m, u, conv, ssm, k: dict | None = None, valid=None):
    """Tokens run one after another from a given state, the state not written: how a drafter runs
    each new node of a level from its parent's materialised state (the recurrence, no tree tables).

    Args:
        m: the adapter; u: ``(N, L, d_model)``: a chain of ``L`` tokens per row, run in order.
        conv: ``(N, c, w)`` raw conv inputs before the chain; ssm: ``(N, H, dk, dv)`` state.
        k: :func:`constants` of ``m``.
        valid: ``(N, L)`` bool or None: a row's False tokens leave its state as it was (left
            padding of a shorter chain; their outputs are not meaningful).
    Returns:
        ``(out (N, L, d_model), conv (N, c, w), ssm (N, H, dk, dv))``: new tensors.
    """
    k = constants(m) if k is None else k
    xbc, g, beta, gate = m.project(u)  # one weight read for the chain
    weight = k["conv_weight"].to(F32)
    outs = []
    for t in range(u.shape[1]):
        new_conv = torch.cat([conv[:, :, 1:], xbc[:, t, :, None].to(conv.dtype)], dim=2)
        conv_out = (new_conv.to(F32) * weight).sum(-1)
        if k["conv_bias"] is not None:
            conv_out = conv_out + k["conv_bias"].to(F32)
        q, key, v = qkv(m, k, F.silu(conv_out).to(xbc.dtype))  # (N, H, dk), (N, H, dv)
        decay = g[:, t].exp()  # (N, H) or (N, H, dk)
        s = ssm.to(F32) * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        delta = (v.to(F32) - (s * key[..., None]).sum(-2)) * beta[:, t].to(F32)[..., None]
        s = s + key[..., None] * delta[..., None, :]
        outs.append((s * q[..., None]).sum(-2).to(v.dtype))
        s = s.to(ssm.dtype)
        if valid is None:
            conv, ssm = new_conv, s
        else:
            keep = valid[:, t]
            conv = torch.where(keep[:, None, None], new_conv, conv)
            ssm = torch.where(keep[:, None, None, None], s, ssm)
    return m.finish(torch.stack(outs, 1), gate), conv, ssm
