"""Dynamic trees: grown round by round from the draft's own probabilities, a shape per batch row.

Shared machinery of the DySpec and DynaTree drafters (``dyspec.py``, ``dynatree.py``); they differ
only in their *rule*, which picks the slots that become nodes in a round.

Slots. Once the draft has run over node ``u`` it has ``K`` ordered candidate children: mode
``"without_replacement"`` draws them as one sequential sample without replacement from
``q_u = target_probs(draft logits, sampling)`` (DySpec's residual sampling: taking the first ``k``
is exactly sampling ``k`` siblings one after another); ``"deterministic"`` ranks the draft's
tokens (DynaTree's top-B, DySpec at temperature 0). Slot ``(u, k)`` is "u's k-th child". Every
node carries ``a_u``, the product of draft probabilities along its path (root 1): DySpec's and
DynaTree's path probability. ``d_u`` is the draft distribution the values are read from: ``q_u``
for sampled children, the draft's softmax at the drafter's ``value_temperature`` for ranked ones.

Round. (1) One draft call over the nodes the previous round added
(:func:`~stree.draft.base.forward_level`: each runs once, from its parent's stored state) gives the
candidates of those nodes. (2) The rule marks the slots to
take and orders them. (3) The taken slots become nodes, appended in that order. A rule may stop
taking slots as soon as it would need candidates of nodes not run yet: the next round runs them.
So the draft runs once per round, and a tree of depth D needs at least D rounds; ``max_depth``
caps the rounds (the last round's nodes are leaves).

Layout. Nodes are appended round by round, so indices are topological, siblings keep their draft
order, and the nodes of one round are one index range shared by every row. A row that takes fewer
slots than the widest row of its round fills the range with padding: copies of node 1 (the root's
first child) hanging from the root. No verifier can accept a padding node: greedy and naive
verification take the *first* child carrying a token, and MSS skips a child whose residual q gives
it probability 0 (node 1's token once node 1 was rejected). In batch 1 there is no padding; in a
batch a row's real nodes can fall short of the budget by the padding it receives (the node count
never exceeds ``1 + budget``). The draft's last run covered every node but the last round's, so
``num_forwarded``, ``depth`` and ``draft_runs`` (rounds) describe the latest draft.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from stree.draft.base import Drafter, forward_level, pick_children
from stree.draft.calibration import AcceptanceCalibration
from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree


@dataclass
class Slots:
    """What a rule sees in a round, for the ``F`` nodes run so far (``(b, F)`` / ``(b, F, K)``).

    a: path probability of each node; depth: its depth; fresh: run for the first time this round;
    open: slots still free (real node, not taken yet, candidate probability > 0); prob: ``d_u`` of
    each ordered candidate; last: True in the last allowed round (its nodes stay leaves);
    ranked: the candidates are the draft's ranking, not draws; rho: ``(K,)`` measured acceptance
    of a k-th child (non-increasing in k) when the drafter is calibrated, else None.
    """

    a: Tensor
    depth: Tensor
    fresh: Tensor
    open: Tensor
    prob: Tensor
    last: bool
    ranked: bool = False
    rho: Tensor | None = None

    @property
    def slot_value(self) -> Tensor:
        """DySpec's slot value ``a_u * (1 - sum of d_u over the earlier siblings)`` (b, F, K): the
        estimated probability that the slot's child is reached and tested."""
        earlier = self.prob.cumsum(-1) - self.prob
        return self.a.unsqueeze(-1) * (1 - earlier).clamp_min(0)

    @property
    def child_value(self) -> Tensor:
        """Path probability ``a_u * d_u(token)`` of the node each slot would create (b, F, K)."""
        return self.a.unsqueeze(-1) * self.prob

    def fifo(self) -> Tensor:
        """Key for breadth-first order: earlier nodes first, then draft order (b, F, K)."""
        b, F, K = self.prob.shape
        return -torch.arange(F * K, device=self.prob.device, dtype=torch.float32).view(1, F, K)


