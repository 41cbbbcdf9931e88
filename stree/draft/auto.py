"""``drafter="auto"``: the tree that maximises predicted tokens per second, re-chosen every step.

STree's Eq. 7 / 8: wall time per token = t(N) / tau. Here a step costs
``t_target(n) + sum over draft levels of t_draft(nodes that level forwards)``, with both ``t``
measured once per model, device and dtype (:mod:`stree.costmodel`, cached on disk), and tau is
predicted from a running acceptance profile:

* ``h_k``: probability that a node's k-th child (draft order) is accepted given the node was
  reached and children ``0..k-1`` were not, estimated from every verdict (counts decay by
  ``decay`` per step, so the profile follows drift; a Beta prior fills unseen ranks). Depth is
  ignored (DySpec's assumption 2). ``p_k = h_k prod_{j<k} (1 - h_j)``.
* A fixed shape's tau is ``1 + sum over nodes of the product of p_rank along its path``; a
  dynamic budget ``dyspec:N`` is predicted by the best N-node tree under ``p`` (greedy, DySpec
  Thm D.1), which it adapts per step; once a candidate has run ``min_runs`` steps its own
  measured tau (decayed running mean) replaces the prediction.

Candidates (default): chains ``chain:1..6``, the static presets, caterpillars of depth 4 to 6 and
``dyspec:8/16/32``. A switch needs a predicted gain of ``switch_margin`` (3%) to avoid flapping.
Draft level costs follow the level mechanism: each level forwards only the nodes it runs
(``level_widths``).

The cost model times ``tree_forward`` alone; a step in the decoding loop also pays the commits,
the verifier, the loop and CPU caches the other model evicted. So the drafter also times whole
steps (the wall time between consecutive ``draft`` calls, ``clock``): the ratio of measured to
predicted step time (decayed running mean, over all candidates) scales every prediction, and a
candidate that has run ``min_runs`` steps uses its own measured step time, as it uses its own
measured tau.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from stree.costmodel import ForwardCost, forward_cost
from stree.draft.base import Drafter
from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree, level_runs

DEFAULT_CANDIDATES = ("chain:1", "chain:2", "chain:3", "chain:4", "chain:5", "chain:6",
                      "static:fig4a", "static:B", "static:C", "static:D", "static:E",
                      "caterpillar:2,2,2,2", "caterpillar:2,2,2,2,2", "caterpillar:3,2,2,2,2",
                      "caterpillar:2,2,2,2,2,2", "dyspec:8", "dyspec:16", "dyspec:32")


@dataclass
class AcceptanceProfile:
    """Decayed counts per child rank: ``events[k]`` acceptances of a k-th child, ``at_risk[k]``
    reached nodes whose children ``0..k-1`` were all rejected and that had a k-th child."""

    max_rank: int = 32
    decay: float = 0.98
    prior_weight: float = 2.0
    events: list[float] = field(default_factory=list)
    at_risk: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.events = self.events or [0.0] * self.max_rank
        self.at_risk = self.at_risk or [0.0] * self.max_rank

    def hazards(self) -> list[float]:
        """``h_k``, with a prior of mean ``0.5 / (k + 1)`` worth ``prior_weight`` nodes."""
        w, out = self.prior_weight, []
        for k, (e, r) in enumerate(zip(self.events, self.at_risk)):
            mean = 0.5 / (k + 1)
            out.append((e + w * mean) / (r + w) if r + w > 0 else mean)
        return out

    def rank_probs(self) -> list[float]:
        out, alive = [], 1.0
        for h in self.hazards():
            out.append(alive * h)
            alive *= 1 - h
        return out

    def update(self, tree: TokenTree, path: Tensor) -> None:
        """Add one verified step: ``path (b, k)`` accepted nodes of ``tree``, -1 padded; rows
        that finished (all -1) are skipped."""
        self.events = [e * self.decay for e in self.events]
        self.at_risk = [r * self.decay for r in self.at_risk]
        for row, nodes in enumerate(path.tolist()):
            nodes = [u for u in nodes if u >= 0]
            for j, u in enumerate(nodes):
                kids = tree.children(row, u)
                rank = kids.index(nodes[j + 1]) if j + 1 < len(nodes) else len(kids)
                for k in range(min(rank + 1, len(kids), self.max_rank)):
                    self.at_risk[k] += 1.0
                if rank < min(len(kids), self.max_rank):
                    self.events[rank] += 1.0


def expected_tau(parents, p: list[float]) -> float:
    """``1 + sum_u prod p_rank`` over a parent list (siblings in draft order)."""
    value, seen, total = [1.0] + [0.0] * (len(parents) - 1), {}, 1.0
    for i, par in enumerate(parents[1:], start=1):
        rank = seen.get(par, 0)
        seen[par] = rank + 1
        value[i] = value[par] * (p[rank] if rank < len(p) else 0.0)
        total += value[i]
    return total


def best_tree(budget: int, p: list[float]) -> list[int]:
    """Parent list, layer by layer, of the ``budget``-node tree maximising :func:`expected_tau`
    (greedy on the slot values ``value(parent) * p_rank``)."""
    nodes = [(-1, 0)]  # (parent, depth)
    value = [1.0]
    heap = [(-p[0], 0, 0)]  # (-value, parent, rank)
    while len(nodes) <= budget and heap:
        v, par, rank = heapq.heappop(heap)
        nodes.append((par, nodes[par][1] + 1))
        value.append(-v)
        if rank + 1 < len(p):
            heapq.heappush(heap, (-value[par] * p[rank + 1], par, rank + 1))
        heapq.heappush(heap, (-value[-1] * p[0], len(nodes) - 1, 0))
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][1], i))
    where = {old: new for new, old in enumerate(order)}
    return [-1] + [where[nodes[i][0]] for i in order[1:]]


def level_widths(parents) -> list[int]:
    """Nodes each draft level runs (:func:`stree.tree.level_runs`, as a static drafter runs
    them: the deepest layer and leaves after a layer's last inner node never run)."""
    return [e - s for s, e in level_runs(parents)]


@dataclass(eq=False)
class AutoDrafter(Drafter):
    """Picks among ``candidates`` (drafter specs) by predicted tokens per second.

    ``target_cost`` / ``draft_cost`` are measured by :meth:`prepare` unless given (tests inject
    them, and ``clock``); ``profile`` is the running acceptance profile.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    target_cost: ForwardCost | None = None
    draft_cost: ForwardCost | None = None
    profile: AcceptanceProfile = field(default_factory=AcceptanceProfile)
    mode: str | None = None
    switch_margin: float = 0.03
    min_runs: int = 8
    clock: Callable[[], float] = time.perf_counter
    name: str = field(init=False, default="auto")
    _drafters: dict = field(init=False, repr=False)
    _measured: dict = field(init=False, repr=False)
    _timed: dict = field(init=False, repr=False)
    _scale: tuple[float, float] = field(init=False, default=(0.0, 0.0))  # decayed sums
    _step_start: float | None = field(init=False, default=None)
    _current: str | None = field(init=False, default=None)

    def __post_init__(self):
        from stree.draft.presets import parse_drafter

        if not self.candidates:
            raise ValueError("auto drafter needs at least one candidate")
        self._drafters = {spec: parse_drafter(spec) for spec in self.candidates}
        self._measured = {}  # spec -> (steps, tokens)
        self._timed = {}  # spec -> (steps, seconds), whole decoding steps

    # --------------------------------------------------------------------------------- shape
    @property
    def chosen(self) -> Drafter:
        return self._drafters[self._current or self.candidates[0]]

    @property
    def num_nodes(self) -> int:
        return max(d.num_nodes for d in self._drafters.values())

    @property
    def depth(self) -> int:
        return self.chosen.depth

    @property
    def num_forwarded(self) -> int:
        return self.chosen.num_forwarded

    @property
    def draft_runs(self) -> int:
        return self.chosen.draft_runs

    def ran(self, node: int) -> bool:
        return self.chosen.ran(node)

    @property
    def layered(self) -> bool:
        # compile=True needs every draft to come from a fixed template, whichever is chosen
        return all(d.layered for d in self._drafters.values())

    @property
    def max_leaves(self) -> int:
        return max(d.max_leaves for d in self._drafters.values())

    @property
    def mixes_chains(self) -> bool:
        return any("chain" in d.modes(SamplingConfig(1.0)) for d in self._drafters.values())

    @property
    def uses_draft_model(self) -> bool:
        return True

    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        if self.mode is not None:
            return (self.mode,)
        if sampling.is_greedy:
            return ("deterministic",)
        return ("without_replacement", "deterministic")

    def with_mode(self, mode: str) -> "AutoDrafter":
        if mode not in ("deterministic", "without_replacement"):
            raise ValueError(f"auto drafts 'deterministic' or 'without_replacement' trees, "
                             f"not {mode!r}")
        other = replace(self, mode=mode)
        for spec, d in other._drafters.items():  # chains keep drafting sampled chains
            if mode in d.modes(SamplingConfig(1.0)) + d.modes(SamplingConfig()):
                other._drafters[spec] = d.with_mode(mode)
        return other

    # ------------------------------------------------------------------------------ decision
    def prepare(self, target, draft) -> None:
        self._step_start = None  # a new generation: the time since the last step is not a step
        if self.target_cost is None:
            self.target_cost = forward_cost(target)
        if self.draft_cost is None:
            self.draft_cost = forward_cost(draft)

    def predict(self, spec: str) -> tuple[float, float]:
        """(predicted tau, predicted seconds per step) of a candidate: measured values once it
        has run ``min_runs`` steps, else the model's (step time scaled by the measured/modelled
        ratio of the steps timed so far)."""
        tau, seconds = self.model(spec)
        steps, tokens = self._measured.get(spec, (0, 0))
        if steps >= self.min_runs:
            tau = tokens / steps
        steps, total = self._timed.get(spec, (0, 0))
        if steps >= self.min_runs:
            return tau, total / steps
        measured, modelled = self._scale
        return tau, seconds * (measured / modelled if modelled > 0 else 1.0)

    def model(self, spec: str) -> tuple[float, float]:
        """(tau, seconds per step) of a candidate by the profile and the cost model alone."""
        if self.target_cost is None or self.draft_cost is None:
            raise ValueError("auto drafter has no cost model: call prepare(target, draft) or "
                             "pass target_cost and draft_cost")
        d, p = self._drafters[spec], self.profile.rank_probs()
        parents = getattr(d, "parents", None)
        if parents is None:  # a dynamic budget: the best tree of its size under the profile
            parents = best_tree(d.num_nodes - 1, p)
        seconds = self.target_cost(len(parents)) + sum(
            self.draft_cost(n) for n in level_widths(parents))
        return expected_tau(parents, p), seconds

    def choose(self) -> str:
        """The candidate with the most predicted tokens per second (Eq. 7/8: t / tau), keeping
        the current one unless another beats it by ``switch_margin``."""
        rate = {}
        for spec in self.candidates:
            tau, seconds = self.predict(spec)
            rate[spec] = tau / seconds
        best = max(rate, key=rate.get)
        current = self._current
        if current is not None and rate[best] < rate[current] * (1 + self.switch_margin):
            return current
        return best

    # ---------------------------------------------------------------------------- decoding
    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> Draft:
        now = self.clock()
        if self._step_start is not None and self._current is not None:
            self._time_step(self._current, now - self._step_start)
        self._step_start = now
        self._current = self.choose()
        return self.chosen.draft(model, cache, roots, sampling, generator)

    def _time_step(self, spec: str, seconds: float) -> None:
        """Record one whole step of ``spec`` (decayed like the acceptance profile)."""
        decay = self.profile.decay
        steps, total = self._timed.get(spec, (0, 0))
        self._timed[spec] = (steps * decay + 1, total * decay + seconds)
        measured, modelled = self._scale
        self._scale = (measured * decay + seconds, modelled * decay + self.model(spec)[1])

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        self.profile.update(tree, path)
        live = path[:, 0] >= 0
        steps, tokens = self._measured.get(self._current, (0, 0))
        decay = self.profile.decay  # the measured tau follows drift like the profile
        self._measured[self._current] = (steps * decay + int(live.sum()),
                                         tokens * decay + int((path >= 0)[live].sum()))
        self.chosen.observe(tree, path)
