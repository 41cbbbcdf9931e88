"""``GraniteMoeHybridForCausalLM`` (Granite 4.0-H): Bamba-like layers with Granite's multipliers
(embeddings, residual branches, attention scale, logits), attention with or without rotary
(``position_embedding_type``), and a routed MoE plus shared MLP (or the shared MLP alone) after
every mixer. MoE and MLP are per-token, so they run as the model's own modules."""
from __future__ import annotations

from stree.hf.common import AttentionView, Family, Mamba2View, layer_name


class GraniteMoeHybridFamily(Family):
    def __init__(self, model):
        super().__init__(model)
        from transformers.models.granitemoehybrid import modeling_granitemoehybrid as mg
        inner = model.model
        for i, layer in enumerate(inner.layers):
            if layer.mamba is not None:
                self.mixers[i] = Mamba2View(layer.mamba, layer_name(model, i, "Mamba2"))
            else:
                self.mixers[i] = AttentionView(layer.self_attn, layer_name(model, i, "attention"),
                                               inner.rotary_emb, mg.apply_rotary_pos_emb)

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids) * inner.embedding_multiplier
        for i, layer in enumerate(inner.layers):
            h = h + run_mixer(i, layer.input_layernorm(h)) * layer.residual_multiplier
            x = layer.post_attention_layernorm(h)
            ffn = layer.block_sparse_moe(x) + layer.shared_mlp(x) if layer.has_experts else layer.shared_mlp(x)
            h = h + ffn * layer.residual_multiplier
        return inner.norm(h)

    def logits(self, h):
        return super().logits(h) / self.model.config.logits_scaling
