"""The verdict type, the verifier protocol and the shared tree walk (the registry of verifiers by
name is :mod:`stree.verify.registry`, above the verifiers).

Every verifier walks the drafted tree from the root: at the current node ``u`` it looks at the
target logits after the root-to-``u`` path and at ``u``'s children (draft order = index order), and
either accepts one child and moves there, or emits one target token (a correction, or a bonus when
``u`` is a leaf) and stops. Only that per-node decision differs between verifiers (a ``NodeRule``).
The rule runs batched over rows (and, for small trees and vocabularies, over every node at once)
and the walk has a static trip count (``max_depth + 1``), so it runs on the device without
per-step host syncs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.kernels._common import debug_checks
from stree.sampling import SamplingConfig


@dataclass
class Verdict:
    """Result of verifying one drafted tree.

    path: (b, k) int64 accepted node indices, root first (path[:, 0] == 0), -1 padded at the end;
        k = tree.max_depth + 1 (static, so no host sync is needed to trim it).
    num_accepted: (b,) int64 drafted tokens accepted (= number of non-negative path entries - 1).
    next_token: (b,) int64 token emitted by the target after the accepted path (correction/bonus).
    """

    path: Tensor
    num_accepted: Tensor
    next_token: Tensor


@runtime_checkable
class Verifier(Protocol):
    name: str

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        """Raise ``ValueError`` if this verifier is not lossless for (draft_mode, sampling)."""

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v), row i = target next-token logits after the root-to-i path."""


@dataclass
class NodeStep:
    """What a node rule sees at the current node of every row (rows already finished included).

    logits: (b, v) float32 raw target logits at the node.
    q: (b, v) float32 draft distribution at the node, or None.
    child_tokens: (b, c) int64 children's tokens in draft order (0 where ``child_valid`` is False).
    child_valid: (b, c) bool, True for real children (a prefix of each row).
    child_fixed, child_drawn: (b, c) bool, a merged draft's ``Draft.fixed`` / ``Draft.drawn`` of
        each child, else None.
    """

    logits: Tensor
    q: Tensor | None
    child_tokens: Tensor
    child_valid: Tensor
    child_fixed: Tensor | None = None
    child_drawn: Tensor | None = None


# A node rule returns (slot (b,) int64: accepted child's column, -1 if none; token (b,) int64:
# the emitted token, read only where slot == -1).
NodeRule = Callable[[NodeStep], "tuple[Tensor, Tensor]"]


def children_table(parents: Tensor, max_children: int | None = None) -> Tensor:
    """Children of every node in index (= draft) order.

    parents: (b, n) int64 with parents[:, 0] == -1. Returns (b, n, c) int64 child node indices,
    -1 padded, c = max number of children of any node (>= 1): ``max_children`` when known on the
    host (``TokenTree.max_children``), else one host sync to size it.
    """
    b, n = parents.shape
    nodes = torch.arange(n, device=parents.device)
    is_child = parents.unsqueeze(1) == nodes.view(1, n, 1)            # (b, parent, child)
    if max_children is None:
        max_children = int(is_child.sum(-1).max())
    c = max(max_children, 1)
    slot = is_child.long().cumsum(-1) - 1                      # slot of child j under its parent
    table = torch.full((b, n, c + 1), -1, dtype=torch.long, device=parents.device)
    # Non-children write into the spare column c, which is dropped.
    col = torch.where(is_child, slot, torch.full_like(slot, c))
    table.scatter_(2, col, nodes.view(1, 1, n).expand(b, n, n).contiguous())
    table[:, :, c] = -1
    return table[:, :, :c]


def validate(draft: Draft, target_logits: Tensor, need_q: bool) -> None:
    """Shape/vocab checks shared by all verifiers (raises ValueError)."""
    tokens = draft.tree.tokens
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be (b, n, v), got shape {tuple(target_logits.shape)}")
    b, n, v = target_logits.shape
    if tuple(tokens.shape) != (b, n):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} does not match the tree's "
                         f"tokens {tuple(tokens.shape)}: expected (b, n, v) with (b, n) = "
                         "tokens.shape")
    if need_q and draft.q is None:
        raise ValueError(f"draft.q is required for mode {draft.mode!r} at temperature > 0")
    if draft.q is not None and tuple(draft.q.shape) != (b, n, v):
        raise ValueError(f"draft.q has shape {tuple(draft.q.shape)} but target_logits has "
                         f"{tuple(target_logits.shape)}; they must match (same vocab v)")
    drafted = tokens[:, 1:]  # the root's token was committed earlier; only drafted ones index v
    # a device read: only for trees whose tokens were not drafted by the library (or in debug)
    trusted = getattr(draft.tree, "max_token", 0) is None and not debug_checks()
    if n > 1 and not trusted and bool(((drafted < 0) | (drafted >= v)).any()):
        raise ValueError(f"drafted tokens must lie in [0, {v}) (the logits' vocab size)")


# Largest ``b * n * v`` whose node rule runs batched over every node at once (see ``walk``):
# measured on a 2-core CPU, batching wins 3x at 9 nodes x 4096 tokens, ties at 13 x 128k and
# loses 2-6x at 63 x 50k-128k, where the rule's passes over every node's vocabulary cost more than
# the per-depth rounds they replace. On a GPU (launch-bound) the larger cap is a guess bounding
# the rule's temporaries (a few of 64 MB), not a measurement.
BATCHED_MAX_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 24}


