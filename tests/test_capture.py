"""Compiled steps (``stree.capture``): the verify step and a draft level of a tiny hybrid compile
with ``torch.compile(fullgraph=True)`` (no graph break, no host sync), give the eager logits
within fp32 tolerance, and ``stree.generate(compile=True)`` emits the eager greedy tokens."""
import pytest
import torch

import stree
from stree import capture
from stree.draft.base import forward_level
from stree.patch import level_step, tree_step
from stree.tree import TokenTree
from tests.test_model_hybrid import VOCAB, make_hybrid

pytestmark = pytest.mark.skipif(capture.unavailable() is not None,
                                reason=f"torch.compile unavailable: {capture.unavailable()}")

PARENTS = [-1, 0, 0, 1, 2]


def _model():
    return stree.patch(make_hybrid((1,), seed=7))  # Mamba2, attention, Mamba2 layers


def _prefilled(model):
    cache = model.allocate_tree_cache(2, 32)
    model.prefill([torch.tensor([3, 9, 4]), torch.tensor([1, 2, 5, 8, 6])], cache)  # ragged rows
    return cache


def test_compiled_steps_match_eager():
    torch.manual_seed(0)
    model = _model()
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)
    cache = _prefilled(model)
    eager = model.tree_forward(tree, cache)
    levels = [forward_level(model, cache, TokenTree(tree.tokens[:, :e], PARENTS[:e]), s, e, 5)
              for s, e in [(0, 1), (1, 3)]]
    cache = _prefilled(model)
    steps = capture.compiled_steps(model)
    torch._dynamo.reset()
    with capture.compiled(model):
        assert model._stree_steps is steps and steps.static
        compiled = model.tree_forward(tree, cache)
        compiled_levels = [forward_level(model, cache, TokenTree(tree.tokens[:, :e], PARENTS[:e]),
                                         s, e, 5) for s, e in [(0, 1), (1, 3)]]
    assert getattr(model, "_stree_steps", None) is None  # eager again after the block
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    for c, e in zip(compiled_levels, levels):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    # fullgraph=True raises on a graph break, so reaching here means one graph per call; the
    # functions really were compiled (not run eagerly after a backend failure)
    assert steps.tree.fn is not tree_step and steps.level.fn is not level_step


def test_generate_compiled_greedy_tokens_equal_eager(monkeypatch):
    # the same fullgraph capture; a backend with no C++ compilation keeps the test fast
    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(1)
    target = _model()
    draft = stree.patch(make_hybrid((), seed=11))
    prompt = torch.randint(0, VOCAB, (1, 6))
    kw = dict(max_new_tokens=12, drafter="static:2,2")
    eager = stree.generate(target, draft, prompt, **kw)
    compiled = stree.generate(target, draft, prompt, compile=True, **kw)
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    assert compiled.stats.target_calls == eager.stats.target_calls


def test_compile_refuses_dynamic_drafters():
    with pytest.raises(ValueError, match="compile=True needs a fixed tree template"):
        stree.generate(_model(), _model(), torch.tensor([[1, 2]]), 4, drafter="dyspec:8",
                       compile=True)
    with pytest.raises(ValueError, match="compile=True needs a fixed tree template"):
        stree.generate(_model(), None, torch.tensor([[1, 2]]), 4, method="ar", compile=True)


def test_mamba_ssm_steps_compile_without_graph_break(monkeypatch):
    """mamba_ssm's MambaLMHeadModel (Mamba2 + MHA) through the same fullgraph capture."""
    from tests.test_model_mamba2 import make_model

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")  # the capture is what is tested here
    model = stree.patch(make_model(attn_layer_idx=(1,), n_layer=3))
    cache = model.allocate_tree_cache(1, 32)
    model.prefill(torch.tensor([[3, 9, 4]]), cache)
    tree = TokenTree(torch.tensor([[5, 6, 7, 8, 9]]), PARENTS)
    level = TokenTree(tree.tokens[:, :3], PARENTS[:3])
    eager, eager_level = model.tree_forward(tree, cache), forward_level(model, cache, level, 0, 1, 5)
    with capture.compiled(model):
        compiled = model.tree_forward(tree, cache)
        compiled_level = forward_level(model, cache, level, 0, 1, 5)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled_level, eager_level, rtol=1e-4, atol=1e-4)
