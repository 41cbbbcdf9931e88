"""Verifier rules on hand-built trees: greedy longest match, refusals, validation, MSS edge cases,
the sampling transform against Hugging Face's warpers, and the registry."""
from __future__ import annotations

import pytest
import torch

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample, sample_from, target_probs
from stree.tree import TokenTree
from stree.verify import Verdict, default_verifier, get_verifier
from stree.verify.base import children_table

NEG = -1e4  # "impossible" logit that still has a finite softmax

# root (token 4) -> n1 (1), n2 (2), n3 (3); n1 -> n4 (0), n5 (2); n2 -> n6 (1); n5 -> n7 (3)
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 5]
TOKENS = [4, 1, 2, 3, 0, 2, 1, 3]
V = 5


def argmax_logits(argmaxes: list[list[int]]) -> torch.Tensor:
    """(b, n, V) logits whose argmax at row b, node i is argmaxes[b][i]."""
    b, n = len(argmaxes), len(argmaxes[0])
    logits = torch.randn(b, n, V, generator=torch.Generator().manual_seed(0))
    logits.scatter_(2, torch.tensor(argmaxes).unsqueeze(-1), 10.0)
    return logits


def hand_tree(b: int = 3) -> TokenTree:
    return TokenTree(torch.tensor(TOKENS).expand(b, -1), torch.tensor(PARENTS))


def greedy(draft, logits) -> Verdict:
    return get_verifier("greedy").verify(draft, logits, SamplingConfig())


# -------------------------------------------------------------------------------- greedy walk
def test_greedy_longest_match_rows_differ():
    logits = argmax_logits([
        [1, 2, 0, 0, 0, 3, 0, 0],   # 0 -1-> n1 -2-> n5 -3-> n7 (leaf): bonus 0
        [4, 0, 0, 0, 0, 0, 0, 0],   # root argmax 4 matches no child: correction 4
        [2, 0, 0, 0, 0, 0, 0, 0],   # 0 -2-> n2, argmax 0 but n2's only child has token 1
    ])
    v = greedy(Draft(hand_tree(), None, "deterministic"), logits)
    assert v.path.tolist() == [[0, 1, 5, 7], [0, -1, -1, -1], [0, 2, -1, -1]]
    assert v.num_accepted.tolist() == [3, 0, 1]
    assert v.next_token.tolist() == [0, 4, 0]
    for t in (v.path, v.num_accepted, v.next_token):
        assert t.dtype == torch.int64


def test_greedy_bonus_at_leaf_of_chain():
    tree = TokenTree.chain(torch.tensor([0, 3, 1, 2]))
    logits = argmax_logits([[3, 1, 2, 4]])
    v = greedy(Draft(tree, None, "chain"), logits)
    assert v.path.tolist() == [[0, 1, 2, 3]] and v.num_accepted.tolist() == [3]
    assert v.next_token.tolist() == [4]   # bonus: the target's argmax after the whole chain


def test_greedy_duplicate_siblings_take_first_in_draft_order():
    tree = TokenTree(torch.tensor([0, 2, 2]), torch.tensor([-1, 0, 0]))
    v = greedy(Draft(tree, None, "iid"), argmax_logits([[2, 1, 3]]))
    assert v.path.tolist() == [[0, 1]] and v.next_token.tolist() == [1]


def _walk_greedy(tokens, parents, argmax):
    """Plain-Python oracle: from the root, take the first child (index order) whose token is the
    argmax after the current node; returns (path, next token)."""
    node, path = 0, [0]
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        hit = next((i for i in kids if tokens[i] == argmax[node]), None)
        if hit is None:
            return path, argmax[node]
        node = hit
        path.append(node)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_matches_a_sequential_walk_on_random_trees(seed):
    """Random per-row trees over a 3-token vocabulary (many duplicate siblings, deep matches)."""
    g = torch.Generator().manual_seed(seed)
    b, n, v = 3, 12, 3
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                for i in range(1, n)]) for _ in range(b)])
    tokens = torch.randint(0, v, (b, n), generator=g)
    logits = torch.randn(b, n, v, generator=g)
    verdict = greedy(Draft(TokenTree(tokens, parents), None, "iid"), logits)
    for r in range(b):
        path, nxt = _walk_greedy(tokens[r].tolist(), parents[r].tolist(), logits[r].argmax(-1).tolist())
        got = [i for i in verdict.path[r].tolist() if i >= 0]
        assert got == path and verdict.next_token[r].item() == nxt
        assert verdict.num_accepted[r].item() == len(path) - 1


