"""``BambaForCausalLM``: pre-norm decoder layers, each a Mamba2 mixer or a rotary GQA attention
(``layers_block_type``), followed by a gated MLP."""
from __future__ import annotations

from stree.hf.common import AttentionView, Family, Mamba2View, layer_name


class BambaFamily(Family):
    def __init__(self, model):
        super().__init__(model)
        from transformers.models.bamba import modeling_bamba as mb
        inner = model.model
        for i, layer in enumerate(inner.layers):
            if layer.block_type == "linear_attention":
                self.mixers[i] = Mamba2View(layer.mamba, layer_name(model, i, "Mamba2"))
            else:
                self.mixers[i] = AttentionView(layer.self_attn, layer_name(model, i, "attention"),
                                               inner.rotary_emb, mb.apply_rotary_pos_emb)

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        for i, layer in enumerate(inner.layers):
            h = h + run_mixer(i, layer.input_layernorm(h))
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        return inner.final_layernorm(h)
