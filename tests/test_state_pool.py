"""The row-indexed state pool (``model.allocate_state_pool`` / ``StatePool.cache(slots)``): batch
rows mapped to arbitrary pool slots give the logits and committed states of an ordinary cache
(itself checked against each model's own step decoding elsewhere) through prefill, tree_forward,
commit and level-by-level drafting, bit for bit, and every other slot of the pool (filled with
random sentinels) stays bit-identical. Models: the stree hybrid, mamba_ssm Mamba2 + MHA, and
transformers' Zamba2 (shared attention blocks keyed as second mixers)."""
import pytest
import torch

import stree
from stree.draft.base import commit_draft, forward_level
from stree.tree import TokenTree
from tests import hf_models
from tests.test_model_hybrid import VOCAB, make_hybrid
from tests.test_model_mamba2 import make_model

PARENTS = torch.tensor([[-1, 0, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 3, 3]])
LEVELS = [(0, 1), (1, 3), (3, 5)]  # nodes 5, 6 (depth 3) are never forwarded
MAX_SEQLEN = 48


def _hybrid(tmp_path=None):
    return stree.patch(make_hybrid((1, 3), seed=7))  # Mamba2, attention, Mamba2, attention


def _mamba_ssm(tmp_path=None):
    return stree.patch(make_model(seed=2, n_layer=3, attn_layer_idx=(1,)))  # Mamba2, MHA, Mamba2


def _zamba2(tmp_path):
    # transformers' Zamba2: Mamba2 backbone + shared attention blocks (second mixers of a layer)
    return stree.patch(hf_models.build("zamba2", tmp_path)[0])


def _kimi_linear(tmp_path):
    # transformers' Kimi Linear: gated delta rule layers (a decay per key channel) and MLA's latent cache
    return stree.patch(hf_models.build("kimi_linear", tmp_path)[0])


def _vocab(model):
    return model.lm_head.weight.shape[0]


def _tensors(layers):
    return {(i, name): t for i, c in layers.items() for name, t in vars(c).items()}


def _sentinel_pool(model, num_slots):
    pool = model.allocate_state_pool(num_slots, MAX_SEQLEN)
    for t in _tensors(pool.layers).values():
        t.copy_(torch.randn_like(t) * 7 + 3)  # nothing a real state would hold
    return pool


def _check_others_untouched(pool, before, slots, when):
    others = [s for s in range(pool.num_slots) if s not in slots]
    for key, t in _tensors(pool.layers).items():
        assert torch.equal(t[others], before[key][others]), f"{when}: {key} changed outside {slots}"


def _check_rows_equal(cache, pool, slots, ref, when):
    """Row r of the pooled cache (pool slot ``slots[r]``) holds the reference cache's row r."""
    assert cache.seqlens == ref.seqlens and torch.equal(cache.lengths, ref.lengths), when
    got, want = _tensors(pool.layers), _tensors(ref.layers)
    for key, t in want.items():
        for r, s in enumerate(slots):
            n = ref.seqlens[r]  # K/V (kv: ..., position, head_dim): the committed positions only
            a, b = got[key][s], t[r]
            if not key[1].endswith("state"):
                a, b = a[..., :n, :], b[..., :n, :]
            assert torch.equal(a, b), f"{when}: {key} row {r} (slot {s})"


def _same(a, b, when):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=when)


def _draft_levels(model, cache, ref, after=lambda when: None) -> TokenTree:
    """A random 2-row tree forwarded level by level (``LEVELS``) through ``cache`` and ``ref``,
    equal logits at every level (``after(level)`` checks more after each); returns the tree."""
    tree = TokenTree(torch.randint(0, _vocab(model), (2, 7)), PARENTS)
    for s, e in LEVELS:
        prefix = TokenTree(tree.tokens[:, :e], PARENTS[:, :e])
        _same(forward_level(model, cache, prefix, s, e, capacity=7),
              forward_level(model, ref, prefix, s, e, capacity=7), f"level {s}:{e} logits")
        after(f"level {s}:{e}")
    return tree


@pytest.mark.parametrize("make", [_hybrid, _mamba_ssm, _zamba2, _kimi_linear],
                         ids=["hybrid", "mamba_ssm", "zamba2", "kimi_linear"])
