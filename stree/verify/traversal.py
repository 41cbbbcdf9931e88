"""Traversal Verification of a sampled tree (Weng, Hu, Chen, Liu, Mei, Qiu, Tian, Shi, "Traversal
Verification for Speculative Tree Decoding", arXiv 2505.12398, NeurIPS 2025).

MSS walks the tree from the root and discards a rejected node's whole subtree. Traversal
Verification tests nodes from the leaves up, each against the probability of its whole root path
(block verification's sequence-level weight, :mod:`stree.verify.block`), so a deep path can be kept
where MSS would already have rejected its first token. The rule, in post-order (children in draft
order, then the node), with ``P_u`` the target's and ``Q_u`` the draft's distribution at node
``u``::

    w_root = 1
    visiting node u (entry weight w_u, first its children's subtrees, in draft order):
        for each drawn child c of u (token x):
            w_c = min(1, w_u P_u(x) / Q_u(x))              c's entry weight; visit c's subtree
            a node of that subtree accepted: stop
            else (c's subtree rejected):
                rho = sum_y (w_u P_u(y) - Q_u(y))+
                w_u <- rho / (rho + 1 - w_u)  ;  P_u <- norm((w_u P_u - Q_u)+)    (old w_u)
                without replacement only: Q_u <- norm(Q_u with x removed)
        then test u itself: accept w.p. w_u -> the path root..u is accepted and the target
        token is a sample of P_u (the bonus at a leaf, a residual above); else u is rejected.

Sources: only the paper's abstract was retrievable here, so the rule above is derived (the proof
below) and checked by ``tests/test_verify_traversal.py`` (exact enumeration, and the paper's
loop as a sequential oracle); its update agrees with the paper's as a public implementation
quotes it (Eq. 3, ``w <- S / (S + 1 - w)`` with ``S = sum (w P - Q)+``, and ``Q`` without the
rejected token: the paper's drafts are drawn without replacement). ``1 - w + rho = 1 - sum
min(w P, Q)`` is the probability that a child's subtree is rejected. The root's weight stays 1, so
the walk always ends. On a chain it is block verification (the tests check the tables agree).

Why it is lossless: by induction on the subtree, visiting ``u`` with weight ``w`` accepts ``u``
or a node below it with probability ``w``, and conditioned on that the tokens after ``u`` are the
target's. A child's subtree then takes mass ``min(w P(x), Q(x))`` of each first token ``x``, the
rest ``(w P - Q)+`` is what the update hands to the next child and to ``u``'s own test, and the
next child must be a draw from the ``Q`` that update leaves: ``Q`` itself for i.i.d. children
("iid", "chain"), ``Q`` without the rejected token for sequential draws without replacement
("without_replacement"). Lossless for those three modes, refused for chosen ("deterministic")
children at temperature > 0 (they are not draws from ``Q``). A child ``Q_u`` gives probability 0
(a dynamic drafter's copy of a rejected sibling, a draw past ``Q``'s support) is skipped: weight
0, ``u``'s state unchanged, as ``mss`` does.

Merged trees (``Draft.fixed`` / ``drawn``: suffix-tree children chosen beside the draws) are
beyond the paper's proof: chosen children are not draws. They are verified by composition, which
is lossless for any chosen children: the traversal runs over the drawn nodes only; from the node
it accepts, whose emitted token ``y`` has the right distribution, the walk enters the first chosen
child carrying ``y``, if any, and continues from there as ``naive`` does (a fresh target sample
at each node, the first chosen child carrying it followed), exactly what ``mss`` does at a node
whose draws were all rejected.

Without host loops over nodes: the entry weights pass down one depth per round (the nodes of
that depth run the rule, a loop over child slots like ``mss``'s), every node draws one uniform for
its own test, and the traversal's result is the first node in post-order whose test passes (a
node is tested only if everything before it in post-order failed, and the states it is tested
with are those after exactly those failures). That node is found from post-order ranks computed
from the ancestor mask. Randomness: one uniform per node, one draw from the accepted node's
residual and, for merged trees, one target draw per node.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs
from stree.verify.base import Verdict, children_table, validate
from stree.verify.greedy import greedy_verdict
from stree.verify.mss import _RESIDUAL_EPS, _normalise


def weight_after_rejection(w: Tensor, rho: Tensor) -> Tensor:
    """A node's weight once one child's subtree is rejected: ``rho / (rho + 1 - w)`` (``1`` where
    that rejection had probability 0). ``w``, ``rho``: ``(m,)``."""
    denom = rho + 1 - w
    return torch.where(denom > 0, rho / denom.clamp_min(torch.finfo(w.dtype).tiny),
                       torch.ones_like(w))


def node_states(w: Tensor, P: Tensor, Q: Tensor, child_tokens: Tensor, child_live: Tensor,
                without_replacement: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The rule at ``m`` nodes with entry weights ``w``, through all their drawn children.

    Args:
        w: ``(m,)`` entry weights. P: ``(m, v)`` target probabilities. Q: ``(m, v)`` normalised
            draft distributions (rows of nodes without drawn children unused).
        child_tokens: ``(m, c)`` int64 children's tokens in draft order; child_live: ``(m, c)``
            bool, True for drawn children.
    Returns:
        ``child_w (m, c)`` the children's entry weights (0 where not live), ``h (m,)`` the
        probability that the node's own test passes, ``residual (m, v)`` the distribution of the
        token emitted when it does (every child before rejected).
    """
    child_w = torch.zeros(child_tokens.shape, dtype=w.dtype, device=w.device)
    R = P
    for j in range(child_tokens.shape[1]):
        tok = child_tokens[:, j:j + 1]
        r_tok = R.gather(1, tok).squeeze(1)
        q_tok = Q.gather(1, tok).squeeze(1)
        # q_tok == 0: not a draw from Q (skipped: weight 0, state unchanged); NaN rows: no child
        live = child_live[:, j] & (q_tok > 0)
        ratio = r_tok / q_tok.clamp_min(torch.finfo(w.dtype).tiny)
        child_w[:, j] = torch.where(live, torch.minimum(w * ratio, torch.ones_like(w)), 0.0)
        resid = (w[:, None] * R - Q).clamp_min(0)
        rho = resid.sum(-1)
        w = torch.where(live, weight_after_rejection(w, rho), w)
        # a residual of (near) zero mass: the rejection had (near) zero probability; keep R
        R = torch.where((live & (rho > _RESIDUAL_EPS))[:, None],
                        resid / rho.clamp_min(_RESIDUAL_EPS)[:, None], R)
        if without_replacement:
            Q = torch.where(live[:, None], _normalise(Q.scatter(1, tok, 0.0)), Q)
    return child_w, w, R