def test_root_only_tree_emits_one_token():
    tree = TokenTree(torch.tensor([[7], [1]]), torch.tensor([-1]))
    logits = argmax_logits([[3], [2]])
    q = torch.full((2, 1, V), 1.0 / V)
    for name, mode in [("greedy", "deterministic"), ("naive", "deterministic"),
                       ("mss", "iid"), ("sps", "chain")]:
        s = SamplingConfig() if name == "greedy" else SamplingConfig(1.0)
        v = get_verifier(name).verify(Draft(tree, q, mode), logits, s, generator=torch.Generator())
        assert v.path.tolist() == [[0], [0]] and v.num_accepted.tolist() == [0, 0]
    assert greedy(Draft(tree, None, "chain"), logits).next_token.tolist() == [3, 2]


def test_children_table_matches_tree_children():
    parents = torch.tensor([PARENTS, [-1, 0, 1, 0, 3, 3, 3, 1]])
    tree = TokenTree(torch.zeros(2, 8, dtype=torch.long), parents)
    table = children_table(tree.parents)
    for b in range(2):
        for i in range(8):
            assert [c for c in table[b, i].tolist() if c >= 0] == tree.children(b, i)


# --------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("name,mode,temp", [
    ("greedy", "deterministic", 0.0), ("naive", "deterministic", 1.0), ("mss", "iid", 0.9),
    ("mss", "without_replacement", 1.3), ("naive", "iid", 0.0), ("mss", "deterministic", 0.0)])
def test_verdict_is_a_valid_root_path(name, mode, temp):
    g = torch.Generator().manual_seed(1)
    b = 64
    tree = TokenTree(torch.randint(0, V, (b, 8), generator=g), torch.tensor(PARENTS))
    logits = torch.randn(b, 8, V, generator=g) * 2
    q = torch.softmax(torch.randn(b, 8, V, generator=g), -1)
    v = get_verifier(name).verify(Draft(tree, q, mode), logits, SamplingConfig(temp), generator=g)
    assert v.path.shape == (b, tree.max_depth + 1) and v.path.dtype == torch.int64
    assert v.num_accepted.shape == v.next_token.shape == (b,)
    assert (v.path[:, 0] == 0).all() and ((v.next_token >= 0) & (v.next_token < V)).all()
    for row, k in zip(v.path.tolist(), v.num_accepted.tolist()):
        assert all(x >= 0 for x in row[: k + 1]) and all(x == -1 for x in row[k + 1:])
        assert all(PARENTS[row[j]] == row[j - 1] for j in range(1, k + 1))


@pytest.mark.parametrize("name,mode", [("naive", "iid"), ("mss", "iid"),
                                       ("mss", "without_replacement"), ("sps", "chain")])
def test_same_seed_same_verdict(name, mode):
    tree = hand_tree(16) if name != "sps" else TokenTree.chain(torch.tensor([[0, 1, 2, 3]] * 16))
    n = tree.num_nodes
    logits = torch.randn(16, n, V, generator=torch.Generator().manual_seed(2))
    q = torch.softmax(torch.randn(16, n, V, generator=torch.Generator().manual_seed(3)), -1)
    verifier, s = get_verifier(name), SamplingConfig(1.0)
    a, b = (verifier.verify(Draft(tree, q, mode), logits, s,
                            generator=torch.Generator().manual_seed(9)) for _ in range(2))
    assert torch.equal(a.path, b.path) and torch.equal(a.next_token, b.next_token)


# ---------------------------------------------------------------------------- MSS edge cases
def _one_node(p_logits, q, child_tokens, mode, b=400):
    """Root with the given children (leaves); returns the verdict for b identical rows."""
    n = 1 + len(child_tokens)
    tokens = torch.tensor([0, *child_tokens]).expand(b, -1)
    tree = TokenTree(tokens, torch.tensor([-1] + [0] * (n - 1)))
    logits = torch.zeros(b, n, len(p_logits))
    logits[:, 0] = torch.tensor(p_logits)
    qq = torch.full((b, n, len(q)), 1.0 / len(q))
    qq[:, 0] = torch.tensor(q)
    return get_verifier("mss").verify(Draft(tree, qq, mode), logits, SamplingConfig(1.0),
                                      generator=torch.Generator().manual_seed(0))


def test_mss_child_with_zero_draft_prob_is_rejected():
    # p = (.5, .5, 0, 0); the child token 0 has q = 0: it cannot have been drawn, so reject it.
    v = _one_node([0.0, 0.0, NEG, NEG], [0.0, 0.0, 1.0, 0.0], [0], "iid")
    assert (v.num_accepted == 0).all()
    assert set(v.next_token.tolist()) == {0, 1}      # a sample of the residual (= p here)


