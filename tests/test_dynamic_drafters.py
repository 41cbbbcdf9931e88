"""Dynamic drafters (DySpec, DynaTree v1/v2) on the fake order-2 Markov models.

Oracles: the papers' own sequential algorithms written out node by node (a heap for DySpec's
Algorithm 1, layer loops for its Algorithm 2 and for DynaTree), reading the draft's distributions
straight from the fake model's table; the target's greedy decoding; the exact target joint for
chi-square tests at T > 0, which a deliberately biased rule must fail.
"""
from __future__ import annotations

import heapq
from collections import deque

import pytest
import torch
from scipy.stats import chisquare

from stree.draft import DynaTree2Drafter, DySpecDrafter, parse_drafter
from stree.draft.dynamic import Slots
from stree.generation import generate, resolve
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from tests.fakes import FakeLM, greedy_reference, target_probs_of_prefix

V = 23
GREEDY, HOT = SamplingConfig(), SamplingConfig(1.0)
PROMPTS = [torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 4])]
SPECS = ["dyspec:12", "dyspec-threshold:0.05:16", "dynatree:4x2:12", "dynatree2:16"]


def drafted(drafter, model, prompts, sampling=GREEDY, seed=0):
    """One draft below each prompt's last token; the model's calls are recorded from here."""
    cache = model.allocate_tree_cache(len(prompts), 256)
    model.prefill(torch.stack([p[:-1] for p in prompts]), cache)
    model.calls.clear()
    roots = torch.stack([p[-1] for p in prompts])
    return drafter.draft(model, cache, roots, sampling, torch.Generator().manual_seed(seed))


def node_paths(tree: TokenTree, row: int = 0) -> set[tuple[int, ...]]:
    """Every non-root node of a row as its token path below the root."""
    toks = tree.tokens[row].tolist()
    return {tuple(toks[i] for i in p if i >= 0)[1:] for p in tree.paths[row].tolist()} - {()}


# -------------------------------------------------------------- sequential oracles (host-side)
def ranked(model: FakeLM, prev: int, cur: int, temperature: float = 1.0):
    """The draft's tokens after (prev, cur), most likely first, with their probabilities at
    ``temperature``."""
    p = (model.table[prev, cur].float() / temperature).softmax(-1)
    order = p.argsort(descending=True, stable=True)
    return order.tolist(), p[order].tolist()


def dyspec_alg1(model, prev, root, budget, temperature):
    """DySpec Algorithm 1 (heap greedy), ranked children: the tree as a set of token paths."""
    nodes = {(): (prev, root, 1.0)}               # path -> (previous token, token, value a)
    heap, tick = [(-1.0, 0, (), 0, 0.0)], 1       # (-slot value, tiebreak, parent path, k, S)
    while len(nodes) - 1 < budget:
        _, _, path, k, s = heapq.heappop(heap)
        pv, tok, a = nodes[path]
        toks, probs = ranked(model, pv, tok, temperature)
        child = path + (toks[k],)
        nodes[child] = (tok, toks[k], a * probs[k])
        heapq.heappush(heap, (-a * (1 - s - probs[k]), tick, path, k + 1, s + probs[k]))
        heapq.heappush(heap, (-a * probs[k], tick + 1, child, 0, 0.0))
        tick += 2
    return set(nodes) - {()}


def dyspec_alg2(model, prev, root, threshold, temperature):
    """DySpec Algorithm 2 (threshold, layer by layer), ranked children."""
    out, layer = set(), [((), prev, root, 1.0)]
    while layer:
        nxt = []
        for path, pv, tok, v in layer:
            toks, probs = ranked(model, pv, tok, temperature)
            for t, p in zip(toks, probs):
                if v < threshold:
                    break
                residual = p / sum(probs[toks.index(t):])  # R[t]: q renormalised after removals
                out.add(path + (t,))
                nxt.append((path + (t,), tok, t, v * residual))
                v *= 1 - residual
        layer = nxt
    return out


