"""Level-by-level drafting (``level_forward``: each node once, from its parent's materialised
state) against the hybrid's own token-by-token decoding (``step``), over two rounds with ragged
prompts, different trees per row, and accepted paths that end above and in the never-forwarded
deepest level (run once by ``commit_draft``, no chain re-run)."""
import pytest
import torch

import stree
from stree.draft.base import commit_draft, forward_level, lead_tensor
from stree.tree import TokenTree
from tests.test_model_hybrid import VOCAB, StepOracle, check_states, close, make_hybrid

LEVELS = [(0, 1), (1, 3), (3, 5)]  # node ranges; nodes 5, 6 (depth 3) are never forwarded


def _prefilled(model, prompts):
    """A cache holding ``prompts`` (ragged rows) and one token-by-token oracle per row fed them."""
    cache = model.allocate_tree_cache(len(prompts), 64)
    model.prefill([torch.tensor(p) for p in prompts], cache)
    oracles = [StepOracle(model) for _ in prompts]
    for o, p in zip(oracles, prompts):
        o.feed(p)
    return cache, oracles


@pytest.mark.parametrize("attn_layers", [(), (1, 3)], ids=["mamba-only", "hybrid"])
def test_levels_and_commit_match_step_decoding(attn_layers):
    torch.manual_seed(0)
    model = stree.patch(make_hybrid(attn_layers, seed=7))
    cache = model.allocate_tree_cache(2, 64)
    prompts = [[3, 9, 4], [7, 1, 2, 8, 5, 6]]
    model.prefill([torch.tensor(p) for p in prompts], cache)
    oracles = [StepOracle(model) for _ in prompts]
    for o, p in zip(oracles, prompts):
        o.feed(p)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 3, 3]])
    for paths in ([[0, 2, 4, 6], [0, 1]], [[0, 1, 3], [0, 1, 3, 5]]):
        tree = TokenTree(torch.randint(0, VOCAB, (2, 7)), parents)
        for s, e in LEVELS:
            prefix = TokenTree(tree.tokens[:, :e], parents[:, :e])
            logits = forward_level(model, cache, prefix, s, e, capacity=7)
            for r in range(2):
                close(logits[r], oracles[r].node_logits(tree, row=r)[s:e], f"row {r} nodes {s}:{e}")
        before = [t.clone() for c in cache.layers.values() for t in vars(c).values()]
        assert cache.seqlens == [o.cache.seqlen for o in oracles]
        counts = [len(p) for p in paths]
        path = torch.tensor([p + [-1] * (4 - len(p)) for p in paths])
        # committed state untouched while drafting
        assert all(torch.equal(a, t) for a, t in zip(
            before, [t for c in cache.layers.values() for t in vars(c).values()]))
        assert commit_draft(model, cache, tree, path, counts, [p[-1] for p in paths], lambda node: node < 5)
        for r in range(2):
            oracles[r].feed([int(tree.tokens[r, j]) for j in paths[r]])
            check_states(model, cache, oracles[r], row=r)


def test_commit_refuses_a_path_below_the_forwarded_levels():
    model = stree.patch(make_hybrid((1,), seed=3))
    cache = model.allocate_tree_cache(1, 32)
    model.prefill(torch.tensor([[1, 2]]), cache)
    tree = TokenTree(torch.tensor([[4, 5, 6]]), [-1, 0, 1])
    forward_level(model, cache, TokenTree(tree.tokens[:, :2], [-1, 0]), 0, 2, capacity=3)
    with pytest.raises(ValueError, match="level_forward them first"):
        cache.commit(torch.tensor([[0, 1, 2]]), [3])


def test_mamba_ssm_levels_equal_tree_forward():
    """mamba_ssm Mamba2 (heads sharing one B/C group) + MHA: level logits and committed states
    equal those of one tree_forward + commit (itself checked against Mamba2.step elsewhere)."""
    from tests.test_model_mamba2 import make_model
    model = stree.patch(make_model(seed=2, n_layer=3, attn_layer_idx=(1,)))
    caches = [model.allocate_tree_cache(2, 32) for _ in range(2)]
    for c in caches:
        model.prefill(torch.tensor([[5, 6, 7], [8, 9, 10]]), c)
    parents = [-1, 0, 0, 1, 2, 3, 4]
    tree = TokenTree(torch.randint(0, 61, (2, 7)), parents)
    full = model.tree_forward(tree, caches[0])
    for s, e in LEVELS:
        logits = forward_level(model, caches[1], TokenTree(tree.tokens[:, :e], parents[:e]), s, e, 7)
        close(logits, full[:, s:e], f"nodes {s}:{e}")
    path, counts = torch.tensor([[0, 2, 4, 6], [0, 1, -1, -1]]), [4, 2]
    caches[0].commit(path, counts)
    assert commit_draft(model, caches[1], tree, path, counts, [6, 1], lambda node: node < 5)
    assert caches[0].seqlens == caches[1].seqlens == [7, 5]
    for i, layer in caches[0].layers.items():
        for name, t in vars(layer).items():
            for r, n in enumerate(caches[0].seqlens):  # K/V: the committed positions only
                ref = t[r] if name.endswith("state") else t[r][..., :n, :]
                got = getattr(caches[1].layers[i], name)[r]
                close(got if name.endswith("state") else got[..., :n, :], ref, f"layer {i} {name} row {r}")


