"""drafter="auto": its decision logic with injected costs and acceptance (no timing), the cost
fit and its disk cache with a fake clock, and losslessness through ``generate``."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from scipy.stats import chisquare

from stree.costmodel import ForwardCost, forward_cost
from stree.draft import parse_drafter
from stree.draft.auto import (OFF, SUFFIX_CANDIDATES, CPU_CANDIDATES, DEFAULT_CANDIDATES, AcceptanceProfile,
                              AutoDrafter, AutoMemory, Ratio, best_tree, expected_tau, forget, level_widths)
from stree.generation import default_drafter, generate, resolve
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from tests.fakes import FakeLM, greedy_reference, target_probs_of_prefix


def profile(hazards, weight=1e6) -> AcceptanceProfile:
    """A profile whose hazards are ``hazards`` (then 0) at every depth, as if from ``weight``
    observations."""
    pr = AcceptanceProfile()
    h = list(hazards) + [0.0] * (pr.max_rank - len(hazards))
    pr.events = [[x * weight for x in h] for _ in range(pr.max_depth)]
    pr.at_risk = [[weight] * pr.max_rank for _ in range(pr.max_depth)]
    return pr


def memory(hazards, weight=1e6) -> AutoMemory:
    """What auto knows after it saw ``weight`` nodes of these ``hazards`` (past its warm-up)."""
    return AutoMemory(profile(hazards, weight), steps=100)


def test_expected_tau_by_hand():
    p = [[0.6, 0.2, 0.1]]  # one row: every depth alike
    assert expected_tau([-1, 0, 1, 2], p) == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    # root with children of rank 0 and 1, the first continued once
    assert expected_tau([-1, 0, 0, 1], p) == pytest.approx(1 + 0.6 + 0.2 + 0.36)
    deeper = [[0.6, 0.2], [0.9, 0.05]]  # depth 1 and below: the rows' last
    assert expected_tau([-1, 0, 1, 2], deeper) == pytest.approx(1 + 0.6 + 0.54 + 0.486)
    assert expected_tau([-1, 0, 0, 1, 1], deeper) == pytest.approx(1 + 0.6 + 0.2 + 0.54 + 0.03)


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("p", [[[0.55, 0.25, 0.1, 0.05, 0.02]],
                               [[0.4, 0.3, 0.1, 0.05, 0.02], [0.8, 0.1, 0.05, 0.0, 0.0], [0.95, 0.0]]],
                         ids=["flat", "by-depth"])
def test_best_tree_is_optimal(budget, p):
    """Against every tree of that size (parents[i] < i, all orders)."""
    trees = ([-1] + list(rest) for rest in itertools.product(*[range(i) for i in range(1, budget + 1)]))
    best = max(expected_tau(t, p) for t in trees)
    tree = best_tree(budget, p)
    assert len(tree) == budget + 1 and expected_tau(tree, p) == pytest.approx(best)


def test_profile_counts_ranks_and_censoring():
    pr = AcceptanceProfile(decay=1.0, prior_weight=0.0)
    tree = TokenTree(torch.zeros(1, 6, dtype=torch.long), [-1, 0, 0, 0, 2, 2])
    # accepted node 2 (the root's rank-1 child), then nothing below it (2 children rejected)
    pr.update(tree, torch.tensor([[0, 2, -1]]))
    assert pr.events[0][:3] == [0.0, 1.0, 0.0] and pr.events[1][:3] == [0.0, 0.0, 0.0]
    assert pr.at_risk[0][:3] == [1.0, 1.0, 0.0]  # root (depth 0): ranks 0, 1
    assert pr.at_risk[1][:3] == [1.0, 1.0, 0.0]  # node 2 (depth 1): ranks 0, 1 rejected
    hazards = pr.hazards()
    assert hazards[0][:2] == [0.0, 1.0] and hazards[1][:2] == [0.0, 0.0]
    # the first ranks alone (what auto reads for trees of at most that many children a node)
    pr.prior_weight = 2.0
    full, prior = pr.rank_probs(), profile([0.3, 0.2]).hazards()
    assert pr.rank_probs(ranks=2) == [row[:2] for row in full]
    assert pr.rank_probs(prior, ranks=3) == [row[:3] for row in pr.rank_probs(prior)]


def test_auto_reads_as_many_ranks_as_its_draft_trees_have_children():
    assert AutoDrafter(("chain:4", "suffix:16"))._ranks == 1
    assert AutoDrafter(("chain:4", "caterpillar:3,2,2+suffix:16"))._ranks == 3
    assert AutoDrafter(("dyspec:8",))._ranks == 8


def test_profile_decays_only_the_depths_a_step_reaches():
    """A short chain run for a long while leaves what deeper levels showed: the hazards of a
    depth it never reaches, and so a long chain's predicted tau, stay as they were measured."""
    auto = AutoDrafter(("chain:2", "chain:6"), ForwardCost(0.0, 1e-3, 1e-2),
                       memory=memory([0.9], weight=50), **COSTS)
    chain2 = TokenTree(torch.zeros(1, 3, dtype=torch.long), [-1, 0, 1])
    prof = auto.memory.profile
    deep_before = [row[:] for row in prof.events[2:]], [row[:] for row in prof.at_risk[2:]]
    for step in range(300):  # chain:2 runs; its second token is always rejected
        auto.memory.current = "chain:2"
        auto._step_model = auto.model("chain:2")
        auto.observe(chain2, torch.tensor([[0, 1, -1]]))
    hazards = auto.memory.profile.hazards()
    assert hazards[0][0] > 0.97 and hazards[1][0] < 0.05  # followed the drift where it ran
    # untouched where it did not (their prior, the depth above's hazards, moved them a little)
    assert (prof.events[2:], prof.at_risk[2:]) == deep_before
    assert all(hazards[d][0] > 0.86 for d in range(2, prof.max_depth))
    assert auto.memory.profile.at_risk[1][0] == pytest.approx(
        50 * 0.98 ** 300 + sum(0.98 ** k for k in range(300)))


