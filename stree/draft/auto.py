"""``drafter="auto"``: the tree that maximises predicted tokens per second, re-chosen every step.

STree's Eq. 7 / 8: wall time per token = t(N) / tau. Here a step costs
``t_target(n) + sum over draft levels of t_draft(nodes that level forwards)``, with both ``t``
measured once per model, device and dtype (:mod:`stree.costmodel`, cached on disk), and tau is
predicted from a running acceptance profile:

* ``h[d][k]``: probability that a depth-``d`` node's k-th child (draft order) is accepted
  given the node was reached and children ``0..k-1`` were not, estimated from every verdict
  (a depth's counts decay by ``decay`` per step that reaches it, so the profile follows drift;
  a Beta prior fills unseen ranks, an unseen depth takes the depth above's hazards).
  ``p[d][k] = h[d][k] prod_{j<k} (1 - h[d][j])``. Depth matters, unlike DySpec's assumption 2:
  acceptance grows with depth (a draft in step with the target stays so), so hazards pooled
  over depth, measured while a short chain ran, predicted every deep shape too low (on the
  shipped pair auto then sat on ``chain:2`` for the rest of an 80-prompt HumanEval run at
  T = 0: 0.87 of the best fixed choice).
* At T > 0 children are drawn and verified by different rules per draft mode (a sampled chain
  is verified by ASpS under ``mss+asps``, a tree's children by MSS), so each mode also keeps its
  own profile, shrunk to the pooled one (``prior_weight`` nodes), and predicts its candidates
  from it. At T = 0 every mode is verified by the same greedy rule and one pooled profile
  serves all.
* A fixed shape's tau is ``1 + sum over nodes of the product of p[depth][rank] along its
  path``; a dynamic budget ``dyspec:N`` is predicted by the best N-node tree under ``p``
  (greedy, DySpec Thm D.1), which it adapts per step.
* The model misses in ways the profile cannot see (ASpS's acceptance grows with the chain's
  length; acceptance is correlated along a path), so each candidate also keeps its measured
  tau against the tau the model predicted for the same steps, and its prediction is the
  model's times that ratio, shrunk to 1 as if the model had been right for ``prior_steps``
  (8) steps. A ratio, not the measured tau itself: a candidate measured on an easy prompt is
  not favoured on a hard one, since the model's tau moved with the prompt too.

Candidates (:func:`default_candidates`, by device): on CUDA chains ``chain:1..6``, the static
presets, caterpillars of depth 3 to 6 and ``dyspec:8/16/32``; elsewhere ``caterpillar:2,2,2``,
``chain:4`` and ``caterpillar:2,2,2,2``, whose draft runs one node per level (every candidate
costs exploration); then suffix trees alone and merged (:data:`SUFFIX_CANDIDATES`), and
:data:`OFF`. A switch needs a predicted gain of ``switch_margin`` (3%) to avoid flapping.
Draft level costs follow the level mechanism: each level forwards only the nodes it runs
(``level_widths``).

What auto learns (profiles, measured taus and step times, its current choice) is an
:class:`AutoMemory`, kept per target/draft pair, candidate set and sampling setting for the
life of the two models: a later ``generate`` call with the same pair starts where the last
one stopped, so learning and exploration are paid once per pair and setting, not once per
prompt (:func:`forget`, or ``AutoDrafter(default_candidates(device), remember=False)``, for a cold
start).

The cost model times ``tree_forward`` alone; a step in the decoding loop also pays the commits,
the verifier, the loop and CPU caches the other model evicted. So the drafter also times whole
steps (the wall time between consecutive ``draft`` calls, ``clock``): the ratio of measured to
predicted step time over all candidates scales every prediction, and each candidate's own
ratio is shrunk to it as its tau ratio is shrunk to 1.

In a batch every row runs its own nodes, so a step's predicted seconds count the per-node cost
once per row (:class:`ForwardCost` with ``rows``); and a batch decodes until its slowest row is
done, so a suffix tree's predicted score is that of the rows furthest behind (the fewest tokens
so far) and a step's measured tau is how far it moved the slowest live row: over a request these
sum to the tokens the whole batch completes, where a mean over rows overstates what a draft
gains (at batch 4 on the shipped pair, averaging over all rows chose suffix trees that ran at
0.73-0.86x the model's own decoding at T = 0).

It starts from its first candidate, the device's default tree, and runs it for ``warmup`` (8)
steps before it chooses, so every depth up to the default tree's has been measured before the
first choice (a short chain, which the uninformed prior favours, would measure only the
shallow levels; before the profile kept depths apart, auto sat on ``chain:2`` for many prompts
that way, at T = 0 from the start, at T = 1 once mid-run). At T > 0, where each
draft mode keeps its own profile, it then runs the first candidate of every other mode
(``chain:4``, verified by ASpS) for as many steps: a warm-up on the MSS tree alone left the ASpS
chains looking worse than they are. Last, :data:`OFF` runs for as many steps, so that the
model's own step is measured before it is weighed against drafting. The warm-up's verdicts go to
the profiles, not to the measured tau ratios (its predictions come from profiles still learning).

One candidate, :data:`OFF`, drafts nothing: the step is the target's one-token step (a
root-only tree through the loop, what ``method="ar-tree"`` runs) and the draft model runs
nothing, so the step costs what the model's own decoding through stree costs. It is predicted
at one token per ``t_target(1)``, corrected by its measured step time like every candidate, and
chosen where no draft is predicted to pay for itself. The tokens the draft model misses are its
backlog (as after a suffix tree's step): the next step that drafts with the model runs them as
its lead (at most ``MAX_LEAD``) or prefills them first. Off, the draft model's predictions stay
as its last verdicts left them, so after ``probe`` (4) steps off in a row one step drafts with
the best-rated draft-model candidate (a probe), and each return to off after a probe doubles the
interval, up to ``max_probe`` (64): the probes cost at most one step in 65 where the draft never
pays, and its verdicts bring ``auto`` back when the text turns predictable (a suffix tree's
prediction follows the text every step, off or not).

Choices are made by optimism in the face of uncertainty: a candidate timed over ``n`` steps
gets a bonus of ``optimism / sqrt(1 + n)`` (20%) on its predicted tokens per second, so the
model's near misses are tried and then judged by their own measurements (a 10% bonus did worse
on the shipped pair at T = 1).
"""
from __future__ import annotations

