"""stree inside vLLM: a plugin loaded through the ``vllm.general_plugins`` entry point.

Installed next to vLLM (``scripts/venv-vllm`` builds such an environment), it runs in every vLLM
process before the engine reads its configuration and:

- refuses any vLLM but :data:`SUPPORTED_VLLM` with one error naming the supported version (it
  reaches into vLLM's internals, which move between releases);
- registers MambaInLlama hybrids (``config.json`` + ``mamba_config.json``, saved as
  ``LlamaForCausalLM``) as a vLLM model (:mod:`.mambainllama`), so that such a checkpoint
  directory, the shipped ``models/stree-tiny`` pair among them, runs in vLLM as it is;
- teaches vLLM's speculative config the ``"stree"`` method (:mod:`.speculative`, :mod:`.proposer`),
  trees (and on the CPU chains) verified by stree inside the engine (:mod:`.trees`), chains
  under SpS on a GPU by vLLM's rejection sampler;
- fixes vLLM's own Mamba speculation where 0.32 gets it wrong (:mod:`.accepted_counts`, and on CPU
  :mod:`.cpu_spec`).

Nothing here imports vLLM at package import time: ``import stree`` works without it.
"""
SUPPORTED_VLLM = "0.32.0"
