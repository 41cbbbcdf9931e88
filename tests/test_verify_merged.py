"""Losslessness of merged trees: a draft model's drawn children and suffix-tree (chosen) children
under one node, verified by MSS's rule for the mix (``stree.verify.mss.mixed_rule``).

The set-up of ``test_verify_distribution``: a tiny target (conditional tables over V tokens) and
draft, one speculative step per row, the emitted tokens completed to three with exact target
samples, and the frequencies of (y1), (y1, y2), (y1, y2, y3) chi-square tested against the
target. The drawn tree is depth 2; the chosen ("fixed") tree is merged in by
:func:`stree.draft.merged.union`, so a fixed token that a draw also produced becomes one node
carrying both marks; one chosen tree even copies a draw (the rule needs no independence). A
negative control (the fixed children passed off as draws) goes through the same machinery and
must fail.
"""
from __future__ import annotations

import pytest
import torch

from stree.draft.merged import union
from stree.draft_types import Draft
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from tests.test_verify_distribution import (ALPHA, V, draw_children, exact_triples, make_models,
                                            pvalues, run_verifier, simulate)

TRIALS = 30_000
T1 = SamplingConfig(1.0)


def _fixed_tree(rule: str, drawn_first: int):
    """The chosen tree (tokens, parents; root first) below a root, by ``rule``."""
    if rule == "one":            # a single continuation two deep
        return [0, 2, 1], [-1, 0, 1]
    if rule == "two":            # two chosen siblings, one of them with a child
        return [0, 1, 3, 0], [-1, 0, 0, 1]
    if rule == "likely":         # the peaked draft's favourite: merges with draws often
        return [0, 0, 3], [-1, 0, 1]
    if rule == "from_draws":     # a copy of the first draw's token, continued
        return [0, drawn_first, 2], [-1, 0, 1]
    raise AssertionError(rule)


def simulate_merged(m, widths, mode: str, rule: str, verify, seed: int, sampling: SamplingConfig,
                    masks: bool = True, trials: int = TRIALS) -> torch.Tensor:
    """Counts of emitted triples (V, V, V) over ``trials`` merged steps (see the module
    docstring). ``masks=False`` hands the verifier the merged tree without its fixed / drawn
    marks, as if every child had been drawn."""
    g = torch.Generator().manual_seed(seed)
    k1, k2 = widths
    N = trials
    t1 = draw_children(m.q1.expand(N, V), k1, mode, g)
    t2 = draw_children(m.q2[t1.reshape(-1)], k2, mode, g).reshape(N, k1 * k2)
    base_parents = [-1] + [0] * k1 + [1 + i for i in range(k1) for _ in range(k2)]
    rows = []
    for r, (a, b) in enumerate(zip(t1.tolist(), t2.tolist())):
        rows.append(union(([0] + a + b, base_parents), _fixed_tree(rule, a[0])))
    n = max(len(t) for t, _, _ in rows)
    pad = [(t + [t[1]] * (n - len(t)), p + [0] * (n - len(p)), f + [False] * (n - len(f)))
           for t, p, f in rows]
    tokens = torch.tensor([t for t, _, _ in pad])
    parents = torch.tensor([p for _, p, _ in pad])
    fixed = torch.tensor([f for _, _, f in pad])
    tree = TokenTree(tokens, parents)
    assert tree.max_depth <= 2
    depth, ptok = tree.depth, tokens.gather(1, parents.clamp_min(0))
    logits = torch.where((depth == 0)[..., None], m.L1,
                         torch.where((depth == 1)[..., None], m.L2[tokens], m.L3[ptok, tokens]))
    n1 = len(base_parents)
    q = torch.zeros(N, n, V)
    q[:, 0] = m.q1
    q[:, 1:1 + k1] = m.q2[t1]
    drawn = torch.zeros(N, n, dtype=torch.bool)
    drawn[:, 1:n1] = True
    draft = (Draft(tree, q, mode, fixed=fixed, drawn=drawn) if masks else Draft(tree, q, mode))
    verdict = verify(draft, logits, g)

    acc = tree.path_tokens(verdict.path)[:, 1:]
    seq = torch.cat([acc, torch.full((N, 1), -1)], 1)
    seq.scatter_(1, verdict.num_accepted.unsqueeze(1), verdict.next_token.unsqueeze(1))
    from stree.sampling import sample_from, target_probs
    P2, P3 = target_probs(m.L2, sampling), target_probs(m.L3, sampling)
    seq[:, 1] = torch.where(seq[:, 1] < 0, sample_from(P2[seq[:, 0]], g), seq[:, 1])
    seq[:, 2] = torch.where(seq[:, 2] < 0, sample_from(P3[seq[:, 0], seq[:, 1]], g), seq[:, 2])
    cell = seq[:, 0] * V * V + seq[:, 1] * V + seq[:, 2]
    return torch.bincount(cell, minlength=V ** 3).view(V, V, V)


