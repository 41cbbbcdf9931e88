"""vLLM's default mode (``enforce_eager=False``: vLLM compiles the target) with ``method: "stree"``:
the tree and chain wrappers run inside vLLM's compiled model (its attention and Mamba2 mixer are
custom ops, which the compiled graph calls as they are), and the proposer compiles the draft's
levels. Greedy output equal token for token to the target's own greedy decoding, four concurrent
requests of different lengths; one engine per configuration, in vLLM's default layout of three
processes (the other engine tests run in one: tests/vllm/engine.py)."""
from tests.vllm import engine
from tests.vllm.test_engine_mambainllama import PROMPTS
from tests.vllm.test_engine_speculative import GREEDY, SHIPPED_DRAFT, TARGET, _acceptance
from tests.vllm.test_engine_speculative import reference  # noqa: F401  (the target's own greedy output)


def test_compiled_engine_equals_own_greedy(reference):
    """A tree (a chain is a tree to the same wrappers; compiled suffix and merged trees:
    tests/vllm/test_engine_suffix.py)."""
    spec = {"method": "stree", "model": SHIPPED_DRAFT, "tree": "caterpillar:2,2,2,2"}
    out = engine.result(engine.run({"engine": {"model": TARGET, "enforce_eager": False, "speculative_config": spec},
                                    "prompts": PROMPTS, "sampling": GREEDY, "processes": True}))
    assert out["tokens"] == reference
    assert _acceptance(out) > 0