COSTS = dict(draft_cost=ForwardCost(0.0, 1e-5, 1e-4))


def test_eq7_step_time_and_tau_of_a_chain():
    auto = AutoDrafter(target_cost=ForwardCost(0.0, 2e-3, 1e-2), memory=memory([0.8]), **COSTS)
    tau, seconds = auto.predict("chain:4")
    assert tau == pytest.approx(1 + 0.8 + 0.8 ** 2 + 0.8 ** 3 + 0.8 ** 4, rel=1e-5)
    # each of the 4 draft levels forwards one new node; the deepest node is never forwarded
    assert seconds == pytest.approx(1e-2 + 5 * 2e-3 + 4 * (1e-4 + 1e-5))


def test_a_backlog_costs_a_prefill_or_rides_in_the_roots_pass_as_a_lead():
    """Tokens the draft has not run (after a suffix tree's step) cost a prefill of their own
    before the draft, unless the draft takes them as its lead: then its roots' pass runs them."""
    cost = ForwardCost(0.0, 1e-5, 1e-4)  # draft seconds for n nodes: 1e-4 + 1e-5 n
    auto = AutoDrafter(("chain:4",), ForwardCost(0.0, 2e-3, 1e-2), memory=memory([0.8]), draft_cost=cost)
    no_backlog = auto.model("chain:4")[1]
    auto._lag = 3
    assert auto.model("chain:4")[1] == pytest.approx(no_backlog + cost(3))
    auto._lead = True
    assert auto.model("chain:4")[1] == pytest.approx(no_backlog + 3 * 1e-5)
    auto._lag = 17  # past MAX_LEAD: prefilled first
    assert auto.model("chain:4")[1] == pytest.approx(no_backlog + cost(17))