import heapq
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import Tensor

from stree.costmodel import ForwardCost, forward_cost
from stree.draft.base import MAX_LEAD, SAMPLED_MODES, Drafter
from stree.draft.merged import MergedDrafter, all_chosen
from stree.draft.presets import parse_tree
from stree.draft.static import StaticTreeDrafter
from stree.draft.suffix import ContextIndex, SuffixDrafter
from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree, level_runs

DEFAULT_CANDIDATES = ("static:fig4a", "chain:1", "chain:2", "chain:3", "chain:4", "chain:5", "chain:6",
                      "static:B", "static:C", "static:D", "static:E",
                      "caterpillar:2,2,2", "caterpillar:2,2,2,2", "caterpillar:2,2,2,2,2", "caterpillar:3,2,2,2,2",
                      "caterpillar:2,2,2,2,2,2", "dyspec:8", "dyspec:16", "dyspec:32")
# Off a GPU every node a draft level runs costs a draft step, so only shapes that draft one node
# per level pay (docs/benchmarks.md), and every extra candidate costs exploration: on the shipped
# pair (CPU, commit e1408cf) auto over the 18 GPU candidates it had then ran 3-7% slower than over 5
# of these, side by side; with the suffix trees beside them, over 9 candidates 1.57x the model's
# own decoding against 1.76x over 3 (10 HumanEval prompts, one run), so three model trees remain.
CPU_CANDIDATES = ("caterpillar:2,2,2", "chain:4", "caterpillar:2,2,2,2")


# Trees that need no draft model (suffix trees, ``suffix.py``) and their merges with the draft's
# (``merged.py``): a step drafts with the model only where that is predicted to pay.
SUFFIX_CANDIDATES = {"cuda": ("suffix:32", "static:fig4a+suffix:32", "chain:4+suffix:32"),
                     "cpu": ("suffix:16", "caterpillar:2,2,2,2+suffix:16")}

# The candidate that drafts nothing: the target's one-token step (a root-only tree, as ``ar-tree``
# runs it) and no draft-model work, for steps where no draft is predicted to pay.
OFF = "off"


def default_candidates(device=None, draft_model: bool = True) -> tuple[str, ...]:
    """The candidates ``"auto"`` picks among on ``device``: on CUDA, where a level or a verify of
    many nodes costs about one, chains, static presets, caterpillars and DySpec budgets
    (:data:`DEFAULT_CANDIDATES`); elsewhere chains and caterpillars (:data:`CPU_CANDIDATES`);
    then suffix trees alone and merged with the draft's (:data:`SUFFIX_CANDIDATES`). Each
    starts with the device's default tree (``stree.default_drafter``), where auto starts, and
    ends with :data:`OFF`, no draft at all. Without a draft model: the suffix trees alone, and
    :data:`OFF`."""
    cuda = torch.device(device or "cpu").type == "cuda"
    suffix = SUFFIX_CANDIDATES["cuda" if cuda else "cpu"]
    if not draft_model:
        return tuple(c for c in suffix if "+" not in c) + (OFF,)
    return (DEFAULT_CANDIDATES if cuda else CPU_CANDIDATES) + suffix + (OFF,)


