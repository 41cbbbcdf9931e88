"""Multi-step speculative sampling (SpecInfer MSS) and its without-replacement variant.

At node u with target p and draft q, children tested in draft order:
    R = p
    for child c (token x):  accept with prob min(1, R[x] / q[x]);
                            on reject: R <- norm((R - q)+)
                                       without replacement only: q[x] <- 0, q <- norm(q)
    nothing accepted: emit a sample of R (at a leaf R = p, the bonus token).
The with-replacement update is lossless iff the children are i.i.d. draws from q ("iid", "chain");
the without-replacement one (DySpec Alg. 3 / Sequoia / SpecExec) iff they were drawn sequentially
without replacement ("without_replacement"). A merged draft (``Draft.fixed``: chosen suffix-tree
children beside the draws) goes through :func:`mixed_rule`. Neither is lossless for chosen ("deterministic")
children at temperature > 0, which ``check`` refuses. A child the current q gives probability 0
cannot have been drawn from it: it is skipped, R and q unchanged. Such children are copies of a
rejected sibling (a dynamic drafter's padding, see ``stree.draft.dynamic``) or draws past q's
support, so skipping them is lossless.
"""
from __future__ import annotations

import torch
from torch import Tensor

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs
from stree.verify.base import NodeStep, Verdict, first_match, validate, walk
from stree.verify.greedy import greedy_verdict

# Below this total variation (R - q)+ is treated as empty. A rejection there has probability
# <= _RESIDUAL_EPS, so keeping R instead costs at most that much in distribution.
_RESIDUAL_EPS = 1e-6


def _normalise(w: Tensor) -> Tensor:
    s = w.sum(-1, keepdim=True)
    return torch.where(s > 0, w / s.clamp_min(torch.finfo(w.dtype).tiny), w)


def mss_rule(step: NodeStep, sampling: SamplingConfig, without_replacement: bool,
             generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """One node of MSS for every row. Returns (accepted slot or -1, emitted token), each (b,)."""
    if step.child_fixed is not None:
        return mixed_rule(step, sampling, without_replacement, generator)
    R = target_probs(step.logits, sampling)
    slot, R = _test_draws(R, step.q, step.child_tokens, step.child_valid, without_replacement,
                          generator)
    return slot, sample_from(R, generator)


def _test_draws(R: Tensor, q: Tensor, tokens: Tensor, valid: Tensor, without_replacement: bool,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """MSS over the drawn children ``tokens (b, c)`` (where ``valid``) against target ``R (b, v)``:
    (accepted slot or -1, the residual to sample from when none is accepted)."""
    # Normalising q is not a re-transformation: it is the distribution multinomial sampling used.
    Q = _normalise(q)
    b, c = tokens.shape
    slot = torch.full((b,), -1, dtype=torch.long, device=R.device)
    for j in range(c):
        live = valid[:, j] & (slot < 0)
        tok = tokens[:, j : j + 1]
        r_tok = R.gather(1, tok).squeeze(1)
        q_tok = Q.gather(1, tok).squeeze(1)
        u = torch.rand(b, generator=generator, device=R.device)
        # u < R/q written without the division. q[x] == 0 means x could not have been drawn;
        # treat it as a rejection (probability-zero event, so any choice is lossless).
        accept = live & (q_tok > 0) & (u * q_tok < r_tok)
        slot = torch.where(accept, j, slot)
        # A child q gives probability 0 was not drawn from q (a later copy of a rejected sibling:
        # a dynamic drafter's padding, or a draw past q's support): skip it, R and q unchanged.
        reject = (live & ~accept & (q_tok > 0)).unsqueeze(1)
        resid = (R - Q).clamp_min(0)
        # (R - q)+ ~ 0 means R == q, where rejection has probability ~0 (only rounding or a
        # q[x] == 0 token gets here): keep R instead of dividing noise by ~0.
        mass = resid.sum(-1, keepdim=True)
        R = torch.where(reject & (mass > _RESIDUAL_EPS), resid / mass.clamp_min(_RESIDUAL_EPS), R)
        if without_replacement:
            # Once q is exhausted (all of the vocab drafted) later children have q[x] == 0 and
            # are rejected, leaving R unchanged: DySpec's early return.
            Q = torch.where(reject, _normalise(Q.scatter(1, tok, 0.0)), Q)
    return slot, R


def mixed_rule(step: NodeStep, sampling: SamplingConfig, without_replacement: bool,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """A node whose children are draws from q and chosen ones (suffix-tree continuations):

        MSS over the drawn children against the target p;
        none accepted: y ~ the residual; accept the first chosen child carrying y, if any,
                       else emit y.

    Every path through the rule emits one token distributed as p (MSS is lossless for its
    draws), and a child is followed only when its token is the one emitted, so the rest of the
    walk continues from the right context with fresh randomness: lossless for any chosen
    children, whatever they depend on. Chosen children add acceptance only where the draws were
    rejected, so a merged tree never accepts less than its drawn part alone (testing the
    chosen children first would waste the draws that coincide with them)."""
    R = target_probs(step.logits, sampling)
    if step.q is None:  # nothing drawn anywhere (a chosen-only tree in a drawn mode)
        slot, resid = torch.full_like(step.child_tokens[:, 0], -1), R
    else:
        slot, resid = _test_draws(R, step.q, step.child_tokens, step.child_valid & step.child_drawn,
                                  without_replacement, generator)
    token = sample_from(resid, generator)
    chosen = NodeStep(step.logits, None, step.child_tokens, step.child_valid & step.child_fixed)
    return torch.where(slot >= 0, slot, first_match(chosen, token)), token


class MSSVerifier:
    name = "mss"

    def check(self, draft_mode: str, sampling: SamplingConfig) -> None:
        if draft_mode == "deterministic" and not sampling.is_greedy:
            raise ValueError(
                "MSS is not lossless for deterministic (top-k / static / beam) children at "
                f"temperature > 0 ({sampling}); use the 'naive' verifier or a sampling drafter")

    def verify(self, draft: Draft, target_logits: Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None = None) -> Verdict:
        """target_logits: (b, n, v); draft.q (b, n, v) required unless sampling is greedy."""
        self.check(draft.mode, sampling)
        # a merged draft with no q has no drawn node (Draft.fixed)
        validate(draft, target_logits, need_q=not sampling.is_greedy and not draft.merged)
        if sampling.is_greedy:  # p is one-hot: MSS reduces to greedy exactly
            return greedy_verdict(draft, target_logits)
        without = draft.mode == "without_replacement"
        return walk(draft, target_logits,
                    lambda step: mss_rule(step, sampling, without, generator))
