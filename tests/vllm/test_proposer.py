"""stree's vLLM proposer without an engine: it compiles the draft's levels when vLLM compiles its
model (``enforce_eager=False``) and the tree has a static template, and the compiled levels draft
what the eager ones do."""
from types import SimpleNamespace

import pytest
import torch

from stree.vllm.proposer import StreeProposer, batch_sizes
from stree.vllm.speculative import ENV, DraftSpec, draft_size

DRAFT = "models/stree-tiny/draft"
TARGET = torch.nn.Module()  # what vLLM passes to load_model: a target with no layers to refuse


def _proposer(monkeypatch, tree: str, enforce_eager: bool) -> StreeProposer:
    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=draft_size(tree)),
                             model_config=SimpleNamespace(enforce_eager=enforce_eager, max_model_len=256,
                                                          uses_mrope=False),
                             scheduler_config=SimpleNamespace(max_num_seqs=2))
    return StreeProposer(config)


def _drafts(proposer: StreeProposer, steps: int = 3) -> list[list[int]]:
    """Draft ``steps`` times for one request, each step committing the first draft token."""
    history, out = [0, 5, 17, 33, 80, 100], []
    proposer.bind(["r"])
    for _ in range(steps):
        tokens = proposer.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        out.append(tokens)
        history = history + tokens[:1]
    return out


@pytest.mark.parametrize("tree, compiles", [("caterpillar:2,2,2", True), ("chain:4", True), ("dyspec:6", False)])
def test_draft_levels_compiled_with_vllm_compile(monkeypatch, tree, compiles):
    eager, compiled = _proposer(monkeypatch, tree, True), _proposer(monkeypatch, tree, False)
    assert not eager.compiled and compiled.compiled == compiles  # dynamic trees: no static template
    if compiles:
        assert _drafts(compiled) == _drafts(eager)
        assert getattr(compiled.model, "_stree_compiled", None) is not None  # its compiled steps ran


def _config(tree: str, enforce_eager: bool, max_num_seqs: int, prefix_caching: bool = False) -> SimpleNamespace:
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=draft_size(tree)),
                           model_config=SimpleNamespace(enforce_eager=enforce_eager, max_model_len=256,
                                                        uses_mrope=False),
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                           cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


def _run(proposer: StreeProposer, schedule: list[list[str]], histories: dict, params: dict,
         only: str | None = None) -> list[dict]:
    """Step ``proposer`` through ``schedule`` (the request ids of each step, in batch order; with
    ``only``, that request alone, in the steps where it appears); after step ``s`` request ``r``
    commits the first ``(len(r) + s) % 3`` draft tokens (partial, none or whole acceptance) and a
    token of its own. Returns each step's drafts by request id."""
    histories, out = {r: list(h) for r, h in histories.items()}, []
    for step, rids in enumerate(schedule):
        if only is not None:
            if only not in rids:
                continue
            rids = [only]
        proposer.bind(rids, [params.get(r) for r in rids])
        width = max(len(histories[r]) for r in rids)
        ids = torch.tensor([histories[r] + [0] * (width - len(histories[r])) for r in rids])
        drafts = proposer.propose([[histories[r][-1]] for r in rids], [len(histories[r]) for r in rids], ids)
        out.append(dict(zip(rids, drafts)))
        for r, tokens in zip(rids, drafts):
            histories[r] += tokens[:(len(r) + step) % 3] + [(7 * step + len(r)) % 50 + 3]
    return out


HISTORIES = {"a": [0, 5, 17, 33], "bb": [0, 9, 9, 40, 41, 42, 43, 60], "ccc": [0, 70], "dddd": [0, 11, 12, 13]}
# requests arrive and leave: a batch of three, one leaves, one arrives, the first comes back
SCHEDULE = [["a", "bb", "ccc"], ["a", "bb", "ccc"], ["bb", "ccc"], ["ccc", "bb", "dddd"], ["a", "dddd", "bb"],
            ["a", "dddd", "bb"]]


