"""stree.PrefixCache on hand-built state pools (no model runs): a snapshot holds exactly a row's
committed state, whatever tensors its layer caches hold (Mamba2's conv + SSM states, a Gated
DeltaNet-shaped ``(b, heads, dk, dv)`` SSM state in a MambaLayerCache, another layer kind with
three tensors) and attention K/V up to the prefix length, restored bit for bit into any pool slot
with every other slot untouched; the radix tree's lookups (longest prefix within a limit, inside
an edge, on a branch), K/V shared by nested snapshots, the memory bound with least-recently-used
eviction, counters, and a cache bound to one model per role."""
from dataclasses import dataclass

import pytest
import torch

from stree.cache import AttentionLayerCache, MambaLayerCache, StatePool, grown_capacity
from stree.prefix_cache import PrefixCache

MAX_SEQLEN = 64
SLOTS = 5


@dataclass
class ThreeTensorCache:
    """Another fixed-size layer kind: the cache snapshots whatever tensors a layer holds."""
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor

    def grow(self, capacity):
        pass

    def rows(self, start, stop):
        return ThreeTensorCache(self.a[start:stop], self.b[start:stop], self.c[start:stop])

    def reset(self, slots=None):
        for t in (self.a, self.b, self.c):
            t.index_fill_(0, slots, 0) if slots is not None else t.zero_()


