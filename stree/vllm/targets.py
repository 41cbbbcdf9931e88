"""The target layers stree verifies over a tree inside vLLM, checked on the model vLLM built.

A tree step runs every layer of the target over the tree's nodes at once. A layer kind without
tree rows of stree's would run vLLM's own code there, which reads the flattened tree as a chain
(its state advanced through siblings, its mask causal over them): wrong tokens, or vLLM's own
speculative ops failing mid-generation. So the kinds are an allow-list, checked on the built
target before the engine runs a step (:func:`check_layers`, from the proposer's ``load_model``):

- Mamba2 layers: vLLM's ``MambaMixer2``, built as stree's :class:`~stree.vllm.mixer.TreeMambaMixer2`;
- on the CPU, Qwen's Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): vLLM's
  ``QwenGatedDeltaNetAttention``, built as stree's
  :class:`~stree.vllm.gated_delta.TreeQwenGatedDeltaNet`;
- decoder attention (vLLM's ``Attention`` itself, no subclass) without ALiBi, sliding windows,
  sinks, KV sharing or a quantised cache, on stree's tree attention backend
  (:mod:`stree.vllm.attention`) wherever stree verifies.

Every other layer with state or a KV cache (vLLM's ``AttentionLayerBase``: other Gated DeltaNet
layers (OLMo Hybrid's, which vLLM runs on GPUs only), KDA, Mamba-1, short convolutions, linear attention, MLA ...) is refused, and so are multimodal
rotary positions (M-RoPE: the tree's positions by depth go to the 1-D positions only). The
architectures whose layers pass are listed, for an error before any engine process starts, in
:data:`stree.vllm.speculative.ARCHITECTURES`.
"""
from __future__ import annotations

from torch import nn

from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionType

from stree.vllm.attention import computes_tree_rows
from stree.vllm.mixer import TreeMambaMixer2
from stree.vllm.speculative import UnsupportedTarget
from stree.vllm.attention_rows import attention_refusal

SUPPORTED_LAYERS = ("Mamba2 layers (vLLM's MambaMixer2), on the CPU Qwen's Gated DeltaNet layers "
                    "(QwenGatedDeltaNetAttention), and plain causal decoder attention (vLLM's Attention: "
                    "no ALiBi, sliding window, sinks, KV sharing or quantised KV cache)")


def refusal(layer, stree_verifies: bool) -> str | None:
    """Why stree cannot verify a tree through ``layer`` (one of vLLM's ``AttentionLayerBase``
    layers), or None for a layer kind it verifies (module docstring)."""
    if type(layer) is TreeMambaMixer2:
        return None
    if _tree_gated_delta(layer):
        return None
    if type(layer) is not Attention:
        return f"{type(layer).__name__} layers"
    if layer.attn_type != AttentionType.DECODER:
        return f"{layer.attn_type} attention"
    if layer.kv_sharing_target_layer_name is not None:
        return "attention sharing another layer's KV cache"
    why = attention_refusal(layer.impl)
    if why is not None:
        return f"attention with {why}"
    if stree_verifies and not computes_tree_rows(layer.impl):
        return f"attention on a backend without tree rows ({type(layer.impl).__name__})"
    return None


def _tree_gated_delta(layer) -> bool:
    """Whether ``layer`` is stree's Qwen Gated DeltaNet layer (built on the CPU only)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from stree.vllm.gated_delta import TreeQwenGatedDeltaNet

    return type(layer) is TreeQwenGatedDeltaNet


def full_chains_only(model: nn.Module) -> bool:
    """Whether vLLM's own speculative path is exact on ``model`` only for requests that propose all
    ``K`` draft tokens: vLLM 0.32's CPU Gated DeltaNet path reads a request's conv window at the
    column a step of ``K`` drafts leaves, so a shorter chain it verifies itself would read the wrong
    inputs (and a one-token step after accepted drafts fails its buffer roll; stree's layer runs
    one-token rows itself). The proposer then drafts ``K`` tokens or none for such requests."""
    return any(_tree_gated_delta(module) for module in model.modules())


def check_layers(model: nn.Module, stree_verifies: bool, uses_mrope: bool) -> None:
    """Raise :class:`UnsupportedTarget` unless every stateful or KV-cache layer of ``model`` (the
    target vLLM built) is of a kind stree verifies and its positions are 1-D (``uses_mrope``
    false; module docstring); the error names each refused kind with its first layer and what
    is supported."""
    refused: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, AttentionLayerBase):
            why = refusal(module, stree_verifies)
            if why is not None:
                refused.setdefault(why, []).append(name)
    kinds = [f"{why} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
             for why, names in refused.items()]
    if uses_mrope:
        kinds.append("multimodal rotary positions (M-RoPE)")
    if kinds:
        raise UnsupportedTarget(f"speculative_config method 'stree': stree cannot verify trees on this "
                                f"{type(model).__name__} target inside vLLM: it has {'; '.join(kinds)}. stree verifies "
                                f"{SUPPORTED_LAYERS} only; run this target without method 'stree'")