def dynatree_v1(model, prev, root, depth, branch, budget, tau):
    """DynaTree v1 DRAFTTREE (breadth first, FIFO, top-B, prune below tau, node budget)."""
    out, frontier = [], deque([((), prev, root, 1.0)])
    for _ in range(depth):
        nxt = deque()
        for path, pv, tok, p in frontier:
            if p < tau:
                continue
            toks, probs = ranked(model, pv, tok)
            for t, q in zip(toks[:branch], probs[:branch]):
                if len(out) >= budget:
                    break
                out.append(path + (t,))
                nxt.append((path + (t,), tok, t, p * q))
        frontier = nxt
    return set(out)


def dynatree_v2(model, prev, root, d: DynaTree2Drafter):
    """DynaTree v2 DRAFTTREE with the drafter's current parameters (FIFO frontier)."""
    out, frontier = [], deque([((), prev, root, 1.0)])
    while frontier and len(out) < d.budget:
        path, pv, tok, p = frontier.popleft()
        depth = len(path)
        if depth >= d.max_depth or p < d.rho_stop:
            continue
        if depth >= round(d.history.d0) and p < d.rho_deep:
            continue
        toks, probs = ranked(model, pv, tok)
        c = probs[0]
        width = d.breadth[0] if c >= d.history.tau_h else d.breadth[1] if c >= d.tau_l else d.breadth[2]
        for t, q in zip(toks[:width], probs[:width]):
            if len(out) >= d.budget:
                break
            out.append(path + (t,))
            frontier.append((path + (t,), tok, t, p * q))
    return set(out)


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("seed,vt", [(0, 0.6), (1, 1.0), (2, 0.4)])
@pytest.mark.parametrize("budget", [5, 16, 40])
def test_dyspec_matches_algorithm_1(seed, vt, budget):
    """Round-batched greedy = the heap's tree, node for node (depth cap not binding)."""
    model = FakeLM(V, seed=seed, scale=1.5)
    prompt = torch.tensor([3, 7 + seed])
    d = parse_drafter(f"dyspec-paper:{budget}:{budget}:{vt}")
    assert d.calibration is None and d.name == f"dyspec-paper:{budget}"
    tree = drafted(d, model, [prompt]).tree
    assert tree.num_nodes == budget + 1
    assert node_paths(tree) == dyspec_alg1(model, 3, 7 + seed, budget, d.value_temperature)
    # the draft ran once per round, over the tree so far; fewer rounds than nodes
    calls = [c for c in model.calls if c.kind == "tree_forward"]
    assert len(calls) == d.draft_runs < budget or budget <= 5
    last = TokenTree(calls[-1].tokens, calls[-1].parents)
    assert last.num_nodes == d.num_forwarded and d.depth == last.max_depth + 1  # commit's cut


def dyspec_max_weight(model, prev, root, budget, temperature):
    """Calibrated DySpec with ranked children before any verdict: the maximum-weight subtree of
    Theorem D.1 (weight = path probability), grown by a heap over nodes, not slots."""
    nodes = {(): (prev, root, 1.0)}
    toks, probs = ranked(model, prev, root, temperature)
    heap, tick = [(-probs[0], 0, (), 0)], 1       # (-child weight, tiebreak, parent path, k)
    while len(nodes) - 1 < budget:
        w, _, path, k = heapq.heappop(heap)
        pv, tok, a = nodes[path]
        toks, probs = ranked(model, pv, tok, temperature)
        child = path + (toks[k],)
        nodes[child] = (tok, toks[k], -w)
        heapq.heappush(heap, (-a * probs[k + 1], tick, path, k + 1))
        ctoks, cprobs = ranked(model, tok, toks[k], temperature)
        heapq.heappush(heap, (w * cprobs[0], tick + 1, child, 0))
        tick += 2
    return set(nodes) - {()}


@pytest.mark.parametrize("seed,vt", [(0, 0.6), (1, 1.0)])
@pytest.mark.parametrize("budget", [5, 16, 40])
def test_calibrated_dyspec_ranked_is_the_max_weight_subtree(seed, vt, budget):
    model = FakeLM(V, seed=seed, scale=1.5)
    d = parse_drafter(f"dyspec:{budget}:{budget}:{vt}")
    assert d.calibration is not None and d.name == f"dyspec:{budget}"
    tree = drafted(d, model, [torch.tensor([3, 7 + seed])]).tree
    assert node_paths(tree) == dyspec_max_weight(model, 3, 7 + seed, budget, vt)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("threshold", [0.02, 0.1])
