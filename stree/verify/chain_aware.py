"""``mss+asps``: MSS for sampled trees, ASpS for sampled chains, chosen per draft by its mode.

A drafter that picks its shape step by step (``drafter="auto"``) sometimes drafts a fixed-length
sampled chain (``chain:K``, draft mode ``"chain"``) and sometimes a tree. ``mss`` verifies both
losslessly, but on a chain ASpS accepts at least as much (its Thm 5.6; +5-8% tau on the shipped
pair at T = 1). This verifier runs ASpS on drafts of mode ``"chain"`` and MSS on every other
draft. Each step is then verified by a rule that is lossless for that step's draft, and which
rule runs is decided by the drafter before it drew any token of the step (from earlier steps'
verdicts only), so the sequence stays lossless.

The dispatch reads the draft mode, not the tree's shape: a dynamic tree that happens to come out
as a chain (its length then depends on the drawn tokens) keeps MSS, whose without-replacement rule
covers it; ASpS is proven for chains of a length fixed before drawing.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.verify.asps import ASpSVerifier
from stree.verify.base import Verdict
from stree.verify.mss import MSSVerifier


class ChainAwareVerifier:
    name = "mss+asps"

    def __init__(self):
        self.tree, self.chain = MSSVerifier(), ASpSVerifier()

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        (self.chain if draft_mode == "chain" else self.tree).check(draft_mode, sampling)

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v); draft.q (b, n, v) required unless sampling is greedy."""
        rule = self.chain if draft.mode == "chain" else self.tree
        return rule.verify(draft, target_logits, sampling, generator)