@dataclass
class AcceptanceProfile:
    """Decayed counts per depth and child rank: ``events[d][k]`` acceptances of the k-th child
    of a depth-``d`` node (the root is depth 0), ``at_risk[d][k]`` reached depth-``d`` nodes
    whose children ``0..k-1`` were all rejected and that had a k-th child. Nodes at depth
    ``max_depth - 1`` or deeper share the last row.

    A depth's counts decay only on steps that reach it: a short chain run for a while leaves
    what deeper levels showed as it was, where a pooled, all-decaying profile forgot it and
    predicted every deep shape from the shallow, least accepted levels (auto then sat on
    ``chain:2`` for whole prompt sets)."""

    max_rank: int = 16
    max_depth: int = 8
    decay: float = 0.98
    prior_weight: float = 2.0
    events: list[list[float]] = field(default_factory=list)
    at_risk: list[list[float]] = field(default_factory=list)

    def __post_init__(self):
        self.events = self.events or [[0.0] * self.max_rank for _ in range(self.max_depth)]
        self.at_risk = self.at_risk or [[0.0] * self.max_rank for _ in range(self.max_depth)]

    def hazards(self, prior: list[list[float]] | None = None, ranks: int | None = None) -> list[list[float]]:
        """``h[d][k]`` for the first ``ranks`` ranks (all by default), each with a prior worth
        ``prior_weight`` nodes: of mean ``prior[d][k]`` when given (another profile's hazards),
        else the depth above's ``h[d-1][k]`` (depth 0: ``0.5 / (k + 1)``), so an unseen depth is
        predicted like the nearest seen one."""
        w, out, n = self.prior_weight, [], self.max_rank if ranks is None else min(ranks, self.max_rank)
        for d, (events, at_risk) in enumerate(zip(self.events, self.at_risk)):
            means = (prior[d] if prior is not None else out[-1] if out
                     else [0.5 / (k + 1) for k in range(n)])
            out.append([(e + w * m) / (r + w) if r + w > 0 else m
                        for e, r, m in zip(events[:n], at_risk[:n], means)])
        return out

    def rank_probs(self, prior: list[list[float]] | None = None, ranks: int | None = None) -> list[list[float]]:
        """``p[d][k]``: probability that a reached depth-``d`` node's k-th child is accepted (the
        first ``ranks`` ranks; all by default)."""
        out = []
        for hazards in self.hazards(prior, ranks):
            row, alive = [], 1.0
            for h in hazards:
                row.append(alive * h)
                alive *= 1 - h
            out.append(row)
        return out

    def update(self, tree: TokenTree, path: Tensor) -> None:
        """Add one verified step: ``path (b, k)`` accepted nodes of ``tree``, -1 padded; rows
        that finished (all -1) are skipped."""
        self.add(*rank_counts(tree, path, self.max_rank, self.max_depth))

    def add(self, events: list[list[float]], at_risk: list[list[float]]) -> None:
        """Add one step's counts (:func:`rank_counts`), first decaying by one step the depths
        it reached."""
        for d, (new_events, new_at_risk) in enumerate(zip(events, at_risk)):
            if any(new_at_risk):
                self.events[d] = [e * self.decay + x for e, x in zip(self.events[d], new_events)]
                self.at_risk[d] = [r * self.decay + x for r, x in zip(self.at_risk[d], new_at_risk)]


def rank_counts(tree: TokenTree, path: Tensor | list, max_rank: int,
                max_depth: int) -> tuple[list[list[float]], list[list[float]]]:
    """One verified step's (acceptances, nodes at risk) per depth and child rank (see
    :class:`AcceptanceProfile`); rows that finished (``path`` all -1) count nothing. ``path``:
    the tensor, or its ``tolist()`` when the caller reads it anyway."""
    events = [[0.0] * max_rank for _ in range(max_depth)]
    at_risk = [[0.0] * max_rank for _ in range(max_depth)]
    for row, nodes in enumerate(path.tolist() if isinstance(path, Tensor) else path):
        nodes = [u for u in nodes if u >= 0]
        for j, u in enumerate(nodes):  # the j-th accepted node sits at depth j
            kids, d = tree.children(row, u), min(j, max_depth - 1)
            rank = kids.index(nodes[j + 1]) if j + 1 < len(nodes) else len(kids)
            for k in range(min(rank + 1, len(kids), max_rank)):
                at_risk[d][k] += 1.0
            if rank < min(len(kids), max_rank):
                events[d][rank] += 1.0
    return events, at_risk


