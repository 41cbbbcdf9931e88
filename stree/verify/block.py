"""Block verification of a sampled chain (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh,
"Block Verification Accelerates Speculative Decoding", arXiv 2403.10444, Algorithm 2).

Speculative sampling (``sps``) accepts the chain token by token; block verification decides how
much of the chain to keep from the whole block. With draft tokens ``x_1..x_k``, ``q_i`` the draft
distribution ``x_{i+1}`` was drawn from (node ``i``) and ``p_i`` the target's at node ``i``
(node 0 = the root)::

    w_0 = 1,  w_i = min(1, w_{i-1} p_{i-1}(x_i) / q_{i-1}(x_i))         sequence-level weights
    rho_i = sum_x (w_i p_i(x) - q_i(x))+          (q_k := 0 at the leaf, so rho_k = w_k)
    h_i   = rho_i / (rho_i + 1 - w_i)             (h_k = w_k; h_0 = 1)
    from i = k down to 0: stop at the first i with eta_i <= h_i  (eta_i ~ U(0, 1), one per level)
    accept x_1..x_i, then emit a sample of norm((w_i p_i - q_i)+)   (= p_k at i = k)

Every uniform is drawn at once and the accepted length is the deepest level whose test passes, so
the rule has no loop over levels. It is lossless for a chain sampled from q with a length fixed
before drawing (draft mode ``"chain"``), and its expected number of accepted tokens is the most
any valid verifier of a chain reaches, so never below ``sps``'s (the paper's Theorems 1 and 2;
``tests/test_verify_block.py`` checks both by exact enumeration). Traversal Verification
(:mod:`stree.verify.traversal`) is the same rule on trees. Refusals (and the greedy path) are
``sps``'s.

Decisions where the paper is silent:
  * A drafted token with ``q_{i-1}(x_i) == 0`` (one the draft could not have drawn) gets weight 0,
    so neither it nor anything after it is accepted; any choice is lossless for an event of
    probability 0.
  * ``rho_i + 1 - w_i == 0`` (``w_i = 1`` and ``p_i = q_i``: the block below ``i`` is accepted with
    probability 1) gives ``h_i = 1``; a residual of total mass ``<= 1e-6`` is replaced by ``p_i``,
    as in ``mss``, so rounding noise is never sampled.
  * Computed in float64 (as ``asps``): the weights are products of ratios along the chain.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs, uniforms
from stree.verify.base import Verdict
from stree.verify.mss import _RESIDUAL_EPS
from stree.verify.sps import SpSVerifier


def block_weights(p: Tensor, q: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Block verification's stopping probabilities and residuals for a batch of chains.

    Args:
        p: ``(b, k + 1, v)`` target probabilities at nodes ``0..k`` (root first).
        q: ``(b, k, v)`` draft distributions at nodes ``0..k-1`` (what ``x_{i+1}`` was drawn from),
            normalised.
        tokens: ``(b, k)`` int64 drafted tokens ``x_1..x_k``.
    Returns:
        ``h (b, k + 1)``: the probability that the test at level ``i`` passes (levels tested from
        ``k`` down, the first pass is the accepted length; ``h[:, 0] == 1``), and
        ``residual (b, k + 1, v)``: the distribution of the token emitted after accepting ``i``
        drafted tokens. Both in ``p``'s dtype.
    """
    b, k1, v = p.shape
    p_tok = p[:, :-1].gather(2, tokens[:, :, None]).squeeze(2)                  # (b, k)
    q_tok = q.gather(2, tokens[:, :, None]).squeeze(2)
    ratio = torch.where(q_tok > 0, p_tok / q_tok.clamp_min(torch.finfo(p.dtype).tiny), 0.0)
    # w_i = min(1, w_{i-1} r_i) unrolls to min over j <= i of r_{j+1} ... r_i: in logs, S_i minus
    # the running maximum of S (S_0 = 0, S_i = log r_1 + ... + log r_i)
    S = torch.cat([torch.zeros(b, 1, dtype=p.dtype, device=p.device), ratio.log().cumsum(1)], 1)
    w = (S - S.cummax(1).values).exp()                                  # (b, k + 1), w_0 = 1
    q_leaf = torch.cat([q, torch.zeros(b, 1, v, dtype=q.dtype, device=q.device)], 1)
    resid = (w[:, :, None] * p - q_leaf).clamp_min(0)
    rho = resid.sum(-1)
    denom = rho + 1 - w
    h = torch.where(denom > 0, rho / denom.clamp_min(torch.finfo(p.dtype).tiny), 1.0)
    h[:, 0] = 1.0
    residual = torch.where((rho > _RESIDUAL_EPS)[:, :, None],
                           resid / rho.clamp_min(_RESIDUAL_EPS)[:, :, None], p)
    return h, residual


class BlockVerifier(SpSVerifier):
    """Chain verifier; same inputs, outputs and refusals as ``sps``."""

    name = "block"

    def sampled(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Verdict:
        b, n, v = target_logits.shape
        tokens = draft.tree.tokens.to(target_logits.device)
        q = draft.q.to(target_logits.device)[:, :n - 1].double()
        q = q / q.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        p = target_probs(target_logits, sampling).double()
        h, residual = block_weights(p, q, tokens[:, 1:])
        passed = uniforms((b, n), target_logits.device, generator) < h
        passed[:, 0] = True
        steps = torch.arange(n, device=tokens.device)
        accepted = torch.where(passed, steps, 0).amax(1)                  # the deepest pass
        rows = torch.arange(b, device=tokens.device)
        next_token = sample_from(residual[rows, accepted], generator)
        path = torch.where(steps[None] <= accepted[:, None], steps[None], -1)
        return Verdict(path=path, num_accepted=accepted, next_token=next_token)
