"""Traversal Verification (``stree.verify.traversal``): exact losslessness and acceptance by
enumerating every drafted tree over a 3-token vocabulary, wrong rules the same enumeration
rejects, the paper's sequential algorithm as an oracle for the vectorised one, block verification
on chains, the end-to-end chi-square tests of ``test_verify_distribution`` and
``test_verify_merged`` with their negative controls, greedy equivalence and refusals.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, target_probs
from stree.tree import TokenTree
from stree.verify import get_verifier, traversal
from stree.verify.base import children_table
from stree.verify.block import block_weights
from tests.test_verify_distribution import (ALPHA, _greedy_verdicts, _matches, exact_triples,
                                            make_models, pvalues, run_verifier, simulate)
from tests.test_verify_merged import simulate_merged

V = 3
T1 = SamplingConfig(1.0)


# ---------------------------------------------------------------------- exact enumeration
def _tables(seed: int, depth: int, peaked: bool):
    """Target p and draft q: a distribution after every prefix of length 0..depth + 1."""
    g = torch.Generator().manual_seed(seed)

    def dist(sharp):
        w = torch.rand(V, generator=g, dtype=torch.float64) ** sharp + 1e-3
        return w / w.sum()

    prefixes = [t for L in range(depth + 2) for t in itertools.product(range(V), repeat=L)]
    return ({s: dist(1.0) for s in prefixes}, {s: dist(4.0 if peaked else 1.0) for s in prefixes})


def _prefix(tokens, parents, u) -> tuple:
    """Tokens on the path root..u, the root's excluded."""
    path = []
    while u > 0:
        path.append(tokens[u])
        u = parents[u]
    return tuple(reversed(path))


def _drafts(parents, q, mode):
    """Every tree the draft can produce (tokens root first) with its probability: each node's
    token drawn from its parent's q, i.i.d. or without replacement among earlier siblings."""
    n = len(parents)
    out = []

    def grow(i, tokens, w):
        if i == n:
            out.append((tokens, w))
            return
        d = q[_prefix(tokens, parents, parents[i])].clone()
        if mode == "without_replacement":
            for s in range(1, i):
                if parents[s] == parents[i]:
                    d[tokens[s]] = 0.0
            d = d / d.sum()
        for x in range(V):
            if d[x] > 0:
                grow(i + 1, tokens + [x], w * float(d[x]))

    grow(1, [0], 1.0)
    return out


def _states(parents, p, q, drafts, mode):
    """traversal_states and post-order ranks of every drafted tree (one batch row each), in
    float64."""
    n = len(parents)
    tokens = torch.tensor([t for t, _ in drafts])
    tree = TokenTree(tokens, parents)
    P = torch.stack([torch.stack([p[_prefix(t, parents, u)] for u in range(n)]) for t, _ in drafts])
    Q = torch.stack([torch.stack([q[_prefix(t, parents, u)] for u in range(n)]) for t, _ in drafts])
    live = torch.ones(len(drafts), n, dtype=torch.bool)
    h, residual = traversal.traversal_states(P, Q, tokens, children_table(tree.parents), live,
                                             tree.depth, tree.max_depth,
                                             mode == "without_replacement")
    return h, residual, traversal.postorder_rank(tree.mask, tree.earlier_siblings())


def exact_output(parents, p, q, mode):
    """The exact distribution of the first depth + 1 emitted tokens (completed with exact target
    samples) over every drafted tree and the verifier's randomness, and the expected accepted
    tokens. The traversal accepts node a with probability h_a prod_{c before a} (1 - h_c)."""
    drafts = _drafts(parents, q, mode)
    h, residual, rank = _states(parents, p, q, drafts, mode)
    before = rank[:, None, :] < rank[:, :, None]                         # [row, a, c]
    accept = h * torch.where(before, (1 - h)[:, None, :], torch.ones_like(h)[:, None, :]).prod(-1)
    assert torch.allclose(accept.sum(1), torch.ones(len(drafts), dtype=torch.float64))
    L = max(len(_prefix(drafts[0][0], parents, u)) for u in range(len(parents))) + 1
    out = dict.fromkeys(itertools.product(range(V), repeat=L), 0.0)
    accepted = 0.0
    for r, (tokens, w) in enumerate(drafts):
        for a in range(len(parents)):
            head = _prefix(tokens, parents, a)
            accepted += w * float(accept[r, a]) * len(head)
            for t in range(V):
                m = w * float(accept[r, a] * residual[r, a, t])
                for rest in itertools.product(range(V), repeat=L - len(head) - 1):
                    y, mm = head + (t,) + rest, m
                    for i in range(len(head) + 1, L):
                        mm *= float(p[y[:i]][y[i]])
                    out[y] += mm
    return out, accepted


