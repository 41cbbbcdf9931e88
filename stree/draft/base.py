"""What every drafter shares: the layered shape contract and child selection from a draft distribution.

A drafter grows a tree layer by layer with the draft model, which is itself a patched model: level
``d`` forwards the nodes of layer ``d`` that get children (``forward_level``: each once, from its
parent's state; a model with only ``tree_forward`` reruns the partial tree) and reads their logits to
choose layer ``d + 1``. The committed prefix lives in the draft cache and is never re-run. Nodes are
appended layer by layer, so indices never move; ``Drafter.ran`` says which nodes the draft ran, and
after verification ``commit_draft`` advances the draft cache along the target's accepted path,
running its last node first only when the draft never ran it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs, uniforms
from stree.tree import TokenTree

# Modes a drafter with sampled children can run in, see ``Draft.mode``.
SAMPLED_MODES = ("without_replacement", "iid")


class Drafter(ABC):
    """Builds a :class:`stree.draft_types.Draft` of a fixed size with a patched draft model.

    Attributes (fixed per drafter, so the loop can size caches and buffers up front):
        mode: the ``Draft.mode`` it produces (a static drafter's None: chosen per sampling
            config, see :meth:`modes`).
        num_nodes: tree size ``n``, root included.
        depth: drafted layers below the root (= draft ``tree_forward`` calls per draft, see
            ``draft_runs``); the accepted path is committed to the draft cut to ``depth`` nodes.
        num_forwarded: one past the last node the draft ran (a ``tree_forward``-only draft
            model's last call covered this prefix); 0 when the drafter never calls the draft
            model. Inner leaves in the prefix may not have run (see :meth:`ran`).
        max_leaves: upper bound on root-to-leaf paths of any tree it builds.
    Dynamic drafters (``dynamic.py``) build trees of at most ``num_nodes`` nodes and report the
    ``depth``, ``num_forwarded`` and ``draft_runs`` of their latest draft.
    """

    mode: str

    @property
    @abstractmethod
    def num_nodes(self) -> int: ...

    @property
    @abstractmethod
    def depth(self) -> int: ...

    @property
    @abstractmethod
    def num_forwarded(self) -> int: ...

    @property
    @abstractmethod
    def max_leaves(self) -> int: ...

    @property
    def max_children(self) -> int:
        """The most children a node of its trees may have (a dynamic tree: its whole budget)."""
        return max(self.num_nodes - 1, 1)

    @property
    def uses_draft_model(self) -> bool:
        return self.depth > 0

    @property
    def draft_runs(self) -> int:
        """Draft ``tree_forward`` calls of a draft (of the latest one for dynamic drafters)."""
        return self.depth

    @property
    def layered(self) -> bool:
        """Whether every draft has the same layered shape (a static template, whose steps
        ``compile=True`` can compile); dynamic drafters build a new shape per step."""
        return True

    @property
    def compilable(self) -> bool:
        """Whether ``compile=True`` runs it: its draft model's calls have fixed shapes (a static
        template, or no draft model). The target's trees of varying size (suffix, merged) run
        padded to a few sizes (``tree_forward``'s ``pad_nodes``)."""
        return self.layered

    @property
    def mixes_chains(self) -> bool:
        """Whether some of its drafts are fixed-length sampled chains (mode ``"chain"``) and others
        trees, chosen before each draft: its default verifier at T > 0 is then ``mss+asps``."""
        return False

    def ran(self, node: int) -> bool:
        """Whether the latest draft ran ``node`` through the draft model (its state exists, so
        committing a path that ends there needs no draft forward). Drafters forward prefixes by
        default; a static tree skips the leaves of its inner layers."""
        return node < self.num_forwarded

    def modes(self, sampling: SamplingConfig) -> tuple[str, ...]:
        """Modes this drafter can run in, best first for ``sampling``; overridden by drafters
        whose children may be sampled."""
        return (self.mode,)

    def with_mode(self, mode: str) -> "Drafter":
        """This drafter producing ``mode`` children (one of :meth:`modes`)."""
        if mode != self.mode:
            raise ValueError(f"{type(self).__name__} only drafts {self.mode!r} trees, not {mode!r}")
        return self

    @property
    def reads_context(self) -> bool:
        """Whether it drafts from the rows' text (a suffix tree): the loop then hands it the
        prompts (:meth:`start`) and the outputs (:meth:`finish`)."""
        return False

    def takes_lead(self, model, sampling: SamplingConfig) -> bool:
        """Whether :meth:`draft` takes ``lead=``: per row the committed tokens between the
        draft cache's state and the root that the draft model has not run, run in the roots'
        pass instead of a forward of their own (``model.draft_levels``' lead; committed with
        the next commit of the draft). Without it the caller runs them first."""
        return False

    def wants_draft_model(self, roots: Tensor) -> bool:
        """Whether the next :meth:`draft` (of ``roots (b,)``) runs the draft model, so that the
        loop first brings the draft's cache up to the committed tokens (a drafter that picks per
        step, like ``auto``, decides here for that draft)."""
        return self.uses_draft_model

    def prepare(self, target, draft, sampling: SamplingConfig) -> None:
        """Called once by ``generate`` before anything runs with the patched target, the draft
        model (None when the drafter needs none) and the sampling setting (a drafter that
        measures them, like ``auto``, does it here; one that refuses them raises here)."""

    def start(self, prompts: list[list[int]]) -> None:
        """The rows' prompts, before the first draft (drafters that :attr:`reads_context`)."""

    def observe(self, tree: TokenTree, path: Tensor) -> None:
        """Feedback after verification: ``path (b, k)`` the accepted node indices of ``tree``
        (root first, -1 padded; rows that finished are all -1). Drafters that tune themselves
        online from the acceptance history, or read the rows' text, override it."""

    def finish(self, outputs: list[list[int]]) -> None:
        """Each row's new tokens once decoding ends (drafters that :attr:`reads_context`)."""

    @abstractmethod
    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> Draft:
        """Draft one tree per row.

        Args:
            model: patched draft model (``tree_forward``); ``cache`` its ``TreeCache`` holding the
                committed prefix, which ends just before the root.
            roots: ``(b,)`` int64 node 0 of each row: the last accepted token, which neither
                model has run yet.
            sampling: target sampling config; sampled children are drawn from
                ``target_probs(draft_logits, sampling)``, which is also what ``q`` holds.
        Returns:
            ``Draft(tree (b, n), q (b, n, v), mode)``; ``q`` rows of the deepest layer are 0
            (never forwarded, and leaves' rows are unused by every verifier). At greedy sampling
            ``q`` may be None: no verifier reads it there, so no ``(b, n, v)`` buffer is made.
        """


def pick_children(logits: Tensor, count: int, mode: str, sampling: SamplingConfig,
                  generator: torch.Generator | None = None, noise: Tensor | None = None,
                  temperature: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Choose ``count`` child tokens below each frontier node.

    Args:
        logits: ``(b, w, v)`` draft logits at ``w`` frontier nodes.
        mode: "deterministic" (top-``count`` of the logits: the draft's own ranking, whatever the
            temperature), "iid" / "chain" (i.i.d. draws from q), "without_replacement" (sequential
            draws without replacement from q; draft order = draw order).
        noise: the random numbers the choice takes, drawn beforehand (:func:`child_noise`, so
            that a compiled draft takes them as an input), else drawn here from ``generator``.
        temperature: a 0-d tensor for ``sampling.temperature`` (see :func:`target_probs`).
    Returns:
        tokens ``(b, w, count)`` int64 in draft order, and q ``(b, w, v)`` float32 =
        ``target_probs(logits, sampling)``, the distribution sampled children came from (None at
        greedy sampling for chosen, i.i.d. and chain children, where no verifier reads q).
    """
    if mode == "deterministic":
        # at greedy sampling no verifier reads q (it is None): nothing to compute
        q = None if sampling.is_greedy else target_probs(logits, sampling, temperature)
        return logits.topk(count, dim=-1).indices, q
    if mode in ("iid", "chain") and sampling.is_greedy:  # every draw is the argmax
        return logits.argmax(-1, keepdim=True).expand(*logits.shape[:-1], count), None
    if mode not in SAMPLED_MODES + ("chain",):
        raise ValueError(f"unknown draft mode {mode!r}")
    q = target_probs(logits, sampling, temperature)
    if noise is None:
        noise = child_noise(mode, sampling, q.shape, count, q.device, generator)
    if mode in ("iid", "chain"):
        return sample_from(q.unsqueeze(-2).expand(*q.shape[:-1], count, q.shape[-1]), u=noise), q
    # Exponential race: ordering q_i / E_i (E_i ~ Exp(1)) descending is a sequential sample
    # without replacement (Gumbel-top-k in another guise). If q has fewer than ``count``
    # tokens in its support the extra children get q == 0 tokens, which MSS always rejects.
    return (q / noise.clamp_min(torch.finfo(q.dtype).tiny)).topk(count, dim=-1).indices, q


def child_noise(mode: str, sampling: SamplingConfig, shape, count: int, device,
                generator: torch.Generator | None = None) -> Tensor | None:
    """The random numbers :func:`pick_children` takes to choose ``count`` children below each of
    the nodes whose logits have shape ``shape = (b, w, v)``: None where the choice is not random,
    ``(b, w, count, 1)`` float64 uniforms for i.i.d. and chain children (one inverse-CDF draw
    each), ``(b, w, v)`` fp32 exponentials for children without replacement (the race)."""
    if mode == "deterministic" or (mode in ("iid", "chain") and sampling.is_greedy):
        return None
    if mode in ("iid", "chain"):
        return uniforms((*shape[:-1], count, 1), device, generator)
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)


# ------------------------------------------------------------------ the per-level mechanism
def forward_level(model, cache, tree, start: int, end: int, capacity: int, lead: Tensor | None = None) -> Tensor:
    """Draft logits ``(b, end - start, v)`` of the nodes ``start .. end - 1`` of ``tree`` (the
    tree drafted so far), whose parents were forwarded by earlier calls of this draft.

    With a model that has ``level_forward`` (every patched model) each node runs once, from its
    parent's materialised state; other models (test fakes) run ``tree_forward`` over the whole
    partial tree. ``capacity``: the whole draft's node count. Every drafter calls this. ``lead``
    (the roots' level, a model that ``runs_lead``): tokens run before the roots, in their pass.
    """
    if hasattr(model, "level_forward"):
        b = tree.batch_size
        nodes = torch.arange(start, end, device=tree.device).expand(b, -1)
        if lead is None:  # (models wrapped by callers may not know the argument)
            return model.level_forward(tree, cache, nodes, first=start == 0, capacity=capacity)
        return model.level_forward(tree, cache, nodes, first=start == 0, capacity=capacity, lead=lead)
    if lead is not None:
        raise ValueError("a lead needs a model with level_forward")
    return model.tree_forward(tree, cache)[:, start:end]


# The most tokens a draft that takes a lead (``Drafter.takes_lead``) runs in its roots' pass; a
# draft further behind is caught up by a forward of its own first.
MAX_LEAD = 16


def lead_tensor(rows: list[list[int]]) -> Tensor | None:
    """Each row's tokens a draft is behind (at most ``MAX_LEAD``) as its ``lead``: ``(b, c)``
    int64 on the host, a row's tokens in its last columns and -1 before them, ``c`` the next
    power of two of the longest (a compiled draft then has a few graphs, not one per length);
    None when no row has any."""
    longest = max(map(len, rows), default=0)
    if not longest:
        return None
    if longest > MAX_LEAD:
        raise ValueError(f"a lead of {longest} tokens: at most {MAX_LEAD} run in a draft's roots' pass")
    width = 1 << (longest - 1).bit_length()
    return torch.tensor([[-1] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)


def commit_draft(model, cache, tree, path: Tensor, counts: list[int], last_nodes: list[int],
                 ran: Callable[[int], bool]) -> bool:
    """Advance the draft cache along the target's accepted ``path (b, k)`` of ``counts[r]`` nodes
    per row, ending at node ``last_nodes[r]`` (host ints; no device sync). ``ran(node)``: whether
    the draft forwarded ``node`` (``Drafter.ran``; a static tree's deepest layer and inner
    leaves, or a dynamic tree's last round, never ran). Returns False when the caller must run
    the path as a chain instead (a ``tree_forward`` model whose last call did not cover the
    path).

    After ``forward_level``: when a row's path ends at a node that never ran, the last node of
    every row runs once from its parent's state (rows ending higher recompute the state they
    have), then the committed state becomes the state of each row's last path node (no replay,
    no chain).
    """
    unforwarded = any(c and not ran(node) for c, node in zip(counts, last_nodes))
    # The verdict's path is as wide as the whole drafted tree, but the draft's last forward may
    # have covered a shallower prefix of it (a static tree's deepest layer never runs): commit
    # only the columns some row fills, which that prefix holds (a view, no device sync).
    path = path[:, :max(max(counts), 1)]
    if not hasattr(model, "level_forward"):
        if not unforwarded:
            cache.commit(path, counts)
            return True
        return False
    if unforwarded:
        nodes = torch.tensor([max(node, 0) for node in last_nodes], device=path.device)[:, None]
        model.level_forward(tree, cache, nodes)
    cache.commit(path, counts)
    return True