def test_commit_runs_no_level_when_every_path_ends_at_a_forwarded_node():
    model = stree.patch(make_hybrid((1,), seed=5))
    cache = model.allocate_tree_cache(2, 32)
    model.prefill(torch.tensor([[1, 2], [3, 4]]), cache)
    oracles = [StepOracle(model) for _ in range(2)]
    for o, p in zip(oracles, [[1, 2], [3, 4]]):
        o.feed(p)
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 3, 3]])
    tree = TokenTree(torch.randint(0, VOCAB, (2, 7)), parents)
    for s, e in LEVELS:
        forward_level(model, cache, TokenTree(tree.tokens[:, :e], parents[:, :e]), s, e, capacity=7)
    calls = []
    model.level_forward = lambda *a, **k: calls.append(a)  # must not be needed
    paths = [[0, 2, 4], [0]]
    assert commit_draft(model, cache, tree, torch.tensor([paths[0], [0, -1, -1]]), [3, 1], [4, 0],
                        lambda node: node < 5)
    assert not calls
    for r in range(2):
        oracles[r].feed([int(tree.tokens[r, j]) for j in paths[r]])
        check_states(model, cache, oracles[r], row=r)


def test_caterpillar_runs_only_its_spine_and_commits_paths_ending_at_any_leaf():
    """A caterpillar's draft runs one node per level (its leaves never); a path ending at an
    inner leaf or at the deepest layer is committed by running that leaf once from its parent's
    state, giving the state of token-by-token decoding."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    model = stree.patch(make_hybrid((1,), seed=11))
    drafter = parse_drafter("caterpillar:2,3,2")  # 0 | 1 2 | 3 4 5 | 6 7
    assert [drafter.ran(i) for i in range(8)] == [True, True, False, True, False, False, False, False]
    prompts = [[3, 9, 4], [7, 1, 2, 8]]
    runs = []
    forward, draft_levels = model.level_forward, model.draft_levels
    model.level_forward = lambda tree, cache, nodes, **k: runs.append(nodes.tolist()) or forward(
        tree, cache, nodes, **k)

    def recorded(tokens, cache, levels, pick, lead=None):  # a greedy draft runs its levels in one call
        runs.extend([list(range(s, e))] * len(tokens) for _, s, e in levels)
        return draft_levels(tokens, cache, levels, pick, lead)

    model.draft_levels = recorded
    for paths in ([[0, 2], [0, 1, 3, 7]], [[0, 1, 5], [0]]):
        cache = model.allocate_tree_cache(2, 64)
        model.prefill([torch.tensor(p) for p in prompts], cache)
        oracles = [StepOracle(model) for _ in prompts]
        for o, p in zip(oracles, prompts):
            o.feed(p)
        runs.clear()
        draft = drafter.draft(model, cache, torch.tensor([5, 6]), SamplingConfig())
        assert runs == [[[0], [0]], [[1], [1]], [[3], [3]]]  # the spine only
        counts = [len(p) for p in paths]
        path = torch.tensor([p + [-1] * (4 - len(p)) for p in paths])
        last = [p[-1] for p in paths]
        assert commit_draft(model, cache, draft.tree, path, counts, last, drafter.ran)
        assert runs[3:] == [[[n] for n in last]]  # a leaf is the last node: one level runs it
        for r in range(2):
            oracles[r].feed([int(draft.tree.tokens[r, j]) for j in paths[r]])
            check_states(model, cache, oracles[r], row=r)


@pytest.mark.parametrize("attn_layers", [(), (1,)], ids=["mamba-only", "hybrid"])
@pytest.mark.parametrize("spec", ["static:2,4,2", "caterpillar:3,2,2", "chain:3"])
def test_greedy_draft_in_one_call_picks_the_oracle_top_children(attn_layers, spec):
    """A greedy static draft runs all its levels in one ``draft_levels`` call (no
    ``level_forward``): each node that ran has as children the top tokens of token-by-token
    decoding's logits after its root path, in rank order; the commit then gives that decoding's
    states."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    torch.manual_seed(3)
    model = stree.patch(make_hybrid(attn_layers, seed=13))
    drafter = parse_drafter(spec)
    prompts = [[3, 9, 4], [7, 1, 2, 8, 5]]
    cache, oracles = _prefilled(model, prompts)
    forward = model.level_forward
    model.level_forward = lambda *a, **k: pytest.fail("a greedy static draft ran level by level")
    draft = drafter.draft(model, cache, torch.tensor([5, 6]), SamplingConfig())
    model.level_forward = forward
    tree = draft.tree
    for r in range(2):
        logits = oracles[r].node_logits(tree, row=r)
        for node in range(tree.num_nodes):
            children = tree.children(r, node)
            if drafter.ran(node) and children:
                top = logits[node].topk(len(children)).indices.tolist()
                assert [int(tree.tokens[r, c]) for c in children] == top, f"row {r} node {node}"
    deepest = tree.num_nodes - 1  # a path to the last node (in the never-run deepest layer)
    path = [deepest]
    while path[-1]:
        path.append(int(tree.parents[0, path[-1]]))
    paths = [path[::-1], [0]]
    width = len(paths[0])
    assert commit_draft(model, cache, tree, torch.tensor([p + [-1] * (width - len(p)) for p in paths]),
                        [len(p) for p in paths], [p[-1] for p in paths], drafter.ran)
    for r in range(2):
        oracles[r].feed([int(tree.tokens[r, j]) for j in paths[r]])
        check_states(model, cache, oracles[r], row=r)