def test_a_batch_pays_every_rows_nodes_and_is_judged_by_its_slowest_row():
    """b rows of n nodes cost the per-node terms b times and the fixed term once; a step's
    measured tau is how far it moved the slowest live row (a batch's step count is that row's:
    tokens a row ahead gains do not shorten it); a finished row is never behind."""
    target = ForwardCost(1e-5, 2e-3, 1e-2)
    assert target(5, rows=4) == pytest.approx(4 * (1e-5 * 25 + 2e-3 * 5) + 1e-2)
    auto = AutoDrafter(("chain:2", OFF), target, memory=memory([0.8]), **COSTS)
    auto._plan(torch.zeros(4, dtype=torch.long))
    off = auto.model(OFF)[1]
    assert off == pytest.approx(target(1, rows=4))
    auto.memory.current = "chain:2"
    auto._step_model = auto.model("chain:2")
    tree = TokenTree(torch.zeros(4, 3, dtype=torch.long), [-1, 0, 1])
    paths = torch.tensor([[0, 1, 2], [0, -1, -1], [0, 1, -1], [-1, -1, -1]])  # row 3 finished
    auto.observe(tree, paths)  # rows 0-2 from 0 tokens to 3, 1, 2: the slowest moved by 1
    tau = auto.memory.taus["chain:2"]
    assert tau.n == 1 and tau.measured == 1 and tau.modelled == pytest.approx(auto._step_model[0])
    auto._planned = None
    auto._plan(torch.zeros(4, dtype=torch.long))
    assert auto._behind == [1]  # 1 token, against rows 0 (3) and 2 (2); row 3 done
    auto._step_model = auto.model("chain:2")
    auto.observe(tree, torch.tensor([[0, 1, 2], [0, 1, -1], [0, -1, -1], [-1, -1, -1]]))
    decay = auto.memory.profile.decay  # rows at 6, 3, 3: the slowest from 1 to 3
    assert tau.n == pytest.approx(decay + 1) and tau.measured == pytest.approx(decay + 2)


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


def test_measured_ratios_scale_predictions_then_outweigh_the_model():
    auto = AutoDrafter(("chain:2", "chain:6"), ForwardCost(0.0, 1e-3, 1e-2),
                       memory=memory([0.9]), prior_steps=4, optimism=0.0, **COSTS)
    (tau2, model2), (tau6, model6) = auto.model("chain:2"), auto.model("chain:6")
    assert auto.predict("chain:2") == pytest.approx((tau2, model2))  # nothing measured: the model
    mem, decay = auto.memory, auto.memory.profile.decay
    for _ in range(3):  # three whole chain:6 steps, each twice the modelled time
        mem.scale.add(2 * model6, model6, decay)
        mem.times.setdefault("chain:6", Ratio()).add(2 * model6, model6, decay)
    assert auto.predict("chain:2")[1] == pytest.approx(2 * model2)  # every step's ratio carries over
    assert auto.predict("chain:6")[1] == pytest.approx(2 * model6)
    assert auto.choose() == "chain:6"
    for _ in range(300):  # then chain:2 takes its model's time, chain:6 10x its model's and
        for spec, model, slow in (("chain:2", model2, 1), ("chain:6", model6, 10)):
            mem.scale.add(slow * model, model, decay)
            mem.times[spec] = mem.times.get(spec, Ratio())
            mem.times[spec].add(slow * model, model, decay)
        mem.taus.setdefault("chain:6", Ratio()).add(1.0, tau6, decay)  # accepts nothing
    n2, n6, scale = mem.times["chain:2"].n, mem.times["chain:6"].n, mem.scale.value(1.0, 0.0)
    assert auto.predict("chain:2")[1] == pytest.approx(model2 * (n2 + 4 * scale) / (n2 + 4))
    assert auto.predict("chain:6")[1] == pytest.approx(model6 * (10 * n6 + 4 * scale) / (n6 + 4),
                                                       rel=1e-3)  # (the first 3 steps: 2x)
    k6 = mem.taus["chain:6"].n  # its measured tau: 1 token per step against the model's tau6
    assert auto.predict("chain:6")[0] == pytest.approx(tau6 * (k6 / tau6 + 4) / (k6 + 4))
    assert auto.choose() == "chain:2"  # the long chain's tau no longer pays for its time


