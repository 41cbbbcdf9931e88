"""Conversations in stree's loop (``stree.Session``, ``stree.PrefixCache``) on real models: the
shipped pair (a hybrid target with attention and Mamba2 layers, a one-layer Mamba2 draft) and a
pure mamba_ssm Mamba2 pair. Every turn and every request that resumes from a held or cached state
gives, token for token, the output of a fresh call that prefills the whole prompt (greedy; sampled
with the same seed), for drafters and verifiers of every kind (trees whose branches are rejected,
chains, suffix trees, merged trees, dynamic trees); resumption at turn ends and inside a turn;
two conversations sharing a system prompt; the memory bound and eviction; the counters; bad input
refused with everything left as it was."""
import copy

import pytest
import torch
from tokenizers import Tokenizer

import stree
from tests.test_generate_models import noisy_copy
from tests.test_model_mamba2 import make_model
from tests.test_prefix_cache import held_bytes

PAIR = "models/stree-tiny"
N = 24


@pytest.fixture(scope="module")
def pair():
    from stree.hybrid import MambaInLlamaForCausalLM
    target = stree.patch(MambaInLlamaForCausalLM.from_pretrained(f"{PAIR}/target", dtype=torch.float32))
    draft = stree.patch(MambaInLlamaForCausalLM.from_pretrained(f"{PAIR}/draft", dtype=torch.float32))
    return target, draft


@pytest.fixture(scope="module")
def text():
    tok = Tokenizer.from_file(f"{PAIR}/target/tokenizer.json")
    return lambda s, bos=False: torch.tensor(([0] if bos else []) + tok.encode(s).ids)


@pytest.fixture(scope="module")
def mamba_pair():
    target = make_model(seed=21, n_layer=2)
    return stree.patch(target), stree.patch(noisy_copy(target, 0.3, seed=1))


SYSTEM = "# Helpers for lists, written in plain Python.\nimport math\n\n"
TURNS = ["def quicksort(xs):\n", "\n\ndef binary_search(xs, x):\n", "\n\ndef mean(xs):\n"]


def reply(out) -> list[int]:
    return out.sequences[0, out.lengths[0] - out.stats.new_tokens:out.lengths[0]].tolist()


def fresh(target, draft, prompt, n=N, **kw) -> list[int]:
    """The reference: a call that prefills the whole prompt from nothing."""
    out = stree.generate(target, draft, torch.as_tensor(prompt), n, **kw)
    return out.sequences[0, len(prompt):out.lengths[0]].tolist()


def converse(target, draft, chat, turns, n=N, **kw):
    """Run ``turns`` through ``chat``; check each reply against a fresh call on the whole prompt."""
    for turn in turns:
        prompt = chat.tokens + turn.tolist()
        out = stree.generate(target, draft, turn, n, session=chat, **kw)
        assert out.sequences[0, :len(turn)].tolist() == turn.tolist()  # the turn and its reply
        assert reply(out) == fresh(target, draft, prompt, n, **kw), f"turn {len(chat.turns)}"
        assert chat.tokens == prompt + reply(out)
        yield out


# ------------------------------------------------------------------------------ sessions
@pytest.mark.parametrize("method,drafter,verifier", [
    ("tree", None, None),                              # caterpillar:2,2,2: leaves rejected every step
    ("tree", "static:fig4a", None),
    ("tree", "suffix:16", None),                       # no draft model
    ("tree", "caterpillar:2,2,2+suffix:16", None),     # merged: the draft's backlog, leads
    ("tree", "dyspec:10", None),                       # dynamic
    ("tree", "beam:3x2", "naive"),
    ("chain", "chain:4", None),
    ("ar-tree", None, None),
    ("tree", "auto", None),
], ids=["caterpillar", "fig4a", "suffix", "merged", "dyspec", "beam-naive", "chain", "ar-tree", "auto"])
def test_every_turn_equals_a_fresh_full_prefill(pair, text, method, drafter, verifier):
    target, draft = pair
    draft = None if drafter == "suffix:16" or method == "ar-tree" else draft
    chat = stree.Session()
    turns = [text(SYSTEM + TURNS[0], bos=True)] + [text(t) for t in TURNS[1:]]
    rejected = 0
    for out in converse(target, draft, chat, turns, method=method, drafter=drafter, verifier=verifier):
        s = chat.turns[-1]
        rejected += sum(c for k, c in out.stats.accept_hist.items() if k < 3)
        if len(chat.turns) > 1:  # only the turn and the reply's unseen last token are prefilled
            assert s.input_tokens <= s.prefilled_tokens <= s.input_tokens + 1, s
            assert s.reused_tokens == s.context_tokens - s.prefilled_tokens
    assert chat.target_cache.seqlens[0] >= len(chat.tokens) - 1
    if method != "ar-tree":
        assert rejected > 0  # drafted paths were cut short: rejected branches
    if drafter and "suffix" in drafter:
        assert len(chat.suffix_cache) == len(TURNS)  # the suffix cache carried every reply