class _LevelByLevel:
    """A patched model seen without ``draft_levels``: static drafts run level by level."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        if name == "draft_levels":
            raise AttributeError(name)
        return getattr(self._model, name)


@pytest.mark.parametrize("attn_layers", [(), (1,)], ids=["mamba-only", "hybrid"])
@pytest.mark.parametrize("spec,sampling", [
    ("caterpillar:3,2,2", dict(temperature=1.0)),  # children without replacement (the exponential race)
    ("static:2,3", dict(temperature=0.7)),
    ("chain:3", dict(temperature=1.3))], ids=["without-replacement", "static", "chain"])
def test_a_sampled_draft_in_one_call_draws_what_level_by_level_draws(attn_layers, spec, sampling):
    """A sampled static draft runs all its levels in one ``draft_levels`` call, its random
    numbers drawn first: from the same generator it draws the tokens the level-by-level draft
    draws (whose draws are the distribution's: tests/test_verify_distribution.py) and reports
    the same distributions, and leaves the same state to commit."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    torch.manual_seed(5)
    model = stree.patch(make_hybrid(attn_layers, seed=13))
    drafter, config = parse_drafter(spec), SamplingConfig(**sampling)
    prompts = [[3, 9, 4], [7, 1, 2, 8, 5]]
    drafts = []
    for runner in (model, _LevelByLevel(model)):
        cache, _ = _prefilled(model, prompts)
        forward = model.level_forward
        if runner is model:
            model.level_forward = lambda *a, **k: pytest.fail("a sampled static draft ran level by level")
        draft = drafter.draft(runner, cache, torch.tensor([5, 6]), config, torch.Generator().manual_seed(9))
        model.level_forward = forward
        path = torch.tensor([[0, 1], [0, -1]])
        assert commit_draft(model, cache, draft.tree, path, [2, 1], [1, 0], drafter.ran)
        drafts.append((draft, [t.clone() for c in cache.layers.values() for t in vars(c).values()]))
    (one, one_state), (levels, levels_state) = drafts
    assert torch.equal(one.tree.tokens, levels.tree.tokens) and one.mode == levels.mode
    torch.testing.assert_close(one.q, levels.q, rtol=0, atol=1e-6)
    for a, b in zip(one_state, levels_state):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_k=40), dict(temperature=1.0, top_p=0.9)])
