"""Accepted-token counts for attention-free Mamba models under speculation (vLLM 0.32 skips them).

After each verification vLLM's model runner records how many tokens each request accepted
(``num_accepted_tokens``); the next step's Mamba layers start from the state slot and conv window
those tokens left. ``GPUModelRunner._update_states_after_model_execute`` (the CPU runner inherits
it) does this only when ``model_config.is_hybrid``, so for attention-free models
(``Mamba2ForCausalLM``, a Mamba-only MambaInLlama) the count stays 1 and every step after a
partial acceptance continues from the state after the first token: lossy output. The wrapper
below records the counts the same way for those models (the non-"align" branch of vLLM's
method: the state slots themselves need no copy there).
"""
from __future__ import annotations


def patch_accepted_counts() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._update_states_after_model_execute
    if getattr(original, "_stree", False):
        return

    def update(self, output_token_ids, scheduler_output):
        config = self.model_config
        if (self.speculative_config and not config.is_hybrid and config.is_attention_free
                and self.cache_config.mamba_cache_mode != "align"):
            n = output_token_ids.size(0)
            self.num_accepted_tokens.gpu[:n] = (output_token_ids != -1).sum(dim=1)
            self.input_batch.num_accepted_tokens_cpu_tensor[:n].copy_(self.num_accepted_tokens.gpu[:n])
            self.num_accepted_tokens_event.record()
            return None
        return original(self, output_token_ids, scheduler_output)

    update._stree = True
    GPUModelRunner._update_states_after_model_execute = update
