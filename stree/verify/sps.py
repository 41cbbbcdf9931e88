"""Chain speculative sampling (Leviathan et al. / Chen et al.).

For each drafted x in order: accept with prob min(1, p(x) / q(x)); on rejection emit a sample of
norm((p - q)+) and stop; if all are accepted emit a bonus sample of p at the last node. This is MSS
with one child per node, so it shares ``mss_rule``; it only adds the chain requirement.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.verify.base import Verdict, validate, walk
from stree.verify.greedy import greedy_verdict
from stree.verify.mss import mss_rule


def _is_chain(tree) -> bool:
    # parents[i] < i and at most one child per node make a chain; max_children is host-side
    return tree.max_children <= 1


class SpSVerifier:
    name = "sps"

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        if draft_mode != "chain" and not sampling.is_greedy:
            raise ValueError(
                f"the {self.name!r} verifier needs a sampled chain (draft mode 'chain'), got "
                f"{draft_mode!r} at {sampling}; use 'mss' for sampled trees or 'naive' for "
                "deterministic ones")

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v); the tree must be a chain (node i's parent is i - 1)."""
        self.check(draft.mode, sampling)
        validate(draft, target_logits, need_q=not sampling.is_greedy)
        if not _is_chain(draft.tree):
            raise ValueError(f"the {self.name!r} verifier needs a chain (every node at most one "
                             "child); use 'mss' or 'naive' for trees")
        if sampling.is_greedy:  # p is one-hot: every rule reduces to greedy matching
            return greedy_verdict(draft, target_logits)
        return self.sampled(draft, target_logits, sampling, generator)

    def sampled(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Verdict:
        """The verdict at T > 0 on a checked chain."""
        return walk(draft, target_logits, lambda step: mss_rule(step, sampling, False, generator))
