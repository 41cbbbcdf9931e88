"""The draft side of ``method: "stree"`` in vLLM: a stree-patched draft model on its own state pool.

vLLM's model runner calls ``propose`` once per step with every running request's token history;
each request keeps one row (slot) of the draft's :class:`~stree.cache.StatePool`, keyed by vLLM's
request id, holding the draft state of the committed sequence up to (not including) its last token.
A step first advances those states over the tokens committed since the last step (the previous
root, the accepted draft tokens): from the activations the last draft kept (stree's commit by
replay, one commit per draft batch) when they are a root path of the request's last tree (a merged
tree's, or one whose draft takes a lead: the part the draft ran), else by running them through the
draft (a new request's prompt, a request whose history no longer extends its slot's: preempted and
recomputed, or an id reused; the accepted leaf of a tree's never-run deepest level). A static
tree's draft of an attention-free draft model (the shipped one) runs up to ``MAX_LEAD`` such
tokens in its next draft's roots' pass (its lead: one read of the weights, no forward of their
own), committed with that draft's accepted path; other catch-ups run before drafting (a one-node
level, a compiled chain or a prefill). Then it drafts from each request's new last token (the root,
which neither model has run), **batched across requests**: one draft call per sampling setting (all
greedy requests together, all sampled requests of one temperature / top-k / top-p together), the
rows resuming from their slots at their own lengths (``StatePool.cache(slots, seqlens)``). A
sampled request with its own seed drafts alone, with a generator seeded from it, so that its draft
tokens do not depend on its batch-mates. Dynamic drafters keep the calibration they start with:
their online update (``Drafter.observe``) would read several requests' trees as one. Rows belong to
the requests of the current batch: a request that left it (finished, aborted or preempted) gives
its slot back. :func:`patch_runner` passes vLLM's request ids and sampling parameters in, since
vLLM's custom-proposer call does not carry them.

A greedy request gets the draft's argmax chain. A sampled one gets a chain drawn from the draft's
distribution under the request's own temperature, top-k and top-p, and the distributions each
token was drawn from are handed to vLLM's rejection sampler (the runner's ``_draft_probs``, which
vLLM's custom-proposer path leaves empty): it then verifies by speculative sampling (SpS:
accept x with probability min(1, p(x) / q(x)), else draw from (p - q)+), lossless for any q the
tokens were really drawn from, instead of the one-hot rule, which accepts x only with
probability p(x).

Where stree verifies (:mod:`stree.vllm.step`: every tree spec, and chains but where
:attr:`~stree.vllm.speculative.DraftSpec.stree_verifies` leaves them to vLLM) the drafted tree's
nodes go to vLLM flattened in topological order, and the tree itself (with the distributions its
children were drawn from and the verifier for the request's sampling settings) is kept in
``drafted`` by request id, for stree's verification in the next step.

Suffix trees (``"tree": "suffix:16"``) run no draft model: each request keeps a row of the
engine's :class:`~stree.draft.suffix.ContextIndex` (its text's suffix trie, pushed the request's
new tokens each step, and its place in the engine's cache of earlier outputs, which a request's
output joins when it leaves the batch), and its tree is read from them; a request with no match
proposes nothing that step. Merged with a draft's tree (``"caterpillar:2,2,2+suffix:16"``) the
draft runs as for its tree alone, and accepted suffix nodes it never ran are among the tokens
it is behind; a request whose suffix tree scores the merge's ``solo`` drafts it alone, in a call
of its own, and its draft state is left behind until it next runs the draft model.

When vLLM compiles its model (``enforce_eager=False``) the draft's levels run compiled too
(:mod:`stree.capture`), for drafters with a static template: a draft batch is padded to the next
of a few sizes (powers of two up to ``max_num_seqs``) with scratch rows, and one graph per size
and level width is compiled, for sizes up to ``PRECOMPILED`` when vLLM loads the model
(:meth:`StreeProposer.load_model`), as vLLM captures its own graphs at start-up; a larger size
compiles (once) when a batch first needs it.
"""
from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from stree import capture
from stree.cache import TreeCache
from stree.draft import MergedDrafter, SuffixDrafter
from stree.draft.base import MAX_LEAD, commit_draft, lead_tensor
from stree.draft.suffix import ContextIndex
from stree.kernels import cpu_ops
from stree.prefix_cache import PrefixCache
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from stree.vllm.speculative import DraftSpec, draft_size, load_draft
from stree.vllm.drafted import DraftedTree
from stree.vllm.runner import verified_by_stree

