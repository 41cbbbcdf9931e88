"""Static-shape tree drafter: a fixed parent list whose slots are filled from the draft model.

Each node's children are chosen from the parent's draft distribution, in one of three ways:
``"deterministic"`` (the parent's top-c tokens, c = its number of children; what greedy and naive
verification want), ``"iid"`` (c i.i.d. draws, what SpecInfer MSS needs to be lossless at T > 0) or
``"without_replacement"`` (c sequential draws without replacement; MSS's DySpec variant, lossless and
never wastes a slot on a duplicate sibling). Leaving ``mode=None`` picks ``"deterministic"`` for
greedy sampling and ``"without_replacement"`` otherwise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from torch import Tensor

from stree.draft.base import SAMPLED_MODES, Drafter, child_noise, forward_level, pick_children
from stree.draft_types import Draft
from stree.inputs import vocab_size
from stree.sampling import SamplingConfig
from stree.tree import TokenTree, level_runs, parents_from_widths


@dataclass(frozen=True)
class StaticTreeDrafter(Drafter):
    """A tree of fixed shape drafted layer by layer.

    Args:
        parents: parent list, ``parents[0] == -1``, ``parents[i] < i``, in layer order (depth
            non-decreasing with the index), so that each draft ``tree_forward`` covers a prefix.
        mode: ``"deterministic"``, ``"iid"``, ``"without_replacement"``, ``"chain"`` (chains only)
            or None (chosen from the sampling config, see the module docstring).
        name: label used in statistics and errors.
    """

    parents: tuple[int, ...]
    mode: str | None = None
    name: str = "static"
    # Derived tables, host-side: layer bounds, each node's column among its parent layer, and its
    # rank among its siblings (draft order).
    _bounds: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _parent_col: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _rank: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _fanout: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Per layer above the deepest, one past its last node with children: the draft runs
    # ``layer start .. run_end`` (leaves listed after a layer's inner nodes never run); and
    # per node whether the draft runs it.
    _run_end: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ran: tuple[bool, ...] = field(init=False, repr=False, compare=False)
    # TokenTree of each drafted prefix, per (batch, nodes, device): the structure and its tables
    # (masks, conv windows) are built once and reused with new tokens every step.
    _templates: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        if not parents or parents[0] != -1:
            raise ValueError(f"parents must start with -1 (the root), got {list(parents)}")
        if any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise ValueError(f"parents must satisfy 0 <= parents[i] < i, got {list(parents)}")
        depth = [0] * len(parents)
        for i, p in enumerate(parents[1:], start=1):
            depth[i] = depth[p] + 1
        if any(b < a for a, b in zip(depth, depth[1:])):
            raise ValueError(f"parents must list the tree layer by layer (depth non-decreasing), "
                             f"got depths {depth}")
        if self.mode is not None and self.mode not in ("deterministic", "chain") + SAMPLED_MODES:
            raise ValueError(f"unknown draft mode {self.mode!r}")
        if self.mode == "chain" and any(p != i - 1 for i, p in enumerate(parents) if i):
            raise ValueError("mode 'chain' needs a chain (parents[i] == i - 1)")
        starts = [depth.index(d) for d in range(depth[-1] + 1)] + [len(parents)]
        bounds = tuple(zip(starts[:-1], starts[1:]))
        rank, seen = [0] * len(parents), {}
        for i, p in enumerate(parents[1:], start=1):
            rank[i] = seen.get(p, 0)
            seen[p] = rank[i] + 1
        col = [0] + [p - bounds[depth[p]][0] for p in parents[1:]]
        fanout = tuple(max((seen.get(p, 0) for p in range(s, e)), default=0) for s, e in bounds)
        run_end = tuple(e for _, e in level_runs(parents))
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_parent_col", tuple(col))
        object.__setattr__(self, "_rank", tuple(rank))
        object.__setattr__(self, "_fanout", fanout)
        object.__setattr__(self, "_run_end", run_end)
        object.__setattr__(self, "_ran", tuple(d < len(run_end) and i < run_end[d]
                                               for i, d in enumerate(depth)))
        object.__setattr__(self, "_templates", {})

    def tree(self, tokens: Tensor) -> TokenTree:
        """``tokens (b, e)`` placed on the first ``e`` nodes of this tree, tables reused (tokens
        drafted by the model: trusted, not read back)."""
        b, e = tokens.shape
        key = (b, e, tokens.device)
        if key not in self._templates:
            self._templates[key] = TokenTree(tokens, self.parents[:e])
        return self._templates[key].with_tokens(tokens, trusted=True)

    def _pick(self, mode: str, greedy: bool):
        """The ``pick`` of ``draft_levels`` (one per mode, greedy or sampled: a sampled draft passes
        its temperature as a tensor; kept, since a compiled step guards on it)."""
        shape = SamplingConfig() if greedy else SamplingConfig(1.0)
        key = ("pick", mode, shape)
        if key not in self._templates:
            plan = tuple((self._fanout[d], cs, ce, self._parent_col[cs:ce], self._rank[cs:ce],
                          self._bounds[d][0], self._run_end[d])
                         for d, (cs, ce) in enumerate(self._bounds[1:]))
            self._templates[key] = functools.partial(_place_children, plan, mode, shape)
        return self._templates[key]

    @classmethod
    def from_widths(cls, widths: Sequence[int], mode: str | None = None,
                    name: str = "static") -> "StaticTreeDrafter":
        """Layer ``d`` has ``widths[d-1]`` nodes hanging round-robin from layer ``d-1``
        (see :func:`stree.tree.parents_from_widths`)."""
        return cls(tuple(parents_from_widths(widths)), mode=mode, name=name)

    # ------------------------------------------------------------------------------------- shape
    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return len(self._bounds) - 1

    @property
    def num_forwarded(self) -> int:
        return self._run_end[-1] if self.depth else 0

    def ran(self, node: int) -> bool:
        return self._ran[node]

    @property
    def max_leaves(self) -> int:
        return self.num_nodes - len(set(self.parents[1:]))

    @property
    def max_children(self) -> int:
        return max(self._fanout, default=1) or 1

    # ------------------------------------------------------------------------------------- modes
    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        if self.mode is not None:
            return (self.mode,)
        if sampling.is_greedy:  # sampled siblings would all be the argmax
            return ("deterministic",) + SAMPLED_MODES
        return SAMPLED_MODES + ("deterministic",)

    def with_mode(self, mode: str) -> "StaticTreeDrafter":
        if mode == self.mode:
            return self
        if self.mode is not None or mode == "chain":
            raise ValueError(f"{self.name} drafts {self.modes(SamplingConfig())} trees, not {mode!r}")
        return replace(self, mode=mode)

    # ------------------------------------------------------------------------------------- draft
    def takes_lead(self, model, sampling: SamplingConfig) -> bool:
        # in the roots' pass (the first level of its draft's one call)
        return getattr(model, "runs_lead", False)

    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None, lead: Tensor | None = None) -> Draft:
        mode = self.modes(sampling)[0]
        device = roots.device
        b, n = roots.shape[0], self.num_nodes
        tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        tokens[:, 0] = roots
        # every level and every choice of children in one call; not under top-k or top-p, which
        # would be constants of its graph (a compile for every setting a request brings)
        if hasattr(model, "draft_levels") and (sampling.is_greedy or (sampling.top_k, sampling.top_p) == (0, 1.0)):
            return self._one_call(model, cache, tokens, mode, sampling, generator, lead)
        parent_col = torch.tensor(self._parent_col, device=device)
        rank = torch.tensor(self._rank, device=device)
        q = None
        for d in range(self.depth):
            (s, _), e, (cs, ce) = self._bounds[d], self._run_end[d], self._bounds[d + 1]
            logits = forward_level(model, cache, self.tree(tokens[:, :e]), s, e, n, lead if d == 0 else None)
            picks, probs = pick_children(logits, self._fanout[d], mode, sampling, generator)
            if not sampling.is_greedy:  # at greedy no verifier reads q: no (b, n, v) buffer
                if q is None:
                    q = torch.zeros(b, n, logits.shape[-1], dtype=torch.float32, device=device)
                q[:, s:e] = probs
            tokens[:, cs:ce] = picks[:, parent_col[cs:ce], rank[cs:ce]]
        return Draft(self.tree(tokens), q, mode)

    def _one_call(self, model, cache, tokens: Tensor, mode: str, sampling: SamplingConfig,
                  generator: torch.Generator | None, lead: Tensor | None) -> Draft:
        """The draft as one ``draft_levels`` call (one compiled graph under compiled steps: no
        host work between the levels). A sampled draft draws the random numbers of every level's
        choice first (what the level-by-level draft draws, level by level) and passes them in with
        its temperature as a tensor and the ``(b, n, v)`` buffer its distributions fill."""
        b, n = tokens.shape
        levels = [(self.tree(tokens[:, :e]), self._bounds[d][0], e) for d, e in enumerate(self._run_end)]
        vocab = vocab_size(model)
        noise = [child_noise(mode, sampling, (b, e - s, vocab), self._fanout[d], tokens.device, generator)
                 for d, (_, s, e) in enumerate(levels)]
        q = None if sampling.is_greedy else torch.zeros(b, n, vocab, dtype=torch.float32, device=tokens.device)
        extra = None
        if q is not None or any(x is not None for x in noise):
            extra = (noise, torch.tensor(sampling.temperature, device=tokens.device), q)
        pick = self._pick(mode, sampling.is_greedy)
        drafted = (model.draft_levels(tokens, cache, levels, pick, lead) if extra is None
                   else model.draft_levels(tokens, cache, levels, pick, lead, extra))
        return Draft(self.tree(drafted), q, mode)


def _place_children(plan: tuple, mode: str, sampling: SamplingConfig, d: int, logits: Tensor,
                    tokens: Tensor, extra: tuple | None = None) -> None:
    """Level ``d``'s choice (``pick_children``) written in place into ``tokens``: the children
    layer ``cs .. ce`` of ``plan[d] = (fanout, cs, ce, parent columns, sibling ranks, s, e)``
    below the nodes ``s .. e - 1``. ``extra``: None (a choice with nothing random and no
    distribution read), or ``(noise per level, temperature (0-d), q (b, n, v) or None)``: the
    choice's random numbers, the temperature replacing ``sampling``'s, and the buffer that
    receives the distributions the children were drawn from (rows ``s .. e - 1``)."""
    fanout, cs, ce, cols, ranks, s, e = plan[d]
    noise, temperature, q = extra if extra is not None else (None, None, None)
    picks, probs = pick_children(logits, fanout, mode, sampling, noise=None if noise is None else noise[d],
                                 temperature=temperature)
    if q is not None:
        q[:, s:e] = probs
    tokens[:, cs:ce] = picks[:, list(cols), list(ranks)]