def test_turns_may_change_drafter_verifier_and_sampling(pair, text):
    """The draft model joins at the second turn (its cache prefills the whole conversation once),
    sits out the fourth (a suffix tree), and catches up at the fifth."""
    target, draft = pair
    chat = stree.Session()
    turns = [text(SYSTEM + TURNS[0], bos=True)] + [text(t) for t in TURNS[1:] + ["\n\n# tests\n", "assert"]]
    plan = [(None, "suffix:16", {}), (draft, "caterpillar:2,2,2", {}), (draft, "chain:4", {"method": "chain"}),
            (None, "suffix:16", {"verifier": "naive"}), (draft, "static:fig4a", {"verifier": "mss"})]
    for turn, (d, drafter, kw) in zip(turns, plan):
        list(converse(target, d, chat, [turn], drafter=drafter, **kw))
    prefilled = [t.draft_prefilled_tokens for t in chat.turns]
    assert prefilled[0] == prefilled[3] == 0 and prefilled[1] == chat.turns[1].context_tokens
    assert prefilled[4] > chat.turns[4].input_tokens  # the fourth turn and its reply: caught up once
    chat.reset()
    assert chat.tokens == [] and chat.target_cache.seqlens == [0]
    list(converse(target, draft, chat, turns[:1]))


def test_pure_mamba2_session_and_prefix_cache(mamba_pair):
    target, draft = mamba_pair
    g = torch.Generator().manual_seed(3)
    turns = [torch.randint(0, 61, (n,), generator=g) for n in (30, 7, 12)]
    cache = stree.PrefixCache(min_tokens=4)
    for drafter in ("caterpillar:2,2,2", "static:fig4a"):  # a draft that takes leads, one that does not
        chat = stree.Session(prefix_cache=cache)
        list(converse(target, draft, chat, turns, drafter=drafter))
    # requests resent by a client: at the last turn's end, and leaving the second reply midway
    middle = len(turns[0]) + N + len(turns[1]) + 5
    for prompt in (chat.tokens + turns[0].tolist(), chat.tokens[:middle] + [(chat.tokens[middle] + 1) % 61]):
        want = cache.lookup(prompt, limit=len(prompt) - 1)
        cached, draft_cached = cache.stats.cached_tokens, cache.stats.draft_cached_tokens
        out = stree.generate(target, draft, prompt, N, prefix_cache=cache)
        assert out.sequences[0, len(prompt):].tolist() == fresh(target, draft, prompt)
        assert cache.stats.cached_tokens - cached == want > 0
        assert cache.stats.draft_cached_tokens > draft_cached
    assert want == max(s for s in cache.snapshots() if s < middle)  # the longest shorter snapshot


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_gated_delta_session_and_prefix_cache(family, tmp_path):
    """A Gated DeltaNet (or KDA) target with a one-layer Gated DeltaNet draft: every turn equals a
    fresh full prefill, and a resent conversation hits at the last turn's end."""
    from tests.hf_models import VOCAB, build
    target = stree.patch(build(family, tmp_path, seed=5)[0])
    draft = stree.patch(build("qwen3_5", tmp_path, seed=6, layers=1)[0])
    g = torch.Generator().manual_seed(4)
    turns = [torch.randint(3, VOCAB, (n,), generator=g) for n in (20, 6, 9)]
    cache = stree.PrefixCache(min_tokens=4)
    chat = stree.Session(prefix_cache=cache)
    list(converse(target, draft, chat, turns, drafter="caterpillar:2,2,2"))
    prompt = chat.tokens + turns[0].tolist()
    cached, want = cache.stats.cached_tokens, cache.lookup(prompt, limit=len(prompt) - 1)
    out = stree.generate(target, draft, prompt, N, prefix_cache=cache)
    assert out.sequences[0, len(prompt):].tolist() == fresh(target, draft, prompt)
    # the conversation's committed end: all of it but the last reply token (the next tree's root)
    assert cache.stats.cached_tokens - cached == want == len(chat.tokens) - 1