def test_measured_tau_is_a_ratio_to_the_model_so_easy_prompts_do_not_favour_a_candidate():
    # chain:2 measured while acceptance was high, as the model said: no correction, and once
    # acceptance drops its prediction drops with the model's
    auto = AutoDrafter(("chain:2", "chain:4"), ForwardCost(0.0, 1e-3, 1e-2),
                       memory=memory([0.9], weight=50), prior_steps=4, **COSTS)
    chain = TokenTree(torch.zeros(1, 3, dtype=torch.long), [-1, 0, 1])
    auto.memory.current = "chain:2"
    auto._step_model = auto.model("chain:2")
    auto.observe(chain, torch.tensor([[0, 1, 2]]))  # all accepted: 3 tokens
    high = auto.memory.taus["chain:2"].value(1.0, 0.0)
    assert high == pytest.approx(3 / auto._step_model[0])
    for _ in range(100):  # hard text: nothing accepted, by a chain:4 run
        auto.memory.current = "chain:4"
        auto._step_model = auto.model("chain:4")
        auto.observe(TokenTree(torch.zeros(1, 5, dtype=torch.long), [-1, 0, 1, 2, 3]),
                     torch.tensor([[0, -1, -1, -1, -1]]))
    tau2_model = auto.model("chain:2")[0]
    assert tau2_model < 1.3  # the profile learnt the hard text
    # chain:2's ratio still says the model is right: its prediction is the low model value
    assert auto.predict("chain:2")[0] == pytest.approx(
        tau2_model * (1 * high + 4) / (1 + 4), rel=1e-6)


def test_optimism_tries_a_near_miss_once_then_trusts_its_measurement():
    auto = AutoDrafter(("chain:3", "chain:4"), ForwardCost(0.0, 1e-3, 1e-2),
                       memory=memory([0.8]), **COSTS)
    rate = {c: auto.model(c)[0] / auto.model(c)[1] for c in auto.candidates}
    best, other = sorted(rate, key=rate.get, reverse=True)
    assert rate[other] > rate[best] / 1.2  # within the untried bonus of each other
    mem, decay = auto.memory, auto.memory.profile.decay
    for _ in range(30):  # the best is run and measured as modelled
        mem.times.setdefault(best, Ratio()).add(auto.model(best)[1], auto.model(best)[1], decay)
    assert auto.choose() == other  # untried: its 20% bonus beats the measured one's
    for _ in range(30):  # tried: 30% slower than its model
        mem.times.setdefault(other, Ratio()).add(1.3 * auto.model(other)[1],
                                                 auto.model(other)[1], decay)
    assert auto.choose() == best


def test_draft_times_the_wall_clock_between_consecutive_calls():
    now = [0.0]
    auto = AutoDrafter(("chain:2",), ForwardCost(0.0, 1e-3, 1e-2), memory=memory([0.9]),
                       clock=lambda: now[0], **COSTS)

    class Stub:  # stands in for the chosen chain:2: its shape, mode and draft() are all auto reads
        parents, mode = (-1, 0, 1), "chain"
        uses_draft_model, reads_context = True, False

        def draft(self, *args):
            return "draft"

    auto._drafters["chain:2"] = Stub()
    root = torch.zeros(1, dtype=torch.long)  # one row's root
    for t in (1.0, 1.5, 2.25):  # steps of 0.5 s and 0.75 s; the first call starts the clock
        now[0] = t
        assert auto.draft(None, None, root, None) == "draft"
    timed = auto.memory.times["chain:2"]
    decay = auto.memory.profile.decay
    assert timed.n == pytest.approx(decay + 1)
    assert timed.measured == pytest.approx(0.5 * decay + 0.75)
    assert timed.modelled == pytest.approx((decay + 1) * auto.model("chain:2")[1])
    auto.prepare(None, None, SamplingConfig())  # a new generation: the gap before its first step is not timed
    now[0] = 100.0
    auto.draft(None, None, root, None)
    assert auto.memory.times["chain:2"].n == pytest.approx(decay + 1)



