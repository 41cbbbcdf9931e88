"""The verdict type, the verifier protocol and registry, and the shared tree walk.

Every verifier walks the drafted tree from the root: at the current node ``u`` it looks at the
target logits after the root-to-``u`` path and at ``u``'s children (draft order = index order), and
either accepts one child and moves there, or emits one target token (a correction, or a bonus when
``u`` is a leaf) and stops. Only that per-node decision differs between verifiers (a ``NodeRule``).
The rule runs once over every node of the tree (batched over rows and nodes), then the walk
follows its decisions from the root with a static trip count (``max_depth + 1``), so it runs on the
device without per-step host syncs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor

from stree.draft_types import DRAFT_MODES, Draft
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
    """

    logits: Tensor
    q: Tensor | None
    child_tokens: Tensor
    child_valid: Tensor


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


def walk(draft: Draft, target_logits: Tensor, rule: NodeRule) -> Verdict:
    """Walk every row from the root, applying ``rule`` at each node. Shapes as in ``Verdict``.

    The rule runs once, batched over every node of every row (``b * n`` rows of one
    ``NodeStep``), and the walk then follows the decisions from the root. Same distribution as
    deciding node by node along the walk: a node's decision depends only on its own logits, q,
    children and fresh randomness, and every node draws its own, so the decisions of the nodes
    the walk visits are independent draws of the rule, whichever nodes it visits. A handful of
    batched ops replace ``depth + 1`` rounds of the rule (the verify step of a sampled tree
    cost 2-4 ms in those rounds on a CPU, a launch-bound sequence on a GPU); the extra work is the
    rule on nodes the walk never reaches, one ``(b * n, v)`` pass per op.
    """
    tree = draft.tree
    device = target_logits.device
    tokens = tree.tokens.to(device)
    b, n, v = target_logits.shape
    table = children_table(tree.parents.to(device), getattr(tree, "max_children", None))  # (b, n, c)
    c = table.shape[2]
    valid = table >= 0
    step = NodeStep(
        logits=target_logits.reshape(b * n, v).float(),
        q=None if draft.q is None else draft.q.reshape(b * n, v).float(),
        child_tokens=tokens.gather(1, table.clamp_min(0).view(b, n * c)).view(b * n, c)
        .masked_fill(~valid.view(b * n, c), 0),
        child_valid=valid.view(b * n, c),
    )
    slot, token = (t.view(b, n) for t in rule(step))
    # each node's accepted child, or -1 where the walk stops there
    accepted = torch.where(slot >= 0, table.gather(2, slot.clamp_min(0).unsqueeze(2)).squeeze(2), -1)
    steps = int(tree.max_depth) + 1
    path = torch.full((b, steps), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    node = path[:, 0]
    for d in range(1, steps):
        node = torch.where(node >= 0, accepted.gather(1, node.clamp_min(0).unsqueeze(1)).squeeze(1), -1)
        path[:, d] = node
    # Depth max_depth nodes are leaves (slot -1), so every row stops by then.
    num_accepted = (path >= 0).sum(1) - 1
    last = path.gather(1, num_accepted.unsqueeze(1))
    return Verdict(path=path, num_accepted=num_accepted, next_token=token.gather(1, last).squeeze(1))


def first_match(step: NodeStep, token: Tensor) -> Tensor:
    """Column of the first child whose token equals ``token`` (b,), or -1. (b,) int64."""
    hit = step.child_valid & (step.child_tokens == token.unsqueeze(1))
    c = hit.shape[1]
    first = torch.where(hit, torch.arange(c, device=hit.device), c).min(1).values
    return torch.where(first < c, first, -1)


def get_verifier(name_or_obj) -> Verifier:
    """A verifier by name ("greedy", "mss", "naive", "sps", "asps", "mss+asps"); an object with
    verify/check as is."""
    from stree.verify.asps import ASpSVerifier
    from stree.verify.chain_aware import ChainAwareVerifier
    from stree.verify.greedy import GreedyVerifier
    from stree.verify.mss import MSSVerifier
    from stree.verify.naive import NaiveVerifier
    from stree.verify.sps import SpSVerifier

    classes = (GreedyVerifier, MSSVerifier, NaiveVerifier, SpSVerifier, ASpSVerifier,
               ChainAwareVerifier)
    registry = {cls.name: cls for cls in classes}
    if isinstance(name_or_obj, str):
        if name_or_obj not in registry:
            raise ValueError(
                f"unknown verifier {name_or_obj!r}; expected one of {sorted(registry)}")
        return registry[name_or_obj]()
    if all(callable(getattr(name_or_obj, m, None)) for m in ("verify", "check")):
        return name_or_obj
    raise TypeError(f"expected a verifier name or an object with verify() and check(), "
                    f"got {type(name_or_obj).__name__}")


def default_verifier(sampling: SamplingConfig, draft_mode: str) -> Verifier:
    """The lossless verifier with the best acceptance for this (sampling, draft mode) pair."""
    if draft_mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {draft_mode!r}; expected one of {DRAFT_MODES}")
    if sampling.is_greedy:
        name = "greedy"
    elif draft_mode == "deterministic":
        name = "naive"   # the only lossless sampling rule for chosen (not sampled) children
    elif draft_mode == "chain":
        name = "sps"
    else:
        name = "mss"
    return get_verifier(name)
