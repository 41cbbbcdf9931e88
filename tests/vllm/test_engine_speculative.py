"""Speculative decoding inside vLLM on the shipped MambaInLlama target: ``method: "stree"`` with
three drafts, and vLLM's own ``ngram`` (which the plugin makes exact on CPU), each equal token for
token to the target's own greedy decoding (stree, plain PyTorch) over 64 tokens, four concurrent
requests of different lengths. One engine per configuration."""
import pytest

from tests.vllm import drafts, engine
from tests.vllm.test_engine_mambainllama import N_NEW, PROMPTS, _own_greedy

TARGET, SHIPPED_DRAFT = "models/stree-tiny/target", "models/stree-tiny/draft"
GREEDY = {"temperature": 0.0, "max_tokens": N_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    return _own_greedy(TARGET)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"own": TARGET, "shipped": SHIPPED_DRAFT,
            "perturbed": drafts.perturbed_copy(TARGET, str(root / "perturbed")),
            "unrelated": drafts.unrelated(4096, str(root / "unrelated"))}


def _run(speculative_config):
    proc = engine.run({"engine": {"model": TARGET, "speculative_config": speculative_config},
                       "prompts": PROMPTS, "sampling": GREEDY})
    return engine.result(proc)


def _acceptance(out, per: str = "draft_tokens") -> float:
    """Accepted tokens per draft token (or, with ``per="drafts"``, per speculative step)."""
    spec = out["spec"]
    assert spec["vllm:spec_decode_num_drafts"] > 0  # it did speculate
    return spec["vllm:spec_decode_num_accepted_tokens"] / spec[f"vllm:spec_decode_num_{per}"]


@pytest.mark.parametrize("draft, verifier, low, high", [
    ("own", None, 0.9, 1.0),        # the target's own weights: everything accepted but the cut at the end
    ("perturbed", None, 0.05, 0.9),
    ("perturbed", "sps", 0.05, 0.9),  # vLLM's rejection sampler (the CPU default verifies in stree)
    ("unrelated", None, 0.0, 0.3),  # mostly rejected
])
def test_stree_chain_equals_own_greedy(reference, draft_dirs, draft, verifier, low, high):
    spec = {"method": "stree", "model": draft_dirs[draft], "tree": "chain:4"}
    out = _run(spec if verifier is None else {**spec, "verifier": verifier})
    assert out["tokens"] == reference
    assert low <= _acceptance(out) <= high


def test_vllm_ngram_exact_with_plugin(reference):
    """vLLM's own ngram speculation, prefix caching left at its default: lossy on CPU without the
    plugin's fixes (stree.vllm.cpu_spec), exact with them."""
    out = _run({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert out["tokens"] == reference
    _acceptance(out)


@pytest.mark.parametrize("spec", [{"tree": "chain:4", "verifier": "sps"}, {"tree": "chain:4"},
                                  {"tree": "caterpillar:2,2,2,2"}])
def test_continuous_batching_reuses_draft_slots(spec):
    """Ten requests of different prompt and output lengths through four sequence slots, with
    chains verified by vLLM (``"verifier": "sps"``) and by stree (the CPU default) and trees
    (stree verifies in the engine): requests finish at different times, new ones take their place
    (their draft state-pool rows, Mamba state slots and KV blocks), and every request's tokens
    equal the target's own greedy decoding."""
    prompts = [list(range(5 + i, 5 + 3 * i + 2)) for i in range(10)]
    lengths = [8 + 7 * (i % 4) for i in range(10)]
    proc = engine.run({"engine": {"model": TARGET, "speculative_config": {"method": "stree", "model": SHIPPED_DRAFT,
                                                                          **spec}},
                       "prompts": prompts, "sampling": {"temperature": 0.0, "max_tokens": max(lengths),
                                                        "ignore_eos": True},
                       "max_tokens": lengths})
    assert engine.result(proc)["tokens"] == own_greedy_of(prompts, lengths)


def test_batch_size_schedule_speculates_only_when_the_engine_is_not_busy():
    """vLLM's ``num_speculative_tokens_per_batch_size`` passes through stree's dict: with three or
    four requests running the proposer drafts nothing, with two vLLM verifies the first three
    nodes of each tree (a subtree), alone the whole tree; the output stays the target's own."""
    lengths = [64, 8, 16, 24]  # the first request runs alone for its last 40 tokens
    spec = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2,2",
            "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 2, 3], [3, 4, 0]]}
    out = engine.result(engine.run({"engine": {"model": TARGET, "speculative_config": spec}, "prompts": PROMPTS,
                                    "sampling": GREEDY, "max_tokens": lengths}))
    assert out["tokens"] == own_greedy_of(PROMPTS, lengths)
    spec = out["spec"]
    # some steps verified 3-node subtrees, others whole 8-node trees: the schedule reached the proposer
    assert 3 < spec["vllm:spec_decode_num_draft_tokens"] / spec["vllm:spec_decode_num_drafts"] < 8


def own_greedy_of(prompts, lengths) -> list[list[int]]:
    """The shipped target's own greedy continuation of each prompt (stree, plain PyTorch)."""
    import torch

    import stree
    import stree.hybrid

    model = stree.hybrid.MambaInLlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return [stree.generate(model, None, torch.tensor([p]), n, method="ar").sequences[0, len(p):].tolist()
            for p, n in zip(prompts, lengths)]