def test_sampled_turns_equal_fresh_runs_with_the_same_seed(pair, text):
    """The loop draws nothing while prefilling or restoring, so its random stream after a held or
    restored state is a fresh call's: the same seed gives the same tokens."""
    target, draft = pair
    cache = stree.PrefixCache()
    for drafter, verifier in (("static:fig4a", "mss"), ("chain:4", "sps")):
        chat = stree.Session(prefix_cache=cache)
        for i, t in enumerate([SYSTEM + TURNS[0], TURNS[1]]):
            turn = text(t, bos=i == 0)
            prompt = chat.tokens + turn.tolist()
            kw = dict(temperature=1.0, top_p=0.95, drafter=drafter, verifier=verifier)
            out = stree.generate(target, draft, turn, N, session=chat,
                                 generator=torch.Generator().manual_seed(7 + i), **kw)
            assert reply(out) == fresh(target, draft, prompt, generator=torch.Generator().manual_seed(7 + i), **kw)
        resent = chat.tokens + text(TURNS[2]).tolist()  # a request that hits the last turn's end
        before = cache.stats.cached_tokens
        out = stree.generate(target, draft, resent, N, prefix_cache=cache, generator=torch.Generator().manual_seed(1), **kw)
        assert cache.stats.cached_tokens - before >= len(chat.tokens) - 1
        assert out.sequences[0, len(resent):].tolist() == fresh(target, draft, resent,
                                                                generator=torch.Generator().manual_seed(1), **kw)


# ------------------------------------------------------------------------------ requests
def test_resent_conversations_hit_at_turn_ends(pair, text):
    target, draft = pair
    cache = stree.PrefixCache()
    prompt = text(SYSTEM + TURNS[0], bos=True).tolist()
    for i, t in enumerate(TURNS[1:] + [None]):
        out = stree.generate(target, draft, prompt, N, prefix_cache=cache)
        new = out.sequences[0, len(prompt):].tolist()
        assert new == fresh(target, draft, prompt)
        ends = cache.snapshots()
        assert max(ends) >= len(prompt) + N - 1  # the turn's end: every emitted token but maybe the last
        if t is None:
            break
        hits, cached = cache.stats.hits, cache.stats.cached_tokens
        prompt = prompt + new + text(t).tolist()
        out = stree.generate(target, draft, prompt, 1, prefix_cache=cache)  # the next request: a hit
        assert cache.stats.hits == hits + 1 and cache.stats.cached_tokens - cached == max(ends)
        assert out.sequences[0, -1].item() == fresh(target, draft, prompt, 1)[0]
    assert cache.stats.misses == 1


def test_resuming_inside_a_turn(pair, text):
    """A prompt that leaves an earlier reply midway (an edit, a regeneration) resumes from the
    longest snapshot before the point it leaves, and leaves one there: the next prompt that
    leaves at that point resumes exactly there, inside the earlier turn."""
    target, draft = pair
    cache = stree.PrefixCache()
    first = text(SYSTEM + TURNS[0], bos=True).tolist()
    answer = fresh(target, draft, first, 40)
    stree.generate(target, draft, first, 40, prefix_cache=cache)
    end = cache.snapshots()[-1]
    k = 12
    at = len(first) + k  # inside the reply
    for i, (cut, tail, restored) in enumerate([(k, "x = 1\n", 0),          # nothing before `at`: a miss
                                                (k, "y = 2\n", at),        # exactly at `at`, inside the turn
                                                (k + 5, "z = 3\n", at)]):  # past it: the longest shorter one
        prompt = first + answer[:cut] + text(tail).tolist()
        assert prompt[len(first) + cut] != answer[cut]  # leaves the reply at `len(first) + cut`
        cached = cache.stats.cached_tokens
        out = stree.generate(target, draft, prompt, N, prefix_cache=cache)
        assert cache.stats.cached_tokens - cached == restored, i
        assert out.sequences[0, len(prompt):].tolist() == fresh(target, draft, prompt), i
        assert len(first) + cut in cache.snapshots()  # a snapshot where it left the cached path
    assert end in cache.snapshots()


