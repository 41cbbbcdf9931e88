"""``suffix:N`` and merged trees in the decoding loop, on the fake models: greedy output equals
the target's own, with and without a draft model; the draft's cache keeps up with the target by
catch-up; earlier outputs in a shared cache are drafted from; sampled output keeps the target's
distribution; bad input is refused before anything runs."""
import pytest
import torch
from scipy.stats import chisquare

from stree import SuffixCache
from stree.draft import ContextIndex, MergedDrafter, SuffixDrafter, parse_drafter
from stree.generation import generate, resolve
from stree.sampling import SamplingConfig
from tests.fakes import FakeCache, FakeLM, greedy_reference
from tests.test_generate import _expected, _joint

V = 23
PROMPTS = [torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3]), torch.tensor([9, 4])]


@pytest.fixture(scope="module")
def target():
    return FakeLM(vocab_size=V)


@pytest.fixture(scope="module")
def draft():
    return FakeLM(vocab_size=V, noise=1.5)


def new_tokens(out, prompts):
    return [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(prompts)]


@pytest.mark.parametrize("drafter,with_draft", [
    ("suffix:16", False), ("suffix:1", False), ("suffix:8:factor=4,min_prob=0", False),
    ("caterpillar:2,2,2+suffix:16", True), ("chain:3+suffix:8", True), ("suffix:8+static:2,2", True),
    ("dyspec:8+suffix:8", True), ("beam:2x2+suffix:4", True),
    ("caterpillar:2,2,2+suffix:16:solo=2", True), ("chain:3+suffix:8:min_prob=0.2,solo=1.5", True),
], ids=str)
def test_greedy_equals_target_greedy(target, draft, drafter, with_draft):
    out = generate(target, draft if with_draft else None, PROMPTS, 150, drafter=drafter)
    assert new_tokens(out, PROMPTS) == [greedy_reference(target, p, 150) for p in PROMPTS]
    s = out.stats
    assert s.tau > 1.5  # the order-2 chain repeats itself: the suffix tree finds it
    if not with_draft:
        assert s.draft_calls == 0


def test_no_draft_model_is_needed(target):
    out = generate(target, None, PROMPTS[:1], 40, drafter="suffix:16")
    assert out.stats.drafter == "suffix:16" and out.stats.draft_calls == 0
    with pytest.raises(ValueError, match="needs a draft model"):
        generate(target, None, PROMPTS[:1], 8, drafter="caterpillar:2,2,2+suffix:16")


@pytest.mark.parametrize("drafter", ["caterpillar:2,2,2+suffix:16", "chain:4+suffix:8",
                                     "caterpillar:2,2,2+suffix:16:solo=2"])
def test_draft_cache_catches_up_with_the_target(drafter):
    """Accepted suffix-tree nodes are tokens the draft never ran: it runs them (one prefill)
    before it next drafts, so after every generate the draft has committed what the target has,
    except the tokens accepted since its last draft."""
    target, draft = FakeLM(vocab_size=V), FakeLM(vocab_size=V, noise=1.0)
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        model.allocate_tree_cache = lambda b, m, name=name: caches.setdefault(name, FakeCache(b, m))
    out = generate(target, draft, PROMPTS, 120, drafter=drafter)
    prefills = [c for c in draft.calls if c.kind == "prefill"]
    assert len(prefills) > 2  # the prompt, then catch-ups
    for r in range(2):
        committed, drafted = caches["target"].committed(r), caches["draft"].committed(r)
        assert committed[:len(drafted)] == drafted  # never ahead, never different
        assert committed == out.sequences[r, :len(committed)].tolist()