def target_error(p, out) -> float:
    """Largest gap between ``out`` and the target's distribution of those sequences."""
    err = 0.0
    for y, mass in out.items():
        want = 1.0
        for i in range(len(y)):
            want *= float(p[y[:i]][y[i]])
        err = max(err, abs(mass - want))
    return err


def mss_accepted(parents, p, q, mode) -> float:
    """MSS's expected accepted tokens over the same drafts, from its definition (host loops)."""
    kids = [[c for c in range(len(parents)) if parents[c] == u] for u in range(len(parents))]

    def expected(tokens, u):
        pre = _prefix(tokens, parents, u)
        R, Q = p[pre].clone(), q[pre].clone()
        reach, e = 1.0, 0.0
        for c in kids[u]:
            x = tokens[c]
            if Q[x] == 0:
                continue
            a = min(1.0, float(R[x] / Q[x]))
            e += reach * a * (1 + expected(tokens, c))
            reach *= 1 - a
            resid = (R - Q).clamp_min(0)
            R = resid / resid.sum() if resid.sum() > 1e-12 else R
            if mode == "without_replacement":
                Q[x] = 0
                Q = Q / Q.sum() if Q.sum() > 0 else Q
        return e

    return sum(w * expected(tokens, 0) for tokens, w in _drafts(parents, q, mode))


SHAPES = {
    "2x2": [-1, 0, 0, 1, 1],             # two children of the root, two below the first
    "caterpillar3": [-1, 0, 0, 0, 1, 1, 4],
    "two_chains": [-1, 0, 0, 1, 2],
    "exhaust": [-1, 0, 0, 0, 1],         # 3 children of V = 3: q exhausted without replacement
    "iid4": [-1, 0, 0, 0, 0],            # 4 children of V = 3: repeats among i.i.d. draws
}
EXACT = [(shape, mode) for shape in SHAPES for mode in ("iid", "without_replacement")
         if not (shape == "iid4" and mode == "without_replacement")]


@pytest.mark.parametrize("peaked", [False, True], ids=["random_q", "peaked_q"])
@pytest.mark.parametrize("shape,mode", EXACT, ids=[f"{s}-{m}" for s, m in EXACT])
def test_exact_lossless_and_not_below_mss(shape, mode, peaked):
    """Exactly the target's distribution of the first depth + 1 tokens, and at least MSS's
    expected accepted tokens on the same drafts (the paper reports +2.2-5.7% over it)."""
    parents = SHAPES[shape]
    depth = TokenTree(torch.zeros(len(parents), dtype=torch.long), parents).max_depth
    p, q = _tables(3 if peaked else 0, depth, peaked)
    out, accepted = exact_output(parents, p, q, mode)
    assert target_error(p, out) < 1e-12
    assert accepted >= mss_accepted(parents, p, q, mode) - 1e-12


def _keep_weight(w, rho):
    """WRONG: a node's weight left as it was after a child's subtree is rejected."""
    return w


def _as_iid(states):
    """WRONG when children are drawn without replacement: q not updated after a rejection."""
    return lambda P, Q, tokens, table, live, depth, max_depth, without: states(
        P, Q, tokens, table, live, depth, max_depth, False)


def test_wrong_rules_are_detected_exactly(monkeypatch):
    """The enumeration rejects a rule without the parent's update and the i.i.d. update on
    children drawn without replacement: the distributions miss the target's by far more than
    rounding."""
    p, q = _tables(3, 2, True)
    with monkeypatch.context() as m:
        m.setattr(traversal, "weight_after_rejection", _keep_weight)
        assert target_error(p, exact_output(SHAPES["2x2"], p, q, "iid")[0]) > 1e-3
    with monkeypatch.context() as m:
        m.setattr(traversal, "traversal_states", _as_iid(traversal.traversal_states))
        assert target_error(p, exact_output(SHAPES["2x2"], p, q, "without_replacement")[0]) > 1e-3


