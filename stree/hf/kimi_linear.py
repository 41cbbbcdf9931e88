"""``KimiLinearForCausalLM``: pre-norm decoder layers, each Kimi Delta Attention (the gated delta
rule with a decay per key channel) or multi-head latent attention (absorbed, on its latent cache),
followed by a dense MLP or a routed MoE (``mlp_layer_types``: per token, the model's own module)."""
from __future__ import annotations

from stree.hf.common import Family, layer_name
from stree.hf.gated_delta import KimiDeltaView, LatentAttentionView


class KimiLinearFamily(Family):
    def __init__(self, model):
        super().__init__(model)
        for i, (layer, kind) in enumerate(zip(model.model.layers, model.config.layer_types)):
            if kind == "linear_attention":
                self.mixers[i] = KimiDeltaView(layer.self_attn, layer_name(model, i, "Kimi Delta Attention"))
            elif kind == "full_attention":
                self.mixers[i] = LatentAttentionView(layer.self_attn, layer_name(model, i, "MLA"))
            else:
                raise TypeError(f"{layer_name(model, i, kind)}: layer type {kind!r} is not supported")

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        for i, layer in enumerate(inner.layers):
            h = h + run_mixer(i, layer.input_layernorm(h))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h)
