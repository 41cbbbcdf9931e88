"""The draft side of ``method: "stree"`` in vLLM: a stree-patched draft model on its own state pool.

vLLM's model runner calls ``propose`` once per step with every running request's token history;
each request keeps one row (slot) of the draft's :class:`~stree.cache.StatePool`, keyed by vLLM's
request id, holding the draft state of the committed sequence up to (not including) its last
token. A step feeds the tokens committed since the last step (the previous root, the accepted
draft tokens) through the draft from that state, then drafts a chain from the new last token
(the root, which neither model has run). Rows belong to the requests of the current batch: a
request that left it (finished, aborted or preempted) gives its slot back, and one whose history
no longer extends what its slot holds (preempted and recomputed, or an id reused) is
re-prefilled. :func:`patch_runner` passes vLLM's request ids in, since vLLM's custom-proposer call
does not carry them.
"""
from __future__ import annotations

import torch

from stree.sampling import SamplingConfig
from stree.vllm.speculative import DraftSpec, chain_length, load_draft

GREEDY = SamplingConfig(temperature=0.0)


class _Row:
    """One request's slot and the history its draft state has committed."""

    def __init__(self, slot: int, cache):
        self.slot, self.cache, self.history = slot, cache, []


class StreeProposer:
    """vLLM custom proposer (``speculative_config`` method ``"custom_class"``, which
    :mod:`stree.vllm.speculative` selects for ``"stree"``)."""

    def __init__(self, vllm_config):
        from stree.generation import resolve

        spec = DraftSpec.from_env()
        self.k = chain_length(spec.tree)
        if vllm_config.speculative_config.num_speculative_tokens != self.k:
            raise ValueError(f"num_speculative_tokens={vllm_config.speculative_config.num_speculative_tokens} "
                             f"disagrees with tree {spec.tree!r}")
        self.model = load_draft(spec.model)
        self.drafter, _ = resolve("chain", spec.tree, None, GREEDY)
        slots = vllm_config.scheduler_config.max_num_seqs
        self.pool = self.model.allocate_state_pool(slots, vllm_config.model_config.max_model_len + self.k + 1)
        self.free = list(range(slots))
        self.rows: dict[str, _Row] = {}
        self.req_ids: list[str] = []

    # -- lifecycle (from patch_runner) ------------------------------------------------------------
    def bind(self, req_ids) -> None:
        """This step's batch order (vLLM's ``input_batch.req_ids``); rows of requests no longer in
        the batch are released (the batch holds at most ``max_num_seqs`` requests, so a free slot
        exists for every new one)."""
        self.req_ids = list(req_ids)
        current = set(self.req_ids)
        for rid in [r for r in self.rows if r not in current]:
            self.free.append(self.rows.pop(rid).slot)

    def load_model(self, *args) -> None:  # vLLM calls this with the target; the draft is ours
        pass

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs) -> list[list[int]]:
        """``sampled_token_ids[i]``: tokens request ``i`` gained this step (empty while its prompt
        is still being prefilled); ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` its whole
        sequence. Returns ``K`` draft tokens per request ([] where nothing is drafted)."""
        out = []
        for i, new in enumerate(sampled_token_ids):
            if len(new) == 0 or i >= len(self.req_ids):
                out.append([])
                continue
            history = token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
            out.append(self._draft(self.req_ids[i], history))
        return out

    def _draft(self, rid: str, history: list[int]) -> list[int]:
        row = self.rows.get(rid)
        committed = history[:-1]
        if row is None or row.history != committed[:len(row.history)]:
            row = self._reset(rid, row)
        todo = committed[len(row.history):]
        if todo:
            self.model.prefill(torch.tensor([todo]), row.cache)
            row.history = committed
        d = self.drafter.draft(self.model, row.cache, torch.tensor([history[-1]]), GREEDY)
        return d.tree.tokens[0, 1:].tolist()

    def _reset(self, rid: str, row: _Row | None) -> _Row:
        slot = row.slot if row is not None else self.free.pop()
        row = _Row(slot, self.pool.cache([slot]))  # zeroes the slot's state
        self.rows[rid] = row
        return row


def patch_runner() -> None:
    """Give :class:`StreeProposer` vLLM's request ids (in batch order) each step."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_stree", False):
        return

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if isinstance(getattr(self, "drafter", None), StreeProposer):
            self.drafter.bind(self.input_batch.req_ids)
        return original(self, scheduler_output, *args, **kwargs)

    propose_draft_token_ids._stree = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
