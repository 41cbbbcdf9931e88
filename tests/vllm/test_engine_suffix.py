"""Suffix trees inside vLLM (``"tree": "suffix:16"``, no draft model; merged with the shipped
draft's tree): greedy output equal token for token to the target's own greedy decoding (eager;
compiled: tests/vllm/test_engine_compiled.py, a CPU's default merged tree), with steps where a
request has no match (it proposes nothing), continuous batching and aborts; the engine's cache of
earlier outputs is drafted from and stays bounded; bad settings are refused at start-up; a merged
tree with ``solo`` is exact too. (Sampled output: tests/vllm/test_engine_sampling.py.) The
engines that generate run in one child process, one after another, and so do those refused."""
import pytest

from tests.vllm import engine
from tests.vllm.test_engine_mambainllama import PROMPTS
from tests.vllm.test_engine_speculative import GREEDY, SHIPPED_DRAFT, TARGET, own_greedy_of, run_all, target_run
from tests.vllm.test_engine_speculative import reference  # noqa: F401

SUFFIX = {"method": "stree", "tree": "suffix:16"}
MERGED = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2+suffix:16"}
SOLO = {**MERGED, "tree": MERGED["tree"] + ":solo=2"}
LATE = [[40, 41, 42, 43] * 5, list(range(100, 150))]  # the requests that take the aborted ones' places
REPEATED = [PROMPTS[0]] * 3


@pytest.fixture(scope="module")
def runs():
    plan = {"suffix": target_run(SUFFIX), "merged": target_run(MERGED), "solo": target_run(SOLO),
            "abort": target_run(SUFFIX, abort={"requests": [1, 2], "after_steps": 4, "late": LATE})}
    for name, requests in (("cache", 1024), ("none", 0)):  # one sequence slot, the same prompt three times
        plan[name] = target_run({**SUFFIX, "suffix_cache_requests": requests}, prompts=REPEATED)
        plan[name]["engine"]["max_num_seqs"] = 1
    return run_all(plan)


@pytest.mark.parametrize("name", ["suffix", "merged"])
def test_equals_own_greedy(reference, runs, name):
    """Four concurrent requests of different lengths, 64 tokens: the suffix tree drafts where the
    text repeats and proposes nothing elsewhere (zero-draft steps), and the output is exact."""
    out = runs[name]
    assert out["tokens"] == reference
    s = out["spec"]
    assert 0 < s["vllm:spec_decode_num_accepted_tokens"] < s["vllm:spec_decode_num_draft_tokens"]


def test_solo_merged_equals_own_greedy(reference, runs):
    """``caterpillar:2,2,2+suffix:16:solo=2`` (a CPU's default tree has ``solo=4``, compiled in
    tests/vllm/test_engine_compiled.py): a request whose suffix tree scores ``solo`` drafts it
    alone, in a draft call of its own beside the others' (the draft model left behind until it
    next runs); the output is exact."""
    assert runs["solo"]["tokens"] == reference
    assert runs["solo"]["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_continuous_batching_and_aborts(runs):
    """Two of four requests aborted mid-generation, two new ones take their places (their suffix
    rows and outputs in the cache, their Mamba state slots and KV blocks): every request that
    finishes equals the target's own greedy decoding."""
    out = runs["abort"]["finished"]
    assert sorted(out) == ["0", "3", "late0", "late1"]
    want = own_greedy_of(PROMPTS + LATE, [GREEDY["max_tokens"]] * 6)
    assert [out["0"], out["3"], out["late0"], out["late1"]] == [want[0], want[3], want[4], want[5]]


def test_earlier_outputs_are_drafted_from(runs):
    """One sequence slot, the same prompt three times: the second and third requests draft the
    first one's output from the engine's cache and accept more than with the cache off, equal to
    the target's own greedy decoding either way."""
    want = own_greedy_of(REPEATED, [GREEDY["max_tokens"]] * 3)
    assert runs["cache"]["tokens"] == runs["none"]["tokens"] == want
    accepted = {k: runs[k]["spec"]["vllm:spec_decode_num_accepted_tokens"] for k in ("cache", "none")}
    assert accepted["cache"] > accepted["none"] + 20


BAD = {
    "runs no draft model": {"method": "stree", "tree": "suffix:16", "model": SHIPPED_DRAFT},
    "needs 'model'": {"method": "stree", "tree": "caterpillar:2,2,2+suffix:16"},
    "bad tree size": {"method": "stree", "tree": "suffix:0"},
    "unknown suffix option": {"method": "stree", "tree": "suffix:16:colour=red"},
    "suffix_cache_requests": {"method": "stree", "tree": "suffix:16", "suffix_cache_requests": -1},
    "suffix_cache_tokens": {"method": "stree", "tree": "suffix:16", "suffix_cache_tokens": 0},
}


@pytest.fixture(scope="module")
def refused():
    """Each of :data:`BAD` as the target's speculative_config, one after another in one child:
    ``{message: traceback}``."""
    out = engine.refusals([{"model": TARGET, "speculative_config": spec} for spec in BAD.values()])
    return dict(zip(BAD, out))


@pytest.mark.parametrize("message", list(BAD))
def test_bad_settings_are_refused_at_start_up(refused, message):
    assert refused[message] is not None and "EngineCore" not in refused[message]  # before any engine
    assert message in refused[message]
