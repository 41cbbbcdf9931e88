"""Suffix trees inside vLLM (``"tree": "suffix:16"``, no draft model; merged with the shipped
draft's tree): greedy output equal token for token to the target's own greedy decoding, eager and
compiled, with steps where a request has no match (it proposes nothing), continuous batching and
aborts; the engine's cache of earlier outputs is drafted from and stays bounded; bad settings are
refused at start-up; a merged tree with ``solo`` is exact too. (Sampled output:
tests/vllm/test_engine_sampling.py.) One engine per configuration."""
import pytest

from tests.vllm import engine
from tests.vllm.test_engine_mambainllama import PROMPTS
from tests.vllm.test_engine_speculative import GREEDY, SHIPPED_DRAFT, TARGET, own_greedy_of
from tests.vllm.test_engine_speculative import reference  # noqa: F401

SUFFIX = {"method": "stree", "tree": "suffix:16"}
MERGED = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2+suffix:16"}


def _run(spec: dict, **engine_kwargs) -> dict:
    return engine.result(engine.run({"engine": {"model": TARGET, "speculative_config": spec, **engine_kwargs},
                                     "prompts": PROMPTS, "sampling": GREEDY}))


@pytest.mark.parametrize("spec, eager", [(SUFFIX, True), (MERGED, True), (MERGED, False)],
                         ids=["suffix-eager", "merged-eager", "merged-compiled"])
def test_equals_own_greedy(reference, spec, eager):
    """Four concurrent requests of different lengths, 64 tokens: the suffix tree drafts where the
    text repeats and proposes nothing elsewhere (zero-draft steps), and the output is exact.
    Compiled once, with the draft (its levels compiled too; a compiled engine costs minutes on
    this CPU: the solo test below and tests/vllm/test_engine_compiled.py run compiled too)."""
    out = _run(spec, enforce_eager=eager)
    assert out["tokens"] == reference
    s = out["spec"]
    assert 0 < s["vllm:spec_decode_num_accepted_tokens"] < s["vllm:spec_decode_num_draft_tokens"]


@pytest.mark.parametrize("spec, eager", [({**MERGED, "tree": MERGED["tree"] + ":solo=2"}, True),
                                         ({k: v for k, v in MERGED.items() if k != "tree"}, False)],
                         ids=["solo=2-eager", "default-compiled"])
def test_solo_merged_equals_own_greedy(reference, spec, eager):
    """``caterpillar:2,2,2+suffix:16:solo=2`` (eager), and a CPU's default tree with a draft
    (``solo=4``, compiled): a request whose suffix tree scores ``solo`` drafts it alone, in a draft
    call of its own beside the others' (the draft model left behind until it next runs); the
    output is exact."""
    out = _run(spec, enforce_eager=eager)
    assert out["tokens"] == reference
    assert out["spec"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_continuous_batching_and_aborts():
    """Two of four requests aborted mid-generation, two new ones take their places (their suffix
    rows and outputs in the cache, their Mamba state slots and KV blocks): every request that
    finishes equals the target's own greedy decoding."""
    late = [[40, 41, 42, 43] * 5, list(range(100, 150))]
    out = engine.result(engine.run({"engine": {"model": TARGET, "speculative_config": SUFFIX}, "prompts": PROMPTS,
                                    "sampling": GREEDY, "abort": {"requests": [1, 2], "after_steps": 4,
                                                                  "late": late}}))["finished"]
    assert sorted(out) == ["0", "3", "late0", "late1"]
    want = own_greedy_of(PROMPTS + late, [GREEDY["max_tokens"]] * 6)
    assert [out["0"], out["3"], out["late0"], out["late1"]] == [want[0], want[3], want[4], want[5]]


def test_earlier_outputs_are_drafted_from():
    """One sequence slot, the same prompt three times: the second and third requests draft the
    first one's output from the engine's cache and accept more than with the cache off, equal to
    the target's own greedy decoding either way."""
    prompts = [PROMPTS[0]] * 3
    runs = {}
    for name, requests in (("cache", 1024), ("none", 0)):
        spec = {**SUFFIX, "suffix_cache_requests": requests}
        runs[name] = engine.result(engine.run({"engine": {"model": TARGET, "speculative_config": spec,
                                                          "max_num_seqs": 1},
                                               "prompts": prompts, "sampling": GREEDY}))
    want = own_greedy_of(prompts, [GREEDY["max_tokens"]] * 3)
    assert runs["cache"]["tokens"] == runs["none"]["tokens"] == want
    accepted = {k: v["spec"]["vllm:spec_decode_num_accepted_tokens"] for k, v in runs.items()}
    assert accepted["cache"] > accepted["none"] + 20


@pytest.mark.parametrize("spec, pattern", [
    ({"method": "stree", "tree": "suffix:16", "model": SHIPPED_DRAFT}, "runs no draft model"),
    ({"method": "stree", "tree": "caterpillar:2,2,2+suffix:16"}, "needs 'model'"),
    ({"method": "stree", "tree": "suffix:0"}, "bad tree size"),
    ({"method": "stree", "tree": "suffix:16:colour=red"}, "unknown suffix option"),
    ({"method": "stree", "tree": "suffix:16", "suffix_cache_requests": -1}, "suffix_cache_requests"),
    ({"method": "stree", "tree": "suffix:16", "suffix_cache_tokens": 0}, "suffix_cache_tokens"),
], ids=["model-given", "model-missing", "size", "option", "requests", "tokens"])
def test_bad_settings_are_refused_at_start_up(spec, pattern):
    proc = engine.run({"engine": {"model": TARGET, "speculative_config": spec}, "prompts": PROMPTS[:1],
                       "sampling": GREEDY})
    assert proc.returncode != 0
    assert pattern in proc.stderr