def test_chain_is_block_verification():
    """On a chain the traversal's test probabilities and residuals are block verification's."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 5, 6
    P = (torch.randn(b, k + 1, v, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    Q = (torch.randn(b, k + 1, v, generator=g, dtype=torch.float64) * 1.5).softmax(-1)
    drafted = torch.multinomial(Q[:, :k].reshape(-1, v), 1, generator=g).view(b, k)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafted], 1)
    tree = TokenTree(tokens, torch.arange(-1, k))
    h, residual = traversal.traversal_states(P, Q, tokens, children_table(tree.parents, 1),
                                             torch.ones(b, k + 1, dtype=torch.bool), tree.depth, k,
                                             False)
    h_block, residual_block = block_weights(P, Q[:, :k], drafted)
    torch.testing.assert_close(h, h_block, rtol=0, atol=1e-12)
    torch.testing.assert_close(residual, residual_block, rtol=0, atol=1e-12)


# ------------------------------------------------------------ the paper's sequential algorithm
def sequential_traversal(parents, tokens, P, Q, u, without_replacement):
    """The paper's loop, one tree on the host: visit the children's subtrees in draft order (a
    child's weight from its parent's state at that time), update the parent after each rejected
    subtree, then test the node itself with its uniform ``u[node]``. Returns the accepted node."""
    kids = [[c for c in range(len(parents)) if parents[c] == v] for v in range(len(parents))]

    def visit(node, w):
        R, q = P[node].clone(), Q[node].clone()
        for c in kids[node]:
            x = tokens[c]
            if q[x] <= 0:
                continue
            found = visit(c, min(1.0, w * float(R[x] / q[x])))
            if found is not None:
                return found
            resid = (w * R - q).clamp_min(0)
            rho = float(resid.sum())
            w = rho / (rho + 1 - w) if rho + 1 - w > 0 else 1.0
            R = resid / rho if rho > 1e-6 else R
            if without_replacement:
                q[x] = 0
                q = q / q.sum() if q.sum() > 0 else q
        return node if u[node] < w else None

    return visit(0, 1.0)


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_matches_the_sequential_algorithm_on_random_trees(mode):
    """Random trees (a shape per row, many repeated tokens, some q = 0 children) with the
    verifier's own uniforms: the vectorised verdict is the sequential loop's, row for row."""
    g = torch.Generator().manual_seed(7)
    b, n, v = 200, 12, 4
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                for i in range(1, n)]) for _ in range(b)])
    tokens = torch.randint(0, v, (b, n), generator=g)
    logits = torch.randn(b, n, v, generator=g) * 2
    q = torch.softmax(torch.randn(b, n, v, generator=g) * 2, -1)
    q = torch.where(torch.rand(b, n, v, generator=g) < 0.1, 0.0, q)
    q = q / q.sum(-1, keepdim=True)
    draft = Draft(TokenTree(tokens, parents), q, mode)
    verdict = get_verifier("traversal").verify(draft, logits, T1,
                                               generator=torch.Generator().manual_seed(3))
    u = torch.rand(b, n, generator=torch.Generator().manual_seed(3))  # the verifier's first draw
    P = target_probs(logits, T1)
    depths = set()
    for r in range(b):
        node = sequential_traversal(parents[r].tolist(), tokens[r].tolist(), P[r], q[r],
                                    u[r].tolist(), mode == "without_replacement")
        got = [i for i in verdict.path[r].tolist() if i >= 0]
        assert got == draft.tree.paths[r, node][:len(got)].tolist(), (r, got, node)
        assert got[-1] == node, (r, got, node)
        depths.add(len(got) - 1)
    assert len(depths) >= 3  # accepted at several depths


# ---------------------------------------------------------------- end to end through the verifier
LOSSLESS = [
    ("iid", (3, 2), T1),
    ("iid", (3, 2), SamplingConfig(0.7, top_k=3)),
    ("without_replacement", (3, 2), T1),
    ("without_replacement", (4, 2), T1),                         # the root's q is exhausted
    ("without_replacement", (2, 3), SamplingConfig(0.6, top_p=0.8)),
    ("without_replacement", (3, 2, 1), T1),                      # caterpillar
    ("chain", (1, 1), T1),
]


def _id(case):
    mode, widths, s = case[:3]
    return f"{mode}-{'x'.join(map(str, widths))}-T{s.temperature}-k{s.top_k}-p{s.top_p}"


@pytest.mark.parametrize("case", LOSSLESS, ids=[_id(c) for c in LOSSLESS])
def test_lossless_chi_square(case):
    mode, widths, sampling = case
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, widths, mode, run_verifier("traversal", sampling), seed=5,
                      sampling=sampling)
    p = pvalues(counts, exact_triples(m, sampling))
    assert min(p.values()) > ALPHA, p


def test_negative_control_is_detected(monkeypatch):
    """The rule without the parent's update, run through the verifier: the chi-square fails."""
    monkeypatch.setattr(traversal, "weight_after_rejection", _keep_weight)
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, (3, 2), "iid", run_verifier("traversal", T1), seed=5, sampling=T1)
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) < ALPHA, p


MERGED = [
    ("iid", (1, 1), "likely", T1, True),
    ("iid", (2, 2), "two", SamplingConfig(0.8, top_k=3), True),
    ("without_replacement", (3, 1), "two", T1, False),
]


