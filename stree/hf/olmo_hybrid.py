"""``OlmoHybridForCausalLM``: Gated DeltaNet layers (pre-norm) and attention layers with OLMo's
post-norms (the attention and MLP outputs are normalised before the residual add, their inputs
are not), attention with q/k norms and rotary or none (NoPE, the released checkpoints)."""
from __future__ import annotations

import sys

from stree.hf.common import Family, layer_name
from stree.hf.gated_delta import NormedAttentionView, OlmoHybridDeltaView


class OlmoHybridFamily(Family):
    def __init__(self, model):
        super().__init__(model)
        inner = model.model
        apply_rope = sys.modules[type(inner).__module__].apply_rotary_pos_emb
        for i, layer in enumerate(inner.layers):
            if hasattr(layer, "linear_attn"):
                self.mixers[i] = OlmoHybridDeltaView(layer.linear_attn, layer_name(model, i, "Gated DeltaNet"))
            else:
                self.mixers[i] = NormedAttentionView(layer.self_attn, layer_name(model, i, "attention"),
                                                     inner.rotary_emb, apply_rope)

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        for i, layer in enumerate(inner.layers):
            if hasattr(layer, "linear_attn"):
                h = h + run_mixer(i, layer.input_layernorm(h))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = h + layer.post_attention_layernorm(run_mixer(i, h))
                h = h + layer.post_feedforward_layernorm(layer.mlp(h))
        return inner.norm(h)
