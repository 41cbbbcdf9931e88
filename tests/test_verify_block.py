"""Block verification of a sampled chain (``stree.verify.block``): exact losslessness and
acceptance by enumerating every drafted chain, a wrong rule the same enumeration rejects, the
end-to-end chi-square test of ``test_verify_distribution`` with its negative control, greedy
equivalence and refusals.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from stree.verify import block, get_verifier
from stree.verify.asps import asps_cells
from stree.verify.block import block_weights
from tests.test_verify_asps import K, V, _sps_expected, _tables
from tests.test_verify_distribution import (ALPHA, exact_triples, make_models, pvalues,
                                            run_verifier, simulate)

T1 = SamplingConfig(1.0)


def outcome_table(h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``(b, k + 1, v)``: probability of accepting ``j`` drafted tokens and emitting ``t``, from
    block_weights' outputs (levels tested from ``k`` down, the first pass stops)."""
    fail_below = torch.cat([(1 - h).flip(1).cumprod(1).flip(1)[:, 1:], torch.ones_like(h[:, :1])],
                           1)                     # every level deeper than j failed
    return (h * fail_below)[:, :, None] * residual


def _chain_inputs(p, q, chain):
    P = torch.stack([p[chain[:j]] for j in range(K + 1)])[None]
    Q = torch.stack([q[chain[:j]] for j in range(K)])[None]
    return P, Q, torch.tensor([chain])


def _block_cells(p, q, chain, weights=block_weights):
    return outcome_table(*weights(*_chain_inputs(p, q, chain)))[0]


def _enumerate(p, q, cells):
    """Sum over every drafted chain (weight q(chain)) of ``cells(chain)`` completed with exact
    target samples to K + 1 tokens: (distribution of the K + 1 tokens, expected accepted)."""
    out = {y: 0.0 for y in itertools.product(range(V), repeat=K + 1)}
    accepted = 0.0
    for chain in itertools.product(range(V), repeat=K):
        w = 1.0
        for j, x in enumerate(chain):
            w *= float(q[chain[:j]][x])
        PN = cells(chain)
        assert abs(float(PN.sum()) - 1.0) < 1e-9
        accepted += w * float((PN.sum(-1) * torch.arange(K + 1)).sum())
        for j in range(K + 1):
            for t in range(V):
                for rest in itertools.product(range(V), repeat=K - j):
                    y, m = chain[:j] + (t,) + rest, float(PN[j, t]) * w
                    for i in range(j + 1, K + 1):
                        m *= float(p[y[:i]][y[i]])
                    out[y] += m
    return out, accepted


def _target(p):
    out = {}
    for y in itertools.product(range(V), repeat=K + 1):
        m = 1.0
        for i in range(K + 1):
            m *= float(p[y[:i]][y[i]])
        out[y] = m
    return out


def _max_error(p, out):
    want = _target(p)
    return max(abs(out[y] - want[y]) for y in want)


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_lossless_and_not_below_sps_or_asps(seed, peaked):
    """Over every drafted chain the emitted K + 1 tokens have exactly the target's distribution;
    block verification accepts at least as many tokens in expectation as sps (Thm 1 of the
    paper) and as asps (block verification is optimal among valid chain verifiers, Thm 2)."""
    p, q = _tables(seed, peaked)
    out, e_block = _enumerate(p, q, lambda c: _block_cells(p, q, c))
    assert _max_error(p, out) < 1e-12
    e_sps = sum(float(torch.tensor([q[c[:j]][x] for j, x in enumerate(c)]).prod())
                * _sps_expected(p, q, c) for c in itertools.product(range(V), repeat=K))
    _, e_asps = _enumerate(p, q, lambda c: asps_cells(*_chain_inputs(p, q, c))[0])
    assert e_block >= e_sps - 1e-12 and e_block >= e_asps - 1e-12, (e_block, e_sps, e_asps)


def _accept_prefix_weight(p, q, tokens):
    """WRONG: stop at level i with probability w_i (the prefix's weight) instead of
    rho_i / (rho_i + 1 - w_i), residual unchanged."""
    h, residual = block_weights(p, q, tokens)
    b, k1, _ = p.shape
    ratio = torch.ones(b, k1, dtype=p.dtype)
    for i in range(1, k1):
        x = tokens[:, i - 1:i]
        r = p[:, i - 1].gather(1, x)[:, 0] / q[:, i - 1].gather(1, x)[:, 0]
        ratio[:, i] = torch.minimum(ratio[:, i - 1] * r, torch.ones_like(r))
    return ratio, residual


def test_wrong_rule_is_detected_exactly():
    """The enumeration above rejects a rule with the wrong stopping probabilities: the emitted
    distribution misses the target's by far more than rounding."""
    p, q = _tables(0, True)
    out, _ = _enumerate(p, q, lambda c: _block_cells(p, q, c, weights=_accept_prefix_weight))
    assert _max_error(p, out) > 1e-3


