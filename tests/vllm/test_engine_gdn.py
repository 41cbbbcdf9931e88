"""Gated DeltaNet targets inside vLLM with ``method: "stree"`` (stree.vllm.gated_delta): tiny random
Qwen3.5, Qwen3-Next and Qwen3.5-MoE checkpoints (bf16: vLLM's CPU GDN op runs nothing else), four
concurrent requests of different lengths (prefills beside trees, steps where a suffix tree
proposes nothing, one request with a repetition penalty, which vLLM verifies itself), greedy
output against vLLM's own decoding of the same target: suffix trees with no draft model, a
draft's trees (a MambaInLlama draft of the same vocabulary), merged trees, eager and compiled,
aborts. All engines in one child process. Sampled trees at T = 1 against the exact distribution:
a chi-square test, with a control that fails.

The tree rows compute the rule in fp32 from vLLM's bf16 inputs and state, vLLM's own op in bf16, so
a token may differ where the two are within bf16 rounding of a tie: from each difference on, every
token must be near-greedy for the fp32 model (transformers' own, teacher-forced; tests/vllm/gdn.py),
and at least half the requests must match token for token.

vLLM's Qwen3.5 classes import its Qwen3-VL module, whose image processors import torchvision:
``scripts/venv-vllm`` keeps torchvision 0.28.0 with its C++ ops unloaded (the first test)."""
import numpy as np
import pytest
import torch

import stree  # noqa: F401  (before transformers: its torch paths)

from tests.vllm import drafts, engine, gdn

PROMPTS = [[5, 17, 33, 40, 5, 17, 33, 40, 5, 17], [7, 8, 9, 7, 8, 9, 7, 8], list(range(3, 40)), [11, 12] * 9]
GREEDY = {"temperature": 0.0, "max_tokens": 32, "ignore_eos": True}
SAMPLING = [GREEDY, GREEDY, {**GREEDY, "repetition_penalty": 1.3}, GREEDY]
LATE = [[40, 41, 42, 43] * 5, list(range(20, 58))]
SPECS = {"suffix": ({"tree": "suffix:16"}, {}), "merged": ({"draft": True, "tree": "caterpillar:2,2+suffix:16"}, {}),
         "draft-compiled": ({"draft": True, "tree": "caterpillar:2,2"}, {"enforce_eager": False})}
OTHERS = ("qwen3_next", "qwen3_5_moe")  # the other targets: suffix trees
# requests whose first difference from vLLM's own decoding may come at an fp32 near-tie: two of four
# (seen: the MoE target, whose bf16 router adds ties of its own; compiled, where inductor's bf16
# kernels round otherwise than vLLM's eager decoding; merged trees, once on this CPU)
DIFFERING = 2


def test_torchvision_imports_without_its_cpp_ops():
    import torchvision
    from torchvision.transforms.v2 import functional

    assert torchvision.__version__.startswith("0.28.0")
    assert functional.resize(torch.ones(3, 8, 8), [4, 4]).shape == (3, 4, 4)
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0]), 0.5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn")
    targets = {"qwen3_5": gdn.qwen3_5(root / "qwen3_5"), "qwen3_next": gdn.qwen3_next(root / "qwen3_next"),
               "qwen3_5_moe": gdn.qwen3_5_moe(root / "qwen3_5_moe")}
    draft = drafts.unrelated(gdn.VOCAB, str(root / "draft"))
    plan = [(name, None) for name in targets] + [("qwen3_5", s) for s in SPECS] + [(t, "suffix") for t in OTHERS]
    specs = []
    for name, spec in plan:
        args = {"model": targets[name], "skip_tokenizer_init": True, "dtype": "bfloat16"}
        if spec is not None:
            settings, extra = SPECS[spec]
            config = {"method": "stree", "tree": settings["tree"], **({"model": draft} if settings.get("draft") else {})}
            args = engine.every_step({**args, **extra, "speculative_config": config})
        specs.append({"engine": args, "prompts": PROMPTS, "sampling": SAMPLING})
    # continuous batching with aborts: two of four requests aborted mid-generation, two late ones in
    # their places (their state slots and KV blocks reused), against vLLM's own decoding of those
    base = {"model": targets["qwen3_5"], "skip_tokenizer_init": True, "dtype": "bfloat16"}
    merged = engine.every_step({**base, "speculative_config": {"method": "stree", "model": draft,
                                                                "tree": SPECS["merged"][0]["tree"]}})
    specs += [{"engine": base, "prompts": LATE, "sampling": GREEDY},
              {"engine": merged, "prompts": PROMPTS, "sampling": GREEDY,
               "abort": {"requests": [1, 2], "after_steps": 4, "late": LATE}}]
    plan += [("late", None), ("abort", "merged")]
    out = engine.result(engine.run({"runs": specs}, timeout=1500))["runs"]
    return targets, {key: result for key, result in zip(plan, out)}


