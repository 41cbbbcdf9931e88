"""transformers' own decoding for ``stree.generate(method="ar")`` (:mod:`stree.native` registers it).

The session is the model's own ``generate`` cut at its decoding loop. ``generate`` itself prepares
everything, through a ``custom_generate`` callable (transformers' public hook for a decoding
method) that only captures what it is handed: the generation config and the model kwargs with the
cache ``generate`` creates for this model (``_prepare_cache_for_generation``: a ``DynamicCache``,
named ``cache_params`` for ``Mamba2ForCausalLM``), the prompt's ``position_ids`` and
``logits_to_keep``. Then, as ``GenerationMixin._sample`` runs them: the prefill is ``_prefill``,
and each step is ``prepare_inputs_for_generation`` (slicing the next token, its explicit position:
Bamba's own forward would infer position 0 without it) -> the model's forward (or its compiled call
where ``generate`` compiles) -> ``_update_model_kwargs_for_generation`` (the cache it returns,
positions + 1). transformers 5.23 has no ``cache_position``: the models read the offset from the
cache. Sampling, stopping and counting are the shared loop's.
"""
from __future__ import annotations

from torch import Tensor

from stree.hf import SUPPORTED, _transformers_class


class TransformersSession:
    """One batch of equal-length prompts decoded by a transformers model's own ``generate`` path."""

    def __init__(self, model, batch_size: int, prompt_len: int, max_seqlen: int):
        self.model = model
        self.max_new_tokens = max_seqlen - prompt_len

    def prefill(self, input_ids: Tensor) -> Tensor:
        """input_ids ``(b, l)`` -> logits ``(b, v)``: ``generate``'s own setup, then its ``_prefill``."""
        m = self.model
        # one greedy sequence per prompt whatever the checkpoint's generation config says (beams or
        # several return sequences would make generate expand the batch)
        self.config, kwargs = m.generate(input_ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                         num_beams=1, num_return_sequences=1, custom_generate=_capture)
        self.forward = (m.get_compiled_call(self.config.compile_config)
                        if m._valid_auto_compile_criteria(kwargs, self.config) else m.__call__)
        return self._advance(m._prefill(input_ids, self.config, kwargs), kwargs)

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(b,)`` -> logits ``(b, v)``, one ``_sample`` iteration. Only the new token is
        passed as ``input_ids``: ``prepare_inputs_for_generation`` keeps just the last one of the
        growing sequence ``generate`` passes, so the model sees the same inputs."""
        m = self.model
        inputs = m.prepare_inputs_for_generation(tokens[:, None], next_sequence_length=1, **self.kwargs)
        # entered per step because a session has no end to restore it at; it only switches an MoE's
        # experts implementation on non-CPU devices (a config attribute), as generate's loop does
        with m._optimize_model_for_decode():
            return self._advance(self.forward(**inputs, return_dict=True), self.kwargs)

    def _advance(self, outputs, kwargs: dict) -> Tensor:
        """The model kwargs for the next step (the returned cache, positions + 1); last logits."""
        self.kwargs = self.model._update_model_kwargs_for_generation(outputs, kwargs,
                                                                     is_encoder_decoder=False)
        return outputs.logits[:, -1].float()


def _capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """``custom_generate`` that decodes nothing: returns what ``generate`` prepared."""
    return generation_config, model_kwargs


def is_transformers_family(model) -> bool:
    cls = _transformers_class(model)
    return cls is not None and cls.__name__ in SUPPORTED
