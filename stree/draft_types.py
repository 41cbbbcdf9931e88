"""The drafted tree handed from a drafter to a verifier: ``Draft`` and its draft modes.

Drafters build it and verifiers read it; it lives apart from both so that neither package imports
the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from stree.tree import TokenTree

DRAFT_MODES = ("deterministic", "iid", "without_replacement", "chain")


@dataclass
class Draft:
    """A drafted token tree and how its children were chosen.

    tree: ``stree.tree.TokenTree`` with tokens (b, n); node 0 is the root (last committed token).
    q: (b, n, v) or None. ``q[b, i]`` is the exact distribution node i's children were drawn from
        (after the drafter's own temperature / top-k / top-p; verifiers never re-transform it).
        Rows of leaves are unused. Needed by ``mss`` and ``sps`` at temperature > 0.
    mode: how children were chosen, one of ``DRAFT_MODES``:
        "deterministic" (top-k / static / beam: chosen, not sampled), "iid" (i.i.d. with
        replacement from q), "without_replacement" (sequentially, without replacement, from q
        renormalised; draft order = sampling order), "chain" (one sampled path; iid with one child).
    """

    tree: "TokenTree"
    q: Tensor | None
    mode: str

    def __post_init__(self):
        if self.mode not in DRAFT_MODES:
            raise ValueError(f"unknown draft mode {self.mode!r}; expected one of {DRAFT_MODES}")
