"""``Mamba2ForCausalLM``: pure Mamba2 blocks (residual -> RMSNorm -> mixer -> add)."""
from __future__ import annotations

from stree.hf.common import Family, Mamba2View, layer_name


class Mamba2Family(Family):
    def __init__(self, model):
        super().__init__(model)
        for i, blk in enumerate(model.backbone.layers):
            self.mixers[i] = Mamba2View(blk.mixer, layer_name(model, i, "Mamba2"))

    def hidden(self, input_ids, run_mixer):
        bb = self.model.backbone
        h = bb.embeddings(input_ids)
        for i, blk in enumerate(bb.layers):
            residual = h.float() if blk.residual_in_fp32 else h
            h = residual + run_mixer(i, blk.norm(h.to(blk.norm.weight.dtype)))
        return bb.norm_f(h)
