"""ASpS: accelerated speculative sampling of a chain by Tree Monte Carlo (Hu & Huang, Algorithm 1).

Speculative sampling (``sps``) couples draft and target token by token; ASpS couples the whole
chain. After seeing reference token ``a`` at level ``j`` it re-weights every earlier rejection
outcome by ``r(a) / q_j(a)`` and lets the continuation compete against the full ``q_j(a)``. With
draft tokens ``x_1..x_k``, ``q_j`` the draft distribution they were drawn from at node ``j`` and
``p_j`` the target's at node ``j``, the verifier builds a table ``PN`` of cells ``(j, t)`` =
"accept ``x_1..x_j``, then emit ``t``" and draws one cell::

    PNs = 1                                   # mass still continuing past level j
    for j = 0 .. k-1, a = x_{j+1}:
        if j > 0: PN[j-1, x_j] = 0            # the continuation moves down a level
        C1 = (q_j - PNs * p_j)+ ;  w = (C1[a] / sum C1) / q_j[a]       (0/0 := 0)
        PN[:j] *= w                           # re-weight earlier outcomes (absent in sps)
        PN[j]   = w * (PNs * p_j - q_j)+
        PN[j,a] = min(1, PNs * p_j[a] / q_j[a]);  PNs = PN[j, a]
    final level: PN[k-1, x_k] = 0;  PN[k] = PNs * p_k                  # bonus token

It is lossless for a chain sampled from q (mode "chain") and accepts at least as many tokens as
``sps`` in expectation (the paper's Thm 5.6). A tree version does not exist (the paper's "tree"
is the space of strings), so ``verify`` refuses anything but a chain.

Decisions where the paper is silent:
  * ``q_j[a] == 0`` (a token the draft could not have drawn; probability 0) ends that row's chain
    at level ``j``: its bonus row becomes ``PNs * p_j``. Any choice is lossless there; this one
    keeps ``PN`` a distribution.
  * The table is computed in float64 (the paper: "log-space"); ``sample_from`` needs no
    normalisation, so rounding in ``sum PN = 1`` cannot raise.
  * EOS inside the chain needs nothing here: the loop truncates emitted tokens after EOS, which
    keeps the distribution of the sequence up to EOS.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs
from stree.verify.base import Verdict
from stree.verify.sps import SpSVerifier


def asps_cells(p: Tensor, q: Tensor, tokens: Tensor) -> Tensor:
    """ASpS's outcome table for a batch of chains.

    Args:
        p: ``(b, k + 1, v)`` target probabilities at nodes ``0..k`` (root first).
        q: ``(b, k, v)`` draft probabilities at nodes ``0..k-1`` (what ``x_{j+1}`` was drawn from).
        tokens: ``(b, k)`` int64 drafted tokens ``x_1..x_k``.
    Returns:
        ``(b, k + 1, v)`` float64, cell ``(j, t)`` = probability of accepting ``j`` drafted tokens
        and emitting ``t`` next; each row sums to 1 (up to rounding).
    """
    b, k1, v = p.shape
    k = k1 - 1
    p, q = p.double(), q.double()
    if k == 0:  # the root alone (nothing drafted): its one outcome is a sample of p there
        return p.clone()
    PN = torch.zeros(b, k1, v, dtype=torch.float64, device=p.device)
    PNs = torch.ones(b, dtype=torch.float64, device=p.device)
    live = torch.ones(b, dtype=torch.bool, device=p.device)
    length = torch.zeros(b, dtype=torch.long, device=p.device)    # levels processed per row
    for j in range(k):
        a = tokens[:, j:j + 1]
        qa = q[:, j].gather(1, a).squeeze(1)
        live = live & (qa > 0)
        if j > 0:  # the continuation cell of level j - 1 moves down to level j
            prev = PN[:, j - 1].scatter(1, tokens[:, j - 1:j], 0.0)
            PN[:, j - 1] = torch.where(live[:, None], prev, PN[:, j - 1])
        m = PNs[:, None] * p[:, j]
        C1 = (q[:, j] - m).clamp_min(0)
        Z = C1.sum(-1)
        ratio = torch.where(Z > 0, C1.gather(1, a).squeeze(1) / Z.clamp_min(1e-300), 0.0)
        w = torch.where(live, ratio / qa.clamp_min(1e-300), 1.0)
        PN[:, :j] *= w[:, None, None]
        row = (w[:, None] * (m - q[:, j]).clamp_min(0)).scatter(
            1, a, (m.gather(1, a).squeeze(1) / qa.clamp_min(1e-300)).clamp_max(1.0)[:, None])
        PN[:, j] = torch.where(live[:, None], row, PN[:, j])
        PNs = torch.where(live, row.gather(1, a).squeeze(1), PNs)
        length = length + live.long()
    # Bonus level: the continuation of the last processed level becomes a sample of p there.
    rows = torch.arange(b, device=p.device)
    last = (length - 1).clamp_min(0)
    cont = tokens.gather(1, last[:, None]).squeeze(1)
    kept = PN[rows, last, cont]
    PN[rows, last, cont] = torch.where(length > 0, 0.0, kept)
    PN[rows, length] = PNs[:, None] * p[rows, length]
    return PN


class ASpSVerifier(SpSVerifier):
    """Chain verifier; same inputs, outputs and refusals as ``sps``."""

    name = "asps"

    def sampled(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Verdict:
        b, n, v = target_logits.shape
        tokens = draft.tree.tokens.to(target_logits.device)
        q = draft.q.to(target_logits.device).float()
        q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        PN = asps_cells(target_probs(target_logits, sampling), q[:, :n - 1], tokens[:, 1:])
        cell = sample_from(PN.flatten(1), generator)
        accepted, next_token = cell // v, cell % v
        steps = torch.arange(n, device=tokens.device)
        path = torch.where(steps[None] <= accepted[:, None], steps[None], -1)
        return Verdict(path=path, num_accepted=accepted, next_token=next_token)