@pytest.mark.parametrize("case", MERGED, ids=[f"{c[0]}-{c[2]}" for c in MERGED])
def test_merged_tree_is_lossless(case):
    """Drawn and chosen children in one tree (``test_verify_merged``'s trees): the traversal over
    the draws, then the chosen children naive-style from the node it accepted."""
    mode, widths, rule, sampling, peaked = case
    m = make_models(seed=11, peaked_q=peaked)
    counts = simulate_merged(m, widths, mode, rule, run_verifier("traversal", sampling), seed=5,
                             sampling=sampling)
    p = pvalues(counts, exact_triples(m, sampling))
    assert min(p.values()) > ALPHA, p


def test_merged_negative_control_is_detected():
    """The merged tree handed over without its masks (chosen children taken for draws): biased."""
    m = make_models(seed=11, peaked_q=True)
    counts = simulate_merged(m, (3, 1), "without_replacement", "two", run_verifier("traversal", T1),
                             seed=5, sampling=T1, masks=False)
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) < ALPHA, p


def test_merged_tree_accepts_more_than_its_drawn_part():
    """Chosen children add acceptance where the draws were rejected (the same draws and seed)."""
    m = make_models(seed=11, peaked_q=True)
    seen = {}

    def count(draft, logits, g):
        verdict = run_verifier("traversal", T1)(draft, logits, g)
        seen["accepted"] = float((verdict.num_accepted >= 1).float().mean())
        return verdict

    simulate_merged(m, (2, 2), "without_replacement", "two", count, seed=5, sampling=T1,
                    trials=4000)
    merged = seen["accepted"]
    simulate(m, (2, 2), "without_replacement", count, seed=5, sampling=T1, trials=4000)
    assert merged > seen["accepted"] + 0.03, (merged, seen["accepted"])


# --------------------------------------------------------------------- greedy, edge cases, refusals
@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(1.0, top_k=1)],
                         ids=["T0", "T1-top_k1"])
@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_temperature_zero_is_greedy(mode, sampling):
    """Equal to the greedy oracle of ``test_verify_distribution``, trial for trial."""
    assert _matches(*_greedy_verdicts("traversal", mode, sampling))


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_near_zero_temperature_sampling_path_matches_greedy(mode):
    """At T = 1e-3 p is one-hot in fp32: the sampling path itself gives greedy's verdicts."""
    m = make_models(seed=4)
    out = {}

    def both(draft, logits, g):
        out["greedy"] = get_verifier("greedy").verify(draft, logits, SamplingConfig(0.0))
        out["ours"] = get_verifier("traversal").verify(draft, logits, SamplingConfig(1e-3),
                                                       generator=g)
        return out["ours"]

    simulate(m, (3, 2), mode, both, seed=2, sampling=SamplingConfig(1e-3), trials=2000)
    assert torch.equal(out["ours"].path, out["greedy"].path)
    assert torch.equal(out["ours"].next_token, out["greedy"].next_token)


def test_root_only_chosen_only_and_refusals():
    g = torch.Generator().manual_seed(1)
    verifier = get_verifier("traversal")
    root = Draft(TokenTree(torch.tensor([[3], [1]]), [-1]), torch.full((2, 1, 4), 0.25), "iid")
    v = verifier.verify(root, torch.randn(2, 1, 4, generator=g), T1, generator=g)
    assert v.path.tolist() == [[0], [0]] and v.num_accepted.tolist() == [0, 0]
    # a merged tree with no drawn node and no q: the chosen children, naive-style
    tree = TokenTree(torch.tensor([[0, 1, 2]]).expand(2000, -1), [-1, 0, 1])
    logits = torch.full((2000, 3, 4), -30.0)
    logits[:, 0, 1] = logits[:, 1, 2] = logits[:, 2, 3] = 0.0       # the target's sure path
    fixed = torch.tensor([[False, True, True]]).expand(2000, -1)
    chosen = Draft(tree, None, "iid", fixed=fixed, drawn=torch.zeros_like(fixed))
    v = verifier.verify(chosen, logits, T1, generator=g)
    assert (v.num_accepted == 2).all() and (v.next_token == 3).all()
    for mode in ("iid", "without_replacement", "chain"):
        verifier.check(mode, T1)
    verifier.check("deterministic", SamplingConfig(0.0))
    with pytest.raises(ValueError, match="not deterministic"):
        verifier.check("deterministic", T1)
    with pytest.raises(ValueError, match="naive"):
        verifier.verify(Draft(tree, torch.full((2000, 3, 4), 0.25), "deterministic"), logits, T1)
