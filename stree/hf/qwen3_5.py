"""``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` (Qwen3.5's text models): pre-norm decoder
layers, each a Gated DeltaNet or a gated attention layer (``layer_types``), followed by an MLP
(dense, or a routed MoE with a shared expert: per token, run as the model's own module). Its
rotary is multimodal (M-RoPE); for text every section reads the same position, as here."""
from __future__ import annotations

import sys

from stree.hf.common import Family, layer_name
from stree.hf.gated_delta import GatedAttentionView, Qwen3_5DeltaView


class Qwen3_5Family(Family):
    delta_view = Qwen3_5DeltaView

    def __init__(self, model):
        super().__init__(model)
        inner = model.model
        apply_rope = sys.modules[type(inner).__module__].apply_rotary_pos_emb
        for i, (layer, kind) in enumerate(zip(inner.layers, model.config.layer_types)):
            if kind == "linear_attention":
                self.mixers[i] = self.delta_view(layer.linear_attn, layer_name(model, i, "Gated DeltaNet"))
            elif kind == "full_attention":
                self.mixers[i] = GatedAttentionView(layer.self_attn, layer_name(model, i, "attention"),
                                                    inner.rotary_emb, apply_rope)
            else:
                raise TypeError(f"{layer_name(model, i, kind)}: layer type {kind!r} is not supported")

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        for i, layer in enumerate(inner.layers):
            h = h + run_mixer(i, layer.input_layernorm(h))
            ffn = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (ffn[0] if isinstance(ffn, tuple) else ffn)
        return inner.norm(h)

