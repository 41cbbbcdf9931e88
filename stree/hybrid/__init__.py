"""MambaInLlama-style hybrid (Llama attention + GQA-shaped Mamba2) causal LM, config and checkpoint IO."""
from .attention import LlamaAttention
from .cache import AttentionLayerCache, InferenceCache, MambaLayerCache
from .checkpoint import CheckpointError
from .config import MambaInLlamaConfig
from .mamba import Mamba2GQA
from .modeling import MambaInLlamaForCausalLM

__all__ = [
    "AttentionLayerCache",
    "CheckpointError",
    "InferenceCache",
    "LlamaAttention",
    "Mamba2GQA",
    "MambaInLlamaConfig",
    "MambaInLlamaForCausalLM",
    "MambaLayerCache",
]