@dataclass
class Ratio:
    """Decayed sums of a quantity as measured and as the model predicted it when it was
    measured, over ``n`` (decayed) observations."""

    n: float = 0.0
    measured: float = 0.0
    modelled: float = 0.0

    def add(self, measured: float, modelled: float, decay: float, n: float = 1.0) -> None:
        self.n = self.n * decay + n
        self.measured = self.measured * decay + measured
        self.modelled = self.modelled * decay + modelled

    def value(self, prior: float, weight: float) -> float:
        """measured / modelled, shrunk to ``prior`` as if it had been seen ``weight`` times."""
        if self.modelled <= 0 or self.n + weight <= 0:
            return prior
        return (self.n * self.measured / self.modelled + weight * prior) / (self.n + weight)


@dataclass
class AutoMemory:
    """What auto has learnt for one target/draft pair, candidate set and sampling setting.

    ``profile`` pools every verdict; ``by_mode`` (T > 0 only) holds each draft mode's own;
    ``taus`` / ``times``: per candidate spec, its accepted tokens per row-step and its whole
    step's seconds against the model's; ``scale``: step seconds against the model's over all
    candidates; ``suffix``: drafted tokens accepted from suffix trees against their scores;
    ``current``: the candidate running now; ``steps``: verified steps seen; ``chosen``: steps
    each candidate ran (plain counts, for reports); ``idle`` / ``probe_every``: steps run
    :data:`OFF` since the last probe, and how many it runs before the next (0: not yet off).
    """

    profile: AcceptanceProfile = field(default_factory=AcceptanceProfile)
    by_mode: dict[str, AcceptanceProfile] = field(default_factory=dict)
    taus: dict[str, Ratio] = field(default_factory=dict)
    times: dict[str, Ratio] = field(default_factory=dict)
    scale: Ratio = field(default_factory=Ratio)
    suffix: Ratio = field(default_factory=Ratio)
    current: str | None = None
    steps: int = 0
    chosen: dict[str, int] = field(default_factory=dict)
    idle: int = 0
    probe_every: int = 0


# target -> draft -> (candidates, mode, sampling) -> AutoMemory; entries go with the models
_MEMORY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forget() -> None:
    """Drop what every ``auto`` drafter has learnt (the next ``generate`` starts cold)."""
    _MEMORY.clear()


def _remembered(target, draft, key, fresh: AutoMemory) -> AutoMemory:
    """The memory of ``key`` for this model pair, ``fresh`` stored as it if there is none (or
    when the models cannot be weakly referenced)."""
    try:
        per_draft = _MEMORY.setdefault(target, weakref.WeakKeyDictionary())
        return per_draft.setdefault(draft, {}).setdefault(key, fresh)
    except TypeError:
        return fresh


def _at(p: list[list[float]], depth: int) -> list[float]:
    """Depth ``depth``'s row of per-depth probabilities (the last row serves deeper ones)."""
    return p[min(depth, len(p) - 1)]


def expected_tau(parents, p: list[list[float]]) -> float:
    """``1 + sum_u prod p[depth][rank]`` over a parent list (siblings in draft order);
    ``p[d][k]``: probability that a reached depth-``d`` node's k-th child is accepted."""
    value, depth, seen, total = [1.0] * len(parents), [0] * len(parents), {}, 1.0
    for i, par in enumerate(parents[1:], start=1):
        rank = seen.get(par, 0)
        seen[par] = rank + 1
        row = _at(p, depth[par])
        value[i] = value[par] * (row[rank] if rank < len(row) else 0.0)
        depth[i] = depth[par] + 1
        total += value[i]
    return total


def best_tree(budget: int, p: list[list[float]]) -> list[int]:
    """Parent list, layer by layer, of the ``budget``-node tree maximising :func:`expected_tau`
    (greedy on the slot values ``value(parent) * p[depth(parent)][rank]``: a child's value never
    exceeds its parent's, so the greedy order is DySpec's optimal construction)."""
    nodes = [(-1, 0)]  # (parent, depth)
    value = [1.0]
    heap = [(-_at(p, 0)[0], 0, 0)]  # (-value, parent, rank)
    while len(nodes) <= budget and heap:
        v, par, rank = heapq.heappop(heap)
        nodes.append((par, nodes[par][1] + 1))
        value.append(-v)
        row = _at(p, nodes[par][1])
        if rank + 1 < len(row):
            heapq.heappush(heap, (-value[par] * row[rank + 1], par, rank + 1))
        heapq.heappush(heap, (-value[-1] * _at(p, nodes[-1][1])[0], len(nodes) - 1, 0))
    order = sorted(range(len(nodes)), key=lambda i: (nodes[i][1], i))
    where = {old: new for new, old in enumerate(order)}
    return [-1] + [where[nodes[i][0]] for i in order[1:]]


