"""``BASE+suffix:N``: a draft model's tree and a suffix tree in one tree, shared prefixes merged.

The draft model's tree (any drafter: ``caterpillar:2,2,2``, ``chain:4``, ``dyspec:16``, ...) keeps
its node indices, so the draft's own per-node state stays valid; every suffix-tree node whose
path is not already in it is appended after it (parents before children, so the packing stays
topological). The target verifies the union in one pass.

Children of one node may then be of two kinds: the draft's, drawn from its q at T > 0, and the
suffix tree's, chosen from the context. ``Draft.fixed`` / ``Draft.drawn`` mark them; MSS verifies
such a node by its rule for the mix (``stree.verify.mss.mixed_rule``: the draws first, then the
chosen children against the residual sample), greedy and naive verification need nothing more.
Padding of a batch is neither fixed nor drawn, so that rule never takes it.

With ``solo`` set (``"caterpillar:2,2,2+suffix:16:solo=3"``), a draft whose every row's suffix
tree scores at least ``solo`` (SuffixDecoding's score: the sum of its nodes' path probabilities,
the tokens it expects accepted) is the suffix trees alone, as hybrids of a suffix tree and a
draft model pick one per step by the suffix tree's confidence: the draft model's levels, most of
a merged step's drafting cost, are skipped where the context already predicts a long
continuation. The draft model then runs nothing (:meth:`MergedDrafter.ran` is false for every
node), so its state falls behind by the tokens accepted, which the loop runs as the next lead or
catch-up (:meth:`MergedDrafter.wants_draft_model` tells it beforehand).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from stree.draft.base import Drafter
from stree.draft.suffix import SuffixDrafter, as_rows, pack
from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree


def _merged_mode(mode: str | None) -> str | None:
    # a sampled chain with other children beside it is a tree of i.i.d. draws, one per node
    return "iid" if mode == "chain" else mode


def union(base: tuple[list[int], list[int]], extra: tuple[list[int], list[int]]):
    """The tree ``base`` (tokens, parents; root first) with every path of ``extra`` (same root)
    added: ``(tokens, parents, fixed)``, base nodes first with their indices, ``fixed[i]`` true
    on the nodes ``extra`` holds."""
    tokens, parents = list(base[0]), list(base[1])
    child = {}
    for i in range(len(tokens) - 1, 0, -1):  # the first of equal siblings wins (first match)
        child[parents[i], tokens[i]] = i
    fixed = [False] * len(tokens)
    where = [0] * len(extra[0])
    for j in range(1, len(extra[0])):
        key = (where[extra[1][j]], extra[0][j])
        node = child.get(key)
        if node is None:
            node = len(tokens)
            tokens.append(key[1])
            parents.append(key[0])
            fixed.append(False)
            child[key] = node
        fixed[node] = True
        where[j] = node
    return tokens, parents, fixed


def all_chosen(draft: Draft, mode: str) -> Draft:
    """A chosen-only draft (a suffix tree's) labelled with the drawn ``mode`` of the drafts it
    alternates with (``auto`` at T > 0): every node below the root fixed, none drawn, no q, so
    MSS verifies it as naive sampling does."""
    fixed = torch.ones_like(draft.tree.tokens, dtype=torch.bool)
    fixed[:, 0] = False
    return Draft(draft.tree, None, mode, fixed=fixed, drawn=torch.zeros_like(fixed))


@dataclass(eq=False)
class MergedDrafter(Drafter):
    """The union of ``base``'s tree (a draft model's) and ``suffix``'s tree, every step."""

    base: Drafter
    suffix: SuffixDrafter
    name: str = ""
    solo: float | None = None  # a draft whose suffix trees all score this much skips the draft model
    sizes: list[int] = field(init=False, default_factory=list)  # nodes per row, latest draft
    _size: int = field(init=False, default=0)        # nodes of the base tree in the latest draft
    _base_tree: TokenTree | None = field(init=False, default=None, repr=False)
    _model_ran: bool = field(init=False, default=True)  # whether the latest draft ran the draft model

    def __post_init__(self):
        self.name = self.name or f"{self.base.name}+{self.suffix.name}"
        if self.solo is not None and not self.solo > 0:
            raise ValueError(f"solo must be a positive score (expected accepted tokens), got {self.solo}")

    # ------------------------------------------------------------------------------ shape
    @property
    def mode(self) -> str | None:
        return _merged_mode(self.base.mode)

    @property
    def num_nodes(self) -> int:
        return self.base.num_nodes + self.suffix.config.nodes

    @property
    def depth(self) -> int:
        return self.base.depth

    @property
    def num_forwarded(self) -> int:
        return self.base.num_forwarded

    @property
    def draft_runs(self) -> int:
        return self.base.draft_runs if self._model_ran else 0

    def ran(self, node: int) -> bool:
        return node < self._size and self.base.ran(node)

    @property
    def max_leaves(self) -> int:
        return self.base.max_leaves + self.suffix.max_leaves

    @property
    def layered(self) -> bool:
        return False

    @property
    def compilable(self) -> bool:
        return self.base.compilable

    @property
    def reads_context(self) -> bool:
        return True

    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        return tuple(dict.fromkeys(_merged_mode(m) for m in self.base.modes(sampling)))

    def with_mode(self, mode: str) -> "MergedDrafter":
        for sampling in (SamplingConfig(1.0), SamplingConfig()):
            for m in self.base.modes(sampling):
                if _merged_mode(m) == mode:
                    return replace(self, base=self.base.with_mode(m), name=self.name)
        raise ValueError(f"{self.name} drafts {self.modes(SamplingConfig(1.0))} trees, not {mode!r}")

    # ----------------------------------------------------------------------------- hooks
    def prepare(self, target, draft, sampling: SamplingConfig) -> None:
        self.base.prepare(target, draft, sampling)
        self.suffix.prepare(target, draft, sampling)

    def start(self, prompts: list[list[int]]) -> None:
        self.suffix.start(prompts)

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        if self._model_ran:  # a solo draft teaches the draft model's drafter nothing
            self.base.observe(*self.base_view(path))
        self.suffix.observe(tree, path)

    def base_view(self, path: Tensor) -> tuple[TokenTree, Tensor]:
        """The draft model's own tree of the latest draft and the accepted ``path (b, k)`` cut
        where it leaves that tree: what the base drafter (and ``auto``'s profile of it) learns
        from."""
        inside = (path >= self._size).cumsum(1) == 0
        return self._base_tree, path.masked_fill(~inside, -1)[:, :self._base_tree.max_depth + 1]

    def finish(self, outputs: list[list[int]]) -> None:
        self.suffix.finish(outputs)

    # ----------------------------------------------------------------------------- draft
    def takes_lead(self, model, sampling: SamplingConfig) -> bool:
        return self.base.takes_lead(model, sampling)

    def wants_draft_model(self, roots: Tensor) -> bool:
        return not self._solo(roots.tolist())

    def _solo(self, ids: list[int]) -> bool:
        """Whether the draft of roots ``ids`` is the suffix trees alone (every row scores ``solo``;
        the step's speculation is computed once, so this and :meth:`draft` agree)."""
        return self.solo is not None and all(s.score >= self.solo for s in self.suffix.speculate(ids))

    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None, lead: Tensor | None = None) -> Draft:
        ids = roots.tolist()
        if lead is None and self._solo(ids):  # a lead is the caller's word that the model runs
            d = self.suffix.draft(None, None, roots, sampling)
            self.sizes, self._size, self._model_ran = list(self.suffix.sizes), 0, False
            mode = _merged_mode(self.base.modes(sampling)[0])  # the mode of the drafts it alternates with
            return all_chosen(d, mode) if mode in ("iid", "without_replacement") else d
        self._model_ran = True
        args = (model, cache, roots, sampling, generator)
        d = self.base.draft(*args) if lead is None else self.base.draft(*args, lead=lead)
        extra = as_rows(ids, self.suffix.speculate(ids))
        base = zip(d.tree.tokens.tolist(), d.tree.parents.tolist())
        rows = [union(b, e) for b, e in zip(base, extra)]
        tree = pack([(t, p) for t, p, _ in rows], roots.device)
        self.sizes = [len(t) for t, _, _ in rows]
        self._size, self._base_tree = d.tree.num_nodes, d.tree
        b, n = tree.tokens.shape
        q = d.q
        if q is not None and q.shape[1] < n:
            q = torch.cat([q, q.new_zeros(b, n - q.shape[1], q.shape[2])], 1)
        if d.mode not in ("iid", "without_replacement", "chain"):
            return Draft(tree, q, d.mode)
        fixed = torch.tensor([f + [False] * (n - len(f)) for _, _, f in rows], device=roots.device)
        drawn = torch.zeros(b, n, dtype=torch.bool, device=roots.device)
        drawn[:, 1:self._size] = True
        return Draft(tree, q, _merged_mode(d.mode), fixed=fixed, drawn=drawn)