GREEDY = SamplingConfig(temperature=0.0)
DRAFT_SEED_OFFSET = 0x5EED_D4AF7  # the draft's generator: vLLM's seed plus this
# Draft batch sizes compiled at start-up: each costs seconds of compilation on a CPU, and vLLM's
# CPU default of 256 sequences would add a minute to every engine start.
PRECOMPILED = 8
# Catch-up chain lengths compiled (:meth:`StreeProposer._chain`; padded up to one of them);
# longer runs (a prompt) are prefilled.
CHAIN_WIDTHS = (2, 4, 8, 16)
# Lead widths of a draft (the tokens it is behind, run in its roots' pass; ``lead_tensor``
# pads to them): each a graph of its own, the first compiled at start-up for every precompiled
# batch size, all of them for one request where the tree is merged (its draft falls behind by
# the suffix nodes it never ran).
LEAD_WIDTHS = tuple(1 << i for i in range(MAX_LEAD.bit_length()))
logger = logging.getLogger(__name__)


class _Row:
    """One request's slot, the history its draft state has committed, and for a sampled request
    with its own seed the generator its draft tokens are drawn with."""

    def __init__(self, rid: str, slot: int, seed: int | None):
        self.rid, self.slot, self.history = rid, slot, []
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed)


@dataclass
class _Batch:
    """One draft call of the last step: the cache over its rows' slots (holding the activations
    its commit replays), the tree it drafted (one row per cache row), whether the draft ran each
    node (read when it was drafted: a dynamic drafter's answer changes with its next draft),
    each row's request (None: a scratch row padding the batch), the tokens each row ran before
    its root (its lead, committed with its path), and whether its rows commit only the part of
    their paths the draft ran (leaving the rest to the next lead or catch-up)."""

    cache: TreeCache
    tree: TokenTree
    ran: list[bool]
    rows: list[_Row | None]
    leads: list[list[int]]
    cut: bool


def sampling_of(params) -> SamplingConfig:
    """A vLLM ``SamplingParams`` as stree's :class:`SamplingConfig`: greedy where vLLM's own
    ``sampling_type`` says so; vLLM's top-k 0 or -1 and top-p 1 mean off, as stree's 0 and 1."""
    from vllm.sampling_params import SamplingType

    if params is None or params.sampling_type == SamplingType.GREEDY:
        return GREEDY
    return SamplingConfig(params.temperature, max(params.top_k, 0), params.top_p)


def _levels(drafter):
    """The drafter whose levels the draft model runs (a merged tree's base)."""
    return drafter.base if isinstance(drafter, MergedDrafter) else drafter


