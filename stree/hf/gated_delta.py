"""What transformers' gated delta rule hybrids have in common, seen through stree's layer interfaces.

Their linear-attention layers (``Qwen3_5GatedDeltaNet``, ``Qwen3NextGatedDeltaNet``,
``OlmoHybridGatedDeltaNet``, ``KimiLinearDeltaAttention``) keep one layout: projections to
``[q, k, v]`` (one depthwise short conv over the three, silu), a log-decay ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the rule with L2-normalised q and k, then a gated
RMSNorm per value head and an output projection. They differ in how the projections are split,
which is all a view here says (the adapter interface of ``stree/layers/gated_delta.py``).
Kimi Delta Attention (:class:`KimiDeltaView`) is the same rule with a decay per key channel.
Their attention layers differ more: :class:`GatedAttentionView` is Qwen's (an output gate, per-head
q/k norms, partial rotary), :class:`NormedAttentionView` OLMo Hybrid's (q/k norms over all heads,
rotary or none), :class:`LatentAttentionView` Kimi Linear's multi-head latent attention (MLA)
with its latent cache.
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
        self.num_heads, self.num_k_heads, self.head_k_dim, self.head_v_dim = self.heads(m)
        if self.num_heads % self.num_k_heads:
            raise TypeError(f"{layer_name}: {self.num_heads} value heads are not a multiple of "
                            f"{self.num_k_heads} key heads")

    @staticmethod
    def heads(m) -> tuple[int, int, int, int]:
        """``(value heads, key heads, key head dim, value head dim)`` of the module."""
        return m.num_v_heads, m.num_k_heads, m.head_k_dim, m.head_v_dim

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


class KimiDeltaView(DeltaView):
    """``KimiLinearDeltaAttention`` (Kimi Delta Attention): q/k/v projections, a low-rank forget
    gate giving a log-decay per key channel ``(..., H, dk)`` (the module's ``forget_gate``), a
    low-rank output gate, a sigmoid-gated norm, and Kimi's L2 norm ``x / sqrt(sum(x^2) + eps)``."""

    @staticmethod
    def heads(m):
        return m.num_heads, m.num_heads, m.head_dim, m.head_dim

    @staticmethod
    def l2norm(x, eps: float = 1e-6):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)

    def project(self, h):
        m = self.m
        xbc = torch.cat([m.q_proj(h), m.k_proj(h), m.v_proj(h)], dim=-1)
        return xbc, m.forget_gate(h), m.b_proj(h).sigmoid(), m.g_b_proj(m.g_a_proj(h))

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


class LatentAttentionView:
    """Kimi Linear's attention (MLA, DeepSeek-V2's, without rotary) in its absorbed form, so that
    the cache holds the latent ``[c, k_pe]`` per position (one shared head of ``kv_lora_rank +
    qk_rope_head_dim`` channels), as the model's own cache does, not per-head keys and values.

    With ``W_k, W_v`` each head's slices of ``kv_b_proj`` and ``c`` the normalised latent,
    ``q . k = (W_k^T q_nope) . c + q_pe . k_pe`` and ``attn @ v = W_v (attn @ c)``: the query
    becomes ``[W_k^T q_nope, q_pe]`` against the latent as key, the latent is also the value, and
    each head's output is read back through ``W_v`` (same scale, the per-head ``qk_head_dim``)."""

    def __init__(self, m, layer_name: str):
        cfg = m.config
        if getattr(cfg, "sliding_window", None):
            raise TypeError(f"{layer_name}: sliding-window attention is not supported over trees")
        self.m = m
        self.num_heads, self.num_key_value_heads = m.num_heads, 1
        self.rank, self.nope, self.v_dim = m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim
        self.head_dim = self.rank + m.qk_rope_head_dim
        self.scale = m.scaling

    def parameters(self):
        return self.m.parameters()

    def _kv_b(self):
        """``kv_b_proj``'s weight as ``(heads, nope + v, rank)``."""
        return self.m.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)

    def project_qkv(self, h):
        m = self.m
        q = m.q_proj(h) if m.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(h)))
        q = q.unflatten(-1, (self.num_heads, -1))
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        w_k = self._kv_b()[:, :self.nope]  # (heads, nope, rank)
        q = torch.cat([torch.einsum("blhn,hnr->blhr", q_nope, w_k), q_pe], dim=-1)
        c, k_pe = m.kv_a_proj_with_mqa(h).split([self.rank, self.head_dim - self.rank], dim=-1)
        latent = torch.cat([m.kv_a_layernorm(c), k_pe], dim=-1)[:, :, None]  # (b, l, 1, rank + rope)
        return q, latent, latent

    def apply_rotary(self, q, k, positions):
        return q, k  # Kimi Linear's MLA has no rotary

    def o_proj(self, out):
        out = out.unflatten(-1, (self.num_heads, self.head_dim))[..., :self.rank]
        w_v = self._kv_b()[:, self.nope:]  # (heads, v, rank)
        return self.m.o_proj(torch.einsum("blhr,hvr->blhv", out, w_v).flatten(-2))