def traversal_states(P: Tensor, Q: Tensor, tokens: Tensor, table: Tensor, live: Tensor,
                     depth: Tensor, max_depth: int,
                     without_replacement: bool) -> tuple[Tensor, Tensor]:
    """Every node's test probability and residual for a batch of trees.

    Args:
        P: ``(b, n, v)`` target probabilities, Q: ``(b, n, v)`` normalised draft distributions.
        tokens: ``(b, n)`` int64; table: ``(b, n, c)`` children (``base.children_table``);
        live: ``(b, n)`` bool, the drawn nodes (every node below the root unless merged).
        depth: ``(b, n)`` int64 (``TokenTree.depth``); max_depth: the trees' depth (host int).
    Returns:
        ``h (b, n)`` (0 for nodes the traversal never accepts: chosen-only nodes, nodes below a
        weight-0 node) and ``residual (b, n, v)``, in ``P``'s dtype.

    One round per depth ``d < max_depth``: the nodes of depth ``d`` (whose entry weights the
    round before set) run the rule and set their children's. A round gathers a fixed number of
    nodes, ``min(c ** d, n - d)`` (no more nodes can sit at depth ``d``), from the nodes sorted by
    depth, so it needs no host read and costs that many nodes' rule, not ``n``.
    """
    b, n, v = P.shape
    c = table.shape[2]
    device = P.device
    rows = torch.arange(b, device=device)[:, None]
    order = torch.argsort(depth * n + torch.arange(n, device=device), dim=1)   # by depth, stable
    first = (depth[:, :, None] < torch.arange(max_depth + 1, device=device)).sum(1)  # (b, D + 1)
    # the spare column n takes every write of a slot that is not a node of the round
    w = torch.zeros(b, n + 1, dtype=P.dtype, device=device)
    w[:, 0] = 1.0
    h = torch.zeros_like(w)
    residual = torch.cat([P, P[:, :1]], 1)                            # leaves keep P
    kids_live = (table >= 0) & live.gather(1, table.clamp_min(0).view(b, n * c)).view(b, n, c)
    for d in range(max_depth):
        width = min(c ** d, n - d)
        pos = first[:, d:d + 1] + torch.arange(width, device=device)
        nodes = order.gather(1, pos.clamp_max(n - 1))                          # (b, width)
        here = (pos < n) & (depth.gather(1, nodes) == d)
        kids = table[rows, nodes]                                              # (b, width, c)
        child_live = kids_live[rows, nodes] & here[:, :, None]
        child_w, h_here, r_here = node_states(
            w.gather(1, nodes).view(-1), P[rows, nodes].view(-1, v), Q[rows, nodes].view(-1, v),
            tokens.gather(1, kids.clamp_min(0).view(b, -1)).view(-1, c), child_live.view(-1, c),
            without_replacement)
        w.scatter_(1, torch.where(child_live, kids, n).view(b, -1), child_w.view(b, -1))
        at = torch.where(here, nodes, n)
        h.scatter_(1, at, h_here.view(b, width))
        residual.scatter_(1, at[:, :, None].expand(b, width, v), r_here.view(b, width, v))
    # a node without drawn children is tested with its entry weight (residual P)
    h = torch.where(kids_live.any(-1), h[:, :n], w[:, :n])
    return h, residual[:, :n]


