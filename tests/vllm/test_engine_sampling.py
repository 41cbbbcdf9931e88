"""Sampled decoding inside vLLM against the exact distribution: the joint distribution of the first
three new tokens at T = 1, enumerated from the target's own model (stree, plain PyTorch) on a
4-token vocabulary, checked by a chi-square test that rejects a wrong distribution (the draft's).

vLLM's own non-speculative sampling passes; so do ``method: "stree"`` (chains and trees) and vLLM's own ``ngram``,
which without the plugin's ``expand_kernel`` fix (stree.vllm.cpu_spec) failed with p = 0.0."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM

from tests.vllm import engine

VOCAB, PROMPT, N_TOKENS, N_SAMPLES = 4, [1, 2, 3], 3, 1500
ALPHA = 1e-3


def _model(seed: int, scale: float = 3.0) -> MambaInLlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = MambaInLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, head_dim=32, attn_layers=(1,))
    model = MambaInLlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked, prompt-dependent distribution rather than a flat one
        model.lm_head.weight.mul_(scale)
    return model.eval()


def _joint(model) -> np.ndarray:
    """P(t1, t2, t3 | PROMPT), enumerated: (VOCAB ** 3,) in itertools.product order."""
    probs = []
    with torch.no_grad():
        for seq in itertools.product(range(VOCAB), repeat=N_TOKENS):
            ids = torch.tensor([PROMPT + list(seq)])
            logp = model(ids)[0].float().log_softmax(-1)  # (l, v)
            probs.append(sum(logp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(seq)))
    p = np.exp(np.array(probs))
    return p / p.sum()


def _counts(sequences) -> np.ndarray:
    index = {seq: i for i, seq in enumerate(itertools.product(range(VOCAB), repeat=N_TOKENS))}
    counts = np.zeros(VOCAB ** N_TOKENS)
    for s in sequences:
        counts[index[tuple(s[:N_TOKENS])]] += 1
    return counts


def _pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    keep = p * counts.sum() >= 5  # pool the cells too rare for the chi-square approximation
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(p[keep], p[~keep].sum()) * counts.sum()
    nonzero = expected > 0
    return chisquare(observed[nonzero], expected[nonzero]).pvalue


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target, draft = _model(0), _model(1)
    target.save_pretrained(str(root / "target"))
    draft.save_pretrained(str(root / "draft"))
    return str(root / "target"), str(root / "draft"), _joint(target), _joint(draft)


def _sample(target: str, speculative_config: dict | None = None) -> dict:
    eng = {"model": target, "skip_tokenizer_init": True, "max_num_seqs": 64}
    if speculative_config:
        eng["speculative_config"] = speculative_config
    return engine.result(engine.run({"engine": eng, "prompts": [PROMPT] * N_SAMPLES,
                                     "sampling": {"temperature": 1.0, "max_tokens": N_TOKENS, "ignore_eos": True}}))


def test_chi_square_rejects_a_wrong_distribution(pair):
    """The control: as many draws from the draft's distribution fail the test."""
    _, _, p_target, p_draft = pair
    assert _pvalue(np.random.default_rng(0).multinomial(N_SAMPLES, p_draft), p_target) < ALPHA


def test_vllm_sampling_matches_exact_distribution(pair):
    """vLLM without speculation: validates the oracle and the test."""
    target, _, p_target, _ = pair
    assert _pvalue(_counts(_sample(target)["tokens"]), p_target) > ALPHA


def test_stree_verifies_with_the_draft_distributions(pair):
    """The target's own weights as the draft at T = 1: with the draft's distributions vLLM's
    rejection sampler accepts a token with probability min(1, p/q) = 1 (up to rounding between
    vLLM's and stree's kernels); the one-hot rule, without them, would accept it only with
    probability p(x), about E[p] on this peaked vocabulary (computed below). Exact either way."""
    target, _, p_target, _ = pair
    out = _sample(target, {"method": "stree", "model": target, "tree": "chain:3", "verifier": "sps"})
    spec = out["spec"]
    acceptance = spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_draft_tokens"]
    with torch.no_grad():  # E_x~p [p(x)] at the first new token: the one-hot rule's acceptance
        p_first = _model(0)(torch.tensor([PROMPT]))[0, -1].float().softmax(-1)
    one_hot = (p_first * p_first).sum().item()
    assert one_hot < 0.9 and acceptance > 0.97
    assert _pvalue(_counts(out["tokens"]), p_target) > ALPHA


@pytest.mark.parametrize("method", ["stree", "stree-vllm", "stree-asps", "stree-tree", "stree-suffix",
                                    "stree-merged", "ngram"])
def test_speculative_sampling_matches_exact_distribution(pair, method):
    """stree's chain under SpS (verified by stree inside the engine, the CPU default, and by
    vLLM's rejection sampler), stree's chain under ASpS and stree's tree (stree's verifiers inside
    the engine; the tree's children drawn without replacement from the draft, MSS), a suffix tree
    (no draft model; chosen children, naive sampling), a merged tree (drawn and chosen children
    under one node, MSS's rule for the mix) and vLLM's ngram."""
    target, draft, p_target, _ = pair
    config = {"stree": {"method": "stree", "model": draft, "tree": "chain:3"},
              "stree-vllm": {"method": "stree", "model": draft, "tree": "chain:3", "verifier": "sps"},
              "stree-asps": {"method": "stree", "model": draft, "tree": "chain:3", "verifier": "asps"},
              "stree-tree": {"method": "stree", "model": draft, "tree": "caterpillar:2,2,2"},
              "stree-suffix": {"method": "stree", "tree": "suffix:4"},
              "stree-merged": {"method": "stree", "model": draft, "tree": "caterpillar:2,2,2+suffix:4"},
              "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                        "prompt_lookup_min": 1}}[method]
    out = _sample(target, config)
    spec = out["spec"]
    assert 0 < spec["vllm:spec_decode_num_accepted_tokens"] < spec["vllm:spec_decode_num_draft_tokens"]
    assert _pvalue(_counts(out["tokens"]), p_target) > ALPHA
