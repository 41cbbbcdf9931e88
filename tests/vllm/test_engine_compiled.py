"""vLLM's default mode (``enforce_eager=False``: vLLM compiles the target) with ``method: "stree"``
and a CPU's default tree (``caterpillar:2,2,2+suffix:16:solo=4``: the draft's caterpillar and a
suffix tree merged, the suffix tree alone where it scores 4): the tree wrappers run inside vLLM's
compiled model (its attention and Mamba2 mixer are custom ops, which the compiled graph calls as
they are), and the proposer compiles the draft's levels. Greedy output equal token for token to
the target's own greedy decoding, four concurrent requests of different lengths, in vLLM's default
layout of three processes (the other engine tests run in one: tests/vllm/engine.py). The only
compiled engine of a Mamba2 target in the suite: each costs minutes on this CPU (a chain, a
caterpillar and a suffix tree are trees to the same wrappers; their eager runs:
tests/vllm/test_engine_trees.py and tests/vllm/test_engine_suffix.py)."""
from tests.vllm import engine
from tests.vllm.test_engine_mambainllama import PROMPTS
from tests.vllm.test_engine_speculative import GREEDY, SHIPPED_DRAFT, TARGET, _acceptance
from tests.vllm.test_engine_speculative import reference  # noqa: F401  (the target's own greedy output)


def test_compiled_engine_with_the_default_tree_equals_own_greedy(reference):
    spec = {"method": "stree", "model": SHIPPED_DRAFT}  # no "tree": the CPU default
    out = engine.result(engine.run({"engine": {"model": TARGET, "enforce_eager": False, "speculative_config": spec},
                                    "prompts": PROMPTS, "sampling": GREEDY, "processes": True}))
    assert out["tokens"] == reference
    assert _acceptance(out) > 0