def test_dyspec_threshold_matches_algorithm_2(seed, threshold):
    model = FakeLM(V, seed=seed, scale=2.0)
    d = DySpecDrafter(200, max_depth=30, threshold=threshold)
    tree = drafted(d, model, [torch.tensor([5, 1 + seed])]).tree
    assert tree.num_nodes < 201  # the budget did not bind
    assert node_paths(tree) == dyspec_alg2(model, 5, 1 + seed, threshold, d.value_temperature)


@pytest.mark.parametrize("depth,branch,budget,tau", [(4, 2, 12, 0.05), (6, 3, 20, 0.03),
                                                     (3, 3, 50, 0.0), (8, 2, 7, 0.1)])
def test_dynatree_matches_v1(depth, branch, budget, tau):
    model = FakeLM(V, seed=4, scale=1.5)
    d = parse_drafter(f"dynatree:{depth}x{branch}:{budget}:{tau}")
    tree = drafted(d, model, [torch.tensor([2, 8])]).tree
    assert node_paths(tree) == dynatree_v1(model, 2, 8, depth, branch, budget, tau)
    assert tree.max_depth <= depth and tree.num_nodes <= budget + 1


@pytest.mark.parametrize("d0,tau_h", [(5.0, 0.9), (2.0, 0.5), (7.0, 0.95)])
def test_dynatree2_matches_v2(d0, tau_h):
    model = FakeLM(V, seed=6, scale=2.0)
    d = DynaTree2Drafter(24)
    d.history.d0, d.history.tau_h = d0, tau_h
    tree = drafted(d, model, [torch.tensor([4, 11])]).tree
    assert node_paths(tree) == dynatree_v2(model, 4, 11, d)


def test_shapes_vary_per_row_and_padding_is_inert():
    """Rows get their own shapes in one padded tree; padding copies node 1 below the root."""
    model = FakeLM(V, seed=0, scale=3.0)
    prompts = [torch.tensor([i, (3 * i) % V]) for i in range(6)]
    d = DySpecDrafter(10, max_depth=11)  # > budget: the last-round fill never happens
    draft = drafted(d, model, prompts)
    assert draft.tree.num_nodes <= 11
    assert len({tuple(r) for r in draft.tree.parents.tolist()}) > 1
    padded = 0
    for r in range(len(prompts)):
        solo = drafted(DySpecDrafter(10, max_depth=11), model, [prompts[r]]).tree
        toks, par = draft.tree.tokens[r].tolist(), draft.tree.parents[r].tolist()
        pads = [i for i in range(2, len(toks)) if par[i] == 0 and toks[i] == toks[1]]
        padded += len(pads)
        # the row's real nodes are the first nodes of its own greedy tree (pads share node 1's path)
        assert node_paths(draft.tree, r) <= node_paths(solo)
        assert all(draft.tree.children(r, i) == [] for i in pads)
    assert padded > 0


def test_dynatree2_history_tunes_depth_and_confidence():
    d = DynaTree2Drafter(16)
    tree = TokenTree(torch.zeros(2, 5, dtype=torch.long), [-1, 0, 1, 2, 3])  # depth 4
    full = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    for _ in range(20):
        d.observe(tree, full)   # everything accepted: go deeper, trust the draft more
    assert d.history.d0 == d.max_depth - 1 and d.history.tau_h < 0.9
    none = torch.tensor([[0, -1, -1, -1, -1], [-1, -1, -1, -1, -1]])  # row 1 finished: ignored
    for _ in range(40):
        d.observe(tree, none)
    assert d.history.d0 == 1.0 and d.history.tau_h == 1.0


def test_dynatree2_breadth_follows_confidence():
    d = DynaTree2Drafter(16)
    prob = torch.tensor([[[0.95, 0.01, 0.01], [0.5, 0.2, 0.1], [0.2, 0.2, 0.1]]])
    slots = Slots(a=torch.ones(1, 3), depth=torch.zeros(1, 3, dtype=torch.long),
                  fresh=torch.ones(1, 3, dtype=torch.bool), open=torch.ones(1, 3, 3, dtype=torch.bool),
                  prob=prob, last=False)
    _, take = d.select(slots)
    assert take.sum(-1).tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("spec", ["dyspec:0", "dyspec:4:0", "dyspec-threshold:1.5",
                                  "dyspec-threshold:0", "dynatree:4x0:8", "dynatree:4x2",
                                  "dynatree:4x2:8:2", "dynatree2:0", "dynatree2:x"])