def test_flat_verify_cost_picks_a_big_tree_steep_cost_a_chain():
    h = [0.6, 0.3, 0.2, 0.1]
    flat = AutoDrafter(target_cost=ForwardCost(0.0, 1e-6, 1e-1), memory=memory(h), **COSTS)
    assert flat.choose() == "dyspec:32"  # constant cost (weights dominate): most tokens per call
    steep = AutoDrafter(target_cost=ForwardCost(1e-3, 1e-2, 1e-3), memory=memory(h), **COSTS)
    assert steep.choose().startswith("chain:")
    confident = AutoDrafter(("chain:2", "chain:6", "static:B"), ForwardCost(0.0, 1e-2, 5e-2),
                            memory=memory([0.97]), **COSTS)
    assert confident.choose() == "chain:6"  # the top token is nearly always right: a long chain


def test_choice_follows_acceptance_drift():
    auto = AutoDrafter(target_cost=ForwardCost(0.0, 1e-3, 2e-2), memory=memory([0.9, 0.5], 50),
                       **COSTS)
    auto.memory.current = first = auto.choose()
    tree = TokenTree(torch.zeros(1, 7, dtype=torch.long), [-1, 0, 1, 2, 3, 4, 5])
    for _ in range(200):  # the draft stops being accepted
        auto.observe(tree, torch.tensor([[0, -1, -1, -1, -1, -1, -1]]))
        auto.memory.current = auto.choose()
        auto._step_model = auto.model(auto.memory.current)  # as draft() does
    assert first != auto.memory.current and auto.predict(auto.memory.current)[0] < 1.2


def test_at_t_above_0_each_draft_mode_predicts_from_its_own_verdicts():
    # chains verified by ASpS may accept more than a tree's first children under MSS
    auto = AutoDrafter(("chain:4", "caterpillar:2,2,2,2"), ForwardCost(0.0, 1e-4, 1e-2),
                       memory=memory([0.6, 0.5]), **COSTS).with_mode("without_replacement")
    assert [d.mode for d in auto._drafters.values()] == ["chain", "without_replacement"]
    chain = TokenTree(torch.zeros(1, 5, dtype=torch.long), [-1, 0, 1, 2, 3])
    for by_mode in (False, True):
        auto.by_mode = by_mode
        auto.memory.current = "chain:4"
        auto._step_model = auto.model("chain:4")
        for _ in range(20):  # every chain token accepted
            auto.observe(chain, torch.tensor([[0, 1, 2, 3, 4]]))
    pooled = auto.memory.profile.hazards()
    own = auto.memory.by_mode["chain"].hazards(pooled)
    assert own[0][0] > 0.95 and pooled[0][0] < 0.9  # the pooled profile's 1e6 tree verdicts hold it

    def chain_tau(h, n):
        return 1 + sum(math.prod(h[d][0] for d in range(k)) for k in range(1, n + 1))

    assert auto.model("chain:4")[0] == pytest.approx(chain_tau(own, 4))
    assert auto.model("caterpillar:2,2,2,2")[0] == pytest.approx(
        expected_tau(parse_drafter("caterpillar:2,2,2,2").parents, auto.memory.profile.rank_probs()))
    auto.by_mode = False  # T = 0: one pooled profile for every mode
    assert auto.model("chain:4")[0] == pytest.approx(chain_tau(pooled, 4))


def test_memory_carries_over_generate_calls_per_pair_and_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("STREE_CACHE", str(tmp_path))
    forget()
    target, draft = FakeLM(23), FakeLM(23, noise=1.5)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7])

    def steps(m):
        return m.steps

    generate(target, draft, prompt, 24, drafter="auto")
    (greedy,) = auto_memories(target, draft)
    first = steps(greedy)
    assert first > 0
    generate(target, draft, prompt, 24, drafter="auto")  # the same memory, more steps in it
    assert auto_memories(target, draft) == [greedy] and steps(greedy) > first
    generate(target, draft, prompt, 24, drafter="auto", temperature=1.0,
             generator=torch.Generator().manual_seed(0))  # another setting: its own memory
    hot = [m for m in auto_memories(target, draft) if m is not greedy]
    assert len(hot) == 1 and steps(greedy) > first and hot[0].by_mode
    generate(target, draft, prompt, 24, drafter=AutoDrafter(remember=False))
    assert len(auto_memories(target, draft)) == 2
    forget()
    assert auto_memories(target, draft) == []