@pytest.mark.parametrize("slots", [[5, 2], [3, 4]], ids=["scattered", "contiguous"])
def test_rows_in_arbitrary_slots_match_an_ordinary_cache_and_touch_nothing_else(make, slots, tmp_path):
    model = make(tmp_path)
    torch.manual_seed(0)
    vocab = _vocab(model)
    pool = _sentinel_pool(model, 7)
    before = {k: t.clone() for k, t in _tensors(pool.layers).items()}
    cache, ref = pool.cache(torch.tensor(slots)), model.allocate_tree_cache(2, MAX_SEQLEN)
    _check_others_untouched(pool, before, slots, "pool.cache")

    ids = torch.randint(0, vocab, (2, 3))  # both rows at once, then row by row (ragged)
    _same(model.prefill(ids, cache), model.prefill(ids, ref), "prefill logits")
    _check_others_untouched(pool, before, slots, "prefill")
    _check_rows_equal(cache, pool, slots, ref, "prefill")
    more = [torch.tensor([3, 9]), torch.tensor([7, 1, 2, 8, 5])]
    _same(model.prefill(more, cache), model.prefill(more, ref), "ragged prefill logits")
    _check_others_untouched(pool, before, slots, "ragged prefill")
    _check_rows_equal(cache, pool, slots, ref, "ragged prefill")

    # verify: one tree forward, then commit paths of different lengths
    tree = TokenTree(torch.randint(0, vocab, (2, 7)), PARENTS)
    _same(model.tree_forward(tree, cache), model.tree_forward(tree, ref), "tree_forward logits")
    _check_others_untouched(pool, before, slots, "tree_forward")
    path, counts = torch.tensor([[0, 2, 4, 6], [0, 1, -1, -1]]), [4, 2]
    cache.commit(path, counts)
    ref.commit(path, counts)
    _check_others_untouched(pool, before, slots, "commit")
    _check_rows_equal(cache, pool, slots, ref, "commit")

    # draft: level by level, then a commit whose path ends in the never-forwarded level
    tree = _draft_levels(model, cache, ref, lambda when: _check_others_untouched(pool, before, slots, when))
    path, counts = torch.tensor([[0, 1, 3, -1], [0, 1, 3, 5]]), [3, 4]
    assert commit_draft(model, cache, tree, path, counts, [3, 5], lambda node: node < 5)
    assert commit_draft(model, ref, tree, path, counts, [3, 5], lambda node: node < 5)
    _check_others_untouched(pool, before, slots, "level commit")
    _check_rows_equal(cache, pool, slots, ref, "level commit")

    cache.reset()  # empties its own slots only
    _check_others_untouched(pool, before, slots, "reset")
    assert cache.seqlens == [0, 0]


def test_two_caches_over_one_pool_advance_independently():
    """Two requests of an engine: caches over disjoint slots of one pool, their steps
    interleaved (one's tree pending while the other commits), each equal to its own cache."""
    torch.manual_seed(1)
    model = _hybrid()
    pool = _sentinel_pool(model, 5)
    before = {k: t.clone() for k, t in _tensors(pool.layers).items()}
    a, b = pool.cache([4, 0]), pool.cache(torch.tensor([2], dtype=torch.int32))
    ref_a, ref_b = model.allocate_tree_cache(2, MAX_SEQLEN), model.allocate_tree_cache(1, MAX_SEQLEN)
    pairs = [(a, ref_a, [4, 0]), (b, ref_b, [2])]
    for cache, ref, _ in pairs:
        ids = torch.randint(0, VOCAB, (cache.batch_size, 4 + cache.batch_size))
        _same(model.prefill(ids, cache), model.prefill(ids, ref), "prefill logits")
    for step in range(2):
        trees = [TokenTree(torch.randint(0, VOCAB, (c.batch_size, 7)), PARENTS[:c.batch_size])
                 for c, _, _ in pairs]
        for (cache, ref, _), tree in zip(pairs, trees):
            _same(model.tree_forward(tree, cache), model.tree_forward(tree, ref), f"step {step} logits")
        paths = [torch.tensor([[0, 2, 4], [0, 1, 3]]), torch.tensor([[0, 1, -1]])]
        for (cache, ref, slots), path in reversed(list(zip(pairs, paths))):
            counts = (path >= 0).sum(1).tolist()
            cache.commit(path, counts)
            ref.commit(path, counts)
    for cache, ref, slots in pairs:
        _check_rows_equal(cache, pool, slots, ref, "after two steps")
    _check_others_untouched(pool, before, [4, 0, 2], "both caches")


