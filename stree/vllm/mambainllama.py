"""MambaInLlama hybrids as vLLM models, built from vLLM's own layers.

A MambaInLlama checkpoint is Llama with a GQA-shaped Mamba2 mixer (``model.layers.N.mamba.*``) in
place of attention at the layers not listed in ``attn_layers`` (see :mod:`stree.hybrid.mamba`).
Attention layers, MLPs, norms, embeddings and the head are vLLM's Llama modules; each Mamba layer
is vLLM's ``MambaMixer2``, so vLLM's per-request state slots, prefix caching rules and kernels (and
stree's own tree mixer, where it replaces ``MambaMixer2``) apply unchanged.

The one difference from a stock Mamba2 mixer: MambaInLlama's x and B are ``d_xb`` wide
(``d_xb // d_state`` groups) and repeated to ``nheads`` groups after the conv. The conv is
depthwise and silu acts per channel, so repeating the *channels* of ``in_proj`` and ``conv1d`` at
load time gives exactly the same activations: the loaded mixer is a stock Mamba2 with
``ngroups = nheads``, ``headdim = d_state`` (its conv state holds the repeated channels too).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree, IsHybrid
from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from vllm.model_executor.models.utils import extract_layer_index


def _sizes(config) -> dict:
    """The Mamba sizes that :func:`stree.vllm.plugin._route` attached to Llama's config."""
    mamba = getattr(config, "stree_mamba", None)
    if mamba is None:
        raise ValueError("this config has no MambaInLlama sizes: load the checkpoint directory "
                         "(config.json + mamba_config.json) with stree's vLLM plugin installed")
    return dict(mamba, nheads=mamba["d_inner"] // mamba["d_state"])


class MambaInLlamaMambaLayer(nn.Module):
    """A Llama decoder layer whose mixer is a Mamba2 layer (same residual and norm structure)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        m = _sizes(config)
        self.mamba = MambaMixer2(
            hidden_size=config.hidden_size, ssm_state_size=m["d_state"], conv_kernel_size=m["d_conv"],
            intermediate_size=m["d_inner"], use_conv_bias=True, use_bias=False, n_groups=m["nheads"],
            num_heads=m["nheads"], head_dim=m["d_state"], rms_norm_eps=1e-5,  # MambaInLlama's fixed eps
            activation="silu", model_config=vllm_config.model_config,
            cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.mamba")
        self.mlp = LlamaMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            hidden_act=config.hidden_act, quant_config=vllm_config.quant_config,
                            bias=getattr(config, "mlp_bias", False), prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.mamba(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def _decoder_layer(*, vllm_config: VllmConfig, prefix: str = "") -> nn.Module:
    """vLLM's Llama layer at MambaInLlama's attention indices, a Mamba layer elsewhere."""
    if extract_layer_index(prefix) in _sizes(vllm_config.model_config.hf_config)["attn_layers"]:
        return LlamaDecoderLayer(vllm_config=vllm_config, prefix=prefix)
    return MambaInLlamaMambaLayer(vllm_config=vllm_config, prefix=prefix)


def expand_mamba_weight(name: str, weight: torch.Tensor, m: dict) -> tuple[str, torch.Tensor]:
    """Checkpoint ``(name, weight)`` of a Mamba layer -> the stock-Mamba2 parameter vLLM holds.

    ``in_proj`` rows are ``[z, x, B, C, dt]`` and ``conv1d`` channels ``[x, B, C]``; the x and B
    blocks (``d_xb // d_state`` groups of ``d_state``) are repeated group by group to ``nheads``
    groups, as MambaInLlama repeats them after the conv. ``A_log`` becomes vLLM's ``A`` (its
    weight loader takes ``-exp``). Other names pass through.
    """
    d_inner, d_xb, d_state = m["d_inner"], m["d_xb"], m["d_state"]
    repeat = m["nheads"] // (d_xb // d_state)

    def grow(block):  # (d_xb, ...) -> (nheads * d_state, ...), head i reads group i // repeat
        return block.unflatten(0, (d_xb // d_state, d_state)).repeat_interleave(repeat, 0).flatten(0, 1)

    if name.endswith(".A_log"):
        return name[:-len("A_log")] + "A", weight
    if name.endswith(".in_proj.weight"):
        z, x, B, rest = torch.split(weight, [d_inner, d_xb, d_xb, weight.shape[0] - d_inner - 2 * d_xb])
        return name, torch.cat([z, grow(x), grow(B), rest])
    if name.endswith((".conv1d.weight", ".conv1d.bias")):
        x, B, C = torch.split(weight, [d_xb, d_xb, d_inner])
        return name, torch.cat([grow(x), grow(B), C])
    return name, weight


class _MambaInLlamaBase(LlamaForCausalLM, HasInnerState):
    """Shared by the hybrid and the Mamba-only variants (they differ in vLLM's interfaces only)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        if get_tensor_model_parallel_world_size() != 1:
            # x/B groups would have to be repeated per shard; not written yet
            raise ValueError("MambaInLlama in vLLM runs with tensor_parallel_size=1 only")
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=_decoder_layer)
        self._mamba_sizes = _sizes(vllm_config.model_config.hf_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        m = _sizes(vllm_config.model_config.hf_config)
        return MambaStateShapeCalculator.mamba2_state_shape(
            intermediate_size=m["d_inner"], tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
            n_groups=m["nheads"], num_heads=m["nheads"], head_dim=m["d_state"], state_size=m["d_state"],
            conv_kernel=m["d_conv"], num_spec=vllm_config.num_speculative_tokens)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        m = self._mamba_sizes
        return super().load_weights(
            expand_mamba_weight(name, w, m) if ".mamba." in name else (name, w) for name, w in weights)


class MambaInLlamaForCausalLM(_MambaInLlamaBase, IsHybrid):
    """A MambaInLlama hybrid (attention and Mamba2 layers)."""


class MambaInLlamaMambaOnlyForCausalLM(_MambaInLlamaBase, IsAttentionFree):
    """A MambaInLlama checkpoint with no attention layer (``attn_layers`` empty)."""