def test_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_drafter(spec)


# ------------------------------------------------------------------- losslessness, greedy
@pytest.mark.parametrize("spec", SPECS)
def test_greedy_equals_target_greedy(spec):
    target, draft = FakeLM(V), FakeLM(V, noise=1.5)
    out = generate(target, draft, PROMPTS, 96, drafter=spec)
    got = [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(PROMPTS)]
    assert got == [greedy_reference(target, p, 96) for p in PROMPTS]
    assert out.stats.tau > 1.5
    assert out.stats.draft_calls >= out.stats.target_calls  # at least one draft run per step


def test_resolved_pairs_and_refusals():
    d, v = resolve("tree", "dyspec:8", None, HOT)
    assert (d.mode, v.name) == ("without_replacement", "mss")
    d, v = resolve("tree", "dyspec:8", None, GREEDY)
    assert (d.mode, v.name) == ("deterministic", "greedy")
    d, v = resolve("tree", "dyspec:8", "naive", HOT)
    assert (d.mode, v.name) == ("deterministic", "naive")
    for spec in ("dynatree:4x2:8", "dynatree2"):
        d, v = resolve("tree", spec, None, HOT)
        assert (d.mode, v.name) == ("deterministic", "naive")
        with pytest.raises(ValueError, match="not lossless"):
            resolve("tree", spec, "mss", HOT)
    with pytest.raises(ValueError, match="chain"):
        resolve("tree", "dyspec:8", "asps", HOT)


# ----------------------------------------------------------------- losslessness, T > 0
def _joint(out, prompt, v):
    toks = out.sequences[:, len(prompt):len(prompt) + 3]
    return torch.bincount((toks[:, 0] * v + toks[:, 1]) * v + toks[:, 2], minlength=v ** 3)


def _pvalue(drafter, verifier=None, rows=3000, v=5):
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0, drafter=drafter,
                   verifier=verifier, generator=torch.Generator().manual_seed(0))
    assert out.stats.tau > 1.3  # speculation did happen
    p = target_probs_of_prefix(target, prompt, 3).reshape(-1).double()
    return chisquare(_joint(out, prompt, v).double(), p / p.sum() * rows).pvalue


@pytest.mark.parametrize("spec", ["dyspec:6", "dyspec-threshold:0.1:8", "dynatree:3x2:6",
                                  "dynatree2:6"])
def test_sampled_output_has_the_target_distribution(spec):
    """3000 rows (each its own tree shape, so padding is exercised), first 3 tokens against the
    exact target joint."""
    assert _pvalue(spec) > 1e-3


class _PeekingDySpec(DySpecDrafter):
    """A wrong rule: keeps a sampled child only if the token drawn is likely under the draft
    (decides on the token itself, which DySpec warns makes the result biased)."""

    def select(self, slots: Slots):
        value, take = super().select(slots)
        return value, take & (slots.prob >= 0.25)


def test_distribution_test_catches_a_token_dependent_rule():
    assert _pvalue(_PeekingDySpec(6, max_depth=10)) < 1e-6


class _Recording(DySpecDrafter):
    """dyspec that records (draft runs, depth) of every draft."""

    def draft(self, *args, **kwargs):
        out = super().draft(*args, **kwargs)
        self.seen.append((self.draft_runs, self.depth))
        return out


def test_rounds_adding_only_shallow_nodes_commit_to_the_draft():
    """A round may add only siblings of shallow nodes, so draft runs exceed the drafted depth;
    the draft commit cuts the path to ``depth`` (1 + the deepest node the draft ran)."""
    target = FakeLM(V, seed=2, scale=4.0)
    draft = FakeLM(V, seed=2, scale=4.0, noise=1.0)
    d = _Recording(12, max_depth=10, mode="deterministic", value_temperature=1.0)  # kept by resolve
    d.seen = []
    out = generate(target, draft, PROMPTS, 96, drafter=d)
    got = [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(PROMPTS)]
    assert got == [greedy_reference(target, p, 96) for p in PROMPTS]
    assert any(runs > depth for runs, depth in d.seen)
    assert out.stats.draft_calls >= sum(runs for runs, _ in d.seen)
