"""``suffix:N``: trees read from the request's own text and earlier outputs, with no draft model.

Text repeats what its context holds (names, idioms, whole lines of the prompt). SuffixDecoding
(Oliaro et al., arXiv 2411.04975) drafts from suffix tries of the request's prompt and output and
of earlier outputs (:mod:`stree.draft.suffix_index`): the context's last tokens are matched, and
the continuations that followed them are grown into a tree best-first by their frequency, as
large as the match earns. Such children are chosen, not drawn ("deterministic"): greedy
verification at T = 0, the target sampled at each node (``naive``) above.

:class:`ContextIndex` is the per-request state (one trie per row, updated with every accepted
token, never rescanned) that every suffix-reading drafter of one ``generate`` call shares: the
plain :class:`SuffixDrafter`, a merged tree (``stree.draft.merged``) and ``auto``'s candidates.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stree.draft.base import Drafter
from stree.draft.suffix_index import (Matcher, SpeculationConfig, Speculation, SuffixCache,
                                      SuffixTrie)
from stree.draft_types import Draft
from stree.inputs import vocab_size
from stree.sampling import SamplingConfig
from stree.tree import TokenTree

TRIE_DEPTH = 32  # longest substring counted; longer matches continue through lazy pointers


class _Row:
    """One request: its tokens, their trie, and where the context stands in it and in the cache."""

    def __init__(self, prompt: list[int], cache: SuffixCache | None, trie_depth: int):
        self.trie = SuffixTrie(trie_depth)
        self.sid = self.trie.new_sequence()
        self.context: list[int] = self.trie.seqs[self.sid]
        self.active: list[int] = [0]
        self.matcher = Matcher(cache.trie) if cache is not None else None
        self.push(prompt)

    def push(self, tokens: list[int]) -> None:
        if not tokens:
            return
        self.active = self.trie.append(self.sid, tokens, self.active)
        if self.matcher is not None:
            self.matcher.extend(tokens, self.context)

    def resume(self, prompt: list[int]) -> bool:
        """Continue this row with ``prompt`` if it extends the row's context (a conversation's
        next turn): its own trie takes only the new tokens, and the cache, which has taken
        outputs since, is matched again. Returns False (nothing changed) otherwise."""
        n = len(self.context)
        if len(prompt) < n or prompt[:n] != self.context:
            return False
        if len(prompt) > n:
            self.active = self.trie.append(self.sid, prompt[n:], self.active)
        if self.matcher is not None:
            self.matcher.rematch(self.context)
        return True

    def speculate(self, config: SpeculationConfig) -> Speculation:
        own = self.trie.best([(u, self.trie.depth[u]) for u in self.active[1:]], config)
        if self.matcher is None:
            return own
        shared = self.matcher.trie.best(self.matcher.candidates(), config)
        return shared if shared.score > own.score else own


# the rows the last request left, per suffix cache: a request whose prompt continues one (a
# conversation's next turn, which resends or holds everything before) extends it instead of
# indexing the whole conversation again (about 3 ms for 1.4k tokens of code)
_LAST_ROWS: "weakref.WeakKeyDictionary[SuffixCache, list[_Row]]" = weakref.WeakKeyDictionary()


class ContextIndex:
    """The rows' contexts (prompt, then every emitted token) and their suffix tries.

    The decoding loop's order: :meth:`start` with the prompts; every step :meth:`root` with the
    roots (the last emitted token of each row) and :meth:`speculate`; after verification
    :meth:`observe` with the accepted path; at the end :meth:`finish` with each row's output,
    which goes to the shared cache. Several drafters may read one step (``auto``'s candidates):
    the roots are appended once however many call :meth:`root`, and a step nobody rooted gets
    its root from the path; :meth:`observe` is called once a step, by whoever owns the index.
    :meth:`finish` leaves the rows with the cache, and the next :meth:`start` on that cache
    extends a row whose context its prompt continues (a conversation's next turn).
    """

    def __init__(self, cache: SuffixCache | None = None, trie_depth: int = TRIE_DEPTH):
        self.cache, self.trie_depth = cache, trie_depth
        self.rows: list[_Row] = []
        self._rooted = False  # this step's roots are appended
        self._specs: dict[SpeculationConfig, list[Speculation]] = {}

    def new_row(self, tokens: list[int]) -> _Row:
        """A row for one request's ``tokens`` (a serving engine keeps one per request)."""
        return _Row(tokens, self.cache, self.trie_depth)

    def use(self, rows: list[_Row]) -> None:
        """Draft the next step for ``rows`` (a serving engine's requests of one draft call, each
        already holding its root: the engine pushes every request's new tokens itself)."""
        self.rows, self._rooted, self._specs = list(rows), True, {}

    def bind(self, target) -> None:
        if self.cache is not None:
            self.cache.bind(vocab_size(target))

    def start(self, prompts: list[list[int]]) -> None:
        kept = _LAST_ROWS.pop(self.cache, []) if self.cache is not None else []
        self.rows = []
        for p in prompts:
            row = next((r for r in kept if r.trie.max_depth == self.trie_depth and r.resume(p)), None)
            if row is None:
                row = _Row(p, self.cache, self.trie_depth)
            else:
                kept.remove(row)
            self.rows.append(row)
        self._rooted, self._specs = False, {}

    def root(self, roots: list[int]) -> None:
        if not self._rooted:
            for row, tok in zip(self.rows, roots):
                row.push([tok])
            self._rooted = True

    def speculate(self, config: SpeculationConfig) -> list[Speculation]:
        """Each row's best tree under ``config`` for this step (computed once per config)."""
        if config not in self._specs:
            self._specs[config] = [row.speculate(config) for row in self.rows]
        return self._specs[config]

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        """Append each row's accepted drafted tokens (``path (b, k)``, root first, -1 padded;
        finished rows all -1)."""
        skip = 1 if self._rooted else 0
        for row, toks in zip(self.rows, tree.path_tokens(path).tolist()):
            if toks[0] >= 0:
                row.push([t for t in toks[skip:] if t >= 0])
        self._rooted, self._specs = False, {}

    def finish(self, outputs: list[list[int]]) -> None:
        if self.cache is not None:
            for out in outputs:
                self.cache.add(out)
            _LAST_ROWS[self.cache] = self.rows


# ------------------------------------------------------------------------------ packing
_TEMPLATES: "OrderedDict[tuple, TokenTree]" = OrderedDict()
_MAX_TEMPLATES = 256


def pack(rows: list[tuple[list[int], list[int]]], device) -> TokenTree:
    """A TokenTree from per-row ``(tokens, parents)`` lists (root first), rows padded to the
    longest: a padding node hangs from the root and repeats the row's first child (or its root),
    so no verifier accepts it where the real node would not be (first match wins). Tree
    structures recur (chains of each length, most of all), so their tables are built once and
    kept (the last 256)."""
    n = max(len(tokens) for tokens, _ in rows)
    tokens_out, parents_out = [], []
    for tokens, parents in rows:
        pad = n - len(tokens)
        fill = tokens[1] if len(tokens) > 1 else tokens[0]
        tokens_out.append(tokens + [fill] * pad)
        parents_out.append(parents + [0] * pad)
    key = (tuple(map(tuple, parents_out)), torch.device(device))
    tokens = torch.tensor(tokens_out, dtype=torch.long, device=device)
    template = _TEMPLATES.get(key)
    if template is None:
        template = TokenTree(tokens, torch.tensor(parents_out))
        _TEMPLATES[key] = template
        if len(_TEMPLATES) > _MAX_TEMPLATES:
            _TEMPLATES.popitem(last=False)
    else:
        _TEMPLATES.move_to_end(key)
    return template.with_tokens(tokens)


def as_rows(roots: list[int], specs: list[Speculation]) -> list[tuple[list[int], list[int]]]:
    """Per row ``(tokens, parents)`` of the tree rooted at ``roots[r]`` holding ``specs[r]``."""
    return [([root] + s.tokens, [-1] + [p + 1 for p in s.parents]) for root, s in zip(roots, specs)]


# ------------------------------------------------------------------------------ drafter
@dataclass(eq=False)
class SuffixDrafter(Drafter):
    """Trees of at most ``config.nodes`` drafted nodes from the context's suffix tries (and
    ``index.cache``'s earlier outputs), one per row, sized per step by the match; never runs a
    draft model."""

    config: SpeculationConfig = field(default_factory=SpeculationConfig)
    index: ContextIndex = field(default_factory=ContextIndex)
    name: str = "suffix"
    mode: str = field(init=False, default="deterministic")
    sizes: list[int] = field(init=False, default_factory=list)  # nodes per row, latest draft

    @property
    def num_nodes(self) -> int:
        return self.config.nodes + 1

    @property
    def depth(self) -> int:
        return 0  # draft-model levels

    @property
    def num_forwarded(self) -> int:
        return 0

    @property
    def max_leaves(self) -> int:
        return max(self.config.nodes, 1)

    @property
    def layered(self) -> bool:
        return False

    @property
    def compilable(self) -> bool:
        return True  # no draft model

    @property
    def reads_context(self) -> bool:
        return True

    def prepare(self, target, draft, sampling: SamplingConfig) -> None:
        self.index.bind(target)

    def start(self, prompts: list[list[int]]) -> None:
        self.index.start(prompts)

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        self.index.observe(tree, path)

    def finish(self, outputs: list[list[int]]) -> None:
        self.index.finish(outputs)

    def speculate(self, roots: list[int]) -> list[Speculation]:
        self.index.root(roots)
        return self.index.speculate(self.config)

    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> Draft:
        ids = roots.tolist()
        rows = as_rows(ids, self.speculate(ids))
        self.sizes = [len(tokens) for tokens, _ in rows]
        return Draft(pack(rows, roots.device), None, self.mode)