def auto_memories(target, draft) -> list[AutoMemory]:
    from stree.draft.auto import _MEMORY

    return list(_MEMORY.get(target, {}).get(draft, {}).values())


def test_no_cost_model_is_an_error():
    with pytest.raises(ValueError, match="cost model"):
        AutoDrafter(warmup=0).choose()
    with pytest.raises(ValueError, match="cost model"):
        AutoDrafter().model("chain:4")
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
    with pytest.raises(ValueError, match="fixed draft shapes"):
        resolve("tree", "auto", None, SamplingConfig(), compile=True, device="cuda")  # dyspec
    static_only = AutoDrafter(("chain:2", "static:fig4a"))
    assert static_only.layered


def test_auto_candidates_follow_the_device():
    """Off CUDA auto picks among shapes whose draft runs one node per level (a level of w nodes
    costs w draft steps there); on CUDA among every default candidate, wide trees included;
    then suffix trees alone and merged with the draft's; without a draft model, suffix trees;
    last, no draft at all."""
    cpu, gpu = parse_drafter("auto", "cpu"), parse_drafter("auto", torch.device("cuda"))
    assert cpu.candidates == CPU_CANDIDATES + SUFFIX_CANDIDATES["cpu"] + (OFF,)
    assert gpu.candidates == DEFAULT_CANDIDATES + SUFFIX_CANDIDATES["cuda"] + (OFF,)
    assert set(CPU_CANDIDATES) < set(DEFAULT_CANDIDATES)
    for spec in CPU_CANDIDATES:
        assert all(w == 1 for w in level_widths(parse_drafter(spec).parents)), spec
    assert any(w > 1 for spec in gpu.candidates if getattr(parse_drafter(spec), "parents", None)
               for w in level_widths(parse_drafter(spec).parents))
    drafter, _ = resolve("tree", "auto", None, SamplingConfig(), device="cpu")
    assert drafter.candidates == cpu.candidates and drafter.uses_draft_model
    alone, _ = resolve("tree", "auto", None, SamplingConfig(), device="cpu", draft_model=False)
    assert alone.candidates == ("suffix:16", OFF) and not alone.uses_draft_model
    # each starts from the device's default tree
    assert cpu.candidates[0] == default_drafter("tree", "cpu")
    assert gpu.candidates[0] == default_drafter("tree", "cuda")


def test_warmup_runs_the_first_candidate_then_chooses():
    """A fresh memory runs the first candidate for ``warmup`` verified steps (the profile is
    first measured on it), then the prediction decides."""
    auto = AutoDrafter(("chain:6", "chain:1"), ForwardCost(0.0, 1e-3, 1e-2), warmup=3,
                       memory=AutoMemory(profile([0.05], 1e6)), **COSTS)  # chain:1 predicted best
    tree = TokenTree(torch.zeros(1, 7, dtype=torch.long), [-1, 0, 1, 2, 3, 4, 5])
    for _ in range(3):
        assert auto.choose() == "chain:6"
        auto.observe(tree, torch.tensor([[0, -1, -1, -1, -1, -1, -1]]))
    assert auto.memory.steps == 3 and auto.choose() == "chain:1"


def test_warmup_teaches_the_profile_not_the_tau_ratios():
    """The warm-up's verdicts go to the acceptance profile but not to the candidates' measured /
    predicted tau ratios: its predictions come from a profile still learning, and a ratio to
    them, kept by a candidate that ran only there, held that candidate down for good."""
    auto = AutoDrafter(("chain:6", "chain:1"), ForwardCost(0.0, 1e-3, 1e-2), warmup=3,
                       memory=AutoMemory(), **COSTS)
    tree = TokenTree(torch.zeros(1, 7, dtype=torch.long), [-1, 0, 1, 2, 3, 4, 5])

    def step():
        auto.memory.current = auto.choose()
        auto._step_model = auto.model(auto.memory.current)  # as draft() does
        auto.observe(tree, torch.tensor([[0, 1, -1, -1, -1, -1, -1]]))

    for _ in range(3):
        step()
    assert auto.memory.taus == {} and auto.memory.profile.at_risk[0][0] > 0
    step()
    assert list(auto.memory.taus) == [auto.memory.current] and auto.memory.taus[auto.memory.current].n == 1


