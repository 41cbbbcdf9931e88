"""What the proposer hands the engine's tree path for one request: :class:`DraftedTree` (the type
both :mod:`stree.vllm.proposer` and :mod:`stree.vllm.step` use, below both)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree


@dataclass
class DraftedTree:
    """What the proposer drafted for one request: the tree (root first), the distributions its
    children were drawn from (``q``, None when chosen deterministically or greedy), the draft
    mode, the verifier and the sampling settings it is verified under, and for a merged tree the
    marks of its chosen and drawn nodes (``Draft.fixed`` / ``Draft.drawn``)."""

    tree: TokenTree
    q: torch.Tensor | None
    mode: str
    verifier: object
    sampling: SamplingConfig
    fixed: torch.Tensor | None = None
    drawn: torch.Tensor | None = None

    @classmethod
    def of(cls, draft: Draft, r: int, verifier, sampling: SamplingConfig) -> "DraftedTree":
        """Row ``r`` of a batched ``draft``."""
        def row(t):
            return None if t is None else t[r:r + 1]

        q = row(draft.q)
        return cls(draft.tree.row(r), None if q is None else q.float(), draft.mode, verifier, sampling,
                   row(draft.fixed), row(draft.drawn))

    @property
    def draft(self) -> Draft:
        return Draft(self.tree, self.q, self.mode, self.fixed, self.drawn)

    def prefix(self, m: int) -> "DraftedTree":
        """The first ``m`` nodes (vLLM may schedule fewer drafts than it was given, and a suffix
        or merged tree of a batch is padded past its own nodes); a prefix of a topological order
        is a subtree."""
        if m == self.tree.num_nodes:
            return self
        tree = TokenTree(self.tree.tokens[:, :m], self.tree.parents[:, :m])

        def cut(t):
            return None if t is None else t[:, :m]

        return DraftedTree(tree, cut(self.q), self.mode, self.verifier, self.sampling, cut(self.fixed),
                           cut(self.drawn))
