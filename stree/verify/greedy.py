"""Greedy tree verification: follow the target's argmax down the tree (longest match + one token).

Output equals target greedy decoding exactly for any tree, so it works with every draft mode, but
only for greedy sampling (temperature 0 or top_k 1).
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.verify.base import NodeStep, Verdict, first_match, validate, walk


def greedy_rule(step: NodeStep) -> tuple[Tensor, Tensor]:
    """Accept the first child whose token is the target argmax; else emit the argmax."""
    y = step.logits.argmax(-1)
    return first_match(step, y), y


class GreedyVerifier:
    name = "greedy"

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        if not sampling.is_greedy:
            raise ValueError(
                f"the greedy verifier reproduces greedy decoding only; with {sampling} use "
                "'naive', 'mss' or 'sps' (see stree.verify.default_verifier)")

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v). Consumes no randomness."""
        self.check(draft.mode, sampling)
        validate(draft, target_logits, need_q=False)
        return walk(draft, target_logits, greedy_rule)
