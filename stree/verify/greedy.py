"""Greedy tree verification: follow the target's argmax down the tree (longest match + one token).

Output equals target greedy decoding exactly for any tree, so it works with every draft mode, but
only for greedy sampling (temperature 0 or top_k 1).
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.verify.base import Verdict, validate


def greedy_verdict(draft: Draft, target_logits: Tensor) -> Verdict:
    """Follow the target's argmax down the tree, taking the first matching child at every node
    (the longest match, plus the argmax after it): what a root-to-leaf walk with a first-match
    rule gives, computed for all nodes at once (a fixed handful of ops, no per-depth loop).

    ``target_logits``: ``(b, n, v)``. Shapes as in :class:`Verdict`.
    """
    tree = draft.tree
    b = target_logits.shape[0]
    best = target_logits.argmax(-1)                                        # (b, n)
    parents = tree.parents
    # node i > 0 follows the argmax after its parent
    match = tree.tokens == best.gather(1, parents.clamp_min(0))
    # ... and is taken only if no earlier sibling matched too (first match in draft order)
    first = match & ~(tree.earlier_siblings() & match[:, None, :]).any(-1)
    first[:, 0] = True  # the root
    # accepted nodes: every ancestor-or-self is a first match; they form one root path
    on_path = ~(tree.mask & ~first[:, None, :]).any(-1)                     # (b, n)
    end = (on_path * (tree.depth + 1)).argmax(1, keepdim=True)             # deepest accepted node
    path = tree.paths.gather(1, end[:, :, None].expand(b, 1, tree.paths.shape[-1]))[:, 0]
    return Verdict(path=path, num_accepted=tree.depth.gather(1, end)[:, 0],
                   next_token=best.gather(1, end)[:, 0])


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
        return greedy_verdict(draft, target_logits)