def test_two_token_example():
    """A context-free case worked by hand: p = (1/3, 2/3), q = (2/3, 1/3), a block of 2.
    sps accepts P(>= 1) + P(>= 2) = 2/3 + (2/3)^2 = 10/9 tokens in expectation; block
    verification 2/3 + sum_x1 q(x1) sum_x2 min(q(x2), w_1(x1) p(x2)) = 2/3 + (2/3 * 1/2 +
    1/3 * 2/3) = 11/9 (w_1(A) = 1/2, w_1(B) = 1)."""
    P = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    Q = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    e_block = e_sps = 0.0
    for chain in itertools.product(range(2), repeat=2):
        w = float(Q[chain[0]] * Q[chain[1]])
        cells = outcome_table(*block_weights(P.expand(1, 3, 2), Q.expand(1, 2, 2),
                                             torch.tensor([chain])))[0]
        e_block += w * float((cells.sum(-1) * torch.arange(3)).sum())
        a1, a2 = (min(1.0, float(P[x] / Q[x])) for x in chain)
        e_sps += w * (a1 + a1 * a2)
    assert abs(e_sps - 10 / 9) < 1e-12 and abs(e_block - 11 / 9) < 1e-12, (e_sps, e_block)


# ---------------------------------------------------------------- end to end through the verifier
LOSSLESS = [SamplingConfig(1.0), SamplingConfig(0.7, top_k=3), SamplingConfig(0.8, top_p=0.8)]


@pytest.mark.parametrize("sampling", LOSSLESS,
                         ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_lossless_chi_square(sampling):
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, (1, 1), "chain", run_verifier("block", sampling), seed=5,
                      sampling=sampling)
    p = pvalues(counts, exact_triples(m, sampling))
    assert min(p.values()) > ALPHA, p


def test_negative_control_is_detected(monkeypatch):
    """The wrong stopping rule above, run through the verifier: the chi-square test fails."""
    monkeypatch.setattr(block, "block_weights", _accept_prefix_weight)
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, (1, 1), "chain", run_verifier("block", T1), seed=5, sampling=T1)
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) < ALPHA, p


def test_acceptance_not_below_sps_on_the_same_draws():
    """Block, sps and asps on the same 4000 drafted chains (K = 4, V = 8): block's mean
    accepted tokens is not below either (paired, 4 standard errors of slack)."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 4000, 4, 8
    logits = torch.randn(b, k + 1, v, generator=g) * 1.5
    q = (torch.randn(b, k + 1, v, generator=g) * 1.5).softmax(-1)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long),
                        torch.multinomial(q[:, :k].reshape(-1, v), 1, generator=g).view(b, k)], 1)
    draft = Draft(TokenTree(tokens, torch.arange(-1, k)), q, "chain")
    acc = {name: get_verifier(name).verify(draft, logits, T1, generator=g).num_accepted.double()
           for name in ("block", "sps", "asps")}
    for other in ("sps", "asps"):
        diff = acc["block"] - acc[other]
        assert diff.mean() > -4 * diff.std() / b ** 0.5, (other, acc["block"].mean(),
                                                          acc[other].mean())


# --------------------------------------------------------------------- greedy, edge cases, refusals
@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(1.0, top_k=1),
                                      SamplingConfig(1e-3)], ids=["T0", "top_k1", "T1e-3"])
def test_greedy_and_near_zero_temperature_match_greedy(sampling):
    """At greedy settings the verdicts are greedy matching's, trial for trial; at T = 1e-3 the
    sampling path itself (p one-hot in fp32) gives them too."""
    g = torch.Generator().manual_seed(1)
    b, k, v = 500, 4, 5
    logits = torch.randn(b, k + 1, v, generator=g) * 3
    q = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    tokens = torch.where(torch.rand(b, k + 1, generator=g) < 0.7, logits.argmax(-1).roll(1, 1),
                         torch.randint(0, v, (b, k + 1), generator=g))
    draft = Draft(TokenTree(tokens, torch.arange(-1, k)), q, "chain")
    ours = get_verifier("block").verify(draft, logits, sampling, generator=g)
    greedy = get_verifier("greedy").verify(draft, logits, SamplingConfig(0.0))
    assert torch.equal(ours.path, greedy.path) and torch.equal(ours.next_token, greedy.next_token)
    assert torch.equal(ours.num_accepted, greedy.num_accepted)
    assert len(set(greedy.num_accepted.tolist())) > 2  # the chains are accepted to varied depths


def test_zero_draft_probability_ends_the_chain():
    """A drafted token q gives probability 0: nothing from it on is accepted."""
    p = torch.tensor([[[.2, .3, .5], [.6, .2, .2], [1 / 3] * 3]], dtype=torch.float64)
    q = torch.tensor([[[.5, .5, 0.], [.3, .3, .4]]], dtype=torch.float64)
    h, residual = block_weights(p, q, torch.tensor([[2, 0]]))
    assert h[0, 1:].tolist() == [0.0, 0.0] and h[0, 0] == 1.0
    assert torch.allclose(residual[0, 0], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))


def test_root_only_and_refusals():
    g = torch.Generator().manual_seed(1)
    verifier = get_verifier("block")
    root = Draft(TokenTree(torch.tensor([[3], [1]]), [-1]), torch.full((2, 1, 4), 0.25), "chain")
    v = verifier.verify(root, torch.randn(2, 1, 4, generator=g), T1, generator=g)
    assert v.path.tolist() == [[0], [0]] and v.num_accepted.tolist() == [0, 0]
    for mode in ("iid", "without_replacement", "deterministic"):
        with pytest.raises(ValueError, match="'block' verifier needs a sampled chain"):
            verifier.check(mode, T1)
        verifier.check(mode, SamplingConfig(0.0))
    tree = Draft(TokenTree(torch.randint(0, 4, (1, 4), generator=g), [-1, 0, 0, 1]),
                 torch.full((1, 4, 4), 0.25), "chain")
    with pytest.raises(ValueError, match="needs a chain"):
        verifier.verify(tree, torch.randn(1, 4, 4), T1)