@pytest.mark.parametrize("tree, enforce_eager", [("caterpillar:2,2,2", True), ("caterpillar:2,2,2", False),
                                                 ("chain:4", True), ("dyspec:6", True)])
def test_batched_drafts_equal_each_request_drafted_alone(monkeypatch, tree, enforce_eager):
    """The proposer drafts all greedy requests in one batch (padded to a compiled size when
    compiled), each resuming from its slot at its own length; every request's drafts equal those
    of a proposer that only ever sees that request."""
    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()
    batched = StreeProposer(_config(tree, enforce_eager, 4))
    batched.load_model(TARGET)
    if not enforce_eager:
        assert batched.sizes == [1, 2, 4] and len(batched.scratch) == 1  # three requests: one scratch row
    together = _run(batched, SCHEDULE, HISTORIES, {})
    for rid in HISTORIES:
        alone = _run(StreeProposer(_config(tree, True, 1)), SCHEDULE, HISTORIES, {}, only=rid)
        assert [d[rid] for d in together if rid in d] == [d[rid] for d in alone]


def test_a_seeded_request_drafts_the_same_whatever_its_batch(monkeypatch):
    """A sampled request with its own seed drafts alone, with its own generator: its draft tokens
    do not depend on the requests drafted beside it (those without a seed share one batch)."""
    from vllm import SamplingParams

    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, "chain:4").to_env()
    params = {r: SamplingParams(temperature=1.0) for r in HISTORIES}
    params["a"] = SamplingParams(temperature=1.0, seed=11)
    schedule = [["a", "bb", "ccc"], ["bb", "a"], ["ccc", "a", "dddd"], ["a"]]  # others come and go
    proposer = StreeProposer(_config("chain:4", True, 4))
    with_others = _run(proposer, schedule[:1], HISTORIES, params)
    assert sorted(len(b.rows) for b in proposer.batches) == [1, 2]  # "a" alone, "bb" and "ccc" together
    with_others = _run(StreeProposer(_config("chain:4", True, 4)), schedule, HISTORIES, params)
    alone = _run(StreeProposer(_config("chain:4", True, 4)), schedule, HISTORIES, params, only="a")
    assert [d["a"] for d in with_others] == [d["a"] for d in alone]


