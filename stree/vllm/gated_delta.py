"""vLLM's Qwen Gated DeltaNet layer (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) with tree rows:
registered in place of ``QwenGatedDeltaNetAttention`` (vLLM's ``PluggableLayer.register_oot``),
so every such layer vLLM builds is this class.

Outside speculation it is vLLM's layer unchanged. Under speculation vLLM's CPU op
(``cpu_gdn_attention_core``, which vLLM's compilation keeps out of its graphs) hands the decode
rows to its speculative path, which runs each request's draft tokens as a chain and keeps a state
per draft position. For this layer that path is stree's (:meth:`TreeQwenGatedDeltaNet.spec_rows`):

- each tree request's nodes: the short conv along ancestor chains (:mod:`stree.vllm.conv_rows`)
  and the gated delta rule over the ancestor mask (:mod:`stree.vllm.delta_rows`) from the
  committed window and state, nothing written; the commit replays the accepted path into one
  state slot (``num_accepted - 1``), as for Mamba2 layers;
- decode rows without drafts: one token, run and committed at once;
- what is left (prefills, and requests vLLM verifies itself as chains: sampling settings stree's
  verifiers do not apply) goes to vLLM's own code, the rows above masked out of it.

vLLM's CPU op computes in bf16 only; the tree rows compute the rule in fp32 from its bf16
inputs and state.
"""
from __future__ import annotations

import torch

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

from stree.vllm.conv_rows import tree_conv_rows
from stree.vllm.delta_rows import DeltaShape, single_rows, tree_delta_rows
from stree.vllm.speculative import PROPOSER
from stree.vllm.step import TreeStep, current


class TreeQwenGatedDeltaNet(QwenGatedDeltaNetAttention):
    """``QwenGatedDeltaNetAttention`` that verifies token trees (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # only under method "stree": vLLM's own speculative methods keep vLLM's path
        self.stree_speculation = getattr(self.speculative_config, "model", None) == PROPOSER

    def delta_shape(self) -> DeltaShape:
        return DeltaShape(self, self.num_v_heads // self.tp_size, self.num_k_heads // self.tp_size, self.head_k_dim,
                          self.head_v_dim)

    def spec_rows(self, metadata, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, out: torch.Tensor,
                  original) -> None:
        """vLLM's speculative rows of this layer (``metadata``: its ``GDNAttentionMetadata`` with
        spec rows; ``mixed_qkv (tokens, conv_dim)``, ``b``, ``a`` ``(tokens, Hv)``; ``out
        (tokens, Hv, dv)`` written), as the module docstring says; ``original(mixed_qkv, b, a,
        out)`` is vLLM's own path for the same metadata."""
        spec = _SpecRows.of(metadata, current())
        conv_state = gdn_attention._conv_buffer_view(self)  # (slots, dim, width - 1 + K)
        ssm_state = gdn_attention._ssm_state_view(self)  # (slots, Hv, dk, dv)
        weight, bias = gdn_attention._unpacked_conv_weight(self), self.conv1d.bias
        shape = self.delta_shape()
        if spec.trees is not None:
            conv = tree_conv_rows(mixed_qkv, conv_state, weight, bias, "silu", spec.trees, spec.step)
            tree_delta_rows(shape, conv, a, b, ssm_state, spec.trees, spec.step, out)
        if spec.singles is not None:
            tokens, table, accepted = spec.singles
            single_rows(shape, mixed_qkv, a, b, tokens, table, accepted, conv_state, weight, bias, ssm_state, out)
        if spec.rest_spec:  # requests vLLM verifies: its own path, the rows above masked out
            saved = metadata.spec_state_indices_tensor, metadata.num_accepted_tokens
            metadata.spec_state_indices_tensor, metadata.num_accepted_tokens = spec.masked
            scratch = torch.empty_like(out)
            try:
                original(mixed_qkv, b, a, scratch)
            finally:
                metadata.spec_state_indices_tensor, metadata.num_accepted_tokens = saved
            out[spec.rest_tokens] = scratch[spec.rest_tokens]
        elif metadata.num_prefills:  # the prefills alone, by vLLM's code for them
            index = metadata.non_spec_token_indx
            width = weight.shape[1]
            rows = gdn_attention._spec_aware_nonspec_subset(
                self, metadata, mixed_qkv.index_select(0, index), b.index_select(0, index),
                a.index_select(0, index), conv_state, ssm_state, width)
            out.index_copy_(0, index, rows.to(out.dtype))


