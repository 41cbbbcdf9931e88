"""The suffix tries behind ``suffix:N``: counts, matches and speculations against brute force.

Oracles are written from the definitions on plain lists (substring counts by enumeration, a
match as the longest context suffix that occurred before, a child's probability as a ratio of
occurrence counts), never from the trie's own code.
"""
from __future__ import annotations

import collections
import random
import time

import pytest

from stree.draft.suffix_index import (Matcher, SpeculationConfig, SuffixCache, SuffixTrie,
                                      _unlazy)


def substring_counts(seqs, depth):
    """occurrences of every substring of at most ``depth`` tokens, and of those followed by a
    token (the continuation count)."""
    count, cont = collections.Counter(), collections.Counter()
    for s in seqs:
        for i in range(len(s)):
            for k in range(1, depth + 1):
                if i + k > len(s):
                    break
                sub = tuple(s[i:i + k])
                count[sub] += 1
                if i + k < len(s) and k < depth:
                    cont[sub] += 1
    return count, cont


def trie_count(trie: SuffixTrie, sub) -> int:
    """Occurrences of ``sub`` as the trie answers them (a lazy pointer counts one occurrence if
    its sequence continues with the rest of ``sub``)."""
    u = 0
    for j, t in enumerate(sub):
        c = trie.kids[u].get(t)
        if c is None:
            return 0
        if c < 0:
            sid, pos = _unlazy(c)
            rest = list(sub[j + 1:])
            return int(trie.seqs[sid][pos + 1:pos + 1 + len(rest)] == rest)
        u = c
    return trie.count[u]


def random_trie(rng, depth, vocab, sequences=3, length=30):
    trie, seqs = SuffixTrie(depth), []
    for _ in range(sequences):
        s = [rng.randrange(vocab) for _ in range(rng.randint(0, length))]
        sid, active, i = trie.new_sequence(), None, 0
        while i < len(s):  # appended in chunks, as a decoding loop does
            k = rng.randint(1, 4)
            active = trie.append(sid, s[i:i + k], active)
            i += k
        seqs.append((sid, s))
    return trie, seqs


@pytest.mark.parametrize("seed", range(40))
def test_counts_match_enumeration(seed):
    rng = random.Random(seed)
    depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
    trie, seqs = random_trie(rng, depth, vocab)
    if len(seqs) > 1 and rng.random() < 0.5:  # a removal must take back exactly its counts
        sid, _ = seqs.pop(rng.randrange(len(seqs)))
        trie.remove_sequence(sid)
    count, cont = substring_counts([s for _, s in seqs], depth)
    for sub, c in count.items():
        assert trie_count(trie, sub) == c, sub
    # materialised nodes carry the continuation counts; no node is left without an occurrence
    stack = [(0, ())]
    while stack:
        u, prefix = stack.pop()
        if prefix:
            assert trie.count[u] == count[prefix]
            assert trie.cont[u] == cont[prefix], prefix
        for t, c in trie.kids[u].items():
            assert count[prefix + (t,)] > 0
            if c >= 0:
                stack.append((c, prefix + (t,)))


def test_one_occurrence_is_one_pointer():
    """Tokens that never repeat materialise no node: the trie stays small on novel text."""
    trie = SuffixTrie(32)
    trie.add_sequence(list(range(1000)))
    assert trie.num_nodes == 1 and len(trie.kids[0]) == 1000


@pytest.mark.parametrize("seed", range(20))
def test_matcher_follows_the_context(seed):
    """Extending a match token by token finds the nodes of exactly the context suffixes present
    in the trie, as matching from scratch does."""
    rng = random.Random(seed)
    trie, _ = random_trie(rng, rng.randint(2, 6), 3)
    context = [rng.randrange(3) for _ in range(rng.randint(1, 25))]
    walked = Matcher(trie)
    for i in range(len(context)):
        walked.extend(context[i:i + 1], context[:i + 1])
    fresh = Matcher(trie)
    fresh.rematch(context)
    assert walked.active == fresh.active
    count, _ = substring_counts([s for s in trie.seqs.values()], trie.max_depth)
    present = [k for k in range(1, trie.max_depth + 1)
               if k <= len(context) and count[tuple(context[-k:])] >= 2]
    assert [trie.depth[u] for u in fresh.active[1:]] == present