def test_rows_resume_at_their_lengths_in_a_new_grouping():
    """An engine regroups its sequences from step to step: two one-row caches prefill different
    lengths into their slots, then one cache over both slots resumes them at their lengths
    (``seqlens``: nothing zeroed), drafts level by level and commits, and runs a tree: all equal
    to an ordinary cache that held both rows throughout; every other slot untouched."""
    torch.manual_seed(3)
    model = _hybrid()
    pool = _sentinel_pool(model, 6)
    before = {k: t.clone() for k, t in _tensors(pool.layers).items()}
    slots, prompts = [4, 1], [torch.randint(0, VOCAB, (5,)), torch.randint(0, VOCAB, (9,))]
    for slot, prompt in zip(slots, prompts):
        model.prefill(prompt[None], pool.cache([slot]))
    ref = model.allocate_tree_cache(2, MAX_SEQLEN)
    model.prefill(prompts, ref)
    cache = pool.cache(slots, seqlens=[5, 9])
    _check_rows_equal(cache, pool, slots, ref, "resumed")
    tree = _draft_levels(model, cache, ref)
    path, counts = torch.tensor([[0, 2, 4, 6], [0, -1, -1, -1]]), [4, 1]
    for c in (cache, ref):
        assert commit_draft(model, c, tree, path, counts, [6, 0], lambda node: node < 5)
    _check_rows_equal(cache, pool, slots, ref, "level commit")
    tree = TokenTree(torch.randint(0, VOCAB, (2, 7)), PARENTS)
    _same(model.tree_forward(tree, cache), model.tree_forward(tree, ref), "tree_forward logits")
    _check_others_untouched(pool, before, slots, "resumed rows")


@pytest.mark.parametrize("seqlens, match", [([3], "one length in"), ([-1, 0], r"\[0, 48\]"),
                                            ([MAX_SEQLEN + 1, 0], r"got \[49, 0\]")])
def test_bad_seqlens_are_refused_and_lose_nothing(seqlens, match):
    model = _hybrid()
    pool = _sentinel_pool(model, 4)
    before = {k: t.clone() for k, t in _tensors(pool.layers).items()}
    with pytest.raises(ValueError, match=match):
        pool.cache([1, 2], seqlens=seqlens)
    _check_others_untouched(pool, before, [], "refused seqlens")


@pytest.mark.parametrize("slots, match", [
    ([0, 7], r"slots \[7\] out of range for a pool of 7 slots"),
    (torch.tensor([-1, 2]), r"slots \[-1\] out of range"),
    ([3, 1, 3], "slots must be distinct"),
    (torch.tensor([1.0, 2.0]), "slots must be an integer tensor, got dtype torch.float32"),
    (torch.tensor([True, False]), "slots must be an integer tensor"),
    (torch.tensor([[1, 2]]), r"slots must be 1-D .* got shape \(1, 2\)"),
    ([1, 2.0], "slots must be a 1-D sequence of ints"),
    (3, "slots must be a 1-D sequence of ints, got int"),
    ([], "at least one pool slot"),
])
def test_bad_slots_are_refused_and_lose_nothing(slots, match):
    model = _hybrid()
    pool = _sentinel_pool(model, 7)
    before = {k: t.clone() for k, t in _tensors(pool.layers).items()}
    with pytest.raises(ValueError, match=match):
        pool.cache(slots)
    _check_others_untouched(pool, before, [], "refused slots")


def test_attention_flat_index_reaches_row_head_position():
    """K/V writes and commit moves go through one flat index into ``kv``: entry (r, i, 0, h) of
    ``flat_index`` is ``k[slot of row r, h, pos[r, i]]`` (the row itself unpooled), entry
    (r, i, 1, h) the same position of ``v``."""
    from stree.cache import AttentionLayerCache

    cache = AttentionLayerCache.zeros(5, 3, 16, 4, dtype=torch.float32, device="cpu")
    cache.kv.copy_(torch.arange(cache.kv.numel(), dtype=torch.float32).view(cache.kv.shape))
    pos = torch.tensor([[2, 3, 7], [0, 9, 15]])
    for view, slots in ((cache.rows(1, 3), torch.tensor([1, 2])),
                        (cache.gather(torch.tensor([4, 0])), torch.tensor([4, 0]))):
        index = view.flat_index(torch.arange(2)[:, None], pos)
        assert index.shape == (2, 3, 2, 3)
        for j, t in enumerate((cache.k, cache.v)):
            got = view.kv.reshape(-1, 4)[index[:, :, j]]  # (row, node, head, d)
            want = t[slots[:, None, None], torch.arange(3), pos[:, :, None]]
            assert torch.equal(got, want)