def test_mss_empty_residual_keeps_target():
    # p == q: rejecting the q = 0 child leaves (p - q)+ = 0; R must stay p (not NaN / zero), so the
    # next child (token 0, R/q = 1) is accepted with probability 1.
    p = [0.0, 0.0, NEG, NEG]
    v = _one_node(p, [0.5, 0.5, 0.0, 0.0], [2, 0], "iid")
    assert (v.path[:, 1] == 2).all()
    v = _one_node(p, [0.5, 0.5, 0.0, 0.0], [2, 3], "without_replacement")
    assert (v.num_accepted == 0).all() and set(v.next_token.tolist()) == {0, 1}


@pytest.mark.parametrize("seed", range(3))
def test_mss_without_replacement_exhaustive_children_always_accept(seed):
    # All V tokens drafted: the target's sample is always among them, and the without-replacement
    # rule accepts one (after rejections R lives on the undrawn tokens, the last one has R = q = 1).
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(V, generator=g).tolist()
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1).tolist()
    order = torch.randperm(V, generator=g).tolist()
    v = _one_node(p_logits, q, order, "without_replacement")
    assert (v.num_accepted == 1).all()


def test_mss_accepts_with_prob_min_one_ratio():
    # One child x with p(x) = .2, q(x) = .8: accepted w.p. .25 (binomial, 8 sd band).
    p = torch.tensor([0.2, 0.3, 0.5, 0.0, 0.0]).clamp_min(1e-30).log().tolist()
    b = 20_000
    v = _one_node(p, [0.8, 0.1, 0.1, 0.0, 0.0], [0], "iid", b=b)
    rate = v.num_accepted.float().mean().item()
    assert abs(rate - 0.25) < 8 * (0.25 * 0.75 / b) ** 0.5


# -------------------------------------------------------------------------------- refusals
def test_check_refuses_non_lossless_pairs():
    hot = SamplingConfig(0.8)
    with pytest.raises(ValueError, match="deterministic"):
        get_verifier("mss").check("deterministic", hot)
    get_verifier("mss").check("deterministic", SamplingConfig(0.0))  # greedy targets: fine
    get_verifier("mss").check("deterministic", SamplingConfig(0.8, top_k=1))
    with pytest.raises(ValueError, match="chain"):
        get_verifier("sps").check("iid", hot)
    with pytest.raises(ValueError, match="greedy"):
        get_verifier("greedy").check("iid", hot)
    for mode in ("deterministic", "iid", "without_replacement", "chain"):
        get_verifier("naive").check(mode, hot)
        get_verifier("greedy").check(mode, SamplingConfig())


def test_verify_refuses_deterministic_mss_and_non_chain_sps():
    tree = hand_tree(1)
    logits = torch.randn(1, 8, V)
    q = torch.full((1, 8, V), 1.0 / V)
    with pytest.raises(ValueError, match="naive"):
        get_verifier("mss").verify(Draft(tree, q, "deterministic"), logits, SamplingConfig(1.0))
    with pytest.raises(ValueError, match="chain"):
        get_verifier("sps").verify(Draft(tree, q, "chain"), logits, SamplingConfig(1.0))
    with pytest.raises(ValueError, match="chain"):   # structure is checked at greedy too
        get_verifier("sps").verify(Draft(tree, q, "chain"), logits, SamplingConfig(0.0))


def test_registry():
    with pytest.raises(ValueError, match="unknown verifier"):
        get_verifier("beam")
    with pytest.raises(TypeError):
        get_verifier(3)
    v = get_verifier("naive")
    assert get_verifier(v) is v
    assert {get_verifier(n).name for n in ("greedy", "mss", "naive", "sps")} == {
        "greedy", "mss", "naive", "sps"}
    with pytest.raises(ValueError, match="draft mode"):
        Draft(hand_tree(1), None, "beam")


@pytest.mark.parametrize("mode,temp,expected", [
    ("deterministic", 0.0, "greedy"), ("iid", 0.0, "greedy"), ("deterministic", 0.7, "naive"),
    ("iid", 0.7, "mss"), ("without_replacement", 0.7, "mss"), ("chain", 0.7, "sps")])
def test_default_verifier(mode, temp, expected):
    s = SamplingConfig(temp)
    v = default_verifier(s, mode)
    assert v.name == expected
    v.check(mode, s)   # the default is always an accepted pair


