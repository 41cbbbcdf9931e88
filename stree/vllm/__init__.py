"""stree inside vLLM: a plugin loaded through the ``vllm.general_plugins`` entry point.

Installed next to vLLM (``scripts/venv-vllm`` builds such an environment), it runs in every vLLM
process before the engine reads its configuration and:

- refuses any vLLM but :data:`SUPPORTED_VLLM` with one error naming the supported version (it
  reaches into vLLM's internals, which move between releases);
- registers MambaInLlama hybrids (``config.json`` + ``mamba_config.json``, saved as
  ``LlamaForCausalLM``) as a vLLM model, so that such a checkpoint directory, the shipped
  ``models/stree-tiny`` pair among them, runs in vLLM as it is.

Nothing here imports vLLM at package import time: ``import stree`` works without it.
"""
SUPPORTED_VLLM = "0.32.0"