CASES = [
    # (verifier, draw mode, drawn widths, fixed tree, sampling)
    ("mss", "without_replacement", (2, 2), "one", T1),
    ("mss", "without_replacement", (3, 1), "two", T1),
    ("mss", "without_replacement", (2, 2), "likely", T1),
    ("mss", "iid", (2, 2), "two", SamplingConfig(0.8, top_k=3)),
    ("mss", "iid", (1, 1), "likely", T1),                       # a chain's draws beside chosen ones
    ("mss", "without_replacement", (2, 2), "likely", SamplingConfig(0.7, top_p=0.9)),
    ("mss", "without_replacement", (2, 2), "from_draws", T1),
    ("naive", "without_replacement", (2, 2), "two", T1),
]


def _id(case):
    name, mode, widths, rule, s = case
    return f"{name}-{mode}-{'x'.join(map(str, widths))}-{rule}-T{s.temperature}-k{s.top_k}-p{s.top_p}"


@pytest.mark.parametrize("peaked", [False, True], ids=["random_q", "peaked_q"])
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_merged_tree_is_lossless(case, peaked):
    name, mode, widths, rule, sampling = case
    m = make_models(seed=11, peaked_q=peaked)
    counts = simulate_merged(m, widths, mode, rule, run_verifier(name, sampling), seed=5,
                             sampling=sampling)
    p = pvalues(counts, exact_triples(m, sampling))
    assert min(p.values()) > ALPHA, f"{name}/{mode}/{rule} deviates from the target: {p}"


@pytest.mark.parametrize("peaked,rule", [(False, "likely"), (True, "two")])
def test_merged_tree_accepts_more_than_its_drawn_part(peaked, rule):
    """Chosen children add acceptance where the draws were rejected: the first token is accepted
    more often than with the drawn tree alone (the same draws, the same seed) when the chosen
    tokens are ones the draft rarely draws (token 0 for the random q, 1 and 3 for the peaked)."""
    m = make_models(seed=11, peaked_q=peaked)
    seen = {}

    def count(draft, logits, g):
        verdict = run_verifier("mss", T1)(draft, logits, g)
        seen["accepted"] = float((verdict.num_accepted >= 1).float().mean())
        return verdict

    simulate_merged(m, (2, 2), "without_replacement", rule, count, seed=5, sampling=T1, trials=4000)
    merged = seen["accepted"]
    simulate(m, (2, 2), "without_replacement", count, seed=5, sampling=T1, trials=4000)
    assert merged > seen["accepted"] + 0.03, (merged, seen["accepted"])


def test_negative_control_is_detected():
    """The merged tree verified as if every child had been drawn from q: biased."""
    m = make_models(seed=11, peaked_q=True)
    counts = simulate_merged(m, (2, 2), "without_replacement", "likely", run_verifier("mss", T1),
                             seed=5, sampling=T1, masks=False)
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) < ALPHA, f"not detected: {p}"


def test_draft_masks_are_checked():
    tree = TokenTree(torch.tensor([[0, 1, 2]]), [-1, 0, 0])
    both = torch.tensor([[False, True, False]])
    with pytest.raises(ValueError, match="both its fixed and its drawn"):
        Draft(tree, None, "iid", fixed=both)
    with pytest.raises(ValueError, match="describe a drawn tree"):
        Draft(tree, None, "deterministic", fixed=both, drawn=both)


def test_union_merges_shared_prefixes():
    tokens, parents, fixed = union(([5, 1, 2, 3], [-1, 0, 0, 1]), ([5, 1, 3, 4, 9], [-1, 0, 1, 2, 0]))
    # 1 and 1->3 are shared; 1->3->4 and 9 are new, appended after the base nodes
    assert tokens == [5, 1, 2, 3, 4, 9]
    assert parents == [-1, 0, 0, 1, 3, 0]
    assert fixed == [False, True, False, True, True, True]