def test_batch_sizes():
    assert batch_sizes(1) == [1] and batch_sizes(4) == [1, 2, 4] and batch_sizes(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("tree", ["caterpillar:2,2,2", "chain:4"])
def test_batch_size_schedule_budget(monkeypatch, tree):
    """vLLM's ``num_speculative_tokens_per_batch_size`` reaches the proposer as a per-step budget:
    0 drafts nothing (no draft work, the last trees dropped), fewer than K returns the first
    tokens of the full draft, and after steps without drafting a request's drafts equal those of
    a fresh proposer given the same history (its slot was caught up, not left stale)."""
    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()
    k = draft_size(tree)
    proposer = StreeProposer(_config(tree, True, 2))
    histories = {"a": [0, 5, 17, 33], "bb": [0, 9, 9, 40, 41]}
    for step, budget in enumerate([k, 0, 0, 2, k, 0, k]):
        rids = list(histories)
        proposer.bind(rids, None, budget)
        width = max(len(h) for h in histories.values())
        ids = torch.tensor([h + [0] * (width - len(h)) for h in histories.values()])
        drafts = proposer.propose([[h[-1]] for h in histories.values()], [len(h) for h in histories.values()], ids)
        if budget == 0:
            assert drafts == [[], []] and not proposer.batches and not proposer.drafted
        for rid, tokens in zip(rids, drafts):
            fresh = StreeProposer(_config(tree, True, 1))
            fresh.bind([rid])
            h = histories[rid]
            full = fresh.propose([[h[-1]]], [len(h)], torch.tensor([h]))[0]
            assert len(full) == k and tokens == full[:budget]
            histories[rid] = h + tokens[:step % 2] + [(7 * step + len(rid)) % 50 + 3]


@pytest.mark.parametrize("tree", ["suffix:16", "caterpillar:2,2,2+suffix:16"])
def test_suffix_trees_of_sampled_requests_only_where_asked(monkeypatch, tree):
    """With ``suffix_sampled`` off (the CPU default) a sampled request drafts no suffix tree: with
    a suffix tree alone nothing, with a merged tree the draft's part only (what the draft's tree
    alone drafts); greedy requests draft the whole tree. With it on, sampled ones do too."""
    from vllm import SamplingParams

    model = DRAFT if "+" in tree else None
    repeated = [0, 5, 17, 33, 80, 5, 17, 33, 80, 5, 17, 33]  # a text whose suffix trie predicts itself
    histories = {"g": repeated, "s": repeated}
    params = {"g": None, "s": SamplingParams(temperature=1.0)}
    drafts = {}
    for sampled in (False, True):
        monkeypatch.setenv(ENV, "")
        DraftSpec(model, tree, suffix_sampled=sampled).to_env()
        config = _config(tree, True, 2)
        config.model_config.get_vocab_size = lambda: 4096
        drafts[sampled] = _run(StreeProposer(config), [["g", "s"]], histories, params)[0]
    assert len(drafts[False]["g"]) > (3 if model else 0) and len(drafts[True]["s"]) > (3 if model else 0)
    if model is None:
        assert drafts[False]["s"] == []
    else:  # the draft's caterpillar:2,2,2 alone: 6 nodes
        assert len(drafts[False]["s"]) == 6 < len(drafts[True]["s"])


def _proposers(monkeypatch, tree: str = "caterpillar:2,2,2+suffix:16"):
    """A factory of proposers (``enforce_eager`` its argument) of ``tree`` (by default a merged
    tree), two slots."""
    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()

    def proposer(eager):
        config = _config(tree, eager, 2)
        config.model_config.get_vocab_size = lambda: 4096
        return StreeProposer(config)

    return proposer


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_one_token_catch_up_drafts_what_a_fresh_prefill_does(monkeypatch, enforce_eager):
    """A merged tree whose draft part is accepted to its deepest node leaves the draft one token
    behind (that node, which the draft never ran): where the draft takes no lead (a sampled
    request's), caught up as a one-node level instead of a prefill; the next drafts equal those
    of a fresh proposer that prefills the whole history."""
    proposer = _proposers(monkeypatch)
    drafting = proposer(enforce_eager)
    drafting.takes_lead = {True: False, False: False}
    drafting.load_model(TARGET)
    history, one_token = [0, 5, 17, 33, 80, 100], []
    original = drafting._one_token
    monkeypatch.setattr(drafting, "_one_token", lambda *a: one_token.append(1) or original(*a))
    for _ in range(3):
        drafting.bind(["r"])
        drafts = drafting.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        fresh = proposer(True)
        fresh.bind(["r"])
        assert drafts == fresh.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        drafted = drafting.drafted["r"].tree
        node, spine = 0, []
        while drafted.children(0, node):  # the first children down to the draft's deepest level
            node = drafted.children(0, node)[0]
            spine.append(int(drafted.tokens[0, node]))
        history = history + spine + [(spine[-1] + 1) % 4096]  # all accepted, then a bonus token
    assert len(one_token) == 2


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_several_tokens_behind_caught_up_as_a_chain_draft_what_a_fresh_prefill_does(monkeypatch,
                                                                                    enforce_eager):
    """A merged tree's draft falls several tokens behind when the target accepts suffix nodes
    it never ran (here: tokens outside its tree, 2 to 9 a step): where the draft takes no lead
    (a sampled request's) and compiled, they are run as one padded chain (a compiled tree step)
    instead of a prefill; the next drafts equal those of a fresh proposer that prefills the
    whole history."""
    proposer = _proposers(monkeypatch)
    drafting = proposer(enforce_eager)
    drafting.takes_lead = {True: False, False: False}
    history, chains = [0, 5, 17, 33, 80, 100], []
    original = drafting._chain
    monkeypatch.setattr(drafting, "_chain",
                        lambda cache, tokens: chains.append(len(tokens[0])) or original(cache, tokens))
    for step, extra in enumerate([2, 9, 3, 5]):
        drafting.bind(["r"])
        drafts = drafting.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        fresh = proposer(True)
        fresh.bind(["r"])
        assert drafts == fresh.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0], step
        history = history + [(history[-1] * 7 + 3 * i + 1) % 4000 + 50 for i in range(extra)]
    # a short prompt too (5 tokens before its root); then each step's root and the tokens after
    # it, less the new root
    assert chains == ([] if enforce_eager else [5, 2, 9, 3])