def test_two_conversations_share_a_system_prompt(pair, text):
    target, draft = pair
    system = text(SYSTEM, bos=True)
    cache = stree.PrefixCache()
    a, b = stree.Session(prefix_cache=cache), stree.Session(prefix_cache=cache)
    out = stree.generate(target, draft, system, 0, session=a)  # max_new_tokens=0: commit, snapshot
    assert out.stats.new_tokens == 0 and a.tokens == system.tolist()
    assert cache.snapshots() == cache.snapshots("draft") == [len(system)]
    list(converse(target, draft, a, [text(TURNS[0])]))
    assert a.turns[-1].prefilled_tokens == len(text(TURNS[0]))  # the system prompt was held
    list(converse(target, draft, b, [torch.cat([system, text(TURNS[1])])]))
    assert b.turns[0].restored_tokens == b.turns[0].reused_tokens == len(system)
    assert b.turns[0].draft_prefilled_tokens == len(text(TURNS[1]))
    list(converse(target, draft, a, [text(TURNS[2])]))
    list(converse(target, draft, b, [text(TURNS[2])]))
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)  # b's first turn; a's prefill of the system prompt


def test_a_request_leaving_a_cached_path_leaves_a_snapshot_where_the_next_one_hits(pair, text):
    """Without a turn that commits the system prompt alone: the second request misses, stops its
    prefill where it left the first's path once and snapshots there; the third hits."""
    target, draft = pair
    system = text(SYSTEM, bos=True).tolist()
    cache = stree.PrefixCache()
    users = [text(t).tolist() for t in ("print(1)\n", "x = [3, 1, 2]\n", "def f():\n")]
    assert len({u[0] for u in users}) == 3
    for i, user in enumerate(users):
        prompt = system + user
        cached = cache.stats.cached_tokens
        out = stree.generate(target, draft, prompt, N, prefix_cache=cache)
        assert out.sequences[0, len(prompt):].tolist() == fresh(target, draft, prompt)
        assert cache.stats.cached_tokens - cached == (len(system) if i == 2 else 0)
    assert len(system) in cache.snapshots() and len(system) in cache.snapshots("draft")


def test_a_batch_of_requests_resumes_each_row_from_its_own_prefix(pair, text):
    target, draft = pair
    cache = stree.PrefixCache()
    first = text(SYSTEM + TURNS[0], bos=True).tolist()
    stree.generate(target, draft, first, N, prefix_cache=cache)
    end = cache.snapshots()[-1]
    rows = [first + fresh(target, draft, first) + text(TURNS[1]).tolist(),  # hits the turn's end
            text(SYSTEM + "x = 2\n", bos=True).tolist(),                     # branches off early: a miss
            first[:-2]]                             # inside the first prompt: row 1's branch snapshot
    branch = next(i for i, (a, b) in enumerate(zip(first, rows[1])) if a != b)
    out = stree.generate(target, draft, [torch.tensor(r) for r in rows], N, prefix_cache=cache)
    for i, r in enumerate(rows):
        assert out.sequences[i, len(r):out.lengths[i]].tolist() == fresh(target, draft, r), i
    assert (cache.stats.hits, cache.stats.misses) == (2, 2)
    assert cache.stats.cached_tokens == end + branch


