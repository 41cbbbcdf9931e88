"""``Zamba2ForCausalLM``: a Mamba2 backbone; at ``hybrid`` layers a shared transformer block (one of
``num_mem_blocks`` weight sets) reads ``concat(hidden, original embeddings)``, with per-use LoRA-style
adapters on q/k/v (and the MLP's gate/up), and its projected output is added to the Mamba2 layer's
input. The shared attention keeps its own K/V per use (per layer index), like the model's cache.

Cache keys: layer i's Mamba2 state is ``i``, its shared-attention K/V ``num_hidden_layers + i``.
"""
from __future__ import annotations

import torch

from stree.hf.common import AttentionView, Family, Mamba2View, layer_name


class Zamba2AttentionView(AttentionView):
    """The shared attention as used at one layer: base projections plus that use's adapters."""

    def __init__(self, m, name, rotary, apply_rope, layer_idx: int):
        super().__init__(m, name, rotary, apply_rope)
        self.adapter = m.layer_dic[layer_idx] if m.config.use_shared_attention_adapter else None

    def project_qkv(self, h):
        m = self.m
        q, k, v = m.q_proj(h), m.k_proj(h), m.v_proj(h)
        if self.adapter is not None:
            j = self.adapter
            q = q + m.linear_q_adapter_list[j](h)
            k = k + m.linear_k_adapter_list[j](h)
            v = v + m.linear_v_adapter_list[j](h)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)),
                k.unflatten(-1, (self.num_key_value_heads, self.head_dim)),
                v.unflatten(-1, (self.num_key_value_heads, self.head_dim)))


class Zamba2Family(Family):
    def __init__(self, model):
        super().__init__(model)
        from transformers.models.zamba2 import modeling_zamba2 as mz
        inner = model.model
        self.offset = len(inner.layers)
        rotary = inner.rotary_emb if model.config.use_mem_rope else None
        for i, layer in enumerate(inner.layers):
            hybrid = hasattr(layer, "shared_transformer")
            mamba = layer.mamba_decoder.mamba if hybrid else layer.mamba
            self.mixers[i] = Mamba2View(mamba, layer_name(model, i, "Mamba2"))
            if hybrid:
                self.mixers[self.offset + i] = Zamba2AttentionView(
                    layer.shared_transformer.self_attn, layer_name(model, i, "shared attention"),
                    rotary, mz.apply_rotary_pos_emb, i)

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        original = h
        for i, layer in enumerate(inner.layers):
            if hasattr(layer, "shared_transformer"):
                st = layer.shared_transformer
                a = run_mixer(self.offset + i, st.input_layernorm(torch.cat([h, original], dim=-1)))
                t = layer.linear(st.feed_forward(st.pre_ff_layernorm(a), i))
                md = layer.mamba_decoder
                h = h + run_mixer(i, md.input_layernorm(h + t))
            else:
                h = h + run_mixer(i, layer.input_layernorm(h))
        return inner.final_layernorm(h)

