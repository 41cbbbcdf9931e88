"""The draft side of ``method: "stree"`` in vLLM: a stree-patched draft model on its own state pool.

vLLM's model runner calls ``propose`` once per step with every running request's token history;
each request keeps one row (slot) of the draft's :class:`~stree.cache.StatePool`, keyed by vLLM's
request id, holding the draft state of the committed sequence up to (not including) its last
token. A step advances that state over the tokens committed since the last step (the previous
root, the accepted draft tokens): from the activations the last draft kept (stree's commit by
replay) when they are a root path of the last drafted tree, else by running them through the
draft; then it drafts from the new last token (the root, which neither model has run). Dynamic
drafters keep the calibration they start with: their online update (``Drafter.observe``) reads
the drafter's last batch, which here is another request's. Rows belong to the requests of the
current batch: a request that left it (finished, aborted or preempted) gives its slot back, and
one whose history no longer extends what its slot holds (preempted and recomputed, or an id
reused) is re-prefilled. :func:`patch_runner` passes vLLM's request ids and sampling parameters in, since
vLLM's custom-proposer call does not carry them.

A greedy request gets the draft's argmax chain. A sampled one gets a chain drawn from the draft's
distribution under the request's own temperature, top-k and top-p, and the distributions each
token was drawn from are handed to vLLM's rejection sampler (the runner's ``_draft_probs``, which
vLLM's custom-proposer path leaves empty): it then verifies by speculative sampling (SpS:
accept x with probability min(1, p(x) / q(x)), else draw from (p - q)+), lossless for any q the
tokens were really drawn from, instead of the one-hot rule, which accepts x only with
probability p(x).

Where stree verifies (:mod:`stree.vllm.trees`: a tree spec, or a chain under another verifier than
SpS) the drafted tree's nodes go to vLLM flattened in topological order, and the tree itself (with
the distributions its children were drawn from and the verifier for the request's sampling
settings) is kept in ``drafted`` by request id, for stree's verification in the next step.

When vLLM compiles its model (``enforce_eager=False``) the draft's levels run compiled too
(:mod:`stree.capture`), for drafters with a static template.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from stree import capture
from stree.draft.base import commit_draft
from stree.sampling import SamplingConfig
from stree.vllm.speculative import DraftSpec, draft_size, load_draft
from stree.vllm.trees import DraftedTree

GREEDY = SamplingConfig(temperature=0.0)


class _Row:
    """One request's slot, the history its draft state has committed, and the generator its
    draft tokens are drawn with (seeded from the request's seed, if it has one)."""

    def __init__(self, slot: int, cache, seed: int | None):
        self.slot, self.cache, self.history = slot, cache, []
        self.last = None  # the tree last drafted from this row's cache (its activations are kept)
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()


def sampling_of(params) -> SamplingConfig:
    """A vLLM ``SamplingParams`` as stree's :class:`SamplingConfig`: greedy where vLLM's own
    ``sampling_type`` says so; vLLM's top-k 0 or -1 and top-p 1 mean off, as stree's 0 and 1."""
    from vllm.sampling_params import SamplingType

    if params is None or params.sampling_type == SamplingType.GREEDY:
        return GREEDY
    return SamplingConfig(params.temperature, max(params.top_k, 0), params.top_p)


class StreeProposer:
    """vLLM custom proposer (``speculative_config`` method ``"custom_class"``, which
    :mod:`stree.vllm.speculative` selects for ``"stree"``)."""

    def __init__(self, vllm_config):
        spec = DraftSpec.from_env()
        self.k = draft_size(spec.tree)
        if vllm_config.speculative_config.num_speculative_tokens != self.k:
            raise ValueError(f"num_speculative_tokens={vllm_config.speculative_config.num_speculative_tokens} "
                             f"disagrees with tree {spec.tree!r}")
        self.stree_verifies = spec.stree_verifies
        self.model = load_draft(spec.model)
        # (drafter, verifier) for greedy requests and for sampled ones: the draft mode, and with it
        # the lossless verifier, depends only on whether the request samples
        self.pairs = {greedy: spec.pair(sampling) for greedy, sampling
                      in ((True, GREEDY), (False, SamplingConfig(temperature=1.0)))}
        self.drafted: dict[str, DraftedTree] = {}  # where stree verifies: each request's last tree
        # vLLM compiles its model unless enforce_eager; the draft's levels follow, where the tree
        # has a static template (one graph per level width, as stree's own compile=True)
        self.compiled = (not vllm_config.model_config.enforce_eager
                         and all(drafter.layered for drafter, _ in self.pairs.values()))
        slots = vllm_config.scheduler_config.max_num_seqs
        self.pool = self.model.allocate_state_pool(slots, vllm_config.model_config.max_model_len + self.k + 1)
        self.free = list(range(slots))
        self.rows: dict[str, _Row] = {}
        self.req_ids: list[str] = []
        self.params: list = []  # this step's SamplingParams, in batch order
        self.last_probs: torch.Tensor | None = None  # (num_reqs, K, vocab) of the last propose

    # -- lifecycle (from patch_runner) ------------------------------------------------------------
    def bind(self, req_ids, params=None) -> None:
        """This step's batch order (vLLM's ``input_batch.req_ids``) and each request's
        ``SamplingParams`` (None: greedy); rows of requests no longer in the batch are released
        (the batch holds at most ``max_num_seqs`` requests, so a free slot exists for every new
        one)."""
        self.req_ids = list(req_ids)
        self.params = list(params) if params is not None else [None] * len(self.req_ids)
        current = set(self.req_ids)
        for rid in [r for r in self.rows if r not in current]:
            self.free.append(self.rows.pop(rid).slot)
            self.drafted.pop(rid, None)

    def take_probs(self) -> torch.Tensor | None:
        """The draft distributions of the last ``propose``: ``(num_reqs, K, vocab)`` fp32, row
        ``[i, j]`` the distribution request ``i``'s draft token ``j`` was drawn from (zeros for
        greedy requests and requests that drafted nothing), or None if no request sampled."""
        probs, self.last_probs = self.last_probs, None
        return probs

    def load_model(self, *args) -> None:  # vLLM calls this with the target; the draft is ours
        pass

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs) -> list[list[int]]:
        """``sampled_token_ids[i]``: tokens request ``i`` gained this step (empty while its prompt
        is still being prefilled); ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` its whole
        sequence. Returns ``K`` draft tokens per request ([] where nothing is drafted)."""
        out, probs = [], {}
        with capture.compiled(self.model) if self.compiled else nullcontext():
            for i, new in enumerate(sampled_token_ids):
                if len(new) == 0 or i >= len(self.req_ids):
                    out.append([])
                    continue
                history = token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
                tokens, q = self._draft(i, history)
                out.append(tokens)
                if q is not None:
                    probs[i] = q
        self.last_probs = None
        if probs:
            vocab = next(iter(probs.values())).shape[-1]
            self.last_probs = torch.zeros(len(sampled_token_ids), self.k, vocab)
            for i, q in probs.items():
                self.last_probs[i] = q
        return out

    def _draft(self, i: int, history: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """Request ``i``'s K draft tokens and, if sampled, the ``(K, vocab)`` distributions they
        were drawn from."""
        rid, params = self.req_ids[i], self.params[i]
        row = self.rows.get(rid)
        committed = history[:-1]
        if row is None or row.history != committed[:len(row.history)]:
            row = self._reset(rid, row, getattr(params, "seed", None))
        todo = committed[len(row.history):]
        sampling = sampling_of(params)
        drafter, verifier = self.pairs[sampling.is_greedy]
        if todo:
            if not self._commit_drafted(row, todo, drafter):
                self.model.prefill(torch.tensor([todo]), row.cache)
            row.history = committed
        d = drafter.draft(self.model, row.cache, torch.tensor([history[-1]]), sampling, row.generator)
        row.last = d.tree
        if self.stree_verifies:
            q = None if d.q is None else d.q.float()
            self.drafted[rid] = DraftedTree(d.tree, q, d.mode, verifier, sampling)
            return d.tree.tokens[0, 1:].tolist(), None
        q = None if sampling.is_greedy else d.q[0, :self.k].float()  # node j's children: token j + 1
        return d.tree.tokens[0, 1:].tolist(), q

    def _commit_drafted(self, row: _Row, todo: list[int], drafter) -> bool:
        """Advance the row's draft state over ``todo`` (last step's root and the drafts the
        target accepted) from the activations the last draft kept, as stree's own loop does,
        instead of running the tokens through the draft again. False when ``todo`` is not a
        root path of the last tree (the caller prefills)."""
        tree, row.last = row.last, None
        if tree is None:
            return False
        tokens, path = tree.tokens[0].tolist(), [0]
        if tokens[0] != todo[0]:
            return False
        for token in todo[1:]:
            child = next((c for c in tree.children(0, path[-1]) if tokens[c] == token), None)
            if child is None:
                return False
            path.append(child)
        return commit_draft(self.model, row.cache, tree, torch.tensor([path]), [len(path)], [path[-1]], drafter.ran)

    def _reset(self, rid: str, row: _Row | None, seed: int | None) -> _Row:
        slot = row.slot if row is not None else self.free.pop()
        row = _Row(slot, self.pool.cache([slot]), seed)  # zeroes the slot's state
        self.rows[rid] = row
        return row


def patch_runner() -> None:
    """Give :class:`StreeProposer` vLLM's request ids (in batch order) and sampling parameters
    each step, and hand its draft distributions to vLLM's rejection sampler for the next step
    (``_draft_probs``, keyed by request id, which the runner fills only for its own drafters)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.propose_draft_token_ids
    if getattr(original, "_stree", False):
        return

    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, StreeProposer):
            return original(self, scheduler_output, *args, **kwargs)
        req_ids = list(self.input_batch.req_ids)
        drafter.bind(req_ids, [getattr(self.requests.get(r), "sampling_params", None) for r in req_ids])
        out = original(self, scheduler_output, *args, **kwargs)
        probs = drafter.take_probs()
        if probs is not None:
            self._draft_probs = probs.to(self.device)
            self._draft_prob_req_ids = req_ids
        return out

    propose_draft_token_ids._stree = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
