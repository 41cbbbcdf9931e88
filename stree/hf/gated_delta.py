"""What transformers' gated delta rule hybrids have in common, seen through stree's layer interfaces.

Their linear-attention layers (``Qwen3_5GatedDeltaNet``, ``Qwen3NextGatedDeltaNet``,
``OlmoHybridGatedDeltaNet``, ``KimiLinearDeltaAttention``) keep one layout: projections to
``[q, k, v]`` (one depthwise short conv over the three, silu), a log-decay ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the rule with L2-normalised q and k, then a gated
RMSNorm per value head and an output projection. They differ in how the projections are split,
which is all a view here says (the adapter interface of ``stree/layers/gated_delta.py``).
Their attention layers differ more: :class:`GatedAttentionView` is Qwen's (an output gate, per-head
q/k norms, partial rotary), :class:`NormedAttentionView` OLMo Hybrid's (q/k norms over all heads,
rotary or none).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stree.hf.common import AttentionView


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen's and OLMo Hybrid's L2 norm (fla's): ``x * rsqrt(sum(x^2) + eps)`` over the last axis."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class DeltaView:
    """A transformers gated delta rule layer as stree's adapter (the shared parts).

    Subclasses implement :meth:`project` (``h -> (xbc, g, beta, gate)``); the rest is common.
    """

    def __init__(self, m, layer_name: str):
        act = getattr(m, "activation", "silu")
        if act not in ("silu", "swish"):
            raise TypeError(f"{layer_name}: short conv activation {act!r} is not supported (only silu)")
        self.m, self.conv1d = m, m.conv1d
        self.num_heads, self.num_k_heads = m.num_v_heads, m.num_k_heads
        self.head_k_dim, self.head_v_dim = m.head_k_dim, m.head_v_dim
        if self.num_heads % self.num_k_heads:
            raise TypeError(f"{layer_name}: {self.num_heads} value heads are not a multiple of "
                            f"{self.num_k_heads} key heads")

    def parameters(self):
        return self.m.parameters()

    def decay(self, a: torch.Tensor) -> torch.Tensor:
        """``g (..., H)`` fp32 from the raw ``a`` projection, as the module computes it."""
        return -self.m.A_log.float().exp() * F.softplus(a.float() + self.m.dt_bias)

    def split_qkv(self, conv_out: torch.Tensor):
        """Post-conv ``(..., conv_dim)`` -> ``q, k (..., Hk, dk)``, ``v (..., H, dv)``."""
        kd = self.num_k_heads * self.head_k_dim
        q, k, v = torch.split(conv_out, [kd, kd, self.num_heads * self.head_v_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_heads, self.head_v_dim)))

    l2norm = staticmethod(l2norm)

    def norm(self):
        return self.m.norm

    def out_proj(self):
        return self.m.out_proj

    def finish(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``o (..., H, dv)`` -> gated RMSNorm per value head -> output projection."""
        shape = o.shape[:-2]
        out = self.norm()(o.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
        return self.out_proj()(out.reshape(*shape, -1))


class Qwen3_5DeltaView(DeltaView):
    """``Qwen3_5GatedDeltaNet`` (Qwen3.5 and Qwen3.5-MoE): separate ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``."""

    def project(self, h):
        m = self.m
        return m.in_proj_qkv(h), self.decay(m.in_proj_a(h)), m.in_proj_b(h).sigmoid(), m.in_proj_z(h)


class Qwen3NextDeltaView(DeltaView):
    """``Qwen3NextGatedDeltaNet``: fused ``in_proj_qkvz`` / ``in_proj_ba`` grouped by key head,
    reordered by the module's own ``fix_query_key_value_ordering``."""

    def project(self, h):
        m = self.m
        q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
        xbc = torch.cat([t.flatten(-2) for t in (q, k, v)], dim=-1)
        return xbc, self.decay(a), b.sigmoid(), z


class OlmoHybridDeltaView(DeltaView):
    """``OlmoHybridGatedDeltaNet``: separate q/k/v/a/b projections, a ``g_proj`` output gate,
    and with ``linear_allow_neg_eigval`` a write strength ``2 sigmoid(b)`` in ``[0, 2]`` (the
    same rule: the tree math holds for any beta)."""

    def project(self, h):
        m = self.m
        xbc = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
        beta = m.b_proj(h).sigmoid()
        if m.allow_neg_eigval:
            beta = beta * 2.0
        return xbc, self.decay(m.a_proj(h)), beta, m.g_proj(h)

    def norm(self):
        return self.m.o_norm

    def out_proj(self):
        return self.m.o_proj


class GatedAttentionView(AttentionView):
    """Qwen3.5's / Qwen3-Next's attention: ``q_proj`` gives each head's query and an output gate,
    RMSNorm on each head of q and k, rotary on the first ``partial_rotary_factor`` of each head,
    and ``o_proj(out * sigmoid(gate))``."""

    def project_qkv(self, h):
        m = self.m
        q, gate = m.q_proj(h).unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        k = m.k_proj(h).unflatten(-1, (self.num_key_value_heads, self.head_dim))
        v = m.v_proj(h).unflatten(-1, (self.num_key_value_heads, self.head_dim))
        return m.q_norm(q), m.k_norm(k), v, gate.flatten(-2)

    def o_proj(self, out, gate):
        return self.m.o_proj(out * torch.sigmoid(gate))


class NormedAttentionView(AttentionView):
    """OLMo Hybrid's attention: RMSNorm over all of q's and all of k's heads before the split."""

    def project_qkv(self, h):
        m = self.m
        return (m.q_norm(m.q_proj(h)).unflatten(-1, (self.num_heads, self.head_dim)),
                m.k_norm(m.k_proj(h)).unflatten(-1, (self.num_key_value_heads, self.head_dim)),
                m.v_proj(h).unflatten(-1, (self.num_key_value_heads, self.head_dim)))