def test_warmup_at_t_above_zero_runs_each_modes_first_candidate():
    """T > 0: the sampled tree's mode and the chains' mode each get their first candidate's
    warm-up, in candidate order."""
    auto = AutoDrafter(("caterpillar:2,2", "chain:3", "chain:1", "static:3,3"),
                       ForwardCost(0.0, 1e-3, 1e-2), warmup=2, **COSTS)
    auto = auto.with_mode("without_replacement")
    auto.by_mode = True
    assert auto._drafters["caterpillar:2,2"].mode != auto._drafters["chain:3"].mode
    tree = TokenTree(torch.zeros(1, 2, dtype=torch.long), [-1, 0])
    seen = []
    for _ in range(4):
        seen.append(auto.choose())
        auto.observe(tree, torch.tensor([[0, -1]]))
    assert seen == ["caterpillar:2,2"] * 2 + ["chain:3"] * 2
    auto.by_mode = False  # one pooled profile (T = 0): the first candidate only
    assert auto._warmup_order() == ["caterpillar:2,2"]


# ------------------------------------------------------------------------------------ "off"
def test_off_wins_where_no_draft_pays_and_probes_at_doubling_intervals():
    """A draft that is never accepted and costs half a target step: auto runs the model's own
    one-token step (off), and probes the draft after 4, 8, 16, ... off steps (at most
    ``max_probe``); once a probe shows the draft accepted, it drafts and the interval resets."""
    auto = AutoDrafter(("chain:4", OFF), ForwardCost(0.0, 1e-3, 1e-2), draft_cost=ForwardCost(0.0, 0.0, 5e-3),
                       memory=memory([0.01]), probe=4, max_probe=16)
    seen = []
    for _ in range(60):
        auto.memory.current = auto.choose()
        seen.append(auto.memory.current)
    runs = "".join("-" if s == OFF else "c" for s in seen).split("c")
    assert seen[0] == OFF and [len(r) for r in runs[:4]] == [4, 8, 16, 16]
    assert auto.model(OFF) == (1.0, pytest.approx(1.1e-2))
    auto.memory, auto._probs = memory([0.9]), {}  # the text turned predictable: the next probe stays on
    auto.memory.current, auto.memory.idle, auto.memory.probe_every = OFF, 16, 16
    assert auto.choose() == "chain:4"
    auto.memory.current = "chain:4"
    assert auto.choose() == "chain:4" and (auto.memory.idle, auto.memory.probe_every) == (0, 0)


def test_warmup_measures_off_after_the_drafts():
    """The model's own step is measured in the warm-up, after the draft modes' first candidates:
    its prediction is not the cost model's (timed on one row) times the drafts' ratio."""
    auto = AutoDrafter(("chain:6", "chain:1", OFF), ForwardCost(0.0, 1e-3, 1e-2), warmup=2,
                       memory=AutoMemory(profile([0.9], 1e6)), **COSTS)
    seen = []
    for _ in range(5):
        auto.memory.current = auto.choose()
        seen.append(auto.memory.current)
        n = 1 if seen[-1] == OFF else 1 + int(seen[-1][-1])
        auto.observe(TokenTree(torch.zeros(1, n, dtype=torch.long), list(range(-1, n - 1))),
                     torch.tensor([list(range(n))]))
    assert seen == ["chain:6"] * 2 + [OFF] * 2 + ["chain:6"]


def test_off_is_not_chosen_where_the_draft_pays():
    auto = AutoDrafter(("chain:4", OFF), ForwardCost(0.0, 1e-3, 1e-2), memory=memory([0.8]), **COSTS)
    assert auto.choose() == "chain:4"


class TimedLM(FakeLM):
    """A FakeLM whose calls advance a fake clock (shared by a model pair) by ``cost`` of the
    tokens they run: auto then measures the step times its cost model predicts."""

    def __init__(self, clock: list[float], cost: ForwardCost, **kwargs):
        super().__init__(**kwargs)
        self.clock, self.cost = clock, cost

    def tree_forward(self, tree, cache):
        self.clock[0] += self.cost(tree.num_nodes)
        return super().tree_forward(tree, cache)

    def prefill(self, input_ids, cache, logits=True):
        if not isinstance(input_ids, (list, tuple)):  # (ragged rows come back here one by one)
            self.clock[0] += self.cost(input_ids.shape[1])
        return super().prefill(input_ids, cache, logits)