# compiled with the merged tree only (a compiled proposer costs a minute or two on this CPU)
@pytest.mark.parametrize("tree, enforce_eager", [("caterpillar:2,2,2", True), ("caterpillar:2,2,2+suffix:16", True),
                                                 ("caterpillar:2,2,2+suffix:16", False)])
def test_tokens_behind_run_as_the_next_drafts_lead_drafting_what_a_fresh_prefill_does(monkeypatch, tree,
                                                                                      enforce_eager):
    """A greedy request's draft runs the tokens it is behind (its tree's deepest accepted node,
    which it never ran; a short prompt; here also tokens outside its tree, which leave the whole
    step behind) in its next draft's roots' pass, padded to a lead width, with no catch-up of
    their own, and commits them with its accepted path; more than 16 are prefilled first. The
    drafts equal those of a fresh proposer that prefills the whole history."""
    proposer = _proposers(monkeypatch, tree)
    drafting = proposer(enforce_eager)
    assert drafting.takes_lead == {True: True, False: True}
    drafting.load_model(TARGET)
    leads, prefills = [], []
    draft_levels, prefill = drafting.model.draft_levels, drafting.model.prefill
    monkeypatch.setattr(drafting.model, "draft_levels", lambda tokens, cache, levels, pick, lead=None: leads.append(
        None if lead is None else tuple(lead.shape)) or draft_levels(tokens, cache, levels, pick, lead))
    monkeypatch.setattr(drafting.model, "prefill",
                        lambda ids, cache, **kw: prefills.append(len(leads)) or prefill(ids, cache, **kw))
    for name in ("_one_token", "_chain"):
        monkeypatch.setattr(drafting, name, lambda *a: pytest.fail("caught up outside the draft"))
    history = [0, 5, 17, 33, 80, 100]
    for step, extra in enumerate([0, 0, 2, 0, 12, 0]):
        drafting.bind(["r"])
        drafts = drafting.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        fresh = proposer(True)
        fresh.bind(["r"])
        assert drafts == fresh.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0], step
        drafted = drafting.drafted["r"].tree
        node, spine = 0, []
        while drafted.children(0, node) and drafted.children(0, node)[0] < 7:  # the draft's spine
            node = drafted.children(0, node)[0]
            spine.append(int(drafted.tokens[0, node]))
        tail = [(history[-1] * 7 + 3 * i + 1) % 4000 + 50 for i in range(extra)]  # outside the tree
        history = history + spine + tail + [(spine[-1] + 1) % 4096]  # a bonus token
    # the prompt (5 tokens before its root); the deepest spine node; a step outside the tree
    # (1 + root + 3 + 2 tokens); the deepest node again; 1 + 1 + 3 + 12 tokens: prefilled
    assert leads == [(1, 8), (1, 1), (1, 1), (1, 8), (1, 1), None]
    assert set(prefills) == {5}  # before the sixth draft only


