"""Drafters on the fake draft model: shapes of every preset, stable layer-by-layer growth, one draft
call per depth over the tree only, q rows, child selection per mode, beam search bookkeeping."""
import pytest
import torch

from stree.draft import (STATIC_TREES, BeamTreeDrafter, ChainDrafter, StaticTreeDrafter,
                         parse_drafter)
from stree.sampling import SamplingConfig, target_probs
from stree.tree import TokenTree
from tests.fakes import FakeLM

GREEDY = SamplingConfig()
HOT = SamplingConfig(temperature=1.0)


def layer_widths(parents):
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    return [depth.count(d) for d in range(1, max(depth) + 1)]


def prefilled(model, prompts, max_seqlen=64):
    cache = model.allocate_tree_cache(len(prompts), max_seqlen)
    model.prefill(torch.tensor(prompts), cache)
    model.calls.clear()
    return cache


# Table 3 of the paper: (max width, depth, tokens); fig4a = A.
TABLE3 = {"fig4a": (3, 4, 13), "A": (3, 4, 13), "B": (16, 3, 29), "C": (6, 3, 16),
          "D": (4, 4, 13), "E": (3, 5, 16)}


@pytest.mark.parametrize("name", sorted(TABLE3))
def test_static_presets_match_table3(name):
    drafter = parse_drafter(f"static:{name}")
    widths = layer_widths(drafter.parents)
    assert (max(widths), len(widths), drafter.num_nodes) == TABLE3[name]
    assert drafter.depth == len(widths)
    assert drafter.num_forwarded == drafter.num_nodes - widths[-1]
    assert parse_drafter(name) == drafter  # bare names (CLI --tree) parse the same
    assert set(STATIC_TREES) == set(TABLE3)


@pytest.mark.parametrize("steps,beams", [(1, 1), (4, 3), (3, 5)])
def test_beam_shape(steps, beams):
    d = parse_drafter(f"beam:{steps}x{beams}")
    assert isinstance(d, BeamTreeDrafter)
    assert (d.num_nodes, d.depth, d.num_forwarded) == (1 + steps * beams, steps, 1 + (steps - 1) * beams)


@pytest.mark.parametrize("spec", ["static:Z", "beam:4", "beam:4x", "chain:x", "chain:0", "foo",
                                  "static:fig4a:bogus", "static:", "static:3,0", ""])
def test_unknown_specs_raise(spec):
    with pytest.raises(ValueError):
        parse_drafter(spec)


def test_static_rejects_non_layered_parents():
    with pytest.raises(ValueError, match="layer by layer"):
        StaticTreeDrafter((-1, 0, 1, 0))  # node 3 (depth 1) after node 2 (depth 2)
    with pytest.raises(ValueError):
        StaticTreeDrafter((0, 0))


def test_mode_choice():
    d = parse_drafter("static:fig4a")
    assert d.modes(GREEDY)[0] == "deterministic"
    assert d.modes(HOT)[0] == "without_replacement"
    assert parse_drafter("static:A:iid").modes(HOT) == ("iid",)
    assert d.with_mode("iid").mode == "iid"
    with pytest.raises(ValueError):
        parse_drafter("static:A:iid").with_mode("deterministic")
    assert ChainDrafter(4).modes(HOT) == ("chain",)
    assert BeamTreeDrafter(2, 2).modes(HOT) == ("deterministic",)


@pytest.mark.parametrize("spec,sampling", [
    ("static:fig4a", GREEDY), ("static:B", HOT), ("static:D:iid", HOT), ("beam:4x3", GREEDY),
    ("beam:3x2", HOT), ("chain:5", HOT), ("chain:3", GREEDY), ("caterpillar:3,2,2", HOT)], ids=str)
def test_draft_calls_once_per_depth_over_tree_only(spec, sampling):
    model = FakeLM(vocab_size=19, noise=1.0)
    cache = prefilled(model, [[1, 2, 3], [4, 5, 6]])
    drafter = parse_drafter(spec)
    roots = torch.tensor([7, 8])
    draft = drafter.draft(model, cache, roots, sampling, torch.Generator().manual_seed(0))
    tree = draft.tree
    assert tree.num_nodes == drafter.num_nodes and tree.max_depth == drafter.depth
    assert torch.equal(tree.tokens[:, 0], roots)
    calls = model.calls
    assert [c.kind for c in calls] == ["tree_forward"] * drafter.depth
    ran = torch.tensor([drafter.ran(i) for i in range(drafter.num_nodes)])
    if isinstance(drafter, StaticTreeDrafter):  # runs exactly the nodes with children
        inner = set(tree.parents[0, 1:].tolist())
        assert ran.tolist() == [i in inner for i in range(drafter.num_nodes)]
    for level, call in enumerate(calls):
        m = call.tokens.shape[1]
        # the call covers the tree up to the last node of layer `level` that runs, starting at
        # the root (never the prefix)
        assert m == 1 + max(i for i in range(drafter.num_nodes) if ran[i] and tree.depth[0, i] == level)
        assert torch.equal(call.tokens, tree.tokens[:, :m])  # earlier layers never move
        assert torch.equal(call.parents, tree.parents[:, :m])
        assert call.committed == [3, 3]  # committed state untouched while drafting
    assert calls[-1].tokens.shape[1] == drafter.num_forwarded
    # q: distributions at the nodes the draft ran, zero rows elsewhere (the deepest layer, inner
    # leaves); at greedy sampling no verifier reads q and none is allocated
    q = draft.q
    if sampling.is_greedy:
        assert q is None
        return
    assert q.shape == (2, drafter.num_nodes, 19)
    assert (q >= 0).all()
    torch.testing.assert_close(q[:, ran].sum(-1), torch.ones(2, int(ran.sum())))
    assert (q[:, ~ran] == 0).all()


