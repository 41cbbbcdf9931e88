"""vLLM's Mamba2 mixer with tree rows: registered in place of ``MambaMixer2`` (vLLM's
``PluggableLayer.register_oot``), so every Mamba2 layer vLLM builds (its Mamba2 family and
stree's MambaInLlama model) is this class.

Outside a tree step it is vLLM's mixer unchanged. In a step with trees (:mod:`stree.vllm.step`)
its ``conv_ssm_forward`` (the part of the layer that runs inside vLLM's ``mamba_mixer2`` op, which
vLLM's compilation keeps out of its graphs) runs each tree's nodes with stree's tree conv and tree
scan from the committed state, nothing written, keeping what the commit replays; the batch's other
rows (prefills, requests without a tree) go through vLLM's own code with the tree rows' state slots
set to vLLM's null block, which its ops skip (where every decode row is a tree, through its prefill
path alone). Where the tree rows sit among the decode rows, their
slots and start states are read once per step (:meth:`~stree.vllm.step.TreeStep.recurrent_rows`)
and shared by every layer: per layer and tree shape the work is the gathers, the conv, the scan
and the output writes.
"""
from __future__ import annotations

import torch

from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID

from stree.vllm.conv_rows import tree_conv_rows
from stree.vllm.mamba2_rows import tree_scan_rows
from stree.vllm.step import current


class TreeMambaMixer2(MambaMixer2):
    """``MambaMixer2`` that verifies token trees (see the module docstring)."""

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor):
        step = current()
        metadata = get_forward_context().attn_metadata
        metadata = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if step is None or metadata is None or not metadata.num_decodes:
            return super().conv_ssm_forward(projected_states, output)
        rows = step.recurrent_rows(metadata.query_start_loc_d, metadata.state_indices_tensor_d,
                               metadata.num_accepted_tokens, NULL_BLOCK_ID)
        d = metadata.num_decode_tokens
        heads, groups = self.num_heads // self.tp_size, self.n_groups // self.tp_size
        # the tree rows first: vLLM's ops below work in place on the projected inputs
        xbc, dt = torch.split(projected_states[..., self.tped_intermediate_size:],
                              [self.tped_conv_size, self.tped_dt_size], dim=-1)
        conv_state = self.kv_cache[0] if _conv_dim_first() else self.kv_cache[0].transpose(-1, -2)
        conv = tree_conv_rows(xbc[:d], conv_state, self.conv_weights, self.conv1d.bias, self.activation, rows, step)
        x, B, C = self.split_hidden_states_B_C_fn(conv)
        out = output[:d].view(d, heads, self.head_dim)
        others = rows.masked is not None  # decode rows without a tree
        y = out.new_empty(out.shape) if others else out
        tree_scan_rows(self.kv_cache[1], x.view(d, heads, self.head_dim), dt[:d], self.A, B.view(d, groups, -1),
                       C.view(d, groups, -1), self.D, self.dt_bias, rows, step, out=y)
        if others or metadata.num_prefills:  # then the other rows, by vLLM's own code
            # the tree rows' slots masked; where every decode row is a tree, vLLM's decode
            # path is skipped (it would compute the trees again, as drafts, and discard them)
            saved = metadata.state_indices_tensor_d, metadata.num_decodes
            if others:
                metadata.state_indices_tensor_d = rows.masked
            else:
                metadata.num_decodes = 0
            try:
                super().conv_ssm_forward(projected_states, output)
            finally:
                metadata.state_indices_tensor_d, metadata.num_decodes = saved
            if others:
                out[rows.tokens] = y[rows.tokens]


def _conv_dim_first() -> bool:
    """vLLM's conv-state layout (as ``MambaMixer2.conv_ssm_forward`` reads it)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2

    return mamba_mixer2.is_conv_state_dim_first()


def register() -> None:
    """Make vLLM build this class wherever it builds ``MambaMixer2`` (once per process)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get("MambaMixer2") is not TreeMambaMixer2:
        MambaMixer2.register_oot(TreeMambaMixer2, name="MambaMixer2")