def test_lazy_match_runs_past_the_depth():
    """A context that repeats one earlier output keeps matching it beyond ``max_depth`` and
    drafts its continuation, token for token."""
    cache = SuffixCache(max_depth=4)
    out = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 3]
    cache.add(out)
    m = Matcher(cache.trie)
    context = []
    for t in out[:9]:
        context.append(t)
        m.extend([t], context)
    assert m.lazy is not None and m.lazy[1] == 9
    spec = cache.trie.best(m.candidates(), SpeculationConfig(nodes=8, factor=4))
    assert spec.tokens == out[9:] and spec.parents == [-1, 0, 1] and spec.match == 9


def brute_children(seqs, context_suffix):
    """Continuations of ``context_suffix`` over every earlier occurrence: token -> count."""
    k = len(context_suffix)
    out = collections.Counter()
    for s in seqs:
        for i in range(len(s) - k):
            if s[i:i + k] == context_suffix:
                out[s[i + k]] += 1
    return out


def test_speculation_probabilities_are_count_ratios():
    """First-level children of the best match carry count(child) / occurrences with a
    continuation, found by enumeration; children are best-first (non-increasing probability)
    and every parent precedes its children."""
    rng = random.Random(3)
    text = [rng.randrange(5) for _ in range(400)]
    trie = SuffixTrie(8)
    sid = trie.new_sequence()
    active = trie.append(sid, text)
    spec = trie.best([(u, trie.depth[u]) for u in active[1:]],
                     SpeculationConfig(nodes=12, depth=6, min_prob=0.0, factor=100))
    suffix = text[-spec.match:]
    kids = brute_children([text[:-1] + [-1]], suffix)  # the last occurrence has no continuation
    total = sum(kids.values())
    first = [(t, p) for t, par, p in zip(spec.tokens, spec.parents, spec.probs) if par == -1]
    assert first and all(abs(p - kids[t] / total) < 1e-12 for t, p in first)
    assert all(a >= b for a, b in zip(spec.probs, spec.probs[1:]))
    assert all(par < i for i, par in enumerate(spec.parents))


def test_budget_depth_and_min_prob():
    cfg = SpeculationConfig(nodes=16, depth=3, min_prob=0.3, factor=2.0, offset=1.0)
    assert [cfg.budget(p) for p in (0, 1, 3, 20)] == [1, 3, 7, 16]
    trie = SuffixTrie(16)
    sid = trie.new_sequence()
    active = trie.append(sid, [1, 2, 3, 4, 5, 6] * 3 + [1, 2, 3])
    spec = trie.best([(u, trie.depth[u]) for u in active[1:]], cfg)
    assert spec.tokens == [4, 5, 6]  # depth 3 caps the chain
    assert all(p >= 0.3 for p in spec.probs)
    for bad in (dict(nodes=0), dict(depth=0), dict(min_prob=1.5), dict(factor=-1.0),
                dict(offset=float("nan"))):
        with pytest.raises(ValueError):
            SpeculationConfig(**bad)


def test_cache_eviction_is_bounded_and_exact():
    cache = SuffixCache(max_requests=3, max_tokens=50, max_depth=6)
    rng = random.Random(0)
    outputs = [[rng.randrange(4) for _ in range(rng.randint(5, 20))] for _ in range(12)]
    for out in outputs:
        cache.add(out)
        assert len(cache) <= 3 and cache.num_tokens <= 50
    kept = list(cache.trie.seqs.values())
    assert kept == outputs[-len(kept):]
    count, _ = substring_counts(kept, 6)
    assert all(trie_count(cache.trie, sub) == c for sub, c in count.items())
    cache.clear()
    assert len(cache) == 0 and cache.trie.num_nodes == 1


def test_cache_vocabulary_is_bound_once():
    cache = SuffixCache()
    cache.bind(100)
    cache.bind(100)
    with pytest.raises(ValueError, match="vocabulary of 100 tokens; the target has 50"):
        cache.bind(50)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(max_tokens=0)


def test_update_and_lookup_cost_at_an_8k_context():
    """The work per step does not grow with the context: appending tokens and reading a
    16-node tree at an 8k-token context of code-like text stays well under a millisecond
    (the benchmark's row, bench/suffix.py, measures it; this bounds it loosely on a busy CI)."""
    rng = random.Random(1)
    lines = [[rng.randrange(4096) for _ in range(rng.randint(3, 12))] for _ in range(200)]
    text = [t for _ in range(1500) for t in rng.choice(lines)][:8192]
    trie = SuffixTrie(32)
    sid = trie.new_sequence()
    active = trie.append(sid, text)
    cfg = SpeculationConfig(nodes=16, factor=4)
    start = time.perf_counter()
    for t in text[:200]:
        active = trie.append(sid, [t], active)
        trie.best([(u, trie.depth[u]) for u in active[1:]], cfg)
    assert (time.perf_counter() - start) / 200 < 2e-3
