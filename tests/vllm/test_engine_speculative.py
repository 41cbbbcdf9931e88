"""Speculative decoding inside vLLM on the shipped MambaInLlama target: ``method: "stree"`` with
three drafts, and vLLM's own ``ngram`` (which the plugin makes exact on CPU), each equal token for
token to the target's own greedy decoding (stree, plain PyTorch) over 64 tokens, four concurrent
requests of different lengths. Every engine of the module runs in one child process, one after
another (:func:`runs`)."""
import pytest

from tests.vllm import drafts, engine
from tests.vllm.test_engine_mambainllama import N_NEW, PROMPTS, _own_greedy

TARGET, SHIPPED_DRAFT = "models/stree-tiny/target", "models/stree-tiny/draft"
GREEDY = {"temperature": 0.0, "max_tokens": N_NEW, "ignore_eos": True}

CHAINS = [  # (draft, verifier, low, high): accepted tokens per draft token
    ("own", None, 0.9, 1.0),        # the target's own weights: everything accepted but the cut at the end
    ("perturbed", None, 0.05, 0.9),
    ("perturbed", "sps", 0.05, 0.9),  # vLLM's rejection sampler (the CPU default verifies in stree)
    ("unrelated", None, 0.0, 0.3),  # mostly rejected
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
BATCHING = [{"tree": "chain:4", "verifier": "sps"}, {"tree": "chain:4"}, {"tree": "caterpillar:2,2,2,2"}]
# ten requests of different prompt and output lengths through four sequence slots
BATCHING_PROMPTS = [list(range(5 + i, 5 + 3 * i + 2)) for i in range(10)]
BATCHING_LENGTHS = [8 + 7 * (i % 4) for i in range(10)]
SCHEDULE_LENGTHS = [64, 8, 16, 24]  # the first request runs alone for its last 40 tokens
SCHEDULE = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2,2",
            "num_speculative_tokens_per_batch_size": [[1, 1, 8], [2, 2, 3], [3, 4, 0]]}


@pytest.fixture(scope="module")
def reference():
    return _own_greedy(TARGET)


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"own": TARGET, "shipped": SHIPPED_DRAFT,
            "perturbed": drafts.perturbed_copy(TARGET, str(root / "perturbed")),
            "unrelated": drafts.unrelated(4096, str(root / "unrelated"))}


def target_run(speculative_config: dict | None, **spec) -> dict:
    """An engine spec (tests/vllm/engine.py) of the shipped target with ``speculative_config``,
    on :data:`PROMPTS` greedily unless ``spec`` says otherwise."""
    engine_args = {"model": TARGET, **({"speculative_config": speculative_config} if speculative_config else {})}
    return {"engine": engine_args, "prompts": PROMPTS, "sampling": GREEDY, **spec}


def run_all(plan: dict) -> dict:
    """Run every engine spec of ``plan`` in one child, one after another: ``{key: result}``."""
    return dict(zip(plan, engine.result(engine.run({"runs": list(plan.values())}, timeout=1800))["runs"]))


@pytest.fixture(scope="module")
def runs(draft_dirs):
    plan = {("chain", draft, verifier): target_run({"method": "stree", "model": draft_dirs[draft], "tree": "chain:4",
                                                   **({"verifier": verifier} if verifier else {})})
            for draft, verifier, _, _ in CHAINS}
    for i, spec in enumerate(BATCHING):
        plan["batching", i] = target_run(
            {"method": "stree", "model": SHIPPED_DRAFT, **spec}, prompts=BATCHING_PROMPTS,
            sampling={"temperature": 0.0, "max_tokens": max(BATCHING_LENGTHS), "ignore_eos": True},
            max_tokens=BATCHING_LENGTHS)
    plan["schedule"] = target_run(SCHEDULE, max_tokens=SCHEDULE_LENGTHS)
    # last: once vLLM's ngram proposer has loaded its numba kernels, vLLM's CPU platform fails to
    # rebind its Triton kernels for a further engine in the same process
    plan["ngram"] = target_run(NGRAM)
    return run_all(plan)


def _acceptance(out, per: str = "draft_tokens") -> float:
    """Accepted tokens per draft token (or, with ``per="drafts"``, per speculative step)."""
    spec = out["spec"]
    assert spec["vllm:spec_decode_num_drafts"] > 0  # it did speculate
    return spec["vllm:spec_decode_num_accepted_tokens"] / spec[f"vllm:spec_decode_num_{per}"]


@pytest.mark.parametrize("draft, verifier, low, high", CHAINS)
def test_stree_chain_equals_own_greedy(reference, runs, draft, verifier, low, high):
    out = runs["chain", draft, verifier]
    assert out["tokens"] == reference
    assert low <= _acceptance(out) <= high


def test_vllm_ngram_exact_with_plugin(reference, runs):
    """vLLM's own ngram speculation, prefix caching left at its default: lossy on CPU without the
    plugin's fixes (stree.vllm.cpu_spec), exact with them."""
    assert runs["ngram"]["tokens"] == reference
    _acceptance(runs["ngram"])


@pytest.mark.parametrize("i", range(len(BATCHING)), ids=["chain-sps", "chain", "tree"])
def test_continuous_batching_reuses_draft_slots(runs, i):
    """Ten requests of different prompt and output lengths through four sequence slots, with
    chains verified by vLLM (``"verifier": "sps"``) and by stree (the CPU default) and trees
    (stree verifies in the engine): requests finish at different times, new ones take their place
    (their draft state-pool rows, Mamba state slots and KV blocks), and every request's tokens
    equal the target's own greedy decoding."""
    assert runs["batching", i]["tokens"] == own_greedy_of(BATCHING_PROMPTS, BATCHING_LENGTHS)


def test_batch_size_schedule_speculates_only_when_the_engine_is_not_busy(runs):
    """vLLM's ``num_speculative_tokens_per_batch_size`` passes through stree's dict: with three or
    four requests running the proposer drafts nothing, with two vLLM verifies the first three
    nodes of each tree (a subtree), alone the whole tree; the output stays the target's own."""
    out = runs["schedule"]
    assert out["tokens"] == own_greedy_of(PROMPTS, SCHEDULE_LENGTHS)
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