def test_solo_steps_leave_the_draft_behind_drafting_what_a_fresh_prefill_does(monkeypatch):
    """``caterpillar:2,2,2+suffix:16:solo=2``: where the request's text repeats its suffix tree
    scores 2 or more and the step drafts it alone, the draft model not run and its state not
    caught up; where the text stops repeating the draft model runs again, from a state brought
    up to every token accepted meanwhile. Every step's drafts equal those of a fresh proposer
    that prefills the whole history. (Eager: which steps run the draft model is decided before
    its levels run, compiled or not.)"""
    proposer = _proposers(monkeypatch, "caterpillar:2,2,2+suffix:16:solo=2")
    drafting = proposer(True)
    drafting.load_model(TARGET)
    levels = []
    draft_levels = drafting.model.draft_levels
    monkeypatch.setattr(drafting.model, "draft_levels", lambda *a, **kw: levels.append(1) or draft_levels(*a, **kw))
    pattern = [5, 17, 33, 80, 100, 7, 9, 11]
    history, ran = [0] + pattern * 3, []
    for step, novel in enumerate([0, 0, 3, 0, 0, 2, 0]):
        drafting.bind(["r"])
        before = len(levels)
        drafts = drafting.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        ran.append(len(levels) > before)
        fresh = proposer(True)
        fresh.bind(["r"])
        assert drafts == fresh.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0], step
        if ran[-1]:  # the draft's spine, all accepted, and a bonus token
            tree, node, new = drafting.drafted["r"].tree, 0, []
            while tree.children(0, node) and tree.children(0, node)[0] < 7:
                node = tree.children(0, node)[0]
                new.append(int(tree.tokens[0, node]))
            new.append((new[-1] + 1) % 4096)
        else:  # three of the suffix tree's tokens accepted, its fourth the bonus: the text goes on
            new = drafts[:4]
        tail = [(history[-1] * 7 + 3 * i + 1) % 4000 + 50 for i in range(novel)]  # text it never saw
        history = history + new + tail
    # solo while the pattern repeats; the draft model after new text, caught up over three solo
    # steps' tokens and the new ones, and again after one solo step
    assert ran == [False, False, False, True, True, False, True]


def _conversation(proposer: StreeProposer) -> list[list[int]]:
    """A conversation's first turn (request "t1", three steps), another request, then its second
    turn ("t2": t1's whole history and new user tokens, three steps); each step commits part of
    its draft and a token of its own. Returns every step's drafts."""
    drafts, history = [], [(7 * i) % 50 + 3 for i in range(24)]
    for rid, steps in (("t1", 3), ("other", 1), ("t2", 3)):
        h = list(range(40, 60)) if rid == "other" else history + ([9, 8, 7, 6] if rid == "t2" else [])
        for step in range(steps):
            proposer.bind([rid])
            tokens = proposer.propose([[h[-1]]], [len(h)], torch.tensor([h]))[0]
            drafts.append(tokens)
            h = h + tokens[:step % 3] + [(5 * step) % 40 + 3]
        if rid == "t1":
            history = h
    return drafts


@pytest.mark.parametrize("tree", ["caterpillar:2,2,2", "caterpillar:2,2,2+suffix:16"])
def test_a_resumed_conversation_restores_the_drafts_state(monkeypatch, tree):
    """Where vLLM caches prefixes the draft keeps its state at the end of each request that leaves
    the batch, and a later request extending it (the conversation's next turn) restores it instead
    of prefilling the draft over the whole history: its drafts equal those of a proposer without
    the cache; ``draft_prefix_cache_bytes=0`` turns it off."""
    def proposer(prefix_caching: bool) -> StreeProposer:
        config = _config(tree, True, 2, prefix_caching)
        config.model_config.get_vocab_size = lambda: 4096
        return StreeProposer(config)

    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()
    cached, uncached = proposer(True), proposer(False)
    assert uncached.prefix_cache is None
    kept = []
    original = cached.prefix_cache.insert
    monkeypatch.setattr(cached.prefix_cache, "insert", lambda *a, **k: kept.append(len(a[3])) or original(*a, **k))
    assert _conversation(cached) == _conversation(uncached)
    t1 = kept[0]  # the committed history t1 left with: more than its prompt less the root
    assert t1 > 23 and cached.prefix_cache.stats.inserted == 2  # t1's end and the other request's
    assert cached.prefix_cache.stats.draft_cached_tokens == t1  # t2 prefilled only what follows
    DraftSpec(DRAFT, tree, draft_prefix_cache_bytes=0).to_env()
    assert proposer(True).prefix_cache is None
