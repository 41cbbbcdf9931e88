"""DySpec's online acceptance calibration (``stree.draft.calibration``).

Oracles: a host-side walk of the verifier's first-match order for which nodes were tested and
accepted; counts fed by hand for the calibrated estimates; the exact target joint for a chi-square
test of calibrated DySpec at T > 0, which the tempting wrong rule (keying sampled children by
their own token's value) fails.
"""
from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from stree.draft import DySpecDrafter
from stree.draft.calibration import AcceptanceCalibration, node_verdicts
from stree.draft.dynamic import Slots
from stree.generation import generate
from tests.fakes import FakeLM, target_probs_of_prefix


def _random_tree_and_path(rng: random.Random, n: int):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    kids = [[] for _ in range(n)]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    path, u = [0], 0
    while kids[u] and rng.random() < 0.8:
        u = rng.choice(kids[u])
        path.append(u)
    return parents, kids, path


def test_node_verdicts_follow_first_match_order():
    rng = random.Random(0)
    rows = [_random_tree_and_path(rng, 12) for _ in range(40)] + [_random_tree_and_path(rng, 12)]
    k = max(len(r[2]) for r in rows) + 1
    parents = torch.tensor([r[0] for r in rows])
    path = torch.tensor([r[2] + [-1] * (k - len(r[2])) for r in rows])
    path[-1] = -1  # a finished row: nothing tested
    tested, accepted = node_verdicts(parents, path)
    for row, (par, kids, nodes) in enumerate(rows):
        want_t, want_a = set(), set()
        if row < len(rows) - 1:
            for j, u in enumerate(nodes):
                nxt = nodes[j + 1] if j + 1 < len(nodes) else None
                for c in kids[u]:  # siblings tested in index order until one is accepted
                    want_t.add(c)
                    if c == nxt:
                        want_a.add(c)
                        break
        assert set(torch.nonzero(tested[row]).flatten().tolist()) == want_t
        assert set(torch.nonzero(accepted[row]).flatten().tolist()) == want_a


def test_estimates_start_at_the_draft_and_move_to_the_measured_rate():
    cal = AcceptanceCalibration(prior_weight=2.0, decay=1.0)
    x = torch.tensor([[0.005, 0.4, 0.99]])
    for binned in (True, False):
        assert torch.equal(cal(x, binned), x)  # no verdicts: DySpec's own estimate
        assert torch.equal(cal.rank_rates(4, "cpu", binned), torch.ones(4))  # constant rho
    # a 3-node chain below the root, every node a first child with x = 0.005: all accepted
    cells = cal.cells(torch.tensor([[0.0, 0.005, 0.005, 0.005]])[..., None], True)[..., 0]
    cells[:, 0] = -1  # the root is never counted
    parents = torch.tensor([[-1, 0, 1, 2]])
    for _ in range(50):
        cal.update(cells, parents, torch.tensor([[0, 1, 2, 3]]))
    h = cal(torch.tensor([[0.005, 0.3, 0.2]]), True)  # the last axis is the rank
    assert h[0, 0] > 0.95  # the cell itself: 150 of 150 accepted
    assert torch.allclose(h[0, 1:], torch.tensor([0.3, 0.2]))  # ranks 1, 2: no verdicts yet
    # other cells of rank 0 shrink to the rank's pooled rate, not to x
    assert cal(torch.tensor([[0.3]]), True)[0, 0] > 0.9
    # sampled children have a block of their own: still the paper's estimate
    assert torch.equal(cal(x, False), x)
    # rank 1 and 2 have no verdicts: the overall rate, made non-increasing over ranks
    rho = cal.rank_rates(3, "cpu", True)
    assert rho[0] > 0.95 and torch.all(rho[1:] <= rho[:-1])
    # now the first child is always rejected and the second accepted: rank 1 > rank 0 measured,
    # but rho stays non-increasing (a later sibling is never preferred)
    # sampled children: by rank only, whatever x
    par2, cells2 = torch.tensor([[-1, 0, 0]]), cal.cells(torch.tensor([[0.5, 0.5]]), False)
    cells2 = torch.cat([torch.tensor([[-1]]), cells2], 1)
    for _ in range(400):
        cal.update(cells2, par2, torch.tensor([[0, 2]]))
    h = cal(torch.tensor([[0.01, 0.01], [0.9, 0.9]]), False)
    assert torch.all(h[:, 1] > 0.9) and torch.all(h[:, 0] < 0.1)
    rho = cal.rank_rates(2, "cpu", False)
    assert rho[1] == rho[0] < 0.1


@pytest.mark.parametrize("kwargs", [dict(edges=(0.5, 0.2)), dict(edges=(0.0, 0.5)),
                                    dict(rank_groups=0), dict(prior_weight=0.0),
                                    dict(decay=0.0), dict(decay=1.5)])
def test_bad_calibration_settings(kwargs):
    with pytest.raises(ValueError):
        AcceptanceCalibration(**kwargs)


# ----------------------------------------------------------------- losslessness, T > 0
def _trained_calibration() -> AcceptanceCalibration:
    """Counts far from the draft's own estimates, so calibrated keys and values differ."""
    cal = AcceptanceCalibration(decay=1.0)
    tested, accepted = cal._tables("cpu")
    g = torch.Generator().manual_seed(5)
    tested += 20.0
    accepted += torch.rand(cal.num_cells, generator=g) * 20.0
    return cal


def _pvalue(drafter, rows=3000, v=5):
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0, drafter=drafter,
                   generator=torch.Generator().manual_seed(0))
    assert out.stats.tau > 1.3 and out.stats.verifier == "mss"
    p = target_probs_of_prefix(target, prompt, 3).reshape(-1).double()
    toks = out.sequences[:, len(prompt):len(prompt) + 3]
    joint = torch.bincount((toks[:, 0] * v + toks[:, 1]) * v + toks[:, 2], minlength=v ** 3)
    return chisquare(joint.double(), p / p.sum() * rows).pvalue


def test_calibrated_sampled_dyspec_is_lossless():
    assert _pvalue(DySpecDrafter(6, max_depth=10, calibration=_trained_calibration())) > 1e-3


class _OwnTokenKey(DySpecDrafter):
    """A wrong rule: keys sampled children by their own token's calibrated value (what ranked
    children may do), so whether a draw is kept depends on the draw."""

    def priority(self, slots: Slots):
        return slots.child_value.cummin(-1).values, slots.child_value


@pytest.mark.parametrize("rule,lossless", [(DySpecDrafter, True), (_OwnTokenKey, False)])
def test_distribution_test_catches_a_key_from_the_drawn_token(rule, lossless):
    """Same trees, same draws: the right key passes, the one reading the drawn token fails."""
    p = _pvalue(rule(3, max_depth=2, calibration=AcceptanceCalibration()), rows=20000)
    assert p > 1e-3 if lossless else p < 1e-6