def test_solo_steps_skip_the_draft_model():
    """With ``solo`` a step whose suffix tree scores that much drafts it alone: the draft model
    runs fewer levels than the same merged tree without it, the output is the same, and the
    steps without the draft model are counted as no draft calls."""
    target, draft = FakeLM(vocab_size=V), FakeLM(vocab_size=V, noise=1.0)
    runs = {}
    for spec in ("caterpillar:2,2,2+suffix:16", "caterpillar:2,2,2+suffix:16:solo=2"):
        draft.calls.clear()
        out = generate(target, draft, PROMPTS, 120, drafter=spec)
        runs[spec] = (new_tokens(out, PROMPTS), sum(c.kind != "prefill" for c in draft.calls), out.stats)
    (plain, plain_levels, plain_stats), (solo, solo_levels, solo_stats) = runs.values()
    assert solo == plain
    assert 0 < solo_levels < plain_levels
    assert solo_stats.draft_calls < plain_stats.draft_calls


def test_shared_cache_drafts_earlier_outputs(target):
    """A repeated request drafts the earlier output from the cache: more tokens per step; the
    cache holds each output once, and a fresh call without it gains nothing."""
    cache = SuffixCache()
    prompt = [torch.tensor([5, 11, 2])]
    first = generate(target, None, prompt, 60, drafter="suffix:16:factor=8", suffix_cache=cache)
    assert len(cache) == 1 and cache.num_tokens == 60
    again = generate(target, None, prompt, 60, drafter="suffix:16:factor=8", suffix_cache=cache)
    alone = generate(target, None, prompt, 60, drafter="suffix:16:factor=8")
    assert new_tokens(again, prompt) == new_tokens(first, prompt) == new_tokens(alone, prompt)
    assert again.stats.target_calls < alone.stats.target_calls
    assert len(cache) == 2


@pytest.mark.parametrize("drafter,verifier,with_draft", [
    ("suffix:6", None, False),                          # naive (chosen children)
    ("static:2,2+suffix:6", None, True),                # mss, mixed children
    ("chain:2+suffix:4", None, True),                   # mss with i.i.d. draws and chosen ones
    ("static:2,2+suffix:6", "naive", True),
])
def test_sampled_output_has_the_target_distribution(drafter, verifier, with_draft):
    """The first 3 tokens of 3000 rows against the exact target joint (v^3 cells, chi-square);
    the prompt repeats itself so the suffix tree drafts."""
    v, rows = 5, 3000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2])
    out = generate(target, draft if with_draft else None, prompt.expand(rows, -1), 3, temperature=1.0,
                   drafter=drafter, verifier=verifier, generator=torch.Generator().manual_seed(0))
    assert out.stats.tau > 1.05  # speculation did happen
    assert chisquare(_joint(out, prompt, 3, v).double(), _expected(target, prompt, rows)).pvalue > 1e-3


@pytest.mark.parametrize("drafter", ["static:2,2+suffix:6:solo=1", "chain:2+suffix:4:solo=1"])
def test_sampled_solo_steps_keep_the_target_distribution(drafter):
    """A prompt in which every token has one successor: every row's suffix tree scores 1, so
    every step is solo (no draft model), its chosen children verified by MSS's rule for the mix
    (as naive sampling); the first 3 tokens of 3000 rows against the exact joint."""
    v, rows = 5, 3000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([0, 1, 2, 3, 4] * 3)
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0, drafter=drafter,
                   generator=torch.Generator().manual_seed(0))
    assert out.stats.draft_calls == 0 and out.stats.tau > 1.05
    assert chisquare(_joint(out, prompt, 3, v).double(), _expected(target, prompt, rows)).pvalue > 1e-3


def test_resolved_modes_and_verifiers():
    hot = SamplingConfig(1.0)
    d, v = resolve("tree", "suffix:16", None, hot)
    assert (d.mode, v.name) == ("deterministic", "naive")
    d, v = resolve("tree", "caterpillar:2,2,2+suffix:16", None, hot)
    assert (d.mode, v.name) == ("without_replacement", "mss")
    d, v = resolve("tree", "chain:4+suffix:16", None, hot)
    assert (d.mode, v.name) == ("iid", "mss")
    assert resolve("tree", "chain:4+suffix:16", None, SamplingConfig())[1].name == "greedy"
    with pytest.raises(ValueError, match="MSS is not lossless for deterministic"):
        resolve("tree", "suffix:16", "mss", hot)
    with pytest.raises(ValueError, match="needs a sampled chain"):
        resolve("tree", "chain:4+suffix:16", "asps", hot)


