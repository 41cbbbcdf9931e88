"""Chain drafter: K tokens drawn one after another from the draft model (vanilla speculative decoding).

The chain is a static tree with one child per node, so it reuses :class:`StaticTreeDrafter`'s layer
loop; each token is a draw from ``q = target_probs(draft_logits, sampling)``, the argmax at greedy
sampling (q is then one-hot).
"""
from __future__ import annotations

from stree.draft.static import StaticTreeDrafter


class ChainDrafter(StaticTreeDrafter):
    """``k`` sampled tokens below the root (``1 + k`` nodes, mode "chain")."""

    def __init__(self, k: int):
        if int(k) < 1:
            raise ValueError(f"a chain drafter needs k >= 1 drafted tokens, got {k}")
        super().__init__(tuple(range(-1, int(k))), mode="chain", name=f"chain:{int(k)}")

    @property
    def k(self) -> int:
        return self.num_nodes - 1

    def __repr__(self) -> str:
        return f"ChainDrafter(k={self.k})"
