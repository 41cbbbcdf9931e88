"""Online calibration of a dynamic drafter's acceptance estimates from the verifier's verdicts.

DySpec (Eq. 2, Appendix D) estimates the probability that a drafted child is accepted, given that
its parent was accepted and its earlier siblings rejected, by the draft's own residual probability
of the child's token, ``x_k = d(y_k) / (1 - sum_{j<k} d(y_j))``. That estimate is only as good as
the draft is calibrated: at T = 1 a token *sampled* from a flat draft distribution has a small
``d(y)`` while its measured acceptance (``min(1, p(y) / q(y))``, ``1 - TV(p, q)`` on average for
the first child) is large, so DySpec's greedy spends its budget on siblings and goes wide and
shallow; at T = 0 the draft's confidence at temperature 0.6 over- or under-states how often the
target's argmax agrees.

This table replaces ``x_k`` by the *measured* acceptance rate of earlier children like it: each
cell counts the children tested (parent on the accepted path, no earlier sibling accepted:
first-match and MSS verification test siblings in draft order) and accepted in earlier steps.
Ranked children (T = 0) have cells by sibling rank (0, 1, >= 2) and bin of ``x_k``, and

    m = (accepted[rank] + w x_k) / (tested[rank] + w),   h_k = (accepted[cell] + w m) / (tested[cell] + w)

(the rank's pooled rate shrunk to the paper's estimate, the cell's shrunk to the pooled rate).
Sampled children (T > 0) have cells by rank only, ``h_k = m``: for a draw ``y ~ q`` MSS accepts
with ``min(1, p(y) / q(y))``, which ``q(y)`` hardly predicts (on the shipped pair, 5 prompts x 128
tokens at T = 1, binning by ``x`` lost 5-15% of tau against rank only, within noise on 10 prompts;
at T = 0 it gained 9%).
Before any verdict the estimate is ``x_k``, the paper's. Counts decay by ``decay`` per step and are
kept on the device (updates and look-ups are scatters and gathers: no host sync).

Losslessness: ``h_k`` is a function of ``x_k`` (the child's own token) and of earlier steps'
verdicts. The drafter uses ``h_k`` only for the child's descendants and its later siblings, never
to decide whether the child itself is drafted (see ``stree.draft.dynamic``), so the number of
siblings drawn stays a stopping time of the draws made so far, as DySpec's Algorithm 3 needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# Upper edges of the x bins (the last bin is [0.97, 1]); finer where a tiny model's sampled
# children fall (small x at T = 1) and where a confident ranked child falls (x near 1 at T = 0).
DEFAULT_EDGES = (0.01, 0.03, 0.07, 0.15, 0.3, 0.5, 0.7, 0.85, 0.93, 0.97)


@dataclass(eq=False)
class AcceptanceCalibration:
    """Decayed (tested, accepted) counts per (sibling rank group, estimate bin).

    ``edges``: upper bin edges of the estimate ``x``; ``rank_groups``: ranks ``0 .. G-2`` each
    their own group, the rest in the last; ``prior_weight``: ``w``, pseudo-observations at ``x``.
    """

    edges: tuple[float, ...] = DEFAULT_EDGES
    rank_groups: int = 3
    prior_weight: float = 2.0
    decay: float = 0.99
    tested: Tensor | None = field(default=None, repr=False)
    accepted: Tensor | None = field(default=None, repr=False)
    _edge_tensor: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if list(self.edges) != sorted(self.edges) or not all(0.0 < e < 1.0 for e in self.edges):
            raise ValueError(f"calibration edges must increase inside (0, 1), got {self.edges}")
        if int(self.rank_groups) < 1:
            raise ValueError(f"calibration rank groups must be >= 1, got {self.rank_groups}")
        if not self.prior_weight > 0.0:
            raise ValueError(f"calibration prior weight must be > 0, got {self.prior_weight}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"calibration decay must be in (0, 1], got {self.decay}")

    @property
    def num_cells(self) -> int:
        """Two blocks of rank groups x bins: ranked children's, then sampled children's (whose
        bin is always 0)."""
        return 2 * int(self.rank_groups) * (len(self.edges) + 1)

    def _tables(self, device) -> tuple[Tensor, Tensor]:
        if self.tested is None or self.tested.device != torch.device(device):
            self.tested = torch.zeros(self.num_cells, device=device)
            self.accepted = torch.zeros(self.num_cells, device=device)
        return self.tested, self.accepted

    def cells(self, x: Tensor, binned: bool) -> Tensor:
        """Cell index of each estimate ``x (..., K)``, the last axis being the sibling rank.
        ``binned``: the children are the draft's ranking (cells by rank and bin of ``x``);
        otherwise they were sampled, and their cells are by rank only, in a block of their own."""
        bins, groups = len(self.edges) + 1, int(self.rank_groups)
        rank = torch.arange(x.shape[-1], device=x.device).clamp(max=groups - 1)
        if not binned:
            return (groups + rank) * bins + torch.zeros_like(x, dtype=torch.long)
        return rank * bins + torch.bucketize(x, self._edges(x), right=True)

    def _edges(self, x: Tensor) -> Tensor:
        """The bin edges as a tensor like ``x`` (made once per device and dtype)."""
        key = (x.device, x.dtype)
        if self._edge_tensor is None or self._edge_tensor[0] != key:
            self._edge_tensor = (key, torch.tensor(self.edges, device=x.device, dtype=x.dtype))
        return self._edge_tensor[1]

    def __call__(self, x: Tensor, binned: bool) -> Tensor:
        """Calibrated acceptance ``h`` of estimates ``x (..., K)`` (same shape, in [0, 1])."""
        tested, accepted = self._tables(x.device)
        cell = self.cells(x, binned)
        bins, w = len(self.edges) + 1, self.prior_weight
        group = cell // bins
        # The rank group's pooled rate, shrunk to x; for ranked children then the cell's rate,
        # shrunk to the pooled one.
        pooled = (accepted.view(-1, bins).sum(1)[group] + w * x) / (
            tested.view(-1, bins).sum(1)[group] + w)
        if not binned:
            return pooled
        return (accepted[cell] + w * pooled) / (tested[cell] + w)

    def rank_rates(self, K: int, device, binned: bool) -> Tensor:
        """``rho (K,)``: the measured acceptance of a k-th child given it is tested, pooled over
        the estimate bins and made non-increasing in k (a later sibling is never preferred to an
        earlier one); a group without verdicts shrinks to the overall rate of its block (1 with
        none at all, DySpec's constant ``rho``)."""
        tested, accepted = self._tables(device)
        groups, bins = int(self.rank_groups), len(self.edges) + 1
        block = slice(0, groups) if binned else slice(groups, 2 * groups)
        t = tested.view(-1, bins).sum(1)[block]
        a = accepted.view(-1, bins).sum(1)[block]
        w = self.prior_weight
        overall = (a.sum() + w) / (t.sum() + w)
        rate = (a + w * overall) / (t + w)
        rank = torch.arange(K, device=device).clamp(max=groups - 1)
        return rate[rank].cummin(0).values

    def update(self, cells: Tensor, parents: Tensor, path: Tensor) -> None:
        """Add one verified step. ``cells (b, n)``: each drafted node's cell (-1: the root and
        padding, not counted); ``parents (b, n)`` the tree; ``path (b, k)`` the accepted node
        indices, root first, -1 padded (finished rows are all -1 and count nothing)."""
        tested, accepted = self._tables(cells.device)
        hit_tested, hit_accepted = node_verdicts(parents, path)
        real = cells >= 0
        idx = cells.clamp_min(0).flatten()
        tested.mul_(self.decay).scatter_add_(0, idx, (hit_tested & real).flatten().float())
        accepted.mul_(self.decay).scatter_add_(0, idx, (hit_accepted & real).flatten().float())


def node_verdicts(parents: Tensor, path: Tensor) -> tuple[Tensor, Tensor]:
    """Which nodes of a tree (``parents (b, n)``, siblings in draft order = index order) the
    verifier tested and which it accepted, given the accepted ``path (b, k)`` (-1 padded).

    A child is tested when its parent is on the path and no earlier sibling was accepted, i.e.
    when its index is at most that of the parent's accepted child (all of them when the path ends
    at the parent). Returns two ``(b, n)`` bool tensors (the root is neither).
    """
    b, n = parents.shape
    dump = torch.full_like(path, n)  # column n swallows the -1 entries
    on = torch.zeros(b, n + 1, dtype=torch.bool, device=parents.device)
    on.scatter_(1, torch.where(path >= 0, path, dump), True)
    nxt = torch.full((b, n + 1), n, dtype=torch.long, device=parents.device)
    nxt.scatter_(1, torch.where(path[:, :-1] >= 0, path[:, :-1], dump[:, :-1]),
                 torch.where(path[:, 1:] >= 0, path[:, 1:], dump[:, 1:]))
    child = parents >= 0
    par = parents.clamp_min(0)
    node = torch.arange(n, device=parents.device).expand(b, n)
    tested = child & on.gather(1, par) & (node <= nxt.gather(1, par))
    return tested, child & on[:, :n]