def postorder_rank(mask: Tensor, earlier_siblings: Tensor) -> Tensor:
    """``(b, n)`` int64 position of every node in post-order (children in index order, then the
    node): its descendants plus, for it and every ancestor, the subtrees of earlier siblings.

    mask: ``(b, n, n)`` ancestor mask (``TokenTree.mask``); earlier_siblings: ``(b, n, n)``
    (``TokenTree.earlier_siblings()``)."""
    size = mask.sum(1)                                                    # subtree sizes
    before = (earlier_siblings.long() * size[:, None, :]).sum(-1)         # earlier siblings'
    return size - 1 + (mask.long() * before[:, None, :]).sum(-1)


class TraversalVerifier:
    name = "traversal"

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        if draft_mode == "deterministic" and not sampling.is_greedy:
            raise ValueError(
                "Traversal Verification is lossless only for sampled children (draft modes "
                "'iid', 'without_replacement', 'chain'), not deterministic (top-k / static / "
                f"beam) ones at temperature > 0 ({sampling}); use the 'naive' verifier or a "
                "sampling drafter")

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v); draft.q (b, n, v) required unless sampling is greedy (or the
        draft is merged with no drawn node)."""
        self.check(draft.mode, sampling)
        validate(draft, target_logits, need_q=not sampling.is_greedy and not draft.merged)
        if sampling.is_greedy:  # p is one-hot: the traversal reduces to greedy matching
            return greedy_verdict(draft, target_logits)
        tree = draft.tree
        device = target_logits.device
        b, n, v = target_logits.shape
        tokens = tree.tokens.to(device)
        table = children_table(tree.parents.to(device), getattr(tree, "max_children", None))
        P = target_probs(target_logits, sampling)
        live = torch.ones(b, n, dtype=torch.bool, device=device)   # the drawn nodes
        if draft.merged:
            live = draft.drawn.to(device) if draft.q is not None else ~live
        Q = (_normalise(draft.q.to(device).float()) if draft.q is not None
             else torch.zeros_like(P))
        h, residual = traversal_states(P, Q, tokens, table, live, tree.depth.to(device),
                                       int(tree.max_depth), draft.mode == "without_replacement")
        passed = torch.rand(b, n, generator=generator, device=device) < h
        passed[:, 0] = True
        rank = postorder_rank(tree.mask.to(device), tree.earlier_siblings().to(device))
        node = torch.where(passed, rank, n).argmin(1)                     # first pass in post-order
        rows = torch.arange(b, device=device)
        path = tree.paths.to(device)[rows, node].clone()                  # (b, max_depth + 1)
        token = sample_from(residual[rows, node], generator)
        if draft.merged:
            node, token = _chosen_continuation(draft, P, table, path, node, token, generator)
        return Verdict(path=path, num_accepted=(path >= 0).sum(1) - 1, next_token=token)


def _chosen_continuation(draft: Draft, P: Tensor, table: Tensor, path: Tensor, node: Tensor,
                         token: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """From the traversal's node, follow chosen children carrying the emitted token, each step's
    token a fresh target sample at the node reached (``naive``); extends ``path`` in place and
    returns the last node and the token emitted after it, each ``(b,)``."""
    tree = draft.tree
    device = P.device
    b, n, _ = P.shape
    rows = torch.arange(b, device=device)
    tokens, fixed = tree.tokens.to(device), draft.fixed.to(device)
    depth = tree.depth.to(device)
    fresh = sample_from(P, generator)                                     # (b, n)
    c = table.shape[2]
    for _ in range(int(tree.max_depth)):
        kids = table[rows, node]                                          # (b, c)
        hit = (kids >= 0) & fixed.gather(1, kids.clamp_min(0)) & (
            tokens.gather(1, kids.clamp_min(0)) == token[:, None])
        first = torch.where(hit, torch.arange(c, device=device), c).min(1).values
        moved = first < c
        child = kids.gather(1, first.clamp_max(c - 1)[:, None]).squeeze(1)
        node = torch.where(moved, child, node)
        token = torch.where(moved, fresh[rows, node], token)
        col = depth[rows, node]
        path[rows, col] = torch.where(moved, node, path[rows, col])
    return node, token