@dataclass
class LastDraft:
    """Mutable record of the latest draft: draft runs (rounds), nodes the last run covered and
    ``depth`` = 1 + the depth of the deepest of them (a round may add only siblings, so rounds
    can exceed the layers: the accepted path is cut to ``depth`` before the draft commits it)."""

    depth: int
    runs: int
    num_forwarded: int = 0
    cells: Tensor | None = None  # (b, n) calibration cell of each node, -1: root and padding


@dataclass(eq=False)
class DynamicTreeDrafter(Drafter):
    """Base of the dynamic drafters: ``budget`` nodes below the root at most, ``max_depth`` rounds.

    Subclasses set ``candidates`` (K, children per node at most) and implement :meth:`select`.
    """

    budget: int
    max_depth: int
    mode: str | None = None
    # Temperature of the draft softmax that values ranked ("deterministic") children.
    value_temperature: float = 1.0
    # Replaces the draft's estimate of a child's acceptance by the measured rate (DySpec values).
    calibration: AcceptanceCalibration | None = None
    _last: LastDraft = field(init=False, repr=False)

    @property
    def layered(self) -> bool:
        return False

    def __post_init__(self):
        if int(self.budget) < 1:
            raise ValueError(f"{self.name}: node budget must be >= 1, got {self.budget}")
        if int(self.max_depth) < 1:
            raise ValueError(f"{self.name}: max depth must be >= 1, got {self.max_depth}")
        if not float(self.value_temperature) > 0.0:
            raise ValueError(f"{self.name}: value temperature must be > 0, got "
                             f"{self.value_temperature}")
        if self.mode is not None and self.mode not in self.all_modes:
            raise ValueError(f"{self.name} drafts {self.all_modes} trees, not {self.mode!r}")
        self._last = LastDraft(depth=int(self.max_depth), runs=int(self.max_depth))

    # --------------------------------------------------------------------------- to implement
    # Modes this rule can draft, ranked children first (class attribute).
    all_modes = ("deterministic",)

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def candidates(self) -> int:
        """K: ordered candidate children kept per node."""

    @abstractmethod
    def select(self, slots: Slots) -> tuple[Tensor, Tensor]:
        """Rule of one round: ``(key, take)`` (b, F, K); slots with ``take`` become nodes in
        decreasing ``key`` order (ties: index order), cut at the remaining budget. Only open
        slots are taken."""

    def wants_round(self, a: Tensor, depth: Tensor, fresh: Tensor) -> bool:
        """Whether running the draft over the ``fresh`` nodes can add any node (b, F) tensors; a
        rule that prunes on path probability answers from ``a`` without running the draft."""
        return True

    # --------------------------------------------------------------------------------- shape
    @property
    def num_nodes(self) -> int:
        return 1 + int(self.budget)

    @property
    def depth(self) -> int:
        return self._last.depth

    @property
    def num_forwarded(self) -> int:
        return self._last.num_forwarded

    @property
    def draft_runs(self) -> int:
        return self._last.runs

    @property
    def max_leaves(self) -> int:
        return int(self.budget)

    @property
    def uses_draft_model(self) -> bool:
        return True

    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        if self.mode is not None:
            return (self.mode,)
        if sampling.is_greedy or "without_replacement" not in self.all_modes:
            return self.all_modes  # ranked children at T = 0: sampled ones would all be the argmax
        return ("without_replacement",) + tuple(m for m in self.all_modes
                                               if m != "without_replacement")

    def with_mode(self, mode: str) -> "DynamicTreeDrafter":
        if mode == self.mode:
            return self
        if self.mode is not None or mode not in self.all_modes:
            raise ValueError(f"{self.name} drafts {self.all_modes} trees, not {mode!r}")
        return replace(self, mode=mode)

    # --------------------------------------------------------------------------------- draft
    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> Draft:
        mode = self.modes(sampling)[0]
        tree, rounds, rho = GrowingTree.start(roots, self.num_nodes), 0, None
        while rounds < self.max_depth and tree.size < self.num_nodes:
            fresh = tree.fresh()
            if rounds and not self.wants_round(tree.a[:, :tree.size], tree.depth[:, :tree.size],
                                               fresh):
                break
            partial = tree.partial()
            logits = forward_level(model, cache, partial, tree.forwarded, partial.num_nodes,
                                   self.num_nodes)
            rounds += 1
            tree.add_candidates(logits, min(self.candidates, logits.shape[-1]), mode, sampling,
                                generator, self.value_temperature, self.calibration)
            if rho is None and self.calibration is not None:  # fixed until the next observe()
                rho = self.calibration.rank_rates(tree.cand_p.shape[-1], roots.device,
                                                  binned=mode == "deterministic")
            key, take = self.select(tree.slots(fresh, last=rounds == self.max_depth,
                                               ranked=mode == "deterministic", rho=rho))
            if not tree.append(key, take):
                break
        ran = tree.depth[:, :tree.forwarded]
        self._last = LastDraft(depth=int(ran.max()) + 1, runs=rounds, num_forwarded=tree.forwarded,
                               cells=tree.cell[:, :tree.size])
        return tree.as_draft(mode)

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        if self.calibration is not None and self._last.cells is not None:
            self.calibration.update(self._last.cells, tree.parents, path)