def _suffix(drafter) -> SuffixDrafter | None:
    if isinstance(drafter, MergedDrafter):
        return drafter.suffix
    return drafter if isinstance(drafter, SuffixDrafter) else None


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The draft batch sizes compiled for an engine of ``max_num_seqs``: powers of two below it,
    and itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes + [max_num_seqs] if max_num_seqs > 1 else sizes


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
        self.uses_mrope = vllm_config.model_config.uses_mrope  # the target's (checked in load_model)
        self.model = load_draft(spec.model, spec.draft_dtype) if spec.model is not None else None
        # (drafter, verifier) for greedy requests and for sampled ones: the draft mode, and with it
        # the lossless verifier, depends only on whether the request samples
        self.pairs = {greedy: spec.pair(sampling) for greedy, sampling
                      in ((True, GREEDY), (False, SamplingConfig(temperature=1.0)))}
        # suffix trees: one index for the engine (a row per request), its cache of earlier
        # outputs bound to the target's vocabulary
        self.index = ContextIndex(spec.suffix_cache())
        if self.index.cache is not None:
            self.index.cache.bind(vllm_config.model_config.get_vocab_size())
        drafters = [pair[0] for pair in self.pairs.values() if pair is not None]
        for drafter in drafters:
            if _suffix(drafter) is not None:
                _suffix(drafter).index = self.index
        self.contexts: dict[str, tuple] = {}  # request id -> (its index row, its prompt's length)
        self.drafted: dict[str, DraftedTree] = {}  # where stree verifies: each request's last tree
        # vLLM compiles its model unless enforce_eager; the draft's levels follow, where the tree
        # has a static template (one graph per level width and batch size, as stree's compile=True)
        self.compiled = (self.model is not None and not vllm_config.model_config.enforce_eager
                         and all(_levels(drafter).layered for drafter in drafters))
        slots = vllm_config.scheduler_config.max_num_seqs
        self.sizes = batch_sizes(slots) if self.compiled else None
        self.compiled_sizes = {size for size in self.sizes or () if size <= PRECOMPILED}
        # scratch slots after the requests' ones pad a draft batch up to a compiled size
        pad = max((b - a - 1 for a, b in zip(self.sizes, self.sizes[1:])), default=0) if self.compiled else 0
        self.pool = None if self.model is None else self.model.allocate_state_pool(
            slots + pad, vllm_config.model_config.max_model_len + self.k + 1)
        # by sampling kind (greedy or not): whether the drafter runs the tokens a request's draft is
        # behind in its next draft's roots' pass (a static tree of an attention-free draft model)
        self.takes_lead = {greedy: self.model is not None and pair is not None
                           and _levels(pair[0]).takes_lead(self.model, GREEDY if greedy else SamplingConfig(1.0))
                           for greedy, pair in self.pairs.items()}
        # where vLLM caches prefixes, so does the draft: its state at the end of each request that
        # leaves the batch, restored by a later request that extends it (a conversation's next turn)
        caching = getattr(getattr(vllm_config, "cache_config", None), "enable_prefix_caching", False)
        self.prefix_cache = (PrefixCache(spec.draft_prefix_cache_bytes)
                             if self.pool is not None and caching and spec.draft_prefix_cache_bytes else None)
        self.free = list(range(slots))
        self.scratch = list(range(slots, slots + pad))
        # draws of sampled requests without a seed of their own, from vLLM's seed: under tensor
        # parallelism every rank drafts, and each must draw the tree that the draft tokens vLLM
        # schedules (rank 0's) came from, as vLLM seeds its sampler alike on every rank
        self.generator = torch.Generator()
        seed = getattr(vllm_config.model_config, "seed", None)
        if seed is None:
            self.generator.seed()
        else:  # a stream apart from the one vLLM's sampler draws from (seeded with seed itself)
            self.generator.manual_seed(DRAFT_SEED_OFFSET + seed)
        self.rows: dict[str, _Row] = {}
        self.batches: list[_Batch] = []  # the last step's draft calls, committed by the next step
        self.req_ids: list[str] = []
        self.params: list = []  # this step's SamplingParams, in batch order
        self.budget = self.k  # draft tokens per request vLLM takes this step (see bind)
        self.last_probs: torch.Tensor | None = None  # (num_reqs, K, vocab) of the last propose
        self.chains: dict[tuple[int, int], TokenTree] = {}  # catch-up chain templates by (rows, width)
        self.full_chains_only = False  # set in load_model (see full_chains_only in stree.vllm.targets)

    # -- lifecycle (from vLLM and patch_runner) ---------------------------------------------------
    @torch.inference_mode()
    def load_model(self, target, *args) -> None:
        """Called by vLLM at start-up with the target (the draft is ours): refuse a target with
        layers stree does not verify over a tree (:func:`stree.vllm.targets.check_layers`),
        before anything runs; compile the draft's levels for the padded batch sizes up to
        ``PRECOMPILED`` now, on free slots (a request's first draft zeroes its slot), with the
        shortest lead (and for a merged tree all of them, for one request) or the one-token
        catch-up, and a sampled request's for one request (the CPU default drafts only for a
        request running alone); and build stree's C++ CPU ops for the target's tree rows (once
        per machine, cached), so the first tree step does not wait for a compiler."""
        from vllm.platforms import current_platform

        from stree.vllm.targets import check_layers, full_chains_only

        check_layers(target, self.stree_verifies, self.uses_mrope)
        self.full_chains_only = full_chains_only(target)
        if self.stree_verifies and current_platform.is_cpu():
            cpu_ops.ops()
        if not self.compiled:
            return
        drafter = _levels(self.pairs[True][0])
        with capture.compiled(self.model):
            for size in sorted(self.compiled_sizes):  # a run of slots (views of the pool) and scattered slots
                for slots in {tuple(range(size)), tuple(range(size))[::-1]}:
                    cache = self.pool.cache(list(slots))
                    self.model.prefill(torch.zeros(size, 2, dtype=torch.long), cache, logits=False)
                    drafter.draft(self.model, cache, torch.zeros(size, dtype=torch.long), GREEDY)
                    if self.takes_lead[True]:
                        drafter.draft(self.model, cache, torch.zeros(size, dtype=torch.long), GREEDY,
                                      lead=torch.zeros(size, 1, dtype=torch.long))
                    else:
                        self._one_token(self.pool.cache(list(slots), [2] * size), [[0]] * size)
            if self.takes_lead[True] and _suffix(self.pairs[True][0]) is not None:  # drafting alone
                for width in LEAD_WIDTHS[1:]:
                    drafter.draft(self.model, self.pool.cache([0], [2]), torch.zeros(1, dtype=torch.long), GREEDY,
                                  lead=torch.zeros(1, width, dtype=torch.long))
            if self.pairs[False] is not None:  # a sampled request drafting alone: its levels, and with a lead
                sampled = _levels(self.pairs[False][0])  # a static template's drafter: it takes lead=None
                for lead in (None, torch.zeros(1, 1, dtype=torch.long)) if self.takes_lead[False] else (None,):
                    sampled.draft(self.model, self.pool.cache([0], [2]), torch.zeros(1, dtype=torch.long),
                                  SamplingConfig(1.0), self.generator, lead=lead)

    def bind(self, req_ids, params=None, budget: int | None = None) -> None:
        """This step's batch order (vLLM's ``input_batch.req_ids``), each request's
        ``SamplingParams`` (None: greedy) and how many draft tokens vLLM's scheduler takes per
        request (its ``num_spec_tokens_to_schedule``, which a ``num_speculative_tokens_per_batch_size``
        schedule sets by batch size; None: all ``K``). Rows of requests no longer in the batch are
        released (the batch holds at most ``max_num_seqs`` requests, so a free slot exists for
        every new one)."""
        self.req_ids = list(req_ids)
        self.params = list(params) if params is not None else [None] * len(self.req_ids)
        self.budget = self.k if budget is None else min(budget, self.k)
        current = set(self.req_ids)
        for rid in [r for r in self.rows if r not in current]:
            row = self.rows.pop(rid)
            if self.prefix_cache is not None:  # its committed state (a pending tree wrote none)
                self.prefix_cache.insert(self.model, self.pool.cache([row.slot], [len(row.history)]), 0,
                                         row.history, role="draft")
            self.free.append(row.slot)
            self.drafted.pop(rid, None)
        for rid in [r for r in self.contexts if r not in current]:
            row, prompt = self.contexts.pop(rid)  # its output joins the engine's cache
            self.drafted.pop(rid, None)
            if self.index.cache is not None:
                self.index.cache.add(row.context[prompt:])

    def take_probs(self) -> torch.Tensor | None:
        """The draft distributions of the last ``propose``: ``(num_reqs, K, vocab)`` fp32, row
        ``[i, j]`` the distribution request ``i``'s draft token ``j`` was drawn from (zeros for
        greedy requests and requests that drafted nothing), or None if no request sampled."""
        probs, self.last_probs = self.last_probs, None
        return probs

    # -- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kwargs) -> list[list[int]]:
        """``sampled_token_ids[i]``: tokens request ``i`` gained this step (empty while its prompt
        is still being prefilled); ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` its whole
        sequence. Returns the first ``budget`` (see :meth:`bind`) of each request's ``K`` draft
        tokens ([] where nothing is drafted).

        With a budget of 0 (vLLM's batch-size schedule turned speculation off for this batch) the
        draft does no work at all: the last step's trees are dropped uncommitted and each
        request's slot falls behind, to be caught up by one prefill when speculation resumes."""
        out, probs = [[] for _ in sampled_token_ids], {}
        if self.budget == 0:
            self.batches, self.last_probs = [], None
            self.drafted.clear()
            return out
        histories = {i: token_ids_cpu[i, :int(num_tokens_no_spec[i])].tolist()
                     for i, new in enumerate(sampled_token_ids) if len(new) and i < len(self.req_ids)}
        if _suffix(self.pairs[True][0]) is not None:
            for i, history in histories.items():
                self._push(self.req_ids[i], history, len(sampled_token_ids[i]))
        with capture.compiled(self.model) if self.compiled else nullcontext():
            leads, solo = {}, set()
            if self.model is not None:
                solo = {i for i in histories if self._solo(i, histories[i][-1])}
                leading = {self.req_ids[i] for i in histories
                           if self.takes_lead[sampling_of(self.params[i]).is_greedy]}
                leads = self._catch_up({self.req_ids[i]: h[:-1] for i, h in histories.items()}, leading,
                                       {self.req_ids[i] for i in solo})
            groups: dict[object, list[int]] = {}
            for i in histories:
                sampling = sampling_of(self.params[i])
                row = self.rows.get(self.req_ids[i])  # none without a draft model: nothing is drawn
                seeded = row is not None and row.generator is not None and not sampling.is_greedy
                groups.setdefault((("seed", row.rid) if seeded else sampling, i in solo), []).append(i)
            for (_, alone), members in groups.items():
                roots = [histories[i][-1] for i in members]
                for i, (tokens, q) in zip(members, self._draft(members, roots, leads, alone)):
                    out[i] = tokens[:self.budget]  # the tree's first nodes: a subtree
                    if q is not None:
                        probs[i] = q
        if self.full_chains_only:  # what vLLM verifies itself: K draft tokens or none
            for i, tokens in enumerate(out):
                if len(tokens) != self.k and not self._stree_verifies(i):
                    out[i] = []
                    probs.pop(i, None)
        self.last_probs = None
        if probs:
            vocab = next(iter(probs.values())).shape[-1]
            self.last_probs = torch.zeros(len(sampled_token_ids), self.k, vocab)
            for i, q in probs.items():
                self.last_probs[i] = q
        return out

    def _stree_verifies(self, i: int) -> bool:
        """Whether stree verifies request ``i``'s tree this step (else vLLM, as a chain)."""
        return self.stree_verifies and verified_by_stree(self.params[i] if i < len(self.params) else None)

    def _catch_up(self, committed: dict[str, list[int]], leading: set[str],
                  solo: set[str] = frozenset()) -> dict[str, list[int]]:
        """Bring each request's slot to its ``committed`` tokens (its history less the root), or
        for the requests in ``leading`` (whose drafts run a lead) to within
        ``MAX_LEAD`` tokens of them: returns those tokens by request id, for its draft. Requests
        in ``solo`` (drafting without the draft model this step) only commit their last draft.

        The last step's draft batches commit first, each row along its request's accepted path
        with the lead it ran (rows of requests that left, or whose tokens are no root path of
        their tree, commit nothing): a batch's commit rewrites all its rows' slots, so it must
        precede any reset. Then new and diverged rows start over, and every row still behind
        is prefilled (or run as a one-node level or chain) unless its draft takes it as a
        lead."""
        for batch in self.batches:
            paths = [self._accepted(batch, r, row, committed) for r, row in enumerate(batch.rows)]
            counts = [len(p) for p in paths]
            if not any(counts):
                continue
            width = max(counts)
            path = torch.tensor([p + [-1] * (width - len(p)) for p in paths])
            if commit_draft(self.model, batch.cache, batch.tree, path, counts, [p[-1] if p else -1 for p in paths],
                            batch.ran.__getitem__):
                for row, p, lead in zip(batch.rows, paths, batch.leads):
                    if p:
                        row.history = committed[row.rid][:len(row.history) + len(lead) + len(p)]
        self.batches = []
        behind, leads = [], {}
        for rid, tokens in committed.items():
            row = self.rows.get(rid)
            if row is None or row.history != tokens[:len(row.history)]:
                row = self._reset(rid, row, tokens)
            if rid in solo:
                continue
            if rid in leading and 0 < len(tokens) - len(row.history) <= MAX_LEAD:
                leads[rid] = tokens[len(row.history):]
            elif len(row.history) < len(tokens):
                behind.append(row)
        if behind:
            cache = self.pool.cache([row.slot for row in behind], [len(row.history) for row in behind])
            todo = [committed[row.rid][len(row.history):] for row in behind]
            width = max(len(t) for t in todo)
            if width == 1 and (self.sizes is None or len(behind) in self.compiled_sizes):
                self._one_token(cache, todo)
            elif width <= CHAIN_WIDTHS[-1] and self.sizes is not None and len(behind) in self.compiled_sizes:
                self._chain(cache, todo)
            else:
                self.model.prefill([torch.tensor(t) for t in todo], cache, logits=False)
            for row in behind:
                row.history = committed[row.rid]
        return leads

    def _one_token(self, cache: TreeCache, tokens: list[list[int]]) -> None:
        """Commit one token per row of ``cache`` (the usual catch-up: an accepted node of the
        draft's deepest level, whose state it never computed) as a one-node tree: run as a draft
        level (compiled with the levels): 0.49 ms against a one-token prefill's 0.85 for the shipped
        draft on this CPU."""
        self.model.tree_forward(TokenTree(torch.tensor(tokens), [-1]), cache)
        cache.commit(torch.zeros(len(tokens), 1, dtype=torch.long), [1] * len(tokens))

    def _chain(self, cache: TreeCache, tokens: list[list[int]]) -> None:
        """Commit a few tokens per row of ``cache`` (a merged tree's accepted suffix nodes, which
        the draft never ran; a short prompt) as one chain, padded to the next of ``CHAIN_WIDTHS``
        (nodes past a row's tokens are not committed; a chain's earlier nodes do not see them):
        a compiled tree step per padded length instead of an eager prefill, 0.5-0.6 against
        0.8-0.9 ms for the shipped draft on this CPU."""
        width = next(w for w in CHAIN_WIDTHS if w >= max(len(t) for t in tokens))
        key = (len(tokens), width)
        if key not in self.chains:
            self.chains[key] = TokenTree(torch.zeros(len(tokens), width, dtype=torch.long), list(range(-1, width - 1)))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
        self.model.tree_forward(self.chains[key].with_tokens(padded, trusted=True), cache)
        counts = [len(t) for t in tokens]
        cache.commit(torch.tensor([list(range(n)) + [-1] * (width - n) for n in counts]), counts)

    def _accepted(self, batch: _Batch, r: int, row: _Row | None, committed: dict[str, list[int]]) -> list[int]:
        """The root path of ``batch``'s tree row ``r`` spelling the tokens its request committed
        since it was drafted; [] when there is none (or the row's request is gone)."""
        if row is None or self.rows.get(row.rid) is not row or row.rid not in committed:
            return []
        todo = committed[row.rid][len(row.history):]
        lead = batch.leads[r]
        if todo[:len(lead)] != lead:
            return []
        todo = todo[len(lead):]
        tokens = batch.tree.tokens[r].tolist()
        if not todo or todo[0] != tokens[0] or row.history != committed[row.rid][:len(row.history)]:
            return []
        path = [0]
        for token in todo[1:]:
            child = next((c for c in batch.tree.children(r, path[-1]) if tokens[c] == token), None)
            if child is None:
                return []
            path.append(child)
        if batch.cut:  # the part the draft ran; the rest is the next lead, or caught up
            return path[:next((j for j, u in enumerate(path) if not batch.ran[u]), len(path))]
        return path

    def _solo(self, i: int, root: int) -> bool:
        """Whether request ``i``'s draft from ``root`` runs no draft model this step (a merged
        tree whose suffix tree scores its ``solo``: :meth:`MergedDrafter.wants_draft_model`), so
        that its draft state is left behind rather than caught up first."""
        pair = self.pairs[sampling_of(self.params[i]).is_greedy]
        if pair is None or not isinstance(pair[0], MergedDrafter) or pair[0].solo is None:
            return False
        self.index.use([self.contexts[self.req_ids[i]][0]])
        return not pair[0].wants_draft_model(torch.tensor([root]))

    def _draft(self, members: list[int], roots: list[int], leads: dict[str, list[int]],
               solo: bool = False) -> list[tuple[list[int], torch.Tensor | None]]:
        """One draft call for the requests at batch indices ``members`` (one sampling setting),
        from their ``roots``, after the tokens ``leads`` gives a request (its draft is behind by
        them), or where ``solo`` (see :meth:`_solo`) without the draft model: per request its
        draft tokens (at most K; a suffix tree's as many as its match earns) and, if sampled
        under vLLM's verification, the ``(K, vocab)`` distributions they were drawn from."""
        rids = [self.req_ids[i] for i in members]
        sampling = sampling_of(self.params[members[0]])
        if self.pairs[sampling.is_greedy] is None:  # no drafts for such requests (see DraftSpec.pair)
            return [([], None)] * len(members)
        drafter, verifier = self.pairs[sampling.is_greedy]
        pad = 0 if self.sizes is None or solo else next(s for s in self.sizes if s >= len(rids)) - len(rids)
        if _suffix(drafter) is not None:
            self.index.use([self.contexts[rid][0] for rid in rids] + [self.index.new_row([])] * pad)
        if self.model is None or solo:  # solo rows only: the merged drafter drafts their suffix trees alone
            d = drafter.draft(None, None, torch.tensor(roots), sampling)
        else:
            rows = [self.rows[rid] for rid in rids]
            if self.sizes is not None and len(rows) + pad not in self.compiled_sizes:
                logger.info("stree: compiling the draft's levels for batches of %d (once)", len(rows) + pad)
                self.compiled_sizes.add(len(rows) + pad)
            cache = self.pool.cache([row.slot for row in rows] + self.scratch[:pad],
                                    [len(row.history) for row in rows] + [0] * pad)
            generator = None if sampling.is_greedy else rows[0].generator or self.generator
            lead = [leads.get(rid, []) for rid in rids] + [[]] * pad
            args = (self.model, cache, torch.tensor(roots + [0] * pad), sampling, generator)
            d = drafter.draft(*args, lead=lead_tensor(lead)) if any(lead) else drafter.draft(*args)
            cut = _suffix(drafter) is not None or self.takes_lead[sampling.is_greedy]
            self.batches.append(_Batch(cache, d.tree, [drafter.ran(j) for j in range(d.tree.num_nodes)],
                                       rows + [None] * pad, lead, cut))
        sizes = getattr(drafter, "sizes", None)  # a suffix or merged tree's real nodes per row
        out = []
        for r, rid in enumerate(rids):
            n = sizes[r] if sizes else d.tree.num_nodes
            tokens = d.tree.tokens[r, 1:n].tolist()
            if self.stree_verifies:
                self.drafted[rid] = DraftedTree.of(d, r, verifier, sampling).prefix(n)
                out.append((tokens, None))
            else:  # node j's children: token j + 1
                out.append((tokens, None if sampling.is_greedy else d.q[r, :self.k].float()))
        return out

    def _push(self, rid: str, history: list[int], new: int) -> None:
        """Bring request ``rid``'s suffix-index row to its ``history`` (which gained ``new``
        tokens this step): a new request's row holds its whole history and remembers where its
        prompt ends; a known one's is pushed the tokens it lacks; one whose history no longer
        extends its row (recomputed after preemption, an id reused) starts over."""
        entry = self.contexts.get(rid)
        if entry is not None:
            context = entry[0].context
            if len(history) >= len(context) and history[len(context) - 1:len(context)] == context[-1:]:
                entry[0].push(history[len(context):])
                return
        prompt = len(history) - new if entry is None else entry[1]
        self.contexts[rid] = (self.index.new_row(history), prompt)

    def _reset(self, rid: str, row: _Row | None, tokens: list[int]) -> _Row:
        """A fresh row for ``rid`` (its old slot, or a free one) that is to commit ``tokens``: its
        slot zeroed, or holding what the draft's prefix cache serves of them
        (:meth:`PrefixCache.resume`)."""
        slot = row.slot if row is not None else self.free.pop()
        params = self.params[self.req_ids.index(rid)]
        row = _Row(rid, slot, getattr(params, "seed", None))
        cache = self.pool.cache([slot])  # zeroes the slot's state
        if self.prefix_cache is not None:
            self.prefix_cache.resume(self.model, cache, 0, tokens, role="draft")
            row.history = tokens[:cache.seqlens[0]]
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
        drafter.bind(req_ids, [getattr(self.requests.get(r), "sampling_params", None) for r in req_ids],
                     scheduler_output.num_spec_tokens_to_schedule)
        out = original(self, scheduler_output, *args, **kwargs)
        probs = drafter.take_probs()
        if probs is not None:
            self._draft_probs = probs.to(self.device)
            self._draft_prob_req_ids = req_ids
        return out

    propose_draft_token_ids._stree = True
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
