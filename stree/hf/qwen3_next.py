"""``Qwen3NextForCausalLM``: Qwen3.5's layer mix and wiring (:mod:`stree.hf.qwen3_5`) with fused,
key-head-grouped Gated DeltaNet projections (``in_proj_qkvz`` / ``in_proj_ba``)."""
from __future__ import annotations

from stree.hf.gated_delta import Qwen3NextDeltaView
from stree.hf.qwen3_5 import Qwen3_5Family


class Qwen3NextFamily(Qwen3_5Family):
    delta_view = Qwen3NextDeltaView