# ------------------------------------------------------------------------------- validation
def test_shapes_and_vocab_validated():
    tree = hand_tree(2)
    q = torch.full((2, 8, V), 1.0 / V)
    mss, hot = get_verifier("mss"), SamplingConfig(1.0)
    with pytest.raises(ValueError, match=r"\(b, n, v\)"):
        mss.verify(Draft(tree, q, "iid"), torch.randn(2, 8), hot)
    with pytest.raises(ValueError, match="does not match"):
        mss.verify(Draft(tree, q, "iid"), torch.randn(2, 9, V), hot)
    with pytest.raises(ValueError, match="does not match"):
        mss.verify(Draft(tree, q, "iid"), torch.randn(3, 8, V), hot)
    with pytest.raises(ValueError, match="same vocab"):
        mss.verify(Draft(tree, torch.full((2, 8, V + 1), 0.1), "iid"), torch.randn(2, 8, V), hot)
    with pytest.raises(ValueError, match="q is required"):
        mss.verify(Draft(tree, None, "iid"), torch.randn(2, 8, V), hot)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):   # drafted token 4 >= vocab 3
        get_verifier("naive").verify(Draft(tree, None, "iid"), torch.randn(2, 8, 3), hot)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")),
                                    dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_sampling_config_validated(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


# --------------------------------------------------------------------------------- sampling
def _hf_probs(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1.0:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.9), (0.6, 7, 0.75), (2.0, 40, 0.3)])
def test_target_probs_match_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(4)) * 3
    ours = target_probs(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(ours, _hf_probs(logits, temperature, top_k, top_p))
    if top_k:
        assert ((ours > 0).sum(-1) <= top_k).all()


def test_target_probs_greedy_and_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert target_probs(logits, SamplingConfig(0.0)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert target_probs(logits, SamplingConfig(1.0, top_k=1)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    p = target_probs(logits, SamplingConfig(1.0, top_k=2))
    assert p[0, 0] == 0 and p[0, 2] == 0 and torch.isclose(p[0, 1], p[0, 3])
    p = target_probs(logits.half(), SamplingConfig(1.0))
    assert p.dtype == torch.float32 and torch.isclose(p.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 5e-324])
def test_target_probs_at_a_tiny_temperature_tend_to_greedy(temperature):
    """As T -> 0 the distribution tends to the argmax (uniform over tied maxima). Dividing raw
    logits by a T this small overflowed to inf (inf - inf = NaN in softmax), and sampling the NaN
    row always drew token 0."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [1.0, 4.0, 4.0, -2.0]])
    p = target_probs(logits, SamplingConfig(temperature))
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]]
    assert sample(logits[:1], SamplingConfig(temperature)).tolist() == [1]


def test_sample_from_unnormalised_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.tensor([[0.0, 3.0, 1.0, 0.0]]).expand(40_000, -1)
    freq = torch.bincount(sample_from(w, g), minlength=4).float() / w.shape[0]
    assert freq[0] == 0 and freq[3] == 0 and abs(freq[1] - 0.75) < 0.02
    assert sample_from(torch.zeros(3, 4), g).tolist() == [0, 0, 0]  # masked rows must not raise
    # any leading shape (drafters draw (b, w, count) children at once); the last token can win
    w = torch.tensor([1.0, 0.0, 1.0]).expand(2, 3, 4000, 3)
    draws = sample_from(w, g)
    assert draws.shape == (2, 3, 4000) and set(draws.unique().tolist()) == {0, 2}


def test_walk_runs_the_rule_once_over_every_node_or_once_per_depth(monkeypatch):
    from stree.verify import base

    tree = TokenTree(torch.tensor([TOKENS]), PARENTS)  # depth 4: five rounds per-depth
    logits = torch.randn(1, len(PARENTS), V)
    calls = []

    def rule(step):
        calls.append(step.logits.shape[0])
        return torch.full((step.logits.shape[0],), -1), step.logits.argmax(-1)

    verdict = base.walk(Draft(tree, None, "deterministic"), logits, rule)
    assert calls == [len(PARENTS)]  # small: one batched call over every node
    assert verdict.next_token.tolist() == [int(logits[0, 0].argmax())]
    monkeypatch.setattr(base, "BATCHED_MAX_ELEMENTS", {"cpu": 0, "cuda": 0})
    calls.clear()
    base.walk(Draft(tree, None, "deterministic"), logits, rule)
    assert calls == [1] * (int(tree.max_depth) + 1)  # large: the reached node, per depth
