"""The model's own autoregressive decoding: the baseline every speed-up is measured against.

``stree.generate(method="ar")`` runs this, not stree's tree path (that is ``method="ar-tree"``: a
root-only tree through stree's loop and ``commit``, kept to isolate stree's own overhead). Each
model family decodes with its own code at its best:

* ``stree.hybrid.MambaInLlamaForCausalLM``: its own ``forward(ids, cache)`` prefill and ``step``
  recurrence on its own ``InferenceCache``, exactly what its ``generate`` runs.
* mamba_ssm ``MambaLMHeadModel``: its own ``forward`` with its own ``InferenceParams`` (prefill,
  then one token at a time; Mamba2 layers take ``Mamba2.step``), which is what its ``generate``
  runs. On CUDA each step replays the CUDA graph ``generate(cg=True)`` captures
  (``update_graph_cache``). Its ``generate`` itself is not called because it builds CUDA events
  even on CPU and samples with its own ``sample`` (ties at the k-th logit dropped, no list of stop
  ids); the loop here samples every family the same way (:mod:`stree.sampling`).
* transformers' Mamba2 family (:mod:`stree.hf.native`, registered below): its own
  ``generate`` prepares the cache, positions and ``logits_to_keep`` (a ``custom_generate`` hook that
  only captures them), then ``_prefill`` and, per token, ``prepare_inputs_for_generation`` -> forward
  -> ``_update_model_kwargs_for_generation``, as ``generate``'s ``_sample`` loop runs them.

A family plugs in with :func:`register`: a predicate on the model and a factory for a
:class:`NativeSession` (prefill once, then one token per call), and optionally a factory for its
decoding compiled (``compile=True``): for ``stree.hybrid`` its ``step`` on a static cache
(``step_at``: the K/V span fixed, positions as tensors, as gpt-fast and transformers'
static-cache compile run) through the same ``torch.compile`` settings as stree's compiled steps
(:mod:`stree.capture`: one full graph, frozen weights, so packed GEMMs on a CPU). The loop,
sampling, stop ids, streaming and statistics are shared, so rows of every method are comparable:
``target_calls`` counts ``step`` calls, ``tau == 1``, ``verify_s`` is the time in ``step`` and
sampling.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, Protocol

import torch
from torch import Tensor

from stree.cache import grown_capacity
from stree.hf.native import TransformersSession, is_transformers_family
from stree.stats import GenerationStats, timed
from stree.sampling import SamplingConfig, sample


class NativeSession(Protocol):
    """One batch of equal-length prompts decoded by the model's own code."""

    def prefill(self, input_ids: Tensor) -> Tensor:
        """input_ids ``(b, l)`` -> next-token logits after the prompt ``(b, v)``."""

    def step(self, tokens: Tensor) -> Tensor:
        """tokens ``(b,)`` -> next-token logits ``(b, v)``; the state advances by one token."""


# (model) -> bool, (model, batch_size, prompt_len, max_seqlen) -> NativeSession
SessionFactory = Callable[[object, int, int, int], NativeSession]
_FAMILIES: list[tuple[Callable[[object], bool], SessionFactory, SessionFactory | None]] = []


def register(matches: Callable[[object], bool], factory: SessionFactory,
             compiled: SessionFactory | None = None) -> None:
    """Teach :func:`generate` a model family's own decoding, and with ``compiled`` that decoding
    compiled (later registrations win)."""
    _FAMILIES.insert(0, (matches, factory, compiled))


def session_factory(model, compile: bool = False) -> SessionFactory:
    """The registered factory for ``model`` (its compiled one with ``compile``); TypeError naming
    the model if there is none, ValueError if it has no compiled form."""
    for matches, factory, compiled in _FAMILIES:
        if matches(model):
            if compile and compiled is None:
                raise ValueError(f"compile=True with method 'ar': {type(model).__name__}'s own "
                                 "decoding has no compiled form here (stree.hybrid's has); run it "
                                 "eagerly, or compile stree's own path (methods 'tree', 'chain', "
                                 "'ar-tree')")
            return compiled if compile else factory
    raise TypeError(f"no native decoding for {type(model).__name__}: method 'ar' runs the model's "
                    "own decoding (stree.hybrid, mamba_ssm MambaLMHeadModel and transformers' hybrid "
                    "families are registered); method 'ar-tree' runs stree's 1-node tree path "
                    "for any patched model")


def generate(model, prompts: list[Tensor], max_new_tokens: int, sampling: SamplingConfig,
             eos: set[int], generator: torch.Generator | None, streamer, stats: GenerationStats,
             device: torch.device, compile: bool = False) -> list[list[int]]:
    """Decode every prompt (1-D tensors) with the model's own code (``compile``: its compiled
    form, see :func:`register`); returns each row's new tokens.

    Equal-length prompts decode as one batch; ragged ones row by row. ``stats`` is filled as for
    the other methods (first token from the prefill, one step per later token).
    """
    from stree import capture

    factory = session_factory(model, compile)
    if compile and (reason := capture.unavailable()) is not None:
        warnings.warn(f"compile=True: {reason}; running eagerly", RuntimeWarning, stacklevel=3)
        factory = session_factory(model)
    lengths = {len(p) for p in prompts}
    groups = [list(range(len(prompts)))] if len(lengths) == 1 else [[i] for i in range(len(prompts))]
    new: list[list[int]] = [[] for _ in prompts]
    if streamer is not None:
        streamer.put(prompts[0][None].cpu())
    with torch.inference_mode():
        for rows in groups:
            ids = torch.stack([prompts[i] for i in rows])
            for r, toks in zip(rows, _decode(factory, model, ids, max_new_tokens, sampling, eos,
                                             generator, streamer, stats, device)):
                new[r] = toks
    if streamer is not None:
        streamer.end()
    return new