def test_a_sampled_draft_under_top_k_or_top_p_runs_level_by_level(sampling):
    """Top-k and top-p stay out of the one call (they would be constants of its compiled graph:
    a compile for every setting a request brings): such a draft runs level by level."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    model = stree.patch(make_hybrid((), seed=13))
    cache, _ = _prefilled(model, [[3, 9, 4], [7, 1, 2, 8, 5]])
    model.draft_levels = lambda *a, **k: pytest.fail("a filtered sampled draft ran in one call")
    draft = parse_drafter("caterpillar:2,2").draft(model, cache, torch.tensor([5, 6]), SamplingConfig(**sampling),
                                                   torch.Generator().manual_seed(1))
    assert draft.q is not None and torch.allclose(draft.q[:, :2].sum(-1), torch.ones(2, 2))


@pytest.mark.parametrize("spec", ["caterpillar:3,2,2", "chain:3"])
@pytest.mark.parametrize("leads", [[[11], [4]], [[11, 12, 2], []], [[], [8, 1]]], ids=["one-each", "ragged", "second"])
def test_a_lead_runs_in_the_roots_pass_as_token_by_token_decoding(spec, leads):
    """Tokens the draft is behind (``lead``) run in the roots' pass of a greedy one-call draft
    (rows with fewer are left-padded): the tree is the oracle's after prompt + lead, nothing is
    committed until the next commit, which commits lead and path together; a row whose path is
    empty commits neither."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    torch.manual_seed(5)
    model = stree.patch(make_hybrid((), seed=17))
    drafter = parse_drafter(spec)
    assert model.runs_lead and drafter.takes_lead(model, SamplingConfig())
    prompts = [[3, 9, 4], [7, 1, 2, 8, 5]]
    cache, oracles = _prefilled(model, prompts)
    before = [t.clone() for c in cache.layers.values() for t in vars(c).values()]
    draft = drafter.draft(model, cache, torch.tensor([5, 6]), SamplingConfig(), lead=lead_tensor(leads))
    assert cache.seqlens == [len(p) for p in prompts]
    assert all(torch.equal(a, t) for a, t in zip(before, [t for c in cache.layers.values() for t in vars(c).values()]))
    tree = draft.tree
    for r in range(2):
        after_lead = oracles[r].fork()
        if leads[r]:
            after_lead.feed(leads[r])
        logits = after_lead.node_logits(tree, row=r)
        for node in range(tree.num_nodes):
            children = tree.children(r, node)
            if drafter.ran(node) and children:
                top = logits[node].topk(len(children)).indices.tolist()
                assert [int(tree.tokens[r, c]) for c in children] == top, f"row {r} node {node}"
    path = [0]
    while tree.children(0, path[-1]) and drafter.ran(tree.children(0, path[-1])[0]):
        path.append(tree.children(0, path[-1])[0])
    assert commit_draft(model, cache, tree, torch.tensor([path, [-1] * len(path)]), [len(path), 0],
                        [path[-1], -1], drafter.ran)
    oracles[0].feed(leads[0] + [int(tree.tokens[0, j]) for j in path])
    for r in range(2):
        check_states(model, cache, oracles[r], row=r)


def test_a_lead_is_refused_where_attention_would_need_its_positions():
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    model = stree.patch(make_hybrid((1,), seed=13))
    drafter = parse_drafter("chain:3")
    assert not model.runs_lead and not drafter.takes_lead(model, SamplingConfig())
    cache = model.allocate_tree_cache(1, 64)
    model.prefill(torch.tensor([[3, 9, 4]]), cache)
    with pytest.raises(ValueError, match="without attention layers"):
        drafter.draft(model, cache, torch.tensor([5]), SamplingConfig(), lead=torch.tensor([[7]]))
    assert cache.seqlens == [3] and cache.pending is None


def test_a_sampled_draft_runs_its_lead_in_its_first_level():
    """A sampled static draft (drawn level by level) runs its lead in the roots' level: the
    distribution its root's children are drawn from is the oracle's after prompt + lead, and
    the commit commits lead and path; a lead anywhere but before the roots is refused."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    torch.manual_seed(6)
    model = stree.patch(make_hybrid((), seed=19))
    drafter, sampling = parse_drafter("caterpillar:2,2"), SamplingConfig(temperature=1.0)
    assert drafter.takes_lead(model, sampling)
    leads = [[11, 12], [4]]
    cache, oracles = _prefilled(model, [[3, 9, 4], [7, 1, 2, 8, 5]])
    draft = drafter.draft(model, cache, torch.tensor([5, 6]), sampling, torch.Generator().manual_seed(0),
                          lead=lead_tensor(leads))
    tree = draft.tree
    for r in range(2):
        after_lead = oracles[r].fork()
        after_lead.feed(leads[r])
        close(draft.q[r, 0], after_lead.node_logits(tree, row=r)[0].softmax(-1), f"row {r} root q")
    paths = [[0, tree.children(r, 0)[0]] for r in range(2)]
    assert commit_draft(model, cache, tree, torch.tensor(paths), [2, 2], [p[-1] for p in paths], drafter.ran)
    for r in range(2):
        oracles[r].feed(leads[r] + [int(tree.tokens[r, j]) for j in paths[r]])
        check_states(model, cache, oracles[r], row=r)
    with pytest.raises(ValueError, match="only before the roots"):
        model.level_forward(tree, cache, torch.tensor([[1], [1]]), lead=torch.tensor([[3], [3]]))
    with pytest.raises(ValueError, match="last columns"):
        drafter.draft(model, cache, torch.tensor([5, 6]), sampling, lead=torch.tensor([[3, -1], [-1, 4]]))
