"""Tree attention as a vLLM attention backend, registered by the plugin (vLLM's backend registry,
``register_backend``) in place of the platform's own: ``CPU_ATTN`` on the CPU; on CUDA, with
``STREE_VLLM_GPU_TREES=1`` only, ``FLASH_ATTN`` (written against vLLM 0.32's layout, never run).

Outside a tree step each is vLLM's backend unchanged. In a step with trees
(:mod:`stree.vllm.step`) a tree request's query rows are computed once, by
:func:`~stree.vllm.attention_rows.tree_attention`: its committed context and each node's ancestors, at
positions by depth; the K/V vLLM wrote for the nodes (one slot each) are read in place. On the
CPU the batch's other rows (prefills, requests without a tree) go to vLLM's own kernel as a
sub-batch (its metadata and kernel schedule built once per step and shared by the layers), so no
row is computed twice. The CUDA backend computes the other rows with FlashAttention over the whole
batch first and then the tree rows (twice for those rows), and declares no CUDA-graph support of
its own: vLLM then captures the model piecewise, attention (and the Mamba2 mixer) running
eagerly between the captured pieces, so trees keep CUDA graphs for everything else.
"""
from __future__ import annotations

import functools
import os
from dataclasses import replace

import torch

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata)

from stree.vllm.speculative import GPU_TREES
from stree.vllm.attention_rows import rest, tree_attention
from stree.vllm.kv_layout import FlashLayout
from stree.vllm.step import current


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention with tree rows (see the module docstring)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        step = current()
        if step is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        rest_rows = rest(step, attn_metadata, lambda rows, tokens, loc, seq_lens: _sub_batch(
            self, layer, attn_metadata, rows, tokens, loc, seq_lens, query.dtype))
        if rest_rows is not None:
            tokens, sub = rest_rows
            out = output.new_empty((len(tokens), *output.shape[1:]))
            super().forward(layer, query[tokens], key, value, kv_cache, sub, out, *args, **kwargs)
            output[tokens] = out
        blocks, kv_heads, block_size, _ = kv_cache.size()
        key_cache, value_cache = kv_cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        tree_attention(self, layer, query, key_cache, value_cache, attn_metadata, output, step)
        return output


# the attention implementations that compute tree rows (the CUDA one joins when it is built)
TREE_IMPLS: list[type] = [TreeCPUAttentionImpl]


def computes_tree_rows(impl) -> bool:
    """Whether ``impl`` (a layer's vLLM attention implementation) is one of stree's tree backends'."""
    return isinstance(impl, tuple(TREE_IMPLS))


def _sub_batch(impl, layer, metadata: CPUAttentionMetadata, rows, tokens, loc, seq_lens, dtype):
    """``metadata`` cut to the batch rows ``rows`` (their query tokens ``tokens``, re-based
    ``query_start_loc`` ``loc``), with vLLM's kernel schedule for them."""
    from vllm import _custom_ops as ops
    from vllm import envs

    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(rows), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
        seq_lens=seq_lens, dtype=dtype, query_start_loc=loc, causal=metadata.causal,
        sliding_window_size=impl.sliding_window, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None, kv_cache_dtype=impl.kv_cache_dtype)
    return replace(metadata, num_actual_tokens=len(tokens), query_start_loc=loc, seq_lens=seq_lens,
                   max_query_len=int((loc[1:] - loc[:-1]).max()), max_seq_len=int(seq_lens.max()),
                   block_table=metadata.block_table[rows], slot_mapping=metadata.slot_mapping[tokens],
                   scheduler_metadata=schedule, dynamic_causal=None)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's ``CPU_ATTN`` backend whose implementation verifies trees."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl


@functools.cache
def flash_backend():
    """The CUDA backend (built on demand, once: vLLM's FlashAttention module imports CUDA-only
    code)."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                       FlashAttentionMetadataBuilder)

    class TreeFlashAttentionImpl(FlashAttentionImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            step = current()
            result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if step is not None and attn_metadata is not None:
                key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
                tree_attention(self, layer, query, key_cache, value_cache, attn_metadata, output, step, FlashLayout)
            return result

    class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        # the tree rows are host-driven: no full CUDA graph may capture attention
        _cudagraph_support = AttentionCGSupport.NEVER

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            return AttentionCGSupport.NEVER

    class TreeFlashAttentionBackend(FlashAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return TreeFlashAttentionImpl

        @staticmethod
        def get_builder_cls():
            return TreeFlashAttentionMetadataBuilder

    TREE_IMPLS.append(TreeFlashAttentionImpl)
    return TreeFlashAttentionBackend


def register() -> None:
    """Put the tree backend in place of the platform's own (the CPU's always; CUDA's only where
    ``STREE_VLLM_GPU_TREES=1`` asks for the unrun GPU path)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeCPUAttentionBackend")
    elif current_platform.is_cuda() and os.environ.get(GPU_TREES) == "1":
        register_backend(AttentionBackendEnum.FLASH_ATTN, f"{__name__}.TreeFlashAttentionBackend")


def __getattr__(name: str):
    if name == "TreeFlashAttentionBackend":  # the class path the registry imports on CUDA
        return flash_backend()
    raise AttributeError(name)