def test_static_deterministic_children_are_topk_in_order():
    model = FakeLM(vocab_size=19)
    cache = prefilled(model, [[1, 2]])
    drafter = parse_drafter("static:3,2")  # root -> 3 children; first two get one child each
    draft = drafter.draft(model, cache, torch.tensor([5]), GREEDY)
    logits = model.tree_forward(TokenTree(draft.tree.tokens[:, :4], drafter.parents[:4]), cache)
    top3 = logits[0, 0].topk(3).indices.tolist()
    assert draft.tree.tokens[0, 1:4].tolist() == top3
    assert draft.tree.tokens[0, 4:6].tolist() == [int(logits[0, 1].argmax()), int(logits[0, 2].argmax())]
    assert draft.mode == "deterministic"
    assert draft.q is None  # greedy: no verifier reads q


def test_chain_at_greedy_is_the_draft_argmax_chain():
    model = FakeLM(vocab_size=19)
    cache = prefilled(model, [[1, 2]])
    draft = ChainDrafter(4).draft(model, cache, torch.tensor([3]), GREEDY)
    prev, cur, expect = 2, 3, []
    for _ in range(4):
        prev, cur = cur, int(model.table[prev, cur].argmax())
        expect.append(cur)
    assert draft.tree.tokens[0, 1:].tolist() == expect and draft.mode == "chain"


def test_sampled_children_follow_q():
    """i.i.d. children are draws from q; without-replacement siblings are distinct."""
    model = FakeLM(vocab_size=7, scale=1.0)
    rows = 4000
    cache = prefilled(model, [[1, 2]] * rows)
    gen = torch.Generator().manual_seed(0)
    roots = torch.full((rows,), 3)
    iid = parse_drafter("static:2:iid").draft(model, cache, roots, HOT, gen)
    q = iid.q[0, 0]
    freq = torch.bincount(iid.tree.tokens[:, 1:].reshape(-1), minlength=7).float() / (2 * rows)
    assert (freq - q).abs().max() < 0.03
    wor = parse_drafter("static:3:without_replacement").draft(model, cache, roots, HOT, gen)
    kids = wor.tree.tokens[:, 1:]
    assert all(len(set(row)) == 3 for row in kids.tolist())
    first = torch.bincount(kids[:, 0], minlength=7).float() / rows  # first draw is a draw from q
    assert (first - wor.q[0, 0]).abs().max() < 0.03


def _beam_model():
    """Draft where beam A (root's best child) later loses both slots to beam B's continuations."""
    v, P, R, A, B, C, D = 11, 1, 2, 3, 4, 5, 6
    model = FakeLM(vocab_size=v)
    model.table.zero_()
    model.table[P, R, A], model.table[P, R, B] = 5.0, 4.0   # p(A) ~ .70, p(B) ~ .26
    model.table[R, B, C] = model.table[R, B, D] = 10.0      # B -> C or D, p ~ .5 each
    model.table[B, C, 7] = model.table[B, D, 8] = 10.0
    return model, (P, R, A, B, C, D)


def test_beam_search_keeps_dropped_beams_tokens():
    model, (P, R, A, B, C, D) = _beam_model()
    cache = prefilled(model, [[P]])
    draft = BeamTreeDrafter(steps=3, beams=2).draft(model, cache, torch.tensor([R]), GREEDY)
    tree = draft.tree
    assert tree.num_nodes == 7 and draft.mode == "deterministic"
    # layer 1: A then B (best first); layer 2: both continuations hang from B, A is kept as a leaf
    assert tree.tokens[0, 1:3].tolist() == [A, B]
    assert sorted(tree.tokens[0, 3:5].tolist()) == [C, D]
    assert tree.parents[0, 3:5].tolist() == [2, 2]
    assert tree.children(0, 1) == []
    # layer 3: one child under each of C and D
    assert sorted(tree.tokens[0, 5:7].tolist()) == [7, 8]
    assert sorted(tree.parents[0, 5:7].tolist()) == [3, 4]
    assert len(model.calls) == 3


def test_beam_scores_are_summed_log_probs():
    """Each layer is the top-M of (parent score + log q) over all beams' top-M candidates."""
    model = FakeLM(vocab_size=13, scale=1.0)
    cache = prefilled(model, [[1, 2]])
    drafter = BeamTreeDrafter(steps=3, beams=3)
    tree = drafter.draft(model, cache, torch.tensor([4]), GREEDY).tree
    toks, par = tree.tokens[0].tolist(), tree.parents[0].tolist()

    def logp(node):  # log-prob of node's token under its parent's draft distribution
        p = par[node]
        prev = toks[par[p]] if p > 0 else 2
        return float(model.table[prev, toks[p]].log_softmax(-1)[toks[node]])

    score = {0: 0.0}
    for i in range(1, 10):
        score[i] = score[par[i]] + logp(i)
    for start in (1, 4, 7):
        layer = [score[i] for i in range(start, start + 3)]
        assert layer == sorted(layer, reverse=True)
    # brute force layer 2: best 3 of every (beam, token) pair
    cands = sorted((score[b] + float(model.table[toks[par[b]], toks[b]].log_softmax(-1)[t]))
                   for b in (1, 2, 3) for t in range(13))
    assert [round(s, 5) for s in cands[-3:][::-1]] == [round(score[i], 5) for i in (4, 5, 6)]