class _SpecRows:
    """vLLM's speculative rows of one step's GDN metadata, sorted: the tree requests (their
    :class:`~stree.vllm.step.RecurrentRows`), the one-token rows ``(tokens, slot table,
    num_accepted)``, and whether others remain (then the tokens of those and of the prefills,
    and the slot table and accepted counts with the rows stree computes masked). Built once per
    step and metadata (the layers share it)."""

    def __init__(self, metadata, step: TreeStep | None):
        self.step = step
        n = metadata.num_spec_decodes
        qsl = metadata.spec_query_start_loc[:n + 1].long()
        index = metadata.spec_token_indx
        # the spec rows' tokens in the batch's indices (spec rows come in batch order)
        first = qsl[:-1] if index is None or not (metadata.num_prefills or metadata.num_decodes) else \
            index.long()[qsl[:-1]]
        lengths = (qsl[1:] - qsl[:-1]).tolist()
        starts = first.tolist()
        table, accepted = metadata.spec_state_indices_tensor, metadata.num_accepted_tokens
        trees = [i for i, s in enumerate(starts) if step is not None and s in step.rows]
        singles = [i for i, length in enumerate(lengths) if length == 1 and i not in trees]
        self.trees = None
        if trees:
            query_start_loc = torch.tensor(starts + [starts[-1] + lengths[-1]])
            self.trees = step.recurrent_rows(query_start_loc, table, accepted, NULL_BLOCK_ID)
        self.singles = None
        if singles:
            rows = torch.tensor(singles)
            self.singles = (first[rows], table[rows].long(), accepted[rows].long())
        ours = trees + singles
        self.rest_spec = len(ours) < n
        if self.rest_spec:
            masked_table, masked_accepted = table.clone(), accepted.clone()
            masked_table[ours] = NULL_BLOCK_ID
            masked_accepted[ours] = 1
            self.masked = (masked_table, masked_accepted)
            mine = torch.zeros(int(metadata.num_actual_tokens), dtype=torch.bool)
            for i in ours:
                mine[starts[i]:starts[i] + lengths[i]] = True
            self.rest_tokens = (~mine).nonzero()[:, 0]

    @classmethod
    def of(cls, metadata, step: TreeStep | None) -> "_SpecRows":
        if step is None:
            return cls(metadata, None)
        return step.table(("gdn spec rows", id(metadata)), lambda: cls(metadata, step))


def _spec_aware(original):
    """vLLM's CPU speculative GDN path, handing this plugin's layers to their own rows."""
    def spec_aware(layer, metadata, mixed_qkv, b, a, core_attn_out, width, state_len):
        if (not isinstance(layer, TreeQwenGatedDeltaNet) or not layer.stree_speculation
                or metadata.spec_sequence_masks is None):
            return original(layer, metadata, mixed_qkv, b, a, core_attn_out, width, state_len)
        layer.spec_rows(metadata, mixed_qkv, b, a, core_attn_out,
                        lambda x, bb, aa, out: original(layer, metadata, x, bb, aa, out, width, state_len))

    spec_aware._stree = True
    return spec_aware


def register() -> None:
    """Make vLLM build this class wherever it builds ``QwenGatedDeltaNetAttention``, and route
    its CPU speculative path here (once per process)."""
    from vllm.model_executor.custom_op import op_registry_oot

    if op_registry_oot.get("QwenGatedDeltaNetAttention") is not TreeQwenGatedDeltaNet:
        QwenGatedDeltaNetAttention.register_oot(TreeQwenGatedDeltaNet, name="QwenGatedDeltaNetAttention")
    if not getattr(gdn_attention._cpu_gdn_attention_spec_aware, "_stree", False):
        gdn_attention._cpu_gdn_attention_spec_aware = _spec_aware(gdn_attention._cpu_gdn_attention_spec_aware)
