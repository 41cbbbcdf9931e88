"""drafter="auto": its decision logic with injected costs and acceptance (no timing), the cost
fit and its disk cache with a fake clock, and losslessness through ``generate``."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from scipy.stats import chisquare

from stree.costmodel import ForwardCost, forward_cost
from stree.draft import parse_drafter
from stree.draft.auto import AcceptanceProfile, AutoDrafter, best_tree, expected_tau, level_widths
from stree.generate import generate
from stree.tree import TokenTree
from tests.fakes import FakeLM, greedy_reference, target_probs_of_prefix


def profile(hazards, weight=1e6) -> AcceptanceProfile:
    """A profile whose hazards are ``hazards`` (then 0), as if from ``weight`` observations."""
    pr = AcceptanceProfile()
    h = list(hazards) + [0.0] * (pr.max_rank - len(hazards))
    pr.events, pr.at_risk = [x * weight for x in h], [weight] * pr.max_rank
    return pr


def test_expected_tau_by_hand():
    p = [0.6, 0.2, 0.1]
    assert expected_tau([-1, 0, 1, 2], p) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    # root with children of rank 0 and 1, the first continued once
    assert expected_tau([-1, 0, 0, 1], p) == pytest.approx(1 + 0.6 + 0.2 + 0.36)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_best_tree_is_optimal(budget):
    """Against every tree of that size (parents[i] < i, all orders)."""
    p = [0.55, 0.25, 0.1, 0.05, 0.02]
    trees = ([-1] + list(rest) for rest in itertools.product(*[range(i) for i in range(1, budget + 1)]))
    best = max(expected_tau(t, p) for t in trees)
    tree = best_tree(budget, p)
    assert len(tree) == budget + 1 and expected_tau(tree, p) == pytest.approx(best)


def test_profile_counts_ranks_and_censoring():
    pr = AcceptanceProfile(decay=1.0, prior_weight=0.0)
    tree = TokenTree(torch.zeros(1, 6, dtype=torch.long), [-1, 0, 0, 0, 2, 2])
    # accepted node 2 (the root's rank-1 child), then nothing below it (2 children rejected)
    pr.update(tree, torch.tensor([[0, 2, -1]]))
    assert pr.events[:3] == [0.0, 1.0, 0.0]
    assert pr.at_risk[:3] == [2.0, 2.0, 0.0]  # root: ranks 0, 1; node 2: ranks 0, 1 rejected
    assert pr.hazards()[:2] == [0.0, 0.5]


COSTS = dict(draft_cost=ForwardCost(0.0, 1e-5, 1e-4))


def test_eq7_step_time_and_tau_of_a_chain():
    auto = AutoDrafter(target_cost=ForwardCost(0.0, 2e-3, 1e-2), profile=profile([0.8]), **COSTS)
    tau, seconds = auto.predict("chain:4")
    assert tau == pytest.approx(1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4, rel=1e-5)
    # each of the 4 draft levels forwards one new node; the deepest node is never forwarded
    assert seconds == pytest.approx(1e-2 + 5 * 2e-3 + 4 * (1e-4 + 1e-5))


def test_level_widths_count_the_new_nodes_of_each_level():
    assert level_widths([-1, 0, 0, 1, 2, 3, 4]) == [1, 2, 2]  # depth 3 is never forwarded
    assert level_widths([-1, 0, 1, 2]) == [1, 1, 1]
    # a caterpillar: one node per level, its leaves never run (as the static drafter runs it)
    cat = parse_drafter("caterpillar:3,2,2")
    assert level_widths(cat.parents) == [1, 1, 1]
    assert [cat.ran(i) for i in range(cat.num_nodes)] == [True, True, False, False, True, False,
                                                       False, False]
    assert level_widths(parse_drafter("static:D").parents) == [1, 4, 2, 2]


def test_auto_reports_which_nodes_its_chosen_tree_ran():
    # the draft commit runs a path's last node first when the draft never ran it (a
    # caterpillar's leaves): auto must answer for the tree it drafted, not by its prefix
    auto = AutoDrafter(("caterpillar:2,2,2",), ForwardCost(0.0, 1e-3, 1e-2), **COSTS)
    cat = parse_drafter("caterpillar:2,2,2")
    assert auto.num_forwarded == cat.num_forwarded == 4
    assert [auto.ran(i) for i in range(7)] == [cat.ran(i) for i in range(7)] == [
        True, True, False, True, False, False, False]


def test_measured_step_time_scales_predictions_then_replaces_them():
    now = [0.0]
    auto = AutoDrafter(("chain:2", "chain:6"), ForwardCost(0.0, 1e-3, 1e-2),
                       profile=profile([0.9]), clock=lambda: now[0], min_runs=4, **COSTS)
    model6 = auto.model("chain:6")[1]
    auto._current = "chain:6"
    for _ in range(3):  # three whole steps, each twice the modelled time
        auto._time_step("chain:6", 2 * model6)
    tau2, seconds2 = auto.predict("chain:2")
    assert seconds2 == pytest.approx(2 * auto.model("chain:2")[1])  # the ratio carries over
    for _ in range(5):  # then chain:2 measures its model's time and chain:6 10x its model's:
        auto._time_step("chain:2", auto.model("chain:2")[1])  # their own times take over
        auto._time_step("chain:6", 10 * model6)
    assert auto.predict("chain:2")[1] == pytest.approx(auto.model("chain:2")[1])
    assert auto.predict("chain:6")[1] > 5 * model6
    assert auto.choose() == "chain:2"  # the long chain's tau no longer pays for its time



def test_draft_times_the_wall_clock_between_consecutive_calls():
    now = [0.0]
    auto = AutoDrafter(("chain:2",), ForwardCost(0.0, 1e-3, 1e-2), profile=profile([0.9]),
                       clock=lambda: now[0], **COSTS)

    class Stub:  # stands in for the chosen chain:2: its shape and draft() are all auto reads
        parents = (-1, 0, 1)

        def draft(self, *args):
            return "draft"

    auto._drafters["chain:2"] = Stub()
    for t in (1.0, 1.5, 2.25):  # steps of 0.5 s and 0.75 s; the first call starts the clock
        now[0] = t
        assert auto.draft(None, None, None, None) == "draft"
    steps, seconds = auto._timed["chain:2"]
    decay = auto.profile.decay
    assert steps == pytest.approx(decay + 1) and seconds == pytest.approx(0.5 * decay + 0.75)
    auto.prepare(None, None)  # a new generation: the gap before its first step is not timed
    now[0] = 100.0
    auto.draft(None, None, None, None)
    assert auto._timed["chain:2"][0] == pytest.approx(decay + 1)



def test_flat_verify_cost_picks_a_big_tree_steep_cost_a_chain():
    h = [0.6, 0.3, 0.2, 0.1]
    flat = AutoDrafter(target_cost=ForwardCost(0.0, 1e-6, 1e-1), profile=profile(h), **COSTS)
    assert flat.choose() == "dyspec:32"  # constant cost (weights dominate): most tokens per call
    steep = AutoDrafter(target_cost=ForwardCost(1e-3, 1e-2, 1e-3), profile=profile(h), **COSTS)
    assert steep.choose().startswith("chain:")
    confident = AutoDrafter(("chain:2", "chain:6", "static:B"), ForwardCost(0.0, 1e-2, 5e-2),
                            profile=profile([0.97]), **COSTS)
    assert confident.choose() == "chain:6"  # the top token is nearly always right: a long chain


def test_choice_follows_acceptance_drift():
    auto = AutoDrafter(target_cost=ForwardCost(0.0, 1e-3, 2e-2), profile=profile([0.9, 0.5], 50),
                       **COSTS)
    auto._current = first = auto.choose()
    tree = TokenTree(torch.zeros(1, 7, dtype=torch.long), [-1, 0, 1, 2, 3, 4, 5])
    for _ in range(200):  # the draft stops being accepted
        auto.observe(tree, torch.tensor([[0, -1, -1, -1, -1, -1, -1]]))
        auto._current = auto.choose()
    assert first != auto._current and auto.predict(auto._current)[0] < 1.2


def test_no_cost_model_is_an_error():
    with pytest.raises(ValueError, match="cost model"):
        AutoDrafter().choose()
    with pytest.raises(ValueError):
        AutoDrafter(candidates=())


class ClockedLM(FakeLM):
    """A fake LM whose tree_forward advances a fake clock by a known cost of its size."""

    def __init__(self, cost: ForwardCost):
        super().__init__(vocab_size=7)
        self.cost, self.now = cost, 0.0
        self.weight = torch.nn.Parameter(torch.zeros(3))  # gives the model a cache key

    def parameters(self):
        return iter([self.weight])

    def tree_forward(self, tree, cache):
        self.now += self.cost(tree.num_nodes)
        return super().tree_forward(tree, cache)


def test_cost_fit_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREE_CACHE", str(tmp_path))
    true = ForwardCost(2e-6, 3e-4, 5e-3)
    model = ClockedLM(true)
    got = forward_cost(model, clock=lambda: model.now)
    assert (got.a, got.b, got.c) == pytest.approx((true.a, true.b, true.c), rel=1e-6)
    assert json.loads((tmp_path / "costs.json").read_text())
    model.calls.clear()
    assert forward_cost(model, clock=lambda: model.now) == got and model.calls == []  # cached
    lin = ForwardCost.fit([1, 2, 4, 8], [1.0, 1.8, 2.9, 4.0])  # concave: refit linear
    assert lin.a == 0.0 and lin.b > 0


def test_generate_auto_is_lossless(tmp_path, monkeypatch):
    monkeypatch.setenv("STREE_CACHE", str(tmp_path))
    target, draft = FakeLM(23), FakeLM(23, noise=1.5)
    prompts = [torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 4])]
    out = generate(target, draft, prompts, 64, drafter="auto")
    assert [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(prompts)] == \
        [greedy_reference(target, p, 64) for p in prompts]
    assert out.stats.drafter == "auto" and parse_drafter("auto").name == "auto"
    # T > 0: every candidate pairs losslessly with MSS, and choices depend on past steps only
    v, rows = 5, 2000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0,
                   drafter=AutoDrafter(target_cost=ForwardCost(0, 1e-4, 1e-2), **COSTS),
                   generator=torch.Generator().manual_seed(0))
    toks = out.sequences[:, 2:5]
    counts = torch.bincount((toks[:, 0] * v + toks[:, 1]) * v + toks[:, 2], minlength=v ** 3)
    p = target_probs_of_prefix(target, prompt, 3).reshape(-1).double()
    assert chisquare(counts.double(), p / p.sum() * rows).pvalue > 1e-3


def test_compile_refuses_auto_with_dynamic_candidates():
    from stree.generate import resolve
    from stree.sampling import SamplingConfig

    with pytest.raises(ValueError, match="fixed tree template"):
        resolve("tree", "auto", None, SamplingConfig(), compile=True)  # dyspec candidates
    static_only = AutoDrafter(("chain:2", "static:fig4a"))
    assert static_only.layered
