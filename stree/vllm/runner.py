"""The model runner's two hooks that make a step with trees (:mod:`stree.vllm.step`).

1. ``GPUModelRunner._prepare_inputs``: each node's position becomes ``num_computed + depth(i)``
   (rotary embeddings see the node's place on its own path); the slot mapping, already computed,
   keeps one KV slot per node. A :class:`~stree.vllm.step.TreeStep` of the step's trees (keyed by
   the query's first token index) becomes current, for the layers to read.
2. ``GPUModelRunner._sample``: stree's verifier on each tree (the lossless rule for the request's
   sampling settings and the draft's mode) gives the accepted path; the request's output row
   becomes the path's tokens and the token the target emits after it (vLLM's rejection sampler
   runs first only when the batch holds other rows); then the commit. A step in which no request
   has drafts, for any speculative method, is sampled by vLLM's own sampler, not its rejection
   sampler.

A chain (``"chain:K"``) is a tree and takes this path too, but where
:attr:`~stree.vllm.speculative.DraftSpec.stree_verifies` leaves it to vLLM's own rejection sampler
(SpS on a GPU, or ``"verifier": "sps"`` named: :mod:`stree.vllm.proposer`).
"""
from __future__ import annotations

import torch

from stree.vllm.step import TreeRow, TreeStep, begin, current


def verified_by_stree(params) -> bool:
    """Whether stree's verifiers honour all that a request's ``SamplingParams`` ask for:
    temperature, top-k, top-p, seed. A request that also asks for what only vLLM's sampler applies
    (penalties, min-p, logit bias, allowed or bad words, min tokens, structured output, logprobs)
    is left to vLLM: it verifies the flattened tree as a chain of proposed tokens (the rows run
    causally, as vLLM schedules them), which is still lossless, only accepting less."""
    if params is None:
        return True
    return (params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and params.min_p == 0 and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and not params.min_tokens and params.logprobs is None
            and getattr(params, "structured_outputs", None) is None)


def _tree_proposer(runner):
    """The runner's :class:`~stree.vllm.proposer.StreeProposer` where stree verifies, else None
    (known by its ``stree_verifies``)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "stree_verifies", False) else None


def patch_trees() -> None:
    """Install the runner's two hooks of the module docstring (steps without trees go to vLLM's
    own code); the layers' tree rows are the registered attention backend's and recurrent layers'
    (:mod:`stree.vllm.attention`, :mod:`stree.vllm.mixer`, :mod:`stree.vllm.gated_delta`)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_prepare = GPUModelRunner._prepare_inputs
    if getattr(original_prepare, "_stree", False):
        return
    original_sample = GPUModelRunner._sample

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original_prepare(self, scheduler_output, num_scheduled_tokens)
        begin(None)
        proposer, spec = _tree_proposer(self), result[1]
        if proposer is None or spec is None:
            return result
        rows = {}
        computed = self.input_batch.num_computed_tokens_cpu
        starts = self.query_start_loc.np
        cu_draft = [0] + spec.cu_num_draft_tokens.tolist()
        drafts = spec.draft_token_ids.tolist()
        for r, rid in enumerate(self.input_batch.req_ids):
            n = spec.num_draft_tokens[r]
            drafted = proposer.drafted.get(rid)
            if n <= 0 or drafted is None or not verified_by_stree(getattr(self.requests.get(rid), "sampling_params",
                                                                          None)):
                continue
            drafted = drafted.prefix(1 + n)
            if drafted.tree.tokens[0, 1:].tolist() != drafts[cu_draft[r]:cu_draft[r + 1]]:
                raise RuntimeError(f"stree: request {rid}'s scheduled draft tokens are not the tree it drafted")
            start = int(starts[r])
            self.positions[start:start + 1 + n] = int(computed[r]) + drafted.tree.depth[0].to(self.positions.device)
            rows[start] = TreeRow(r, start, drafted, self.input_batch.generators.get(r))
        begin(TreeStep(rows) if rows else None)
        return result

    def _sample(self, logits, spec_decode_metadata):
        from vllm.v1.outputs import SamplerOutput

        step = current()
        begin(None)
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            # no request has drafts (a batch-size schedule turned drafting off, or none drafted):
            # the rejection sampler would only sample each row's bonus token; vLLM's own sampler
            # does that alone (0.1-0.2 ms less per step on this CPU)
            spec_decode_metadata = None
        if step is None or spec_decode_metadata is None:
            return original_sample(self, logits, spec_decode_metadata)
        if step.covers(self.input_batch.num_reqs):  # no rejection sampler needed
            output = SamplerOutput(torch.full((len(step.rows), spec_decode_metadata.max_spec_len + 1), -1,
                                              dtype=torch.int32, device=logits.device), None)
        else:
            output = original_sample(self, logits, spec_decode_metadata)
        step.verify(logits, spec_decode_metadata.cu_num_sampled_tokens.tolist(), output.sampled_token_ids)
        step.commit()
        return output

    _prepare_inputs._stree = True
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._sample = _sample
