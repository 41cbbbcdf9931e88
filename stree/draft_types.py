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
        "deterministic" (top-k / static / beam / suffix: chosen, not sampled), "iid" (i.i.d. with
        replacement from q), "without_replacement" (sequentially, without replacement, from q
        renormalised; draft order = sampling order), "chain" (one sampled path; iid with one child).
    fixed, drawn: (b, n) bool or None, a drawn tree (mode "iid" / "without_replacement") that
        chosen children were merged into (a draft model's tree and a suffix tree): ``fixed``
        marks the chosen nodes, ``drawn`` the draws of ``mode`` from their parent's q (draw
        order = index order among drawn siblings). A node can be both: a draw that a chosen
        continuation coincides with. None: every node below the root is what ``mode`` says.
        A merged draft without ``q`` has no drawn node (a chosen-only tree in a drawn mode).
    """

    tree: "TokenTree"
    q: Tensor | None
    mode: str
    fixed: Tensor | None = None
    drawn: Tensor | None = None

    def __post_init__(self):
        if self.mode not in DRAFT_MODES:
            raise ValueError(f"unknown draft mode {self.mode!r}; expected one of {DRAFT_MODES}")
        if (self.fixed is None) != (self.drawn is None):
            raise ValueError("a merged draft needs both its fixed and its drawn masks")
        if self.fixed is not None and self.mode not in ("iid", "without_replacement"):
            raise ValueError(f"fixed/drawn masks describe a drawn tree (mode 'iid' or "
                             f"'without_replacement'), not mode {self.mode!r}")

    @property
    def merged(self) -> bool:
        """Whether chosen and drawn children share the tree (see ``fixed``)."""
        return self.fixed is not None