def make_pool(seed=0, heads=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cap = grown_capacity(1, MAX_SEQLEN)
    conv = torch.randn(SLOTS, 5, 4, generator=g).transpose(1, 2).contiguous().transpose(1, 2)
    layers = {
        0: MambaLayerCache(torch.randn(SLOTS, 6, 4, generator=g, dtype=dtype),
                           torch.randn(SLOTS, heads, 4, 8, generator=g, dtype=dtype)),      # Mamba2
        1: AttentionLayerCache(torch.randn(SLOTS, 2, 2, cap, 8, generator=g, dtype=dtype)),
        2: MambaLayerCache(conv.to(dtype), torch.randn(SLOTS, 2, 8, 6, generator=g, dtype=dtype)),  # GDN: (b, heads, dk, dv)
        3: ThreeTensorCache(*(torch.randn(SLOTS, *s, generator=g, dtype=dtype) for s in ((3,), (2, 2), (4, 1, 2)))),
        4: AttentionLayerCache(torch.randn(SLOTS, 2, 1, cap, 4, generator=g, dtype=dtype)),
    }
    return StatePool(layers, MAX_SEQLEN, cap)


def tensors(pool):
    return {(i, name): t for i, c in pool.layers.items() for name, t in vars(c).items() if torch.is_tensor(t)}


def fill(pool, slot, seed):
    """Give ``slot`` a distinct state (as if it had committed some tokens)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors(pool).values():
        t[slot] = torch.randn(t[slot].shape, generator=g).to(t.dtype)


def committed(pool, slot, n):
    """What a snapshot of ``n`` tokens at ``slot`` must hold: fixed states whole, K/V to ``n``."""
    return {k: (t[slot, :, :, :n] if isinstance(pool.layers[k[0]], AttentionLayerCache) else t[slot]).clone()
            for k, t in tensors(pool).items()}


def check_restored(pool, slot, want, n, what):
    for k, t in tensors(pool).items():
        got = t[slot, :, :, :n] if isinstance(pool.layers[k[0]], AttentionLayerCache) else t[slot]
        assert torch.equal(got, want[k]), f"{what}: {k} differs"


def held_bytes(pc):
    """Every tensor the trie holds, counted independently of the cache's own accounting."""
    total, stack = 0, [pc.root]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        total += sum(t.numel() * t.element_size() for segs in n.kv.values() for t in segs.values())
        total += sum(s.nbytes for s in n.states.values())
    return total


def seq(first, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [first] + torch.randint(0, 1000, (n - 1,), generator=g).tolist()


def sizes(pool, n):
    fixed = sum(t[0].numel() * t.element_size() for (i, _), t in tensors(pool).items()
                if not isinstance(pool.layers[i], AttentionLayerCache))
    per_token = sum(c.kv[0, :, :, 0].numel() * c.kv.element_size() for c in pool.layers.values()
                    if isinstance(c, AttentionLayerCache))
    return fixed + per_token * n, fixed, per_token


MODEL = torch.nn.Linear(1, 1)


def test_restore_writes_exactly_the_snapshot_into_any_slot_and_nothing_else():
    pool = make_pool()
    pc = PrefixCache(min_tokens=1)
    toks = seq(7, 40)
    fill(pool, 2, seed=5)
    src = pool.cache([2], seqlens=[20])
    want = committed(pool, 2, 20)
    assert pc.insert(MODEL, src, 0, toks)  # keyed by the 20 committed tokens
    fill(pool, 2, seed=6)  # the snapshot is a copy: later changes of the slot do not reach it
    for slots, row in (([0], 0), ([4, 1], 1), ([3], 0)):
        before = {k: t.clone() for k, t in tensors(pool).items()}
        dst = pool.cache(slots, seqlens=[3] * len(slots))
        assert pc.restore(MODEL, dst, row, toks + [1, 2, 3]) == 20
        slot = slots[row]
        check_restored(pool, slot, want, 20, f"slot {slot}")
        assert dst.seqlens[row] == 20 and int(dst.lengths[row]) == 20
        for k, t in tensors(pool).items():
            others = [s for s in range(SLOTS) if s != slot]
            assert torch.equal(t[others], before[k][others]), f"{k} changed outside slot {slot}"
            if isinstance(pool.layers[k[0]], AttentionLayerCache):  # K/V past the prefix: untouched
                assert torch.equal(t[slot, :, :, 20:], before[k][slot, :, :, 20:])
    assert pc.nbytes == held_bytes(pc) == sizes(pool, 20)[0]


def test_nested_and_branching_snapshots_share_their_prefix_kv():
    pool = make_pool()
    pc = PrefixCache(min_tokens=1)
    toks = seq(7, 40)
    other = toks[:25] + seq(9, 15, seed=3)  # branches off after 25 tokens, inside the 20..30 edge
    wants = {}
    for slot, (tokens, n) in enumerate(((toks, 30), (toks, 20), (other, 35))):
        fill(pool, slot, seed=10 + slot)
        wants[tokens is other, n] = committed(pool, slot, n)
        # each slot's K/V of the shared positions are the first's (they are one prefix's K/V)
        assert pc.insert(MODEL, pool.cache([slot], seqlens=[n]), 0, tokens)
    _, fixed, per_token = sizes(pool, 0)
    assert pc.nbytes == held_bytes(pc) == 3 * fixed + 30 * per_token + 10 * per_token
    assert pc.snapshots() == [20, 30, 35]
    # the K/V a restore writes come from the first snapshot that held those positions
    for (branch, n), want in wants.items():
        dst = pool.cache([4])
        tokens = other if branch else toks
        assert pc.restore(MODEL, dst, 0, tokens, limit=n) == n
        for k, t in tensors(pool).items():
            if isinstance(pool.layers[k[0]], AttentionLayerCache):
                shared = min(n, 25 if branch else 30)
                ref = wants[False, 30][k][:, :, :shared]
                assert torch.equal(t[4, :, :, :shared], ref), f"{k}: shared K/V"
                assert torch.equal(t[4, :, :, shared:n], want[k][:, :, shared:n]), f"{k}: own K/V"
            else:
                assert torch.equal(t[4], want[k]), f"{k}: state"


def test_lookup_is_the_longest_snapshot_within_the_limit():
    pool = make_pool()
    pc = PrefixCache(min_tokens=1)
    toks = seq(7, 40)
    for n in (20, 30):
        pc.insert(MODEL, pool.cache([0], seqlens=[n]), 0, toks)
    assert pc.lookup(toks) == 30
    assert pc.lookup(toks, limit=29) == 20
    assert pc.lookup(toks, limit=30) == 30
    assert pc.lookup(toks[:27]) == 20                       # ends inside an edge: the shorter one
    assert pc.lookup(toks[:25] + [toks[25] + 1] * 10) == 20  # leaves the path inside the edge
    assert pc.lookup(toks[:19]) == 0 and pc.lookup([8] + toks[1:]) == 0
    assert pc.lookup(toks, role="draft") == 0
    assert pc.common_prefix(toks[:25] + [toks[25] + 1]) == 25 and pc.common_prefix(toks) == 30
    assert pc.stats.hits == pc.stats.misses == 0  # lookups count nothing


def test_the_memory_bound_evicts_the_least_recently_used():
    pool = make_pool()
    one = sizes(pool, 20)[0]
    pc = PrefixCache(max_bytes=2 * one + one // 2, min_tokens=1)
    a, b, c = seq(1, 30, seed=1), seq(2, 30, seed=2), seq(3, 30, seed=3)
    wants = {}
    for slot, tokens in enumerate((a, b)):
        fill(pool, slot, seed=slot)
        wants[slot] = committed(pool, slot, 20)
        pc.insert(MODEL, pool.cache([slot], seqlens=[20]), 0, tokens)
    assert pc.restore(MODEL, pool.cache([4]), 0, a) == 20  # a is now the most recent
    fill(pool, 2, seed=2)
    wants[2] = committed(pool, 2, 20)
    assert pc.insert(MODEL, pool.cache([2], seqlens=[20]), 0, c)
    assert pc.stats.evicted == 1 and len(pc) == 2
    assert pc.lookup(b) == 0 and pc.lookup(a) == pc.lookup(c) == 20
    assert pc.nbytes == held_bytes(pc) == 2 * one <= pc.max_bytes
    for slot, tokens in ((0, a), (2, c)):
        assert pc.restore(MODEL, pool.cache([4]), 0, tokens) == 20
        check_restored(pool, 4, wants[slot], 20, f"snapshot of slot {slot}")
    # b's branch is gone from the trie (no node is kept for nothing)
    assert b[0] not in pc.root.children


def test_evicting_a_shorter_snapshot_keeps_the_kv_a_longer_one_needs():
    pool = make_pool()
    toks = seq(7, 40)
    s20, fixed, per_token = sizes(pool, 20)
    pc = PrefixCache(max_bytes=2 * fixed + 30 * per_token + s20 - 1, min_tokens=1)
    fill(pool, 0, seed=1)
    pc.insert(MODEL, pool.cache([0], seqlens=[20]), 0, toks)
    fill(pool, 1, seed=2)
    pool.layers[1].kv[1, :, :, :20] = pool.layers[1].kv[0, :, :, :20]  # one prefix: one K/V
    pool.layers[4].kv[1, :, :, :20] = pool.layers[4].kv[0, :, :, :20]
    want = committed(pool, 1, 30)
    pc.insert(MODEL, pool.cache([1], seqlens=[30]), 0, toks)
    pc.restore(MODEL, pool.cache([3]), 0, toks)  # touches the 30 one: the 20 one is the LRU
    pc.insert(MODEL, pool.cache([2], seqlens=[20]), 0, seq(5, 30))  # needs one more snapshot's room
    assert pc.snapshots() == [20, 30] and pc.lookup(toks) == 30 and pc.lookup(toks, limit=29) == 0
    assert pc.restore(MODEL, pool.cache([4]), 0, toks) == 30
    check_restored(pool, 4, want, 30, "the longer snapshot after its prefix's was evicted")
    assert pc.nbytes == held_bytes(pc) <= pc.max_bytes


def test_a_snapshot_larger_than_the_bound_is_not_stored_and_evicts_nothing():
    pool = make_pool()
    one = sizes(pool, 20)[0]
    pc = PrefixCache(max_bytes=one + 1, min_tokens=1)
    pc.insert(MODEL, pool.cache([0], seqlens=[20]), 0, seq(1, 30))
    assert not pc.insert(MODEL, pool.cache([1], seqlens=[21]), 0, seq(2, 30))
    assert (len(pc), pc.stats.rejected, pc.stats.evicted, pc.nbytes) == (1, 1, 0, one)


def test_short_prefixes_are_not_snapshotted():
    pool = make_pool()
    pc = PrefixCache(min_tokens=16)
    assert not pc.insert(MODEL, pool.cache([0], seqlens=[15]), 0, seq(1, 30))
    assert pc.insert(MODEL, pool.cache([0], seqlens=[16]), 0, seq(1, 30))
    assert pc.snapshots() == [16]
    with pytest.raises(ValueError, match="committed 16 tokens but only 10"):
        pc.insert(MODEL, pool.cache([0], seqlens=[16]), 0, seq(1, 10))


def test_counters():
    pool = make_pool()
    pc = PrefixCache(min_tokens=1)
    toks = seq(7, 40)
    pc.insert(MODEL, pool.cache([0], seqlens=[20]), 0, toks)
    assert pc.restore(MODEL, pool.cache([1]), 0, toks) == 20
    assert pc.restore(MODEL, pool.cache([1]), 0, seq(8, 12)) == 0
    assert pc.restore(MODEL, pool.cache([1]), 0, toks, limit=10) == 0
    draft = torch.nn.Linear(1, 1)
    assert pc.restore(draft, pool.cache([1]), 0, toks, role="draft") == 0
    pc.insert(draft, pool.cache([0], seqlens=[25]), 0, toks, role="draft")
    assert pc.restore(draft, pool.cache([1]), 0, toks, role="draft") == 25
    s = pc.stats
    assert (s.hits, s.misses, s.prompt_tokens, s.cached_tokens, s.draft_cached_tokens, s.inserted) == \
           (1, 2, 40 + 12 + 40, 20, 25, 2)
    assert s.hit_rate == pytest.approx(20 / 92)
    assert pc.snapshots() == [20] and pc.snapshots("draft") == [25]


def test_a_cache_serves_one_model_per_role_and_refuses_others_unchanged():
    pool = make_pool()
    pc = PrefixCache(min_tokens=1)
    toks = seq(7, 40)
    pc.insert(MODEL, pool.cache([0], seqlens=[20]), 0, toks)
    other = torch.nn.Linear(1, 1)
    before = (len(pc), pc.nbytes, vars(pc.stats).copy(), pc.snapshots())
    dst = pool.cache([1], seqlens=[0])
    with pytest.raises(ValueError, match="another model"):
        pc.restore(other, dst, 0, toks)
    with pytest.raises(ValueError, match="another model"):
        pc.insert(other, pool.cache([2], seqlens=[30]), 0, toks)
    with pytest.raises(ValueError, match="another model"):
        pc.check(other)
    assert (len(pc), pc.nbytes, vars(pc.stats), pc.snapshots()) == before
    assert dst.seqlens == [0]
    # a cache of other shapes (a cast model) for the bound model: refused too
    with pytest.raises(ValueError, match="differ from those"):
        pc.restore(MODEL, make_pool(heads=5).cache([0]), 0, toks)
    assert pc.restore(MODEL, dst, 0, toks) == 20  # still serves its own model
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0
    pc.check(other)  # unbound again
