"""``stree.patch(model)``: give a mamba_ssm ``MambaLMHeadModel`` (Mamba2 and MHA layers) or a
``stree.hybrid`` MambaInLlama model the tree-decoding API, in place, without touching its own
``forward`` / ``generate``.

The model's class is swapped for a subclass that mixes in :class:`TreeDecodingMixin`, so the only
change is three new methods; the model's own code paths are untouched.
"""
from __future__ import annotations

import functools
import numbers

import torch

from stree.cache import (AttentionActivations, LevelPending, NodeStates, PendingTree, StatePool,
                         TreeCache, grown_capacity)
from stree.inputs import token_ids
from stree.layers import attention, recurrent
from stree.steps import EAGER, Steps
from stree.tree import TokenTree
from stree.walk import mixers, walk


class TreeDecodingMixin:
    """Methods added by :func:`stree.patch`. See ``docs/ARCHITECTURE.md`` for the contract."""

    def allocate_tree_cache(self, batch_size: int, max_seqlen: int, dtype=None) -> TreeCache:
        """Zero state for ``batch_size`` sequences of up to ``max_seqlen`` tokens (prompt,
        generated tokens and one tree of scratch for attention layers). Attention K/V are
        allocated for what the rows hold and grow on demand (:class:`StatePool`), so a large
        ``max_seqlen`` costs nothing up front."""
        pool = self.allocate_state_pool(batch_size, max_seqlen, dtype)
        return TreeCache(pool, batch_size)  # row r = slot r

    def allocate_state_pool(self, num_slots: int, max_seqlen: int, dtype=None) -> StatePool:
        """Zero state for ``num_slots`` sequences of up to ``max_seqlen`` tokens, per layer;
        ``pool.cache(slots)`` makes a :class:`TreeCache` whose row r lives in slot ``slots[r]``
        (see :class:`StatePool`)."""
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in (num_slots, max_seqlen)):
            raise TypeError(f"num_slots / batch_size and max_seqlen must be ints, got {num_slots!r}, "
                            f"{max_seqlen!r}")
        if num_slots < 1 or max_seqlen < 1:
            raise ValueError(f"the number of sequences (batch_size / num_slots) and max_seqlen must be "
                             f"positive, got {num_slots}, {max_seqlen}")
        capacity = grown_capacity(1, max_seqlen)
        layers = {}
        for idx, mixer in mixers(self):
            kind = recurrent.kind(mixer)
            if kind is not None:
                layers[idx] = kind.allocate(mixer, num_slots, dtype)
            else:
                a = attention.view(mixer)
                w = _first_weight(mixer)
                layers[idx] = attention.allocate(a, num_slots, capacity, dtype or w.dtype, w.device)
        return StatePool(layers, max_seqlen, capacity)

    @torch.inference_mode()
    def prefill(self, input_ids, cache: TreeCache, logits: bool = True) -> torch.Tensor | None:
        """Run prompts through the model from the committed state and commit them.

        Args:
            input_ids: ``(b, l)`` tensor, or a list of ``b`` 1-D tensors of different lengths.
            logits: False to only commit (a draft catching up): the head is not run (for the
                shipped draft's 150-token prompt the head, its fp32 copy and the list's padding
                were half of a 7.8 ms prefill).
        Returns:
            logits ``(b, l, vocab)`` (for a list: ``(b, max_l, vocab)``, right-padded with NaN);
            None with ``logits=False``.
        """
        if cache.pending is not None:
            cache.pending = None  # an uncommitted tree is abandoned
        if isinstance(input_ids, (list, tuple)):
            rows = [token_ids(r, cache.lengths.device).view(-1) for r in input_ids]
            if len(rows) != cache.batch_size:
                raise ValueError(f"{len(rows)} prompts for a cache of batch size {cache.batch_size}")
            cache.reserve([len(r) for r in rows])  # grow once for the longest row, before the views
            out = None
            for b, r in enumerate(rows):
                row = cache.row(b)
                row_logits = self.prefill(r[None], row, logits=logits)
                cache.seqlens[b] = row.seqlens[0]
                if logits:
                    if out is None:  # one right-padded output, each row copied in once
                        out = row_logits.new_full((len(rows), max(map(len, rows)), row_logits.shape[-1]),
                                                  float("nan"))
                    out[b, :len(r)] = row_logits[0]
            return out
        input_ids = _check_ids(self, input_ids, cache)
        if len(set(cache.seqlens)) != 1:
            raise ValueError("prefill of a (b, l) tensor needs rows with equal committed lengths; "
                             "pass a list of 1-D prompts to prefill rows separately")
        cache.reserve(input_ids.shape[1])

        states = cache.states()

        def run(idx, mixer, h):
            state, kind = states[idx], recurrent.kind(mixer)
            if kind is not None:
                return kind.prefill(mixer, h, state)
            return attention.prefill(attention.view(mixer), h, state, cache.seqlens[0])

        out = walk(self, input_ids, run, head=logits)
        cache.store(states)
        cache.advance([input_ids.shape[1]] * cache.batch_size)
        return out

    @torch.inference_mode()
    def tree_forward(self, tree: TokenTree, cache: TreeCache, impl: str = "auto", pad_nodes: int = 1) -> torch.Tensor:
        """Logits ``(b, n, vocab)`` for every node of ``tree`` from the committed state.

        Node i's logits are the model's next-token logits after the committed sequence followed by
        the root-to-i path. Committed state is not changed; ``cache.commit(path)`` advances it.
        ``pad_nodes``: run a tree of more than one node padded to a multiple of this many nodes
        (leaves under the root, their logits dropped), so that compiled steps, one graph per
        tree size, serve trees of any size with a few graphs (where the cache has room).
        """
        if not isinstance(tree, TokenTree):
            raise TypeError(f"tree must be a stree.TokenTree, got {type(tree).__name__}")
        if tree.batch_size != cache.batch_size:
            raise ValueError(f"tree batch {tree.batch_size} != cache batch {cache.batch_size}")
        vocab = _vocab_size(self)
        if tree.max_token is not None and tree.max_token >= vocab:  # host-side: no device sync
            raise ValueError(f"tree token {tree.max_token} out of range for vocab size {vocab}")
        tree = tree if tree.device == cache.lengths.device else tree.to(cache.lengths.device)
        run = _padded(tree, pad_nodes, cache)
        cache.reserve(run.num_nodes)
        steps = _steps(self)
        span = cache.capacity if steps.static else max(cache.seqlens) + run.num_nodes
        if tree.num_nodes == 1 and impl == "auto":
            # a root alone (a step with no drafts): the recurrence keeps the state after it, which
            # the commit copies in (no tree tables, no replay, no per-node state slots)
            tables = _tables(self, tree, None, cache.lengths, span)
            logits, acts = steps.root(self, tree.tokens, cache.states(), tables)
        else:
            tables = _tables(self, run, run, cache.lengths, span)
            logits, acts = steps.tree(self, run.tokens, cache.states(), tables, impl)
        # the padding's activations stay (no accepted path reaches them); its logits go
        cache.pending = PendingTree(tree, acts)
        return logits[:, :tree.num_nodes]

    @torch.inference_mode()
    def level_forward(self, tree: TokenTree, cache: TreeCache, nodes: torch.Tensor, *,
                      first: bool = False, capacity: int | None = None,
                      lead: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(b, w, vocab)`` of the tree nodes ``nodes (b, w)``, each run once from its
        parent's materialised state: how a drafter forwards each new level of its tree.

        The parents of ``nodes`` must have been forwarded by earlier ``level_forward`` calls on
        (a prefix of) the same tree, the root's parent being the committed state. ``first``
        starts a new tree (its nodes are the root's level), with room for ``capacity`` nodes
        (default: this tree's size). Per Mamba2 layer the state after every forwarded node is kept, so
        ``cache.commit(path)`` sets the committed state to the path's last node's state with no
        replay; attention K/V go to the scratch slots as in ``tree_forward``. Committed state is
        unchanged until then. ``lead``: with ``first`` and the roots alone as ``nodes``, tokens run
        before them in their pass, as ``draft_levels`` runs its lead.
        """
        b, w = nodes.shape
        if b != cache.batch_size or tree.batch_size != b:
            raise ValueError(f"nodes {tuple(nodes.shape)} / tree batch {tree.batch_size} do not "
                             f"match the cache batch {cache.batch_size}")
        lead, lead_counts = _lead(self, lead, b, nodes.device)
        if lead is not None and not (first and w == 1):
            raise ValueError("a lead runs only before the roots: level_forward(first=True) of one node per row")
        pending = cache.pending
        if first or not isinstance(pending, LevelPending):
            pending = _start_levels(self, cache, capacity or tree.num_nodes)
            pending.lead = lead_counts
        cache.reserve(tree.num_nodes if lead is None else [tree.num_nodes + c for c in lead_counts])
        steps = _steps(self)
        src, dst, tables = _level_inputs(self, steps, pending, tree, cache, nodes)
        logits = steps.level(self, tree.tokens.gather(1, nodes), cache.states(mamba=False),
                             pending.layers, src, dst, tables, lead)
        _forwarded(cache, pending, tree)
        return logits

    @torch.inference_mode()
    def draft_levels(self, tokens: torch.Tensor, cache: TreeCache, levels: list, pick,
                     lead: torch.Tensor | None = None, extra: tuple | None = None) -> torch.Tensor:
        """A tree drafted level by level in one step: what ``level_forward`` over each level in
        turn does, with the drafter's choice of children between the levels, as one call (one
        compiled graph under compiled steps: no host work between the levels).

        Args:
            tokens: ``(b, n)`` int64, the whole tree's tokens; column 0 (the roots) is read, the
                others are filled in by ``pick``.
            levels: per level ``(tree, start, end)``: the tree drafted so far (a prefix of the
                whole tree ending with this level; its structure is read, not its tokens) and
                the nodes ``start .. end - 1`` the level runs.
            pick: ``pick(d, logits (b, end - start, vocab), tokens, extra)`` writes the children
                of level ``d``'s nodes into ``tokens`` in place (a function of tensors only, so
                that a compiled step traces it).
            lead: ``(b, c)`` int64 host tensor or None: per row the tokens between the committed
                state and the root that the model has not run (a node of its last tree it never
                forwarded, tokens of a merged tree's other part), in its last columns, -1 before
                them. They run in the roots' pass, one read of the weights for both
                (attention-free models only, see :attr:`runs_lead`), and are committed with the
                next ``cache.commit`` of a non-empty path, before it (an empty path commits
                neither).
            extra: passed to ``pick``: None, or tensors of the call the choice reads or writes in
                place (a sampled draft's random numbers, its temperature, the buffer of its
                distributions).
        Returns:
            the drafted tokens ``(b, n)`` (a new tensor). The cache is left as after
            ``level_forward`` over the same levels: ``cache.commit(path)`` reads it.
        """
        b, n = tokens.shape
        if b != cache.batch_size:
            raise ValueError(f"tokens {tuple(tokens.shape)} do not match the cache batch {cache.batch_size}")
        lead, lead_counts = _lead(self, lead, b, tokens.device)
        pending = _start_levels(self, cache, n)
        cache.reserve(n if lead is None else [n + c for c in lead_counts])
        steps = _steps(self)
        inputs = [_level_inputs(self, steps, pending, tree, cache,
                                torch.arange(start, end, device=tokens.device).expand(b, -1))
                  for tree, start, end in levels]
        spans = tuple((start, end) for _, start, end in levels)
        out = steps.levels(self, tokens, cache.states(mamba=False), pending.layers, inputs, spans, pick, lead, extra)
        _forwarded(cache, pending, levels[-1][0])
        pending.lead = lead_counts
        return out

    @functools.cached_property
    def runs_lead(self) -> bool:
        """Whether ``draft_levels`` takes a ``lead``: a model without attention layers, whose
        state does not depend on the positions the lead would shift (read once: the loop asks
        every step, and a walk over the layers costs tens of microseconds)."""
        return all(recurrent.kind(mixer) is not None for _, mixer in mixers(self))


def _lead(model, lead, b: int, device) -> tuple[torch.Tensor | None, list[int] | None]:
    """``draft_levels``' ``lead`` checked, on ``device``, and each row's token count (host);
    ``(None, None)`` when no row has one."""
    if lead is None:
        return None, None
    lead = torch.as_tensor(lead, dtype=torch.long)
    if lead.dim() != 2 or lead.shape[0] != b:
        raise ValueError(f"lead must be (batch={b}, c) token ids, got {tuple(lead.shape)}")
    present = lead >= 0
    counts = present.sum(1)
    if not bool(counts.any()):
        return None, None
    if not model.runs_lead:
        raise ValueError("a lead (tokens run before the roots) needs a draft model without attention layers")
    if not torch.equal(present, torch.arange(lead.shape[1]) >= lead.shape[1] - counts[:, None]):
        raise ValueError("a lead row's tokens must be its last columns (-1 only before them)")
    if int(lead.max()) >= _vocab_size(model):
        raise ValueError(f"lead token ids must lie in [0, {_vocab_size(model)})")
    return lead.to(device), counts.tolist()


def _start_levels(model, cache: TreeCache, capacity: int) -> LevelPending:
    """A new tree drafted level by level, with room for ``capacity`` nodes per row: slot 0 holds
    the committed state, slot ``node + 1`` each node's."""
    slots = capacity + 1
    return LevelPending(None, _level_states(model, cache, slots), slots)


def _level_inputs(model, steps: Steps, pending: LevelPending, tree: TokenTree, cache: TreeCache, nodes):
    """What a level step of ``nodes (b, w)`` of ``tree`` reads besides the tokens: the flat
    NodeStates indices of each node's parent's slot (the root's: slot 0, the committed state)
    and of its own (node + 1), row r's slots starting at r * slots; and its tables."""
    span = cache.capacity if steps.static else max(cache.seqlens) + tree.num_nodes
    tables = _tables(model, tree, None, cache.lengths, span, nodes=nodes)
    base = torch.arange(nodes.shape[0], device=nodes.device)[:, None] * pending.slots
    src = (tree.parents.gather(1, nodes) + 1 + base).flatten()
    return src, (nodes + 1 + base).flatten(), tables


def _forwarded(cache: TreeCache, pending: LevelPending, tree: TokenTree) -> None:
    """Record that ``tree``'s levels down to its deepest have run (what ``commit`` checks)."""
    pending.tree = tree
    pending.forwarded_depth = tree.max_depth
    cache.pending = pending


def _padded(tree: TokenTree, pad_nodes: int, cache: TreeCache) -> TokenTree:
    """``tree`` with leaves under its root (the root's token) up to a multiple of ``pad_nodes``
    nodes; ``tree`` itself for a root alone, when it already is one, or when the padding would
    pass the cache's ``max_seqlen``."""
    n, b = tree.num_nodes, tree.batch_size
    size = -(-n // pad_nodes) * pad_nodes
    if n == 1 or size == n or max(cache.seqlens) + size > cache.max_seqlen:
        return tree
    tokens = torch.cat([tree.tokens, tree.tokens[:, :1].expand(b, size - n)], 1)
    parents = torch.cat([tree.parents.cpu(), torch.zeros(b, size - n, dtype=torch.long)], 1)
    return TokenTree(tokens, parents, max_nodes=size)


def _steps(model) -> Steps:
    return getattr(model, "_stree_steps", None) or EAGER


def _tables(model, tree: TokenTree, recurrent_tree: TokenTree | None, lengths, span: int,
            nodes=None) -> dict:
    """Everything the layers of one step read besides their state, built before they run: per
    recurrent layer its kind (:func:`stree.layers.recurrent.kind`), constants and ``recurrent_tree``'s
    conv/scan tables (none for a draft level, whose nodes run one by one by the recurrence); for
    attention layers what
    :func:`stree.steps.attention_tables` builds inside the step from ``tree``'s ancestor mask
    and depth."""
    kinds, consts, per_layer = {}, {}, {}
    for idx, mixer in mixers(model):
        kind = recurrent.kind(mixer)
        if kind is not None:
            kinds[idx], consts[idx] = kind, kind.constants(mixer)
            if recurrent_tree is not None:
                per_layer[idx] = recurrent_tree.conv_scan_tables(kind.conv_width(mixer))
    tree_in = dict(ancestors=tree.mask, depth=tree.depth, lengths=lengths, span=span, nodes=nodes)
    return dict(kinds=kinds, consts=consts, recurrent=per_layer, tree=tree_in)


def _with_slots(t: torch.Tensor, slots: int) -> torch.Tensor:
    """``(b, ...)`` -> ``(b * slots, ...)`` holding row r at flat index ``r * slots`` (slot 0)."""
    out = t.new_empty((t.shape[0] * slots, *t.shape[1:]))
    out[::slots] = t
    return out


def _level_states(model, cache: TreeCache, slots: int) -> dict:
    """Pending layers of a tree drafted level by level: per Mamba2 layer :class:`NodeStates` of
    ``slots`` states per row, slot 0 the committed state (the others are written by the levels
    before anything reads them), per attention layer its K/V scratch marker."""
    states, committed = {}, cache.states()
    for idx, mixer in mixers(model):
        if recurrent.kind(mixer) is None:
            states[idx] = AttentionActivations()
            continue
        state = committed[idx]
        states[idx] = NodeStates(*(_with_slots(t, slots) for t in (state.conv_state,
                                                                   state.ssm_state)))
    return states


def patch(model):
    """Add ``allocate_tree_cache``, ``prefill`` and ``tree_forward`` to ``model`` (in place).

    Idempotent; returns the model. Raises ``TypeError`` for unsupported models or layer types.
    """
    if isinstance(model, TreeDecodingMixin):
        return model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"stree.patch takes a loaded model (a torch.nn.Module), got {type(model).__name__}; "
                        "load a checkpoint directory first, e.g. with stree.hf.load(path)")
    for idx, mixer in mixers(model):  # raises for unsupported models
        if not (recurrent.kind(mixer) is not None or attention.view(mixer) is not None):
            raise TypeError(
                f"layer {idx}: {type(mixer).__name__} is not supported by stree "
                "(supported: mamba_ssm Mamba2, mamba_ssm MHA, stree.hybrid Mamba2/attention)")
    cls = model.__class__
    model.__class__ = type(f"STree{cls.__name__}", (TreeDecodingMixin, cls), {})
    return model


def _first_weight(module):
    return next(module.parameters())


def _vocab_size(model) -> int:
    return model.lm_head.weight.shape[0]


def _check_ids(model, input_ids, cache) -> torch.Tensor:
    ids = token_ids(input_ids, cache.lengths.device)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != cache.batch_size:
        raise ValueError(f"input_ids must be (batch={cache.batch_size}, l), got {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt: prefill needs at least one token")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= _vocab_size(model)):
        raise ValueError(f"token ids must lie in [0, {_vocab_size(model)})")
    return ids
