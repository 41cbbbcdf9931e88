"""ASpS (chain verifier by Tree Monte Carlo): the paper's worked example, exact losslessness and
acceptance by enumerating every drafted chain, and acceptance against ``sps`` on the same draws.

The sampled end-to-end chi-square tests (and the broken-coupling negative control) are in
``test_verify_distribution.py`` with the other verifiers.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from stree.verify import get_verifier
from stree.verify.asps import asps_cells

V, K = 3, 3


def _tables(seed: int, peaked: bool):
    """Target p and draft q: a distribution after every prefix of length 0..K (dict by tuple)."""
    g = torch.Generator().manual_seed(seed)

    def dist(sharp):
        w = torch.rand(V, generator=g, dtype=torch.float64) ** sharp + 1e-3
        return w / w.sum()

    prefixes = [t for L in range(K + 1) for t in itertools.product(range(V), repeat=L)]
    return ({s: dist(1.0) for s in prefixes}, {s: dist(4.0 if peaked else 1.0) for s in prefixes})


def _cells(p, q, chain):
    """asps_cells for one drafted chain (tuple of K tokens)."""
    P = torch.stack([p[chain[:j]] for j in range(K + 1)])[None]
    Q = torch.stack([q[chain[:j]] for j in range(K)])[None]
    return asps_cells(P, Q, torch.tensor([chain]))[0]


def _sps_expected(p, q, chain) -> float:
    """Expected tokens accepted by speculative sampling given the chain: sum_j prod_{i<=j}
    min(1, p/q) along it (independent accept tests)."""
    total, cont = 0.0, 1.0
    for j, x in enumerate(chain):
        cont *= min(1.0, float(p[chain[:j]][x] / q[chain[:j]][x]))
        total += cont
    return total


def test_paper_worked_example():
    """Tables 2/3 of the paper: reference P_ref = (.5,.3,.2), P_ref(.|a) = (.4,.4,.2); target
    P = (.3,.4,.3), P(.|a) uniform. ASpS rows for reference strings aa, ab, ac."""
    f64 = dict(dtype=torch.float64)
    q0, qa = torch.tensor([.5, .3, .2], **f64), torch.tensor([.4, .4, .2], **f64)
    p0, pa = torch.tensor([.3, .4, .3], **f64), torch.full((3,), 1 / 3, **f64)
    # joint mass (target outcome | reference string) from the paper, divided by P_ref(string)
    paper = {(0, 0): {"aa": .1, "b": .05, "c": .05}, (0, 1): {"ab": .1, "b": .05, "c": .05},
             (0, 2): {"ac": .1}}
    ref_mass = {(0, 0): .2, (0, 1): .2, (0, 2): .1}
    for chain, outcomes in paper.items():
        PN = asps_cells(torch.stack([p0, pa, pa])[None], torch.stack([q0, qa])[None],
                        torch.tensor([chain]))[0]
        got = {"b": float(PN[0, 1]), "c": float(PN[0, 2]), "a" + "abc"[chain[1]]: float(PN[2].sum())}
        got = {k: v for k, v in got.items() if v > 1e-12}
        want = {k: v / ref_mass[chain] for k, v in outcomes.items()}
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want), chain
        assert float(PN[1].sum()) == 0.0  # "accept a, then emit a different token" never happens


@pytest.mark.parametrize("peaked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_lossless_and_not_below_sps(seed, peaked):
    """Sum over every drafted chain x (weight q(x)) of ASpS's outcome table, completed with exact
    target samples to K + 1 tokens, equals the target's distribution of K + 1 tokens; and its
    expected acceptance is at least speculative sampling's (Thm 5.6)."""
    p, q = _tables(seed, peaked)
    out = {y: 0.0 for y in itertools.product(range(V), repeat=K + 1)}
    e_asps = e_sps = 0.0
    for chain in itertools.product(range(V), repeat=K):
        w = 1.0
        for j, x in enumerate(chain):
            w *= float(q[chain[:j]][x])
        PN = _cells(p, q, chain)
        assert abs(float(PN.sum()) - 1.0) < 1e-9
        e_asps += w * float((PN.sum(-1) * torch.arange(K + 1)).sum())
        e_sps += w * _sps_expected(p, q, chain)
        for j in range(K + 1):
            for t in range(V):
                prefix = chain[:j] + (t,)
                for rest in itertools.product(range(V), repeat=K - j):
                    y, m = prefix + rest, float(PN[j, t]) * w
                    for i in range(j + 1, K + 1):
                        m *= float(p[y[:i]][y[i]])
                    out[y] += m
    for y, mass in out.items():
        want = 1.0
        for i in range(K + 1):
            want *= float(p[y[:i]][y[i]])
        assert abs(mass - want) < 1e-9, (y, mass, want)
    assert e_asps >= e_sps - 1e-12, (e_asps, e_sps)


def test_acceptance_not_below_sps_on_the_same_draws():
    """Both verifiers on the same 4000 drafted chains (K = 4, V = 8): ASpS's mean accepted tokens
    is not below sps's (paired difference, 4 standard errors of slack for the verifiers' own
    randomness)."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 4000, 4, 8
    logits = torch.randn(b, k + 1, v, generator=g) * 1.5
    q = (torch.randn(b, k + 1, v, generator=g) * 1.5).softmax(-1)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long),
                        torch.multinomial(q[:, :k].reshape(-1, v), 1, generator=g).view(b, k)], 1)
    draft = Draft(TokenTree(tokens, torch.arange(-1, k)), q, "chain")
    s = SamplingConfig(1.0)
    acc = {name: get_verifier(name).verify(draft, logits, s, generator=g).num_accepted.double()
           for name in ("asps", "sps")}
    diff = acc["asps"] - acc["sps"]
    assert diff.mean() > -4 * diff.std() / b ** 0.5, (acc["asps"].mean(), acc["sps"].mean())


def test_greedy_and_refusals():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g)
    q = torch.softmax(torch.randn(2, 4, 6, generator=g), -1)
    chain = Draft(TokenTree(torch.randint(0, 6, (2, 4), generator=g), torch.arange(-1, 3)), q,
                  "chain")
    greedy = get_verifier("greedy").verify(chain, logits, SamplingConfig(0.0))
    ours = get_verifier("asps").verify(chain, logits, SamplingConfig(0.0))
    assert torch.equal(ours.path, greedy.path) and torch.equal(ours.next_token, greedy.next_token)
    tree = Draft(TokenTree(chain.tree.tokens, [-1, 0, 0, 1]), q, "iid")
    with pytest.raises(ValueError, match="'asps' verifier needs a sampled chain"):
        get_verifier("asps").verify(tree, logits, SamplingConfig(1.0))
    with pytest.raises(ValueError, match="needs a chain"):
        get_verifier("asps").verify(Draft(tree.tree, q, "chain"), logits, SamplingConfig(1.0))


def test_zero_draft_probability_ends_the_chain():
    """A drafted token with q = 0 (impossible under q): the row stops there and emits from p."""
    p = torch.tensor([[[.2, .3, .5], [.6, .2, .2], [1 / 3] * 3]], dtype=torch.float64)
    q = torch.tensor([[[.5, .5, 0.], [.3, .3, .4]]], dtype=torch.float64)
    PN = asps_cells(p, q, torch.tensor([[2, 0]]))[0]
    assert torch.allclose(PN[0], p[0, 0]) and float(PN[1:].sum()) == 0.0
