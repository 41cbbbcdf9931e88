"""DySpec's dynamic token tree (Xiong et al.): expand where the estimated acceptance is largest.

A slot ``(u, k)`` ("the k-th sample below node u") is worth ``a_u * (1 - sum of the draft
probabilities of u's earlier samples)``: the estimated probability that the verifier reaches it
(DySpec Eq. 2 with the target's acceptance estimated by the draft's probability, Appendix D Eqs.
8-11); the node it creates has value ``a_u * d_u(token)``.

* ``dyspec-paper:N[:D[:VT]]`` (Algorithm 1, fixed size): the heap greedy adds the highest-value
  slot, N times. Values never increase down the tree or along siblings, so a round can take free
  slots in decreasing value exactly as the heap would, up to the first slot worth less than a node
  it has just created (whose own children need a draft run): Algorithm 1's tree, with the draft
  run once per round instead of once per node. Rounds are capped at D (default 10); the last
  round, whose nodes cannot be expanded, fills the remaining budget with the best free slots.
* ``dyspec:N[:D[:VT]]`` (default): the same greedy with calibrated estimates
  (:mod:`stree.draft.calibration`): a child's acceptance estimate ``x_k = d_k / (1 - sum_{j<k}
  d_j)`` (the paper's) is replaced by the measured acceptance rate of earlier children of the
  same sibling rank (and, for ranked children, a similar ``x``), and the heap key is the expected acceptance the slot
  adds, known before its draw: ``slot value * rho_k`` for sampled children (``rho_k`` the measured
  rate of k-th children, non-increasing in k; the paper's ``rho`` is a constant), the node's own
  value for ranked children (their token is known: Theorem D.1's maximum-weight subtree, keys
  made non-increasing along siblings so they stay in draft order). Before any verdict it is the
  paper's rule at T > 0 and the maximum-weight subtree under the draft's probabilities at T = 0.
* ``dyspec-threshold:T[:N[:D]]`` (Algorithm 2, layer by layer, the paper's estimates): every slot
  worth at least T is taken (the printed ``while v_i < t`` is inverted; ``>=`` is meant), at most
  N nodes (default 32; over it the best slots win) and D rounds (default 10).

Why calibrate (decision; the paper assumes the draft's probability approximates acceptance, its
Hypothesis 1): on the shipped tiny pair that estimate is far off. At T = 1 a first child drawn
with ``q(y) < 0.01`` was accepted ~80% of the time (MSS accepts with ``min(1, p/q)``, ``1 -
TV(p, q)`` on average, whatever the token), so the paper's greedy values siblings above depth and
builds wide, shallow trees (tau 2.0 against 3.7 for a 13-node static tree); at T = 0 the draft's
softmax at 0.6 is under-confident for top-ranked tokens. A calibration from the running
acceptance history is the allowed remedy (issue 9 permits online tuning, as DynaTree v2 does).

At T > 0 children are sampled without replacement from ``q = target_probs(draft logits)`` (the
paper samples draft and target at the same temperature, 0.6) and verified by MSS's
without-replacement rule (DySpec Algorithm 3, ``mss``): whether a slot is taken depends only on
tokens already drawn (its earlier siblings, other nodes) and on earlier steps' verdicts, never on
the token the slot itself holds, so the pair is lossless (a key read from the slot's own token
is not: ``tests/test_calibration.py`` shows the chi-square test failing it). At T = 0 the k-th
child is the draft's k-th most likely token and values use the draft's softmax at
``value_temperature`` (default 0.6, the paper's draft temperature; ``dyspec:N:D:VT`` sets it);
greedy verification. On the shipped tiny pair (5 HumanEval prompts, 64 tokens, T = 0) the paper's
rule reached tau 2.14 / 2.92 / 3.15 at value temperature 1 / 0.6 / 0.4.

Decisions where the paper is silent: the root (the last committed token) is not counted in N;
Algorithm 3 emits a bonus token at a leaf (``mss`` always does); the node order is the order the
greedy adds nodes, round by round (topological, siblings in sampling order), not DySpec's DFS,
which only matters for their attention kernel's block sparsity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stree.draft.dynamic import DynamicTreeDrafter, Slots


@dataclass(eq=False)
class DySpecDrafter(DynamicTreeDrafter):
    """DySpec tree of ``budget`` nodes (greedy, Algorithm 1; calibrated when ``calibration`` is
    given), or every slot worth at least ``threshold`` up to ``budget`` nodes (Algorithm 2) when a
    threshold is given."""

    threshold: float | None = None
    value_temperature: float = 0.6  # the paper's draft temperature
    all_modes = ("deterministic", "without_replacement")

    def __post_init__(self):
        if self.threshold is not None and not 0.0 < float(self.threshold) <= 1.0:
            raise ValueError(f"dyspec-threshold: threshold must be in (0, 1], got {self.threshold}")
        super().__post_init__()

    @property
    def name(self) -> str:
        if self.threshold is None:
            return f"dyspec{'' if self.calibration else '-paper'}:{self.budget}"
        return f"dyspec-threshold:{self.threshold:g}"

    @property
    def candidates(self) -> int:
        return int(self.budget)  # a node never gets more children than the budget

    def priority(self, slots: Slots) -> tuple[Tensor, Tensor]:
        """``(key, bound)`` (b, F, K): the greedy's key of each slot, and an upper bound on the key
        of the first child slot of the node the slot would create (which needs a draft run).

        Uncalibrated (the paper): key = the slot value (probability the slot is tested, with a
        constant acceptance ``rho``), bound = the created node's value. Calibrated: the expected
        acceptance the slot adds, known before the draw: ``slot value * rho_k`` for sampled
        children (``rho`` the measured rate of a k-th child), the created node's own value for
        ranked ones (their tokens are known; Theorem D.1's maximum-weight subtree), made
        non-increasing along siblings so that they are taken in draft order."""
        value = slots.slot_value
        if slots.rho is None:
            return value, slots.child_value
        if slots.ranked:
            key = slots.child_value.cummin(-1).values
            return key, slots.child_value
        return value * slots.rho, slots.child_value * slots.rho[0]

    def select(self, slots: Slots) -> tuple[Tensor, Tensor]:
        if self.threshold is not None:
            value = slots.slot_value
            return value, value >= self.threshold
        key, bound = self.priority(slots)
        if slots.last:
            return key, slots.open
        # Heap order within the round: free slots by decreasing key, while each is worth at
        # least the bound of every node taken before it in this round (else the heap would pop
        # that node's first child slot next, which needs a draft run).
        b = key.shape[0]
        flat = key.masked_fill(~slots.open, -1.0).flatten(1)
        sk, idx = flat.sort(dim=1, descending=True, stable=True)
        child = bound.flatten(1).gather(1, idx)
        before = torch.cat([torch.full((b, 1), -1.0, device=sk.device),
                            child.cummax(1).values[:, :-1]], 1)
        ok = ((sk >= before) & (sk >= 0)).long().cumprod(1).bool()
        return key, torch.zeros_like(ok).scatter(1, idx, ok).view_as(key)