def walk(draft: Draft, target_logits: Tensor, rule: NodeRule) -> Verdict:
    """Walk every row from the root, applying ``rule`` at each node. Shapes as in ``Verdict``.

    The rule runs either once, batched over every node of every row (``b * n`` rows of one
    ``NodeStep``: a handful of large ops instead of ``depth + 1`` rounds of small ones), or per
    depth at the node each row has reached, whichever ``BATCHED_MAX_ELEMENTS`` says is cheaper
    for the tree's size and vocabulary. Both have the node-by-node walk's distribution: a node's
    decision depends only on its own logits, q, children and fresh randomness, and every node
    draws its own, so the decisions of the nodes the walk visits are independent draws of the
    rule, whichever other nodes were decided.
    """
    tree = draft.tree
    device = target_logits.device
    b, n, v = target_logits.shape
    if n == 1:  # a root-only tree (a step that drafted nothing): the rule once, at a root without children
        return _root_only(draft, target_logits, rule)
    tokens = tree.tokens.to(device)
    table = children_table(tree.parents.to(device), getattr(tree, "max_children", None))  # (b, n, c)
    rows = torch.arange(b, device=device)

    def decide(nodes: Tensor | None) -> tuple[Tensor, Tensor]:
        """The rule at ``nodes (b, m)`` (None: every node, read in place): (accepted child's
        column or -1, token), each (b, m)."""
        def at(t):
            return t if nodes is None else t[rows[:, None], nodes]

        kids = at(table)                                                        # (b, m, c)
        m = kids.shape[1]
        valid = kids >= 0
        flat = kids.clamp_min(0).flatten(1)

        def of_children(t):
            return None if t is None else t.to(device).gather(1, flat).view(b * m, -1)

        step = NodeStep(
            logits=at(target_logits).reshape(b * m, v).float(),
            q=None if draft.q is None else at(draft.q).reshape(b * m, v).float(),
            child_tokens=of_children(tokens).masked_fill(~valid.view(b * m, -1), 0),
            child_valid=valid.view(b * m, -1),
            child_fixed=of_children(draft.fixed),
            child_drawn=of_children(draft.drawn),
        )
        return tuple(t.view(b, m) for t in rule(step))

    steps = int(tree.max_depth) + 1
    path = torch.full((b, steps), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    if b * n * v <= BATCHED_MAX_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]:
        slot, token = decide(None)
        # each node's accepted child, or -1 where the walk stops there; then chase the pointers
        nxt = torch.where(slot >= 0, table.gather(2, slot.clamp_min(0).unsqueeze(2)).squeeze(2), -1)
        node = path[:, 0]
        for d in range(1, steps):
            node = torch.where(node >= 0, nxt.gather(1, node.clamp_min(0).unsqueeze(1)).squeeze(1), -1)
            path[:, d] = node
        num_accepted = (path >= 0).sum(1) - 1
        last = path.gather(1, num_accepted.unsqueeze(1))
        return Verdict(path=path, num_accepted=num_accepted, next_token=token.gather(1, last).squeeze(1))
    node = torch.zeros(b, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    next_token = torch.zeros(b, dtype=torch.long, device=device)
    for d in range(steps):
        slot, token = (t.squeeze(1) for t in decide(node.unsqueeze(1)))
        accepted = ~done & (slot >= 0)
        stopped = ~done & (slot < 0)
        next_token = torch.where(stopped, token, next_token)
        child = table[rows, node].gather(1, slot.clamp_min(0).unsqueeze(1)).squeeze(1)
        node = torch.where(accepted, child, node)
        if d + 1 < steps:
            path[:, d + 1] = torch.where(accepted, node, -1)
        done = done | stopped
    # Depth max_depth nodes are leaves, so every row has stopped by now.
    return Verdict(path=path, num_accepted=(path >= 0).sum(1) - 1, next_token=next_token)


def first_match(step: NodeStep, token: Tensor) -> Tensor:
    """Column of the first child whose token equals ``token`` (b,), or -1. (b,) int64."""
    hit = step.child_valid & (step.child_tokens == token.unsqueeze(1))
    c = hit.shape[1]
    first = torch.where(hit, torch.arange(c, device=hit.device), c).min(1).values
    return torch.where(first < c, first, -1)


def _root_only(draft: Draft, target_logits: Tensor, rule: NodeRule) -> Verdict:
    """:func:`walk` of a one-node tree: the rule's token at the root is the step's token (no
    children table, no pointers to chase: a one-token step's verify costs what sampling does)."""
    b, device = target_logits.shape[0], target_logits.device
    none = torch.zeros(b, 1, dtype=torch.bool, device=device)
    _, token = rule(NodeStep(
        logits=target_logits[:, 0].float(), q=None if draft.q is None else draft.q[:, 0].to(device).float(),
        child_tokens=torch.zeros(b, 1, dtype=torch.long, device=device), child_valid=none,
        child_fixed=None if draft.fixed is None else none, child_drawn=None if draft.drawn is None else none))
    return Verdict(path=torch.zeros(b, 1, dtype=torch.long, device=device),
                   num_accepted=torch.zeros(b, dtype=torch.long, device=device), next_token=token)