@pytest.mark.parametrize("target, spec", [("qwen3_5", s) for s in SPECS] + [(t, "suffix") for t in OTHERS])
def test_stree_equals_vllm_greedy_up_to_bf16_near_ties(runs, target, spec):
    targets, out = runs
    own, tree = out[target, None], out[target, spec]
    # the penalised request is verified by vLLM itself: it must match exactly
    differing = gdn.near_tie_differences(targets[target], PROMPTS, own["tokens"], tree["tokens"],
                                         exact=[i for i, p in enumerate(SAMPLING) if p is not GREEDY])
    assert differing <= DIFFERING
    s = tree["spec"]
    assert s["vllm:spec_decode_num_drafts"] > 0 and s["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """A peaked 4-token Qwen3.5 target and a MambaInLlama draft (tests/vllm/test_engine_sampling.py's),
    the target's exact joint distribution of three new tokens from its fp32 transformers model, and
    1500 draws at T = 1 from vLLM's own sampling and from stree's trees with the draft (MSS)."""
    from transformers import AutoModelForCausalLM

    from tests.vllm import test_engine_sampling as chi

    root = tmp_path_factory.mktemp("gdn-sampling")
    target = gdn.qwen3_5(root / "target", seed=2, vocab=chi.VOCAB, logit_scale=12.0)
    draft = chi._model(1)
    draft.save_pretrained(str(root / "draft"))
    oracle = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    p_target, p_draft = chi._joint(lambda ids: oracle(ids).logits), chi._joint(draft)
    base = {"model": target, "skip_tokenizer_init": True, "dtype": "bfloat16", "max_num_seqs": 64}
    tree = engine.every_step({**base, "speculative_config": {"method": "stree", "model": str(root / "draft"),
                                                              "tree": "caterpillar:2,2,2"}})
    sampling = {"temperature": 1.0, "max_tokens": chi.N_TOKENS, "ignore_eos": True}
    out = engine.result(engine.run({"runs": [{"engine": e, "prompts": [chi.PROMPT] * chi.N_SAMPLES,
                                              "sampling": sampling} for e in (base, tree)]}, timeout=1500))["runs"]
    return chi, p_target, p_draft, out


def test_sampled_trees_match_the_exact_distribution(sampled):
    """vLLM's own sampling (the oracle under bf16) and stree's sampled trees pass the chi-square
    test against the fp32 model's joint distribution; as many draws from the draft's distribution
    (the control) fail it."""
    chi, p_target, p_draft, (own, tree) = sampled
    assert chi._pvalue(np.random.default_rng(0).multinomial(chi.N_SAMPLES, p_draft), p_target) < chi.ALPHA
    assert chi._pvalue(chi._counts(own["tokens"]), p_target) > chi.ALPHA
    s = tree["spec"]
    assert 0 < s["vllm:spec_decode_num_accepted_tokens"] < s["vllm:spec_decode_num_draft_tokens"]
    assert chi._pvalue(chi._counts(tree["tokens"]), p_target) > chi.ALPHA


def test_aborted_and_late_requests_equal_vllm_greedy(runs):
    targets, out = runs
    finished = out["abort", "merged"]["finished"]
    assert sorted(finished) == ["0", "3", "late0", "late1"]
    own = out["qwen3_5", None]["tokens"] + out["late", None]["tokens"]
    tree = [finished["0"], finished["3"], finished["late0"], finished["late1"]]
    reference = [own[0], own[3], own[4], own[5]]
    prompts = [PROMPTS[0], PROMPTS[3], *LATE]
    # every differing request near-greedy throughout, however many differ: the late requests join
    # another batch than their reference's, whose bf16 rounding differs (three of four, once)
    gdn.near_tie_differences(targets["qwen3_5"], prompts, reference, tree)


def test_the_near_greedy_check_fails_a_request_decoded_from_a_wrong_state(tmp_path):
    """The control for the bf16 comparisons above (which vLLM's bf16 outputs pass): a request
    decoded as if another prompt's state were its own (the other prompt, then this one's last
    token) fails the check against the fp32 model's greedy tokens, for every pair of prompts."""
    from transformers import AutoModelForCausalLM

    target = gdn.qwen3_5(tmp_path / "qwen3_5")
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def greedy(ids):
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        return out[0, len(ids):].tolist()

    right = [greedy(p) for p in PROMPTS]
    for r, prompt in enumerate(PROMPTS):
        for other in PROMPTS[:r] + PROMPTS[r + 1:]:
            with pytest.raises(AssertionError, match="near-greedy|differs"):
                gdn.near_tie_differences(target, [prompt], [right[r]], [greedy(other[:-1] + prompt[-1:])])