def _decode(factory, model, ids: Tensor, max_new_tokens: int, sampling, eos: set[int], generator,
            streamer, stats, device) -> list[list[int]]:
    b, l = ids.shape
    out: list[list[int]] = [[] for _ in range(b)]
    if max_new_tokens == 0:
        return out
    done = [False] * b
    with timed(stats, "prefill_s", device):
        session = factory(model, b, l, l + max_new_tokens)
        tok = sample(session.prefill(ids), sampling, generator)
    while True:
        for r, t in enumerate(tok.tolist()):
            if not done[r]:
                out[r].append(t)
                done[r] = t in eos or len(out[r]) >= max_new_tokens
                if streamer is not None:
                    streamer.put(torch.tensor([t]))
                if len(out[r]) > 1:
                    stats.record_step(1)
        if all(done):
            return out
        with timed(stats, "verify_s", device):
            tok = sample(session.step(tok), sampling, generator)
        stats.target_calls += 1


# ---------------------------------------------------------------------------------- families
class _HybridSession:
    """stree.hybrid: its own chunked prefill and ``step`` recurrence on its ``InferenceCache``."""

    def __init__(self, model, batch_size: int, prompt_len: int, max_seqlen: int):
        self.model = model
        self.cache = model.allocate_inference_cache(batch_size, max_seqlen)

    def prefill(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids, self.cache, num_last_tokens=1)[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        return self.model.step(tokens[:, None], self.cache)[:, -1]


class _CompiledHybridSession(_HybridSession):
    """stree.hybrid's own decoding compiled: the prefill as in :class:`_HybridSession`, each step
    ``step_at`` through :func:`stree.capture.compile_step` (built once per model). The cache holds
    ``grown_capacity`` positions (512 doubling), so the prompts of a run share a graph or two."""

    def __init__(self, model, batch_size: int, prompt_len: int, max_seqlen: int):
        from stree import capture

        super().__init__(model, batch_size, prompt_len, grown_capacity(max_seqlen, sys.maxsize))
        step = getattr(model, "_stree_compiled_step_at", None)
        if step is None:
            step = model._stree_compiled_step_at = capture.Fallback(
                capture.compile_step(model.step_at), model.step_at)
        self.step_at = step

    def step(self, tokens: Tensor) -> Tensor:
        position = torch.full_like(tokens, self.cache.seqlen)
        logits = self.step_at(tokens[:, None], self.cache, position)
        self.cache.seqlen += 1
        return logits[:, -1]


class _MambaLMSession:
    """mamba_ssm ``MambaLMHeadModel``: its own forward with its own ``InferenceParams``; on CUDA the
    decoding step is the CUDA graph of ``generate(cg=True)``."""

    def __init__(self, model, batch_size: int, prompt_len: int, max_seqlen: int):
        from mamba_ssm.modules import mha
        from mamba_ssm.utils.generation import InferenceParams, update_graph_cache

        device = next(model.parameters()).device
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("mamba_ssm's own decoding runs Triton kernels, which need a CUDA device; "
                             "on CPU use method 'ar-tree' (stree's 1-node tree path) as the baseline")
        if mha.flash_attn_with_kvcache is None and any(
                isinstance(blk.mixer, mha.MHA) for blk in model.backbone.layers):
            raise ValueError("mamba_ssm's own decoding of MHA layers needs flash-attn (without it its "
                             "fallback aligns the causal mask top-left, so a decoded token sees only "
                             "the first key); install flash-attn or use method 'ar-tree'")
        self.model, self.b = model, batch_size
        self.graph = device.type == "cuda"
        if self.graph:
            model._decoding_cache = update_graph_cache(model, getattr(model, "_decoding_cache", None),
                                                       batch_size, prompt_len, max_seqlen)
            self.params = model._decoding_cache.inference_params
            self.params.reset(max_seqlen, batch_size)
        else:
            self.params = InferenceParams(max_seqlen=max_seqlen, max_batch_size=batch_size)

    def prefill(self, input_ids: Tensor) -> Tensor:
        logits = self.model(input_ids, inference_params=self.params, num_last_tokens=1).logits
        self.params.seqlen_offset += input_ids.shape[1]
        return logits[:, -1]

    def step(self, tokens: Tensor) -> Tensor:
        offset = self.params.seqlen_offset
        pos = torch.full((self.b, 1), offset, dtype=torch.long, device=tokens.device)
        if self.graph:
            logits = self.model._decoding_cache.run(tokens[:, None], pos, offset)
        else:
            logits = self.model(tokens[:, None], position_ids=pos, inference_params=self.params,
                                num_last_tokens=1).logits
        self.params.seqlen_offset += 1
        return logits[:, -1]


def _is_hybrid(model) -> bool:
    from stree.hybrid import MambaInLlamaForCausalLM

    return isinstance(model, MambaInLlamaForCausalLM)


def _is_mamba_lm(model) -> bool:
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    return isinstance(model, MambaLMHeadModel)


register(_is_mamba_lm, _MambaLMSession)
register(_is_hybrid, _HybridSession, _CompiledHybridSession)
register(is_transformers_family, TransformersSession)