# ------------------------------------------------------------------------------ memory, errors
def test_the_memory_bound_holds_and_evicts(pair, text):
    target, draft = pair
    probe = stree.PrefixCache()
    prompts = [text(f"# task {i}: " + SYSTEM, bos=True).tolist() for i in range(5)]
    stree.generate(target, draft, prompts[0], N, prefix_cache=probe)
    one = probe.nbytes  # one request's target and draft snapshots
    cache = stree.PrefixCache(max_bytes=int(2.5 * one))
    for p in prompts:
        out = stree.generate(target, draft, p, N, prefix_cache=cache)
        assert out.sequences[0, len(p):].tolist() == fresh(target, draft, p)
        assert cache.nbytes == held_bytes(cache) <= cache.max_bytes
    assert cache.stats.evicted == cache.stats.inserted - len(cache) >= 2 * len(prompts) - 5
    assert cache.lookup(prompts[0] + [5]) == 0  # the oldest went first
    last = prompts[-1] + reply(out) + [5, 6]
    assert cache.lookup(last) > len(prompts[-1])


def test_bad_input_is_refused_and_leaves_everything_as_it_was(pair, text):
    target, draft = pair
    cache = stree.PrefixCache()
    chat = stree.Session(prefix_cache=cache)
    list(converse(target, draft, chat, [text(SYSTEM + TURNS[0], bos=True)]))
    other_target, other_draft = copy.deepcopy(target), copy.deepcopy(draft)  # same shapes, other models

    def state():
        return (list(chat.tokens), len(chat.turns), chat.target_cache.seqlens[:], chat.draft_cache.seqlens[:],
                len(cache), cache.nbytes, vars(cache.stats).copy(), cache.snapshots(), cache.snapshots("draft"))

    before = state()
    turn = text(TURNS[1])
    bad = [
        (ValueError, "another target model", dict(session=chat), other_target, draft, turn),
        (ValueError, "another draft model", dict(session=chat), target, other_draft, turn),
        (ValueError, "another model", dict(prefix_cache=cache), other_target, draft, turn),
        (ValueError, "another model", dict(prefix_cache=cache), target, other_draft, turn),
        (ValueError, "empty prompt", dict(session=chat), target, draft, torch.tensor([], dtype=torch.long)),
        (ValueError, "batch size 1", dict(session=chat), target, draft, [turn, turn]),
        (ValueError, "keeps no state", dict(session=chat, method="ar", drafter=None), target, None, turn),
        (ValueError, "keeps no state", dict(prefix_cache=cache, method="unrolled"), target, draft, turn),
        (ValueError, "give max_seqlen to the Session", dict(session=chat, max_seqlen=4096), target, draft, turn),
        (ValueError, "prefix cache of its own", dict(session=chat, prefix_cache=stree.PrefixCache()), target, draft, turn),
        (TypeError, "stree.Session", dict(session=cache), target, draft, turn),
        (TypeError, "stree.PrefixCache", dict(prefix_cache=chat), target, draft, turn),
    ]
    for error, match, kw, t, d, ids in bad:
        with pytest.raises(error, match=match):
            stree.generate(t, d, ids, N, **kw)
        assert state() == before, match
    with pytest.raises(TypeError, match="stree.PrefixCache"):
        stree.Session(prefix_cache={})
    # nothing was lost: the conversation continues exactly, the cache still serves its models
    list(converse(target, draft, chat, [turn]))
    resent = chat.tokens + text(TURNS[2]).tolist()
    out = stree.generate(target, draft, resent, N, prefix_cache=cache)
    assert out.sequences[0, len(resent):].tolist() == fresh(target, draft, resent)
    assert cache.stats.hits == 1


def test_an_interrupted_turn_leaves_a_session_that_continues_exactly(pair, text):
    target, draft = pair
    chat = stree.Session(prefix_cache=stree.PrefixCache())
    list(converse(target, draft, chat, [text(SYSTEM + TURNS[0], bos=True)]))

    class Interrupt:
        def __init__(self):
            self.puts = 0

        def put(self, tokens):
            self.puts += 1
            if self.puts == 3:
                raise KeyboardInterrupt

        def end(self):
            pass

    tokens = list(chat.tokens)
    with pytest.raises(KeyboardInterrupt):
        stree.generate(target, draft, text(TURNS[1]), N, session=chat, streamer=Interrupt())
    assert chat.tokens == tokens and len(chat.turns) == 1  # the turn never happened
    out = list(converse(target, draft, chat, [text(TURNS[1])]))[0]  # from the turn's end snapshot
    assert chat.turns[-1].restored_tokens >= len(tokens) - 1 and out.stats.new_tokens == N