@dataclass
class GrowingTree:
    """A batch of trees being grown: ``(b, cap)`` node tables, ``size`` nodes so far, the first
    ``forwarded`` of them run by the draft, whose ordered candidates are ``cand_tok`` /
    ``cand_p`` ``(b, cap, K)`` and distributions ``q`` ``(b, cap, v)``."""

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    a: Tensor
    real: Tensor
    taken: Tensor
    cell: Tensor
    cand_tok: Tensor | None = None
    cand_cell: Tensor | None = None
    cand_p: Tensor | None = None
    q: Tensor | None = None
    size: int = 1
    forwarded: int = 0

    @classmethod
    def start(cls, roots: Tensor, cap: int) -> "GrowingTree":
        b, dev = roots.shape[0], roots.device
        tokens = torch.zeros(b, cap, dtype=torch.long, device=dev)
        tokens[:, 0] = roots
        a = torch.zeros(b, cap, device=dev)
        a[:, 0] = 1.0
        real = torch.zeros(b, cap, dtype=torch.bool, device=dev)
        real[:, 0] = True
        return cls(tokens=tokens, parents=torch.full((b, cap), -1, dtype=torch.long, device=dev),
                   depth=torch.zeros(b, cap, dtype=torch.long, device=dev), a=a, real=real,
                   taken=torch.zeros(b, cap, dtype=torch.long, device=dev),
                   cell=torch.full((b, cap), -1, dtype=torch.long, device=dev))

    def partial(self) -> TokenTree:
        return TokenTree(self.tokens[:, :self.size], self.parents[:, :self.size])

    def fresh(self) -> Tensor:
        """(b, size) the real nodes the draft has not run yet."""
        out = torch.zeros_like(self.real[:, :self.size])
        out[:, self.forwarded:] = self.real[:, self.forwarded:self.size]
        return out

    def add_candidates(self, logits: Tensor, K: int, mode: str, sampling: SamplingConfig,
                       generator, value_temperature: float,
                       calibration: AcceptanceCalibration | None = None) -> None:
        """Store the ordered candidates of the nodes just run (``logits (b, size - forwarded,
        v)``); ranked children are valued by the draft's softmax at ``value_temperature``.

        With a ``calibration`` the stored probabilities are the calibrated ones: candidate k's
        residual estimate ``x_k = d_k / (1 - sum_{j<k} d_j)`` becomes ``h_k`` and its stored
        probability ``h_k prod_{j<k} (1 - h_j)``, so that every value formula (``slot_value``,
        ``child_value``) reads calibrated estimates; without verdicts ``h = x`` and the stored
        probability is ``d`` again."""
        b, cap = self.tokens.shape
        if self.cand_tok is None:
            self.cand_tok = torch.zeros(b, cap, K, dtype=torch.long, device=logits.device)
            self.cand_p = torch.zeros(b, cap, K, device=logits.device)
            self.cand_cell = torch.full((b, cap, K), -1, dtype=torch.long, device=logits.device)
        picks, probs = pick_children(logits, K, mode, sampling, generator)
        ranked = mode == "deterministic"
        dist = (logits.float() / value_temperature).softmax(-1) if ranked else probs
        new = slice(self.forwarded, self.size)
        if probs is not None:  # None: ranked children at greedy sampling, where no verifier reads q
            if self.q is None:
                self.q = torch.zeros(b, cap, logits.shape[-1], device=logits.device)
            self.q[:, new] = probs
        self.cand_tok[:, new] = picks
        d = dist.gather(-1, picks)
        if calibration is not None:
            left = (1 - (d.cumsum(-1) - d)).clamp_min(torch.finfo(d.dtype).tiny)
            x = (d / left).clamp(0, 1)
            h = calibration(x, binned=ranked)
            reach = torch.cat([torch.ones_like(h[..., :1]), (1 - h[..., :-1]).cumprod(-1)], -1)
            self.cand_cell[:, new] = calibration.cells(x, binned=ranked)
            d = torch.where(d > 0, h * reach, 0.0)  # a child q cannot draw stays closed
        self.cand_p[:, new] = d
        self.forwarded = self.size

    def free(self) -> Tensor:
        """(b, size, K) open slots: of a real node run by the draft, not taken, probability > 0."""
        e = self.size
        ks = torch.arange(self.cand_p.shape[-1], device=self.tokens.device)
        return self.real[:, :e, None] & (ks >= self.taken[:, :e, None]) & (self.cand_p[:, :e] > 0)

    def slots(self, fresh: Tensor, last: bool, ranked: bool = False,
              rho: Tensor | None = None) -> Slots:
        e = self.size
        return Slots(a=self.a[:, :e], depth=self.depth[:, :e], fresh=fresh, open=self.free(),
                     prob=self.cand_p[:, :e], last=last, ranked=ranked, rho=rho)

    def append(self, key: Tensor, take: Tensor) -> int:
        """Append the open slots ``take`` marks, in decreasing ``key``, cut at the capacity; pad
        short rows (module docstring). Returns the round's width (0: nothing added)."""
        e, K = self.size, self.cand_p.shape[-1]
        take = take & self.free()
        count = take.flatten(1).sum(1).clamp(max=self.tokens.shape[1] - e)
        width = int(count.max())  # host sync: the size of this round
        if width == 0:
            return 0
        key = key.float().masked_fill(~take, float("-inf")).flatten(1)
        order = key.sort(dim=1, descending=True, stable=True).indices[:, :width]
        valid = torch.arange(width, device=key.device) < count.unsqueeze(1)
        u = order // K
        new_tok = self.cand_tok[:, :e].flatten(1).gather(1, order)
        child_a = self.a.gather(1, u) * self.cand_p[:, :e].flatten(1).gather(1, order)
        # Padding copies node 1, which in the first round is each row's first new node.
        pad = new_tok[:, :1] if e == 1 else self.tokens[:, 1:2]
        span = slice(e, e + width)
        self.tokens[:, span] = torch.where(valid, new_tok, pad)
        self.parents[:, span] = torch.where(valid, u, 0)
        self.a[:, span] = torch.where(valid, child_a, 0.0)
        self.depth[:, span] = torch.where(valid, self.depth.gather(1, u) + 1, 1)
        self.real[:, span] = valid
        self.cell[:, span] = torch.where(valid, self.cand_cell[:, :e].flatten(1).gather(1, order), -1)
        self.taken.scatter_add_(1, u, valid.long())
        self.size += width
        return width

    def as_draft(self, mode: str) -> Draft:
        """The tree so far; ``q`` rows of nodes the draft never ran are 0 (leaves)."""
        return Draft(self.partial(), None if self.q is None else self.q[:, :self.size], mode)