@pytest.mark.parametrize("max_probe", [8, 32], ids=["short-backlogs", "backlogs-past-MAX_LEAD"])
def test_off_steps_run_no_draft_and_greedy_output_stays_exact(monkeypatch, max_probe):
    """A draft of another language (never agrees but by chance): auto goes off and stays off
    but for its probes. No draft-model call happens on an off step (the tokens it missed are
    prefilled when a probe next drafts, past ``MAX_LEAD`` too), and every row is the target's
    greedy decoding."""
    clock = [0.0]
    target_cost, draft_cost = ForwardCost(0.0, 1e-3, 1e-2), ForwardCost(0.0, 1e-4, 4e-3)
    target = TimedLM(clock, target_cost, vocab_size=23)
    draft = TimedLM(clock, draft_cost, vocab_size=23, seed=7)
    auto = AutoDrafter(("chain:4", OFF), target_cost, draft_cost, warmup=4, probe=2, max_probe=max_probe,
                       remember=False, clock=lambda: clock[0])
    marks, choose = [], AutoDrafter.choose  # each step's choice and the draft's calls before it
    monkeypatch.setattr(AutoDrafter, "choose",
                        lambda self: marks.append((choose(self), len(draft.calls))) or marks[-1][0])
    prompts = [torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 4]), torch.tensor([3]),
               torch.tensor([8, 8, 1, 2])]
    out = generate(target, draft, prompts, 150, drafter=auto)
    assert [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(prompts)] == \
        [greedy_reference(target, p, 150) for p in prompts]
    ends = [n for _, n in marks[1:]] + [len(draft.calls)]
    assert all(end == n for (spec, n), end in zip(marks, ends) if spec == OFF)  # no draft call
    choices = [spec for spec, _ in marks]
    assert choices[:4] == ["chain:4"] * 4 and choices.count(OFF) > 0.8 * len(choices)
    off_runs = [len(r) for r in "".join("-" if s == OFF else "c" for s in choices).split("c") if r]
    assert max(off_runs) == max_probe and sum(off_runs) == choices.count(OFF)
    assert auto.memory.chosen == {spec: choices.count(spec) for spec in set(choices)}
    catch_ups = [c for c in draft.calls[1:] if c.kind == "prefill"]  # after the prompts' prefill
    assert catch_ups and max(c.tokens.shape[1] for c in catch_ups) == max_probe


@pytest.mark.parametrize("candidates", [("chain:2", OFF), ("caterpillar:2,2", OFF)], ids=["chain", "tree"])
def test_sampled_auto_with_off_steps_is_lossless(candidates):
    """T = 1, 3000 rows in one batch: the first step is off (the model's own step), the second
    a probe of the draft after that step (caught up first, verified by ASpS or MSS). The joint
    distribution of the first three new tokens is the target's (chi-square); the draft's own
    distribution, the control, fails the same test."""
    v, rows = 5, 3000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    clock = itertools.count(0.0, 0.01)
    auto = AutoDrafter(candidates, ForwardCost(0, 1e-4, 1e-2), ForwardCost(0.0, 0.0, 1.0),
                       memory=memory([0.3]), probe=1, remember=False, clock=lambda: next(clock))
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0, drafter=auto,
                   generator=torch.Generator().manual_seed(0))
    assert auto.memory.chosen == {OFF: 1, candidates[0]: 1}
    toks = out.sequences[:, 2:5]
    counts = torch.bincount((toks[:, 0] * v + toks[:, 1]) * v + toks[:, 2], minlength=v ** 3).double()
    for model, lossless in ((target, True), (draft, False)):
        p = target_probs_of_prefix(model, prompt, 3).reshape(-1).double()
        assert (chisquare(counts, p / p.sum() * rows).pvalue > 1e-3) == lossless
