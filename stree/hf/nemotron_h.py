"""``NemotronHForCausalLM``: a per-layer block pattern (``layers_block_type``); every block is
residual + norm + one of Mamba2, attention (no positional encoding: Nemotron-H's attention layers
have no rotary), MLP or MoE. MLP and MoE blocks are per-token and run as the model's own modules."""
from __future__ import annotations

from stree.hf.common import AttentionView, Family, Mamba2View, layer_name


class NemotronHFamily(Family):
    def __init__(self, model):
        super().__init__(model)
        for i, blk in enumerate(model.model.layers):
            if blk.block_type == "linear_attention":
                self.mixers[i] = Mamba2View(blk.mixer, layer_name(model, i, "Mamba2"))
            elif blk.block_type == "full_attention":
                self.mixers[i] = AttentionView(blk.mixer, layer_name(model, i, "attention"))
            elif blk.block_type not in ("mlp", "moe"):
                raise TypeError(f"{layer_name(model, i, blk.block_type)}: block type "
                                f"{blk.block_type!r} is not supported")

    def hidden(self, input_ids, run_mixer):
        inner = self.model.model
        h = inner.embeddings(input_ids)
        for i, blk in enumerate(inner.layers):
            x = blk.norm(h.to(blk.norm.weight.dtype))
            h = h + (run_mixer(i, x) if i in self.mixers else blk.mixer(x))
        return inner.norm_f(h)