def test_one_index_is_shared_by_a_merged_spec():
    d = parse_drafter("caterpillar:2,2,2+suffix:16")
    assert isinstance(d, MergedDrafter) and isinstance(d.suffix, SuffixDrafter)
    assert d.name == "caterpillar:2,2,2+suffix:16" and d.num_nodes == 7 + 16
    cache = SuffixCache()
    d = parse_drafter("suffix:8", suffix_cache=cache)
    assert d.index.cache is cache


@pytest.mark.parametrize("spec,pattern", [
    ("suffix:0", "bad tree size"), ("suffix:x", "bad tree size"), ("suffix:", "bad tree size"),
    ("suffix:8:colour=red", "unknown suffix option"), ("suffix:8:depth", "unknown suffix option"),
    ("suffix:8:min_prob=high", "needs a number"), ("suffix:8:min_prob=2", "min_prob"),
    ("suffix:8:depth=0", "depth >= 1"),
    ("suffix:8+suffix:4", "one draft model's tree and one suffix tree"),
    ("auto+suffix:4", "one draft model's tree"), ("chain:4+static:2,2", "one suffix tree"),
    ("suffix:8:solo=2", "unknown suffix option"), ("chain:4+suffix:8:solo=0", "positive"),
    ("chain:4+suffix:8:solo=many", "needs a number"),
])
def test_bad_specs_are_refused(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_drafter(spec)


def test_errors_before_anything_runs(draft):
    target = FakeLM(vocab_size=V)
    cache = SuffixCache()
    cache.bind(V + 1)  # outputs of another vocabulary
    with pytest.raises(ValueError, match="vocabulary of 24 tokens; the target has 23"):
        generate(target, None, PROMPTS, 8, drafter="suffix:8", suffix_cache=cache)
    assert target.calls == []  # refused before the prefill
    with pytest.raises(ValueError, match="suffix_cache goes with a drafter spec"):
        generate(target, None, PROMPTS, 8, drafter=SuffixDrafter(), suffix_cache=SuffixCache())


def test_a_drafter_object_carries_its_own_cache(target):
    cache = SuffixCache()
    drafter = SuffixDrafter(index=ContextIndex(cache))
    generate(target, None, PROMPTS, 20, drafter=drafter)
    assert len(cache) == 2


def test_a_conversations_next_turn_extends_the_last_rows_index_as_a_fresh_one_would():
    """A request whose prompt continues a row the last request left with the same suffix cache
    (a conversation's next turn) extends that row; its trees equal those of an index built from
    the whole prompt, though the cache took the last output since. A prompt that does not
    continue it gets a fresh row."""
    from stree.draft.suffix_index import SpeculationConfig

    gen = torch.Generator().manual_seed(5)
    words = [torch.randint(1, 12, (int(n),), generator=gen).tolist() for n in torch.randint(2, 6, (40,))]
    text = [t for i in torch.randint(0, 40, (300,), generator=gen).tolist() for t in words[i]]
    cache = SuffixCache()
    index = ContextIndex(cache)
    conversation = text[:80]
    index.start([conversation])
    configs = [SpeculationConfig(nodes=16, factor=8), SpeculationConfig(nodes=6, depth=3, factor=2)]
    for turn, end in enumerate((140, 200, 260)):
        reply, user = text[len(conversation):len(conversation) + 30], text[len(conversation) + 30:end]
        row = index.rows[0]
        row.push(reply[:20])  # the loop pushes what it accepted; the reply's end it never saw
        index.finish([reply])
        conversation = conversation + reply + user
        index = ContextIndex(cache)
        index.start([conversation])
        assert index.rows[0] is row and row.context == conversation
        fresh = ContextIndex(cache)
        fresh.start([conversation])
        assert fresh.rows[0] is not row
        for cfg in configs:
            assert index.speculate(cfg) == fresh.speculate(cfg), (turn, cfg)
        assert any(s.tokens for cfg in configs for s in index.speculate(cfg))
    index.finish([[]])
    other = ContextIndex(cache)
    other.start([text[1:50]])
    assert other.rows[0] is not row
