"""Tree drafts inside vLLM (stree.vllm.step) on the shipped MambaInLlama target: greedy output
equal token for token to the target's own greedy decoding (stree, plain PyTorch) over 64 tokens,
four concurrent requests of different lengths, for static, beam and dynamic trees and three
drafts; requests stree cannot verify, aborts and preemption (continuous batching with trees:
tests/vllm/test_engine_speculative.py). Every engine of the module runs in one child process, one
after another."""
import pytest

from tests.vllm.test_engine_mambainllama import PROMPTS
from tests.vllm.test_engine_speculative import GREEDY, SHIPPED_DRAFT, _acceptance, own_greedy_of, run_all, target_run
# the shipped target's own greedy output and the three drafts, as in the chain tests
from tests.vllm.test_engine_speculative import draft_dirs, reference  # noqa: F401

CATERPILLARS = [  # (draft, low, high): accepted tokens per step
    ("own", 3.6, 4.0),        # the target's own weights: the first child is taken at every level
    ("perturbed", 0.2, 3.6),
    ("unrelated", 0.0, 0.5),  # mostly rejected
]
OTHERS = [("static:fig4a", None), ("beam:2x3", None), ("dyspec:8", None), ("chain:4", "asps")]
TREE = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2,2"}
PENALISED = {**GREEDY, "repetition_penalty": 1.3}
LATE = [[40, 41, 42, 43], list(range(100, 150))]  # the requests that take the aborted ones' places
LONG = [list(range(20 + i, 260 + i)) for i in range(4)]  # 240 tokens: they outgrow one block


@pytest.fixture(scope="module")
def runs(draft_dirs):
    plan = {("caterpillar", d): target_run({**TREE, "model": draft_dirs[d]}) for d, _, _ in CATERPILLARS}
    for tree, verifier in OTHERS:
        plan[tree] = target_run({**TREE, "tree": tree, **({"verifier": verifier} if verifier else {})})
    plan["penalised", None] = target_run(None, sampling=PENALISED)
    plan["penalised", "stree"] = target_run(TREE, sampling=PENALISED)
    plan["abort"] = target_run(TREE, abort={"requests": [1, 2], "after_steps": 4, "late": LATE})
    # 22 blocks of 256 tokens, each request also holding 1 + K blocks of Mamba state
    plan["preempt"] = target_run(TREE, prompts=LONG)
    plan["preempt"]["engine"]["num_gpu_blocks_override"] = 22
    return run_all(plan)


@pytest.mark.parametrize("draft, low, high", CATERPILLARS)
def test_caterpillar_equals_own_greedy(reference, runs, draft, low, high):
    """``caterpillar:2,2,2,2`` (depth 4): the tree's paths are accepted, and K/V and Mamba state
    are committed along them, whatever the draft."""
    out = runs["caterpillar", draft]
    assert out["tokens"] == reference
    assert low <= _acceptance(out, per="drafts") <= high


@pytest.mark.parametrize("tree, verifier", OTHERS)
def test_other_trees_equal_own_greedy(reference, runs, tree, verifier):
    """STree's Fig. 4a static tree, a beam tree, DySpec's dynamic tree (its size varies per step),
    and a chain whose sampled requests ASpS verifies (so stree verifies it in the engine, greedy
    requests greedily), with the shipped draft."""
    out = runs[tree]
    assert out["tokens"] == reference
    assert _acceptance(out, per="drafts") > 0


def test_requests_stree_cannot_verify_fall_back_to_vllm(runs):
    """A repetition penalty is applied by vLLM's sampler only: such a request's tree is verified
    by vLLM as a chain of proposed tokens (lossless), so the output equals vLLM's own
    non-speculative output under the same penalty."""
    out = runs["penalised", "stree"]
    assert out["tokens"] == runs["penalised", None]["tokens"]
    assert out["spec"]["vllm:spec_decode_num_drafts"] > 0


def test_aborted_requests_leave_no_state_behind(runs):
    """Two of four requests are aborted mid-generation and two new ones take their places (their
    draft rows, Mamba state slots and KV blocks, and stree's tree records): every request that
    finishes equals the target's own greedy decoding, and the aborted ones never finish."""
    out = runs["abort"]["finished"]
    assert sorted(out) == ["0", "3", "late0", "late1"]
    want = own_greedy_of(PROMPTS + LATE, [GREEDY["max_tokens"]] * 6)
    assert [out["0"], out["3"], out["late0"], out["late1"]] == [want[0], want[3], want[4], want[5]]


def test_preempted_requests_are_recomputed_exactly(runs):
    """A KV cache too small for the running requests: vLLM preempts running requests and later
    recomputes them; their draft rows and tree records are given back and rebuilt (re-prefilled),
    and every request still equals the target's own greedy decoding."""
    out = runs["preempt"]
    assert out["spec"]["vllm:num_preemptions"] > 0
    assert out["tokens"] == own_greedy_of(LONG, [GREEDY["max_tokens"]] * 4)
