"""DynaTree v1 and v2: breadth-first trees of the draft's top tokens, pruned by path probability.

``p(u)`` is the product of the draft's probabilities (softmax at temperature 1) along the path to
``u``; the root (the last committed token) has ``p = 1``. Each round expands the nodes of the
previous one in breadth-first order, adding children until the node budget is spent.

* ``dynatree:DxB:N[:TAU]`` (v1, Appendix C Algorithm 1): every node with ``p(u) >= TAU`` (default
  0.05, the papers' Table 4 optimum) gets its top-B children, down to depth D, at most N nodes.
* ``dynatree2[:N]`` (v2, Appendix D): node ``u`` gets ``B(u) = 1 / 2 / 3`` children when its
  confidence ``c(u) = max q_D(.|u)`` is ``>= tau_h`` / in ``[tau_l, tau_h)`` / ``< tau_l`` and is
  expanded only while ``p(u) >= rho_stop`` and (``depth < D0`` or ``p(u) >= rho_deep``), up to
  ``D_max`` and N nodes (default 32). After every step the acceptance history tunes ``D0`` and
  ``tau_h``: ``a_r`` = accepted tokens / depth of the drafted tree (mean over live rows),
  ``abar`` its mean over the last W steps, ``D0 <- clip(D0 + eta_D (abar - a*), 1, D_max - 1)``
  (rounded when used), ``tau_h <- clip(tau_h - eta_h (abar - a*), tau_l, 1)``.

Decisions where the papers are silent or inconsistent (digest 3.1, 4.4): "pruning" keeps the node
and only stops expanding it (the pseudocode; the prose says "discarded"); the STree root expands
like any node, so depth 1 holds the top-B tokens rather than DynaTree's single top-1 root; the
frontier is first in, first out, and the budget cuts it in that order; the v1 threshold and v2's
``tau`` and ``rho_stop`` are one test (the larger wins); the v2 defaults the paper does give are
kept (``D0 = 5``, ``D_max = 8``, ``B = 1..3``, ``tau_h = 0.9``, ``tau_l = 0.4``) and the missing ones
chosen here: ``B_mid = 2``, ``rho_stop = 0.03`` (v1's sweep optimum), ``rho_deep = 0.2``,
``W = 8``, ``a* = 0.5``, ``eta_D = 2``, ``eta_h = 0.2``; ``tau_l`` stays fixed (no update rule is
given); one history for the whole batch.

Both papers are greedy only. Children here are always the draft's top tokens (mode
"deterministic"), so at T > 0 the pair is DynaTree + ``naive`` (lossless for any tree; ``mss``
refuses chosen children).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from stree.draft.dynamic import DynamicTreeDrafter, Slots
from stree.tree import TokenTree


@dataclass(eq=False)
class DynaTreeDrafter(DynamicTreeDrafter):
    """DynaTree v1: top-``branch`` children of every node with path probability ``>= tau``,
    ``max_depth`` levels, ``budget`` nodes."""

    branch: int = 2
    tau: float = 0.05

    def __post_init__(self):
        if int(self.branch) < 1:
            raise ValueError(f"dynatree: branch factor B must be >= 1, got {self.branch}")
        if not 0.0 <= float(self.tau) <= 1.0:
            raise ValueError(f"dynatree: threshold tau must be in [0, 1], got {self.tau}")
        super().__post_init__()

    @property
    def name(self) -> str:
        return f"dynatree:{self.max_depth}x{self.branch}:{self.budget}"

    @property
    def candidates(self) -> int:
        return int(self.branch)

    def wants_round(self, a: Tensor, depth: Tensor, fresh: Tensor) -> bool:
        return bool((fresh & (a >= self.tau)).any())

    def select(self, slots: Slots) -> tuple[Tensor, Tensor]:
        grow = slots.fresh & (slots.a >= self.tau)
        return slots.fifo(), grow.unsqueeze(-1) & slots.open


@dataclass
class History:
    """DynaTree v2's online state: recent acceptance ratios and the tuned ``D0`` and ``tau_h``."""

    d0: float = 5.0
    tau_h: float = 0.9
    recent: deque = field(default_factory=lambda: deque(maxlen=8))


@dataclass(eq=False)
class DynaTree2Drafter(DynamicTreeDrafter):
    """DynaTree v2: confidence-aware breadth, probability-gated depth, history tuning (see the
    module docstring for every parameter)."""

    max_depth: int = 8
    breadth: tuple[int, int, int] = (1, 2, 3)
    tau_l: float = 0.4
    rho_stop: float = 0.03
    rho_deep: float = 0.2
    target_accept: float = 0.5
    eta_depth: float = 2.0
    eta_tau: float = 0.2
    history: History = field(default_factory=History)

    def __post_init__(self):
        lo, mid, hi = self.breadth
        if not 1 <= lo <= mid <= hi:
            raise ValueError(f"dynatree2: breadth must satisfy 1 <= B_min <= B_mid <= B_max, "
                             f"got {self.breadth}")
        if not 0.0 < self.tau_l < self.history.tau_h <= 1.0:
            raise ValueError(f"dynatree2: need 0 < tau_l < tau_h <= 1, got {self.tau_l}, "
                             f"{self.history.tau_h}")
        if not 0.0 < self.rho_stop < self.rho_deep < 1.0:
            raise ValueError(f"dynatree2: need 0 < rho_stop < rho_deep < 1, got "
                             f"{self.rho_stop}, {self.rho_deep}")
        super().__post_init__()

    @property
    def name(self) -> str:
        return f"dynatree2:{self.budget}"

    @property
    def candidates(self) -> int:
        return int(self.breadth[2])

    def _expandable(self, a: Tensor, depth: Tensor) -> Tensor:
        shallow = depth < round(self.history.d0)
        return (depth < self.max_depth) & (a >= self.rho_stop) & (shallow | (a >= self.rho_deep))

    def wants_round(self, a: Tensor, depth: Tensor, fresh: Tensor) -> bool:
        return bool((fresh & self._expandable(a, depth)).any())

    def select(self, slots: Slots) -> tuple[Tensor, Tensor]:
        lo, mid, hi = self.breadth
        conf = slots.prob[..., 0]  # the top candidate's probability: max q_D(.|u)
        width = torch.where(conf >= self.history.tau_h, lo,
                            torch.where(conf >= self.tau_l, mid, hi))
        ks = torch.arange(slots.prob.shape[-1], device=conf.device)
        grow = slots.fresh & self._expandable(slots.a, slots.depth)
        return slots.fifo(), grow.unsqueeze(-1) & (ks < width.unsqueeze(-1)) & slots.open

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        live = path[:, 0] >= 0
        if not bool(live.any()):
            return
        accepted = ((path >= 0).sum(1) - 1).float()
        drafted = tree.depth.max(1).values.clamp_min(1).to(accepted.device).float()
        h = self.history
        h.recent.append(float((accepted / drafted)[live].mean()))
        err = sum(h.recent) / len(h.recent) - self.target_accept
        h.d0 = min(max(h.d0 + self.eta_depth * err, 1.0), self.max_depth - 1.0)
        h.tau_h = min(max(h.tau_h - self.eta_tau * err, self.tau_l), 1.0)