def level_widths(parents) -> list[int]:
    """Nodes each draft level runs (:func:`stree.tree.level_runs`, as a static drafter runs
    them: the deepest layer and leaves after a layer's last inner node never run)."""
    return [e - s for s, e in level_runs(parents)]


@dataclass(eq=False)
class AutoDrafter(Drafter):
    """Picks among ``candidates`` (drafter specs) by predicted tokens per second. The default is
    the CUDA set; ``drafter="auto"`` passes :func:`default_candidates` of the target's device.

    ``target_cost`` / ``draft_cost`` are measured by :meth:`prepare` unless given (tests inject
    them, and ``clock``); ``memory`` is what it has learnt, replaced in :meth:`prepare` by the
    memory kept for the model pair and sampling setting unless ``remember`` is False.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    target_cost: ForwardCost | None = None
    draft_cost: ForwardCost | None = None
    memory: AutoMemory = field(default_factory=AutoMemory)
    mode: str | None = None
    switch_margin: float = 0.03
    warmup: int = 8
    prior_steps: float = 8.0
    optimism: float = 0.2
    probe: int = 4
    max_probe: int = 64
    by_mode: bool = False  # one profile per draft mode (set by prepare at T > 0)
    remember: bool = True
    index: "ContextIndex | None" = None
    clock: Callable[[], float] = time.perf_counter
    name: str = field(init=False, default="auto")
    _drafters: dict = field(init=False, repr=False)
    _shapes: dict = field(init=False, repr=False)  # spec -> (parents, level widths), fixed shapes
    _step_start: float | None = field(init=False, default=None)
    _step_model: tuple[float, float] | None = field(init=False, default=None)  # (tau, s) now
    # tokens the draft model has not run (the loop's backlog, max over rows), whether the loop
    # runs them in the next draft's roots' pass (a lead: set by prepare), and this step's choice
    # once made (by wants_draft_model or draft)
    _lag: int = field(init=False, default=0)
    _lead: bool = field(init=False, default=False)
    _planned: str | None = field(init=False, default=None)
    _rows: int = field(init=False, default=1)  # rows of this step's batch (each costs its nodes)
    # tokens each row has emitted in this generation, the rows that have finished, and this
    # step's rows furthest behind (the fewest tokens; the rows a batch's step count waits for)
    _emitted: list = field(init=False, default_factory=list)
    _done: set = field(init=False, default_factory=set)
    _behind: list = field(init=False, default_factory=lambda: [0])
    _probs: dict = field(init=False, default_factory=dict)  # this step's rank_probs by mode (and pooled hazards)
    _ranks: int = field(init=False, default=1)

    def __post_init__(self):
        if not self.candidates:
            raise ValueError("auto drafter needs at least one candidate")
        self.index = self.index if self.index is not None else ContextIndex()
        self._drafters = {spec: StaticTreeDrafter((-1,), mode="deterministic", name=OFF) if spec == OFF
                          else parse_tree(spec, index=self.index) for spec in self.candidates}
        self._shapes = {spec: (d.parents, level_widths(d.parents))
                        for spec, d in ((spec, _model_part(d)) for spec, d in self._drafters.items())
                        if getattr(d, "parents", None)}
        self._lag, self._planned = 0, None
        # the most children of a node any draft-model candidate drafts (a dynamic budget: its
        # size): the ranks its predictions read, all that rank_probs computes each step
        self._ranks = max((_model_part(d).max_children for d in self._drafters.values() if d.uses_draft_model),
                          default=1)

    # --------------------------------------------------------------------------------- shape
    @property
    def chosen(self) -> Drafter:
        return self._drafters[self.memory.current or self.candidates[0]]

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
        # compile=True needs every draft to come from a fixed template, whichever is chosen (its
        # lead graphs are compiled by drafting with a lead before the first step, which a
        # candidate without a draft model would refuse)
        return all(d.layered for d in self._drafters.values())

    @property
    def max_leaves(self) -> int:
        return max(d.max_leaves for d in self._drafters.values())

    @property
    def mixes_chains(self) -> bool:
        return any("chain" in d.modes(SamplingConfig(1.0)) for d in self._drafters.values())

    @property
    def uses_draft_model(self) -> bool:
        return any(d.uses_draft_model for d in self._drafters.values())

    @property
    def reads_context(self) -> bool:
        return any(d.reads_context for d in self._drafters.values())

    def takes_lead(self, model, sampling: SamplingConfig) -> bool:
        # whichever draft-model candidate is chosen must take it (the loop passes a lead only to
        # a step that runs the draft model; a suffix tree alone never gets one)
        return any(d.uses_draft_model for d in self._drafters.values()) and all(
            d.takes_lead(model, sampling) for d in self._drafters.values() if d.uses_draft_model)

    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        if self.mode is not None:
            return (self.mode,)
        if sampling.is_greedy or not self.uses_draft_model:  # suffix trees are chosen, not drawn
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
    def prepare(self, target, draft, sampling: SamplingConfig) -> None:
        self._step_start = None  # a new generation: the time since the last step is not a step
        self._lag, self._planned, self._probs = 0, None, {}
        self._emitted, self._done = [], set()
        self._lead = draft is not None and self.takes_lead(draft, sampling)
        self.by_mode = not sampling.is_greedy
        self.index.bind(target)
        if self.remember:
            key = (self.candidates, self.mode, sampling)
            self.memory = _remembered(target, draft if draft is not None else target, key, self.memory)
        if self.target_cost is None:
            self.target_cost = forward_cost(target)
        if self.draft_cost is None and draft is not None:
            self.draft_cost = forward_cost(draft)

    def start(self, prompts: list[list[int]]) -> None:
        self.index.start(prompts)

    def finish(self, outputs: list[list[int]]) -> None:
        self.index.finish(outputs)

    def predict(self, spec: str, p: list[float] | None = None) -> tuple[float, float]:
        """(predicted tau, predicted seconds per step) of a candidate: the model's, each times
        the candidate's own measured/modelled ratio, shrunk (``prior_steps`` steps) to 1 for
        tau and to every candidate's ratio for seconds. ``p``: the rank probabilities of its
        mode, if already computed."""
        tau, seconds = self.model(spec, p)
        mem, w = self.memory, self.prior_steps
        scale = mem.scale.value(1.0, 0.0)
        return (tau * mem.taus.get(spec, Ratio()).value(1.0, w),
                seconds * mem.times.get(spec, Ratio()).value(scale, w))

    def model(self, spec: str, p: list[float] | None = None) -> tuple[float, float]:
        """(tau, seconds per step) of a candidate by the profile, this step's suffix trees and
        the cost model alone.

        A suffix tree's tau is one plus its score (the sum of its nodes' count probabilities,
        averaged over rows) times the fraction of scores that suffix trees have turned into
        accepted tokens so far (counts overrate a continuation seen once or twice: on the
        shipped pair about 0.3-0.5; prior 0.5 for ``prior_steps`` steps); it costs a verify of
        its size and no draft call. A draft model's
        tree also pays for bringing the draft up to the tokens it has not run (a prefill of
        the backlog). A merged tree is predicted as ``1 + max(a, s) + min(a, s) / 2`` (``a``,
        ``s``: the draft tree's and the suffix tree's expected accepted tokens; they overlap
        where the draft agrees with the text), corrected like every prediction by the
        candidate's measured ratio (:meth:`predict`)."""
        d = self._drafters[spec]
        if self.target_cost is None or (self.draft_cost is None and d.uses_draft_model):
            raise ValueError("auto drafter has no cost model: call prepare(target, draft, sampling) or "
                             "pass target_cost and draft_cost")
        if spec == OFF:  # one token per one-token step; the backlog waits for the next draft
            return 1.0, self.target_cost(1, self._rows)
        suffix = _suffix_part(d)
        if suffix is not None:
            specs = self.index.speculate(suffix.config)
            behind = [specs[r] for r in self._behind]
            score = self.memory.suffix.value(0.5, self.prior_steps) * sum(t.score for t in behind) / len(behind)
            extra = max(len(t) for t in specs)
            if not d.uses_draft_model:
                return 1.0 + score, self.target_cost(1 + extra, self._rows)
        base = _model_part(d)
        p = self.rank_probs(base.mode) if p is None else p
        shape = self._shapes.get(spec)
        if shape is None:  # a dynamic budget: the best tree of its size under the profile
            parents = best_tree(base.num_nodes - 1, p)
            shape = parents, level_widths(parents)
        parents, widths = shape
        backlog = 0.0
        if self._lag and self._lead and self._lag <= MAX_LEAD:  # run in the roots' pass
            widths = [widths[0] + self._lag, *widths[1:]]
        elif self._lag:  # a prefill of its own first
            backlog = self.draft_cost(self._lag, self._rows)
        draft_s = sum(self.draft_cost(n, self._rows) for n in widths) + backlog
        tau = expected_tau(parents, p)
        if suffix is None:
            return tau, self.target_cost(len(parents), self._rows) + draft_s
        a = tau - 1.0
        return (1.0 + max(a, score) + min(a, score) / 2,
                self.target_cost(len(parents) + extra, self._rows) + draft_s)

    def rank_probs(self, mode: str) -> list[list[float]]:
        """``p[d][k]`` for children drafted in ``mode``: the pooled profile's, or with
        ``by_mode`` that mode's own profile shrunk to the pooled one. Computed once per step
        and mode (the profiles change only in :meth:`observe`)."""
        key = (mode, self.by_mode)
        if key not in self._probs:
            pooled = self.memory.profile
            own = self.memory.by_mode.get(mode) if self.by_mode else None
            if own is None:
                self._probs[key] = pooled.rank_probs(ranks=self._ranks)
            else:
                if "pooled" not in self._probs:
                    self._probs["pooled"] = pooled.hazards(ranks=self._ranks)
                self._probs[key] = own.rank_probs(self._probs["pooled"], self._ranks)
        return self._probs[key]

    def choose(self) -> str:
        """The candidate with the most predicted tokens per second (Eq. 7/8: t / tau), keeping
        the current one unless another beats it by ``switch_margin``. Optimism in the face of
        uncertainty: a candidate timed over ``n`` steps gets a bonus of ``optimism /
        sqrt(1 + n)``, so the model's near misses get tried and then judged by their own
        measurements. A new memory first runs each draft mode's first candidate for ``warmup``
        steps (at T = 0, where one profile serves every mode, just the first candidate), then
        :data:`OFF` for as many."""
        if self._warming_up(self.memory.steps):
            return self._warmup_order()[self.memory.steps // self.warmup]
        rate, probs = {}, {}
        for spec, d in self._drafters.items():
            mode = _model_part(d).mode
            if d.uses_draft_model and mode not in probs:
                probs[mode] = self.rank_probs(mode)
            tau, seconds = self.predict(spec, probs.get(mode))
            steps = self.memory.times.get(spec, Ratio()).n
            rate[spec] = tau / seconds * (1 + self.optimism / (1 + steps) ** 0.5)
        best = max(rate, key=rate.get)
        current = self.memory.current
        if current in rate and rate[best] < rate[current] * (1 + self.switch_margin):
            best = current
        return self._explore(best, rate)

    def _explore(self, choice: str, rate: dict[str, float]) -> str:
        """``choice``, except that after ``probe_every`` steps :data:`OFF` in a row one step runs
        the best-rated draft-model candidate (a probe; the best other candidate without a draft
        model): off, the draft model's predictions stay as its last verdicts left them, and a
        probe's verdicts and timing let ``auto`` come back when the text turns predictable (a
        suffix tree's prediction follows the text every step anyway). The interval starts at
        ``probe`` steps and doubles, up to ``max_probe``, each time ``auto`` goes back off after
        a probe: then at most one step in ``max_probe + 1`` drafts in vain. Any other choice
        resets it."""
        mem = self.memory
        if choice != OFF:
            mem.probe_every = mem.idle = 0
            return choice
        if not mem.probe_every:  # going off
            mem.probe_every = self.probe
        elif not mem.idle:  # back off right after a probe
            mem.probe_every = min(2 * mem.probe_every, self.max_probe)
        if mem.idle < mem.probe_every:
            mem.idle += 1
            return OFF
        others = [spec for spec in rate if spec != OFF]
        drafting = [spec for spec in others if self._drafters[spec].uses_draft_model] or others
        if not drafting:
            return OFF
        mem.idle = 0
        return max(drafting, key=rate.get)

    def _warming_up(self, step: int) -> bool:
        """Whether step ``step`` (0-based, of this memory) runs the warm-up (:meth:`choose`);
        the candidates' count bounds its length without building the order, on every step."""
        return step < self.warmup * len(self.candidates) and step < self.warmup * len(self._warmup_order())

    def _warmup_order(self) -> list[str]:
        """The first draft-model candidate of each profile's draft mode (one profile unless
        ``by_mode``), then :data:`OFF`, whose step is measured rather than taken from the cost
        model (timed on one row: a batch's one-token step is not its multiple); suffix trees
        are predicted from their own counts and need none."""
        firsts: dict = {}
        for spec, d in self._drafters.items():
            if d.uses_draft_model:
                firsts.setdefault(_model_part(d).mode if self.by_mode else None, spec)
        return list(firsts.values()) + ([OFF] if OFF in self._drafters else [])

    # ---------------------------------------------------------------------------- decoding
    def wants_draft_model(self, roots: Tensor) -> bool:
        return self._drafters[self._plan(roots)].uses_draft_model

    def _plan(self, roots: Tensor) -> str:
        """This step's candidate, chosen once (the loop asks before drafting whether the draft
        model runs, to bring it up to date first)."""
        if self._planned is not None:
            return self._planned
        now, mem = self.clock(), self.memory
        if self._step_start is not None and self._step_model is not None:
            mem.scale.add(now - self._step_start, self._step_model[1], mem.profile.decay)
            mem.times.setdefault(mem.current, Ratio()).add(
                now - self._step_start, self._step_model[1], mem.profile.decay)
        self._step_start = now
        self._rows = roots.shape[0]
        if len(self._emitted) != self._rows:
            self._emitted = [0] * self._rows
        live = [r for r in range(self._rows) if r not in self._done] or list(range(self._rows))
        least = min(self._emitted[r] for r in live)
        self._behind = [r for r in live if self._emitted[r] == least]
        if self.reads_context:
            self.index.root(roots.tolist())
        mem.current = self.choose()
        mem.chosen[mem.current] = mem.chosen.get(mem.current, 0) + 1
        self._step_model = self.model(mem.current)
        self._planned = mem.current
        return mem.current

    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None, lead: Tensor | None = None) -> Draft:
        spec = self._plan(roots)
        d = self._drafters[spec]
        self._planned = None
        if spec == OFF:  # a root-only tree, no draft-model call (its backlog waits for the next draft)
            model = cache = None
        args = (model, cache, roots, sampling, generator)
        out = d.draft(*args) if lead is None else d.draft(*args, lead=lead)
        if d.uses_draft_model:
            self._lag = 0  # the backlog ran: caught up before this draft, or as its lead
        if self.mode in SAMPLED_MODES and out.mode == "deterministic":
            out = all_chosen(out, self.mode)  # a suffix tree; one verifier for all: MSS, as naive
        return out

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        mem = self.memory
        self._probs = {}
        mem.steps += 1
        paths = path.tolist()  # the step's one read of the verdicts, for every count below
        d = self.chosen
        if d.uses_draft_model:  # the draft's acceptance profile, from its own tree's nodes
            own_tree, own_paths = d.base_view(path) if isinstance(d, MergedDrafter) else (tree, paths)
            pooled = mem.profile
            counts = rank_counts(own_tree, own_paths, pooled.max_rank, pooled.max_depth)
            pooled.add(*counts)
            if self.by_mode:  # each mode's own profile decays only with its own steps
                mem.by_mode.setdefault(_model_part(d).mode, AcceptanceProfile(
                    pooled.max_rank, pooled.max_depth, pooled.decay, pooled.prior_weight)).add(*counts)
        # each row's path nodes this step (None: a finished row)
        counts = [sum(u >= 0 for u in p) if p[0] >= 0 else None for p in paths]
        rows = [r for r, n in enumerate(counts) if n is not None]
        if len(self._emitted) != len(paths):  # a step it did not plan: rows new to it
            self._emitted = [0] * len(paths)
        # the measured tau follows drift like the profile; it is how far the step moved the batch's
        # slowest live row (one row: its path nodes), since a batch decodes until that row is done.
        # Not in the warm-up, whose predictions come from a profile still learning: a ratio to
        # them says little of the candidate, and a mode's first candidate, run only there, kept
        # it (chain:4 at T = 1, never chosen again)
        if self._step_model is not None and rows and not self._warming_up(mem.steps - 1):
            advance = (min(self._emitted[r] + counts[r] for r in rows)
                       - min(self._emitted[r] for r in rows))
            mem.taus.setdefault(mem.current, Ratio()).add(advance, self._step_model[0], mem.profile.decay)
        for r, n in enumerate(counts):
            if n is None:
                self._done.add(r)
            else:
                self._emitted[r] += n
        if isinstance(d, SuffixDrafter) and rows:  # what the suffix trees' scores turn into
            specs = self.index.speculate(d.config)
            mem.suffix.add(sum(counts[r] - 1 for r in rows), sum(specs[r].score for r in rows),
                           mem.profile.decay, len(rows))
        # the loop's backlog: path nodes the draft did not run
        unrun = max((n - next((j for j, u in enumerate(p) if u < 0 or not d.ran(u)), len(p))
                     for p, n in zip(paths, counts) if n is not None), default=0)
        self._lag = (0 if d.uses_draft_model else self._lag) + unrun
        if self.reads_context:
            self.index.observe(tree, path)
        if isinstance(d, MergedDrafter):
            d.base.observe(*d.base_view(path))
        elif not d.reads_context:
            d.observe(tree, path)


def _model_part(d: Drafter) -> Drafter:
    """The draft-model drafter of a candidate (a merged tree's base)."""
    return d.base if isinstance(d, MergedDrafter) else d


def _suffix_part(d: Drafter) -> SuffixDrafter | None:
    return d.suffix if isinstance(d, MergedDrafter) else d if isinstance(d, SuffixDrafter) else None
