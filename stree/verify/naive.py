"""Naive (target-sample matching) tree verification, as in STree's top-k ablation / SpecExec.

At each node draw y from the target p and accept the child carrying y, if any; otherwise emit y and
stop. Every emitted token is a genuine target sample, so this is lossless for any tree and any
draft mode (no draft distribution needed), but acceptance falls quickly as temperature rises.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs
from stree.verify.base import NodeStep, Verdict, first_match, validate, walk
from stree.verify.greedy import greedy_verdict


class NaiveVerifier:
    name = "naive"

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        return None  # lossless for every draft mode and sampling config

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v). Duplicate sibling tokens: the first in draft order is taken."""
        self.check(draft.mode, sampling)
        validate(draft, target_logits, need_q=False)
        if sampling.is_greedy:
            return greedy_verdict(draft, target_logits)

        def rule(step: NodeStep) -> tuple[Tensor, Tensor]:
            y = sample_from(target_probs(step.logits, sampling), generator)
            return first_match(step, y), y

        return walk(draft, target_logits, rule)
