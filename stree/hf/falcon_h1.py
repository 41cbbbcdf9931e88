"""``FalconH1ForCausalLM``: every layer runs a Mamba2 mixer and a rotary GQA attention in parallel on
the same normalised input and adds their outputs, with Falcon-H1's multipliers: embeddings, the
SSM input, the in_proj output (per-segment ``mup_vector``), keys, each branch's output, the MLP and
the logits. The Mamba2 gate is either the grouped gated RMSNorm or a plain ``silu`` gate
(``mamba_rms_norm``).

Cache keys: layer i's Mamba2 state is ``i``, its attention K/V ``num_hidden_layers + i``.
"""
from __future__ import annotations

import torch.nn.functional as F

from stree.hf.common import AttentionView, Family, Mamba2View, layer_name


class FalconH1Mamba2View(Mamba2View):
    def __init__(self, m, name):
        super().__init__(m, name)
        self.in_proj = lambda u: m.in_proj(u * m.ssm_in_multiplier) * m.mup_vector

    def norm(self, y, z):
        m = self.m
        return m.norm(y, z) if m.mamba_rms_norm else y * F.silu(z)


class FalconH1AttentionView(AttentionView):
    def project_qkv(self, h):
        q, k, v = super().project_qkv(h)
        return q, k * self.m.key_multiplier, v


class FalconH1Family(Family):
    def __init__(self, model):
        super().__init__(model)
        from transformers.models.falcon_h1 import modeling_falcon_h1 as mf
        inner = model.model
        self.offset = len(inner.layers)
        for i, layer in enumerate(inner.layers):
            self.mixers[i] = FalconH1Mamba2View(layer.mamba, layer_name(model, i, "Mamba2 branch"))
            self.mixers[self.offset + i] = FalconH1AttentionView(
                layer.self_attn, layer_name(model, i, "attention branch"), inner.rotary_emb,
                mf.apply_rotary_pos_emb)

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids) * inner.embedding_multiplier
        for i, layer in enumerate(inner.layers):
            x = layer.input_layernorm(h)
            ssm = run_mixer(i, x) * layer.ssm_out_multiplier
            attn = run_mixer(self.offset + i, x * layer.attention_in_multiplier) * layer.attn_out_multiplier
            h = h + (ssm + attn)
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        return inner.final_layernorm(h)

    def logits(self, h):
        return (self.model.lm_head(h) * self.model.model.lm_head_multiplier).float()
