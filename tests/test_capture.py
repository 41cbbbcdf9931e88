"""Compiled steps (``stree.capture``): the verify step and the draft levels of a tiny hybrid (and
of a mamba_ssm model) compile with ``torch.compile(fullgraph=True)`` (a graph break or a host
sync would raise), give the eager logits and states within fp32 tolerance, and
``stree.generate(compile=True)`` emits the eager greedy tokens. The verify step runs through the
default backend (inductor); the other tests use ``aot_eager`` (the same capture, no C++ build)."""
import pytest
import torch

import stree
from stree import capture
from stree.draft.base import commit_draft, forward_level
from stree.steps import level_step, levels_step, tree_step
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


def test_compiled_verify_step_matches_eager():
    """The default backend (inductor: generated C++ on the CPU), one graph: the verify step, its
    weights frozen so that inductor packs its linear layers' weights."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = _model()
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)
    eager = model.tree_forward(tree, _prefilled(model))
    cache = _prefilled(model)
    steps = capture.compiled_steps(model)
    counters.clear()
    with capture.compiled(model):
        assert model._stree_steps is steps and steps.static
        compiled = model.tree_forward(tree, cache)
    assert getattr(model, "_stree_steps", None) is None  # eager again after the block
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    # fullgraph=True raises on a graph break, so this was one graph; and it really ran compiled
    # (not eagerly after a backend failure)
    assert steps.tree.fn is not tree_step
    if torch.backends.mkldnn.is_available():  # frozen weights: packed GEMMs (what eager prepacks)
        assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0


def test_two_models_of_one_shape_each_run_their_own_compiled_graph():
    """Inductor freezes a model's weights into its graph, and the steps skip dynamo's guards on
    modules: two models of the same shapes (different weights) compiled in one process must
    each get their own graphs, never the other's."""
    torch.manual_seed(0)
    a, b = _model(), stree.patch(make_hybrid((1,), seed=8))
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)
    eager = [m.tree_forward(tree, _prefilled(m)) for m in (a, b)]
    assert not torch.allclose(eager[0], eager[1])
    with capture.compiled(a, b):
        compiled = [m.tree_forward(tree, _prefilled(m)) for m in (a, b)]
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_compiled_draft_levels_match_eager(monkeypatch):
    """Every level of a draft and the commit's level through the same fullgraph capture (a
    backend with no C++ compilation keeps it fast), then the committed states."""
    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = _model()
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)
    path, counts = torch.tensor([[0, 2, 4], [0, 1, 3]]), [3, 3]

    def draft_and_commit(cache):
        logits = [forward_level(model, cache, TokenTree(tree.tokens[:, :e], PARENTS[:e]), s, e, 5)
                  for s, e in [(0, 1), (1, 3)]]
        assert commit_draft(model, cache, tree, path, counts, [4, 3], lambda node: node < 3)  # runs nodes 4 and 3
        return logits, [t.clone() for c in cache.layers.values() for t in vars(c).values()]

    eager, eager_state = draft_and_commit(_prefilled(model))
    with capture.compiled(model):
        compiled, compiled_state = draft_and_commit(_prefilled(model))
    assert capture.compiled_steps(model).level.fn is not level_step
    for c, e in zip(compiled + compiled_state, eager + eager_state):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,lead", [("caterpillar:2,2,2", None), ("static:2,4", None),
                                       ("caterpillar:2,2,2", [[-1, 7], [2, 3]])], ids=["caterpillar", "static", "lead"])
def test_compiled_greedy_draft_is_one_graph_matching_eager(monkeypatch, spec, lead):
    """A greedy static draft (every level and the choice of children between them, after the
    tokens it is behind where it has a ``lead``) through one fullgraph capture: the eager
    draft's tokens, and the same committed states after it."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = stree.patch(make_hybrid((), seed=7)) if lead else _model()  # a lead: attention-free
    drafter = parse_drafter(spec)

    def draft_and_commit(cache):
        draft = drafter.draft(model, cache, torch.tensor([5, 6]), SamplingConfig(),
                              lead=None if lead is None else torch.tensor(lead))
        last = draft.tree.num_nodes - 1
        path = torch.tensor([[0, int(draft.tree.parents[0, last]), last], [0, 1, -1]])
        assert commit_draft(model, cache, draft.tree, path, [3, 2], [last, 1], drafter.ran)
        return [draft.tree.tokens] + [t.clone() for c in cache.layers.values() for t in vars(c).values()]

    eager = draft_and_commit(_prefilled(model))
    with capture.compiled(model):
        compiled = draft_and_commit(_prefilled(model))
        again = draft_and_commit(_prefilled(model))  # the graph run again
    assert capture.compiled_steps(model).levels.fn is not levels_step
    assert torch.equal(compiled[0], eager[0]) and torch.equal(again[0], eager[0])
    for c, e in zip(compiled[1:], eager[1:]):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)


def test_compiled_sampled_draft_is_one_graph_for_every_temperature(monkeypatch):
    """A sampled static draft (its random numbers drawn first, its temperature a tensor) through
    one fullgraph capture: the eager draft's tokens and distributions from the same generator,
    and no new graph for another temperature."""
    from torch._dynamo.utils import counters

    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = _model()
    drafter = parse_drafter("caterpillar:2,2,2")

    def draft(temperature):
        return drafter.draft(model, _prefilled(model), torch.tensor([5, 6]), SamplingConfig(temperature),
                             torch.Generator().manual_seed(2))

    eager = [draft(t) for t in (0.8, 1.5)]
    with capture.compiled(model):
        first = draft(0.8)
        graphs = counters["stats"]["unique_graphs"]
        compiled = [first, draft(1.5)]
    assert counters["stats"]["unique_graphs"] == graphs
    assert capture.compiled_steps(model).levels.fn is not levels_step
    for c, e in zip(compiled, eager):
        assert torch.equal(c.tree.tokens, e.tree.tokens)
        torch.testing.assert_close(c.q, e.q, rtol=1e-4, atol=1e-5)


def test_compiled_steps_over_a_state_pool(monkeypatch):
    """Rows in scattered slots of a state pool (Mamba2 states gathered, K/V indexed in place by
    the slots, a device tensor) through the same fullgraph capture: the eager identity cache's
    logits, and nothing outside the rows' slots written."""
    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = _model()
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)

    def verify_then_draft(cache):
        model.prefill([torch.tensor([3, 9, 4]), torch.tensor([1, 2, 5, 8, 6])], cache)
        logits = [model.tree_forward(tree, cache)]
        cache.commit(torch.tensor([[0, 2, 4], [0, 1, -1]]), [3, 2])
        return logits + [forward_level(model, cache, TokenTree(tree.tokens[:, :1], [-1]), 0, 1, 5)]

    eager = verify_then_draft(model.allocate_tree_cache(2, 32))
    pool = model.allocate_state_pool(4, 32)
    others = [t[[0, 2]].clone() for c in pool.layers.values() for t in vars(c).values()]
    with capture.compiled(model):
        compiled = verify_then_draft(pool.cache([3, 1]))
    steps = capture.compiled_steps(model)
    assert steps.tree.fn is not tree_step and steps.level.fn is not level_step  # no eager fallback
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(t[[0, 2]], o) for t, o in zip(
        [t for c in pool.layers.values() for t in vars(c).values()], others))


@pytest.mark.parametrize("drafter", ["static:2,2", "caterpillar:2,2,2"])
def test_generate_compiled_greedy_tokens_equal_eager(monkeypatch, drafter):
    # the same fullgraph capture; a backend with no C++ compilation keeps the test fast
    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(1)
    target = _model()
    draft = stree.patch(make_hybrid((), seed=11))
    prompt = torch.randint(0, VOCAB, (1, 6))
    kw = dict(max_new_tokens=12, drafter=drafter)
    eager = stree.generate(target, draft, prompt, **kw)
    compiled = stree.generate(target, draft, prompt, compile=True, **kw)
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    assert compiled.stats.target_calls == eager.stats.target_calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compiled_draft_compiles_its_lead_graph_at_its_first_draft(monkeypatch, temperature):
    """A draft that takes a lead (an attention-free draft behind by its never-run deepest level's
    accepted node) has a second graph; ``generate(compile=True)`` compiles it with the first, so
    that no later step stops to compile: a draft identical to the target (every node accepted,
    so every later draft has a lead) compiles nothing after the first call's first draft, greedy
    (one graph for the whole draft) or sampled (a graph per level)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    target, draft = (stree.patch(make_hybrid((), seed=11)) for _ in range(2))  # the same weights
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(drafter="caterpillar:2,2,2", compile=True, temperature=temperature)
    stree.generate(target, draft, prompt, max_new_tokens=2, **kw)  # one step: its draft compiles
    graphs = counters["stats"]["unique_graphs"]
    out = stree.generate(target, draft, prompt, max_new_tokens=24, **kw)
    assert out.stats.accept_hist.get(4, 0) >= out.stats.target_calls - 1 >= 2  # every node accepted: leads
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_padded_tree_gives_the_trees_logits_and_commit():
    """``tree_forward(pad_nodes=8)``: a 5-node tree runs as 8 nodes; its logits, and the state
    committed along a path, equal the unpadded tree's."""
    model = _model()
    tree = TokenTree(torch.tensor([[4, 7, 1, 9, 2], [3, 3, 8, 5, 6]]), PARENTS)
    path = torch.tensor([[0, 2, 4], [0, 1, -1]])
    out = []
    for pad in (1, 8):
        cache = _prefilled(model)
        logits = model.tree_forward(tree, cache, pad_nodes=pad)
        cache.commit(path, [3, 2])
        out.append((logits, model.tree_forward(TokenTree(torch.tensor([[5], [6]]), [-1]), cache)))
    assert out[1][0].shape == (2, 5, VOCAB)
    for want, got in zip(*out):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("drafter", ["suffix:16", "caterpillar:2,2,2+suffix:16"])
def test_generate_compiled_trees_of_varying_size_equal_eager_and_compile_up_front(monkeypatch, drafter):
    """Suffix and merged trees vary in size: compiled, they run padded to multiples of
    ``PAD_NODES``, every padded size compiled before the first tree (and every lead width of
    the draft with its first draft), so a second request compiles nothing; tokens equal eager."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    target = _model()
    draft = stree.patch(make_hybrid((), seed=11))
    kw = dict(max_new_tokens=16, drafter=drafter)
    prompts = [torch.tensor([[5, 6, 7, 8, 9] * 4 + [5]]), torch.tensor([[2, 3, 2, 3, 4, 2, 3]])]
    stree.generate(target, draft, prompts[1], compile=True, drafter=drafter, max_new_tokens=2)  # one step
    graphs = counters["stats"]["unique_graphs"]
    sizes, forward = set(), target.tree_forward

    def recorded(tree, cache, **kw):
        sizes.add(tree.num_nodes)
        return forward(tree, cache, **kw)

    monkeypatch.setattr(target, "tree_forward", recorded, raising=False)
    for prompt in prompts:
        compiled = stree.generate(target, draft, prompt, compile=True, **kw)
        eager = stree.generate(target, draft, prompt, **kw)
        assert compiled.sequences.tolist() == eager.sequences.tolist()
    assert counters["stats"]["unique_graphs"] == graphs
    assert len(sizes) > 3 and max(sizes) > 8, sizes  # trees of several padded sizes ran


def test_a_merged_draft_compiles_every_lead_width_at_its_first_draft(monkeypatch):
    """A merged tree's accepted suffix nodes reach the draft as leads of 1 to ``MAX_LEAD``
    tokens (``lead_tensor``'s widths): compiled, the first draft compiles them all, so a later
    lead of any width compiles nothing."""
    from torch._dynamo.utils import counters
    from stree.draft import parse_drafter
    from stree.draft.base import MAX_LEAD, lead_tensor
    from stree.generation import _DraftSide
    from stree.sampling import SamplingConfig
    from stree.stats import GenerationStats

    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    draft = stree.patch(make_hybrid((), seed=11))
    drafter = parse_drafter("caterpillar:2,2,2+suffix:16")
    greedy, roots = SamplingConfig(), torch.tensor([3])
    side = _DraftSide(draft, drafter, 1, 64, GenerationStats("tree"), compile=True)
    with capture.compiled(draft):
        side.prefill([torch.tensor([1, 2, 3])])
        side.draft(roots, greedy, None)
        graphs = counters["stats"]["unique_graphs"]
        for count in range(1, MAX_LEAD + 1):
            cache = draft.allocate_tree_cache(1, 64)
            draft.prefill(torch.tensor([[1, 2]]), cache, logits=False)
            drafter.draft(draft, cache, roots, greedy, None, lead=lead_tensor([[4] * count]))
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_refuses_dynamic_drafters():
    with pytest.raises(ValueError, match="compile=True needs fixed draft shapes"):
        stree.generate(_model(), _model(), torch.tensor([[1, 2]]), 4, drafter="dyspec:8",
                       compile=True)


def test_static_step_equals_step():
    """The hybrid's static-shape step (``step_at``: K/V written at a position tensor, attention
    over the whole capacity under a mask), eager, against its own ``step``, token by token on
    two rows past the prefill."""
    torch.manual_seed(3)
    model = make_hybrid((1,), seed=5)
    prompt, tokens = torch.randint(0, VOCAB, (2, 4)), torch.randint(0, VOCAB, (2, 6))
    caches = [model.allocate_inference_cache(2, 16) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(prompt, cache)
        for j in range(tokens.shape[1]):
            ids = tokens[:, j:j + 1]
            expected = model.step(ids, caches[0])
            got = model.step_at(ids, caches[1], torch.full((2,), caches[1].seqlen))
            caches[1].seqlen += 1
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_generate_compiled_ar_equals_eager(monkeypatch):
    """``method="ar", compile=True``: the hybrid's own step compiled on a static cache emits the
    eager tokens, greedy and sampled with one seed, and really ran compiled; a model whose own
    decoding has no compiled form is refused."""
    monkeypatch.setattr(capture, "BACKEND", "aot_eager")
    torch.manual_seed(4)
    model, prompt = stree.patch(make_hybrid((1,), seed=9)), torch.randint(0, VOCAB, (1, 5))
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=10, method="ar", temperature=temperature)
        eager = stree.generate(model, None, prompt, generator=torch.Generator().manual_seed(0), **kw)
        compiled = stree.generate(model, None, prompt, generator=torch.Generator().manual_seed(0),
                                  compile=True, **kw)
        assert compiled.sequences.tolist() == eager.sequences.tolist()
    step = model._stree_compiled_step_at
    assert step.fn is not step.eager  # it ran compiled, with no eager fallback

    from tests.test_model_mamba2 import make_model

    with pytest.raises(ValueError, match="has no compiled form"):
        stree.generate(stree.patch(make_model(n_layer=2)), None, prompt, 4, method="ar",
                       compile=True)


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


def test_backend_failure_and_missing_compile_fall_back_to_eager(monkeypatch):
    torch.manual_seed(2)
    tree = TokenTree(torch.randint(0, VOCAB, (2, 5)), PARENTS)
    model = _model()
    eager = model.tree_forward(tree, _prefilled(model))

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(capture, "BACKEND", broken)
    with capture.compiled(model), pytest.warns(RuntimeWarning, match="running this step eagerly"):
        fallback = model.tree_forward(tree, _prefilled(model))
    torch.testing.assert_close(fallback, eager, rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(capture, "unavailable", lambda: "no torch.compile in this build")
    other, prompt = _model(), torch.tensor([[1, 2, 3]])
    with pytest.warns(RuntimeWarning, match="no torch.compile in this build; running eagerly"):
        out = stree.generate(other, None, prompt, 5, method="ar-tree", compile=True)
    assert getattr(other, "_stree_compiled", None) is None  # nothing was compiled
    assert out.sequences.tolist() == stree.generate(other, None, prompt, 5, method="ar-tree").sequences.tolist()


@pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch._C.has_mkl),
                    reason="needs PyTorch's oneDNN and MKL CPU kernels")
def test_compiled_linears_take_the_eager_packed_kernel():
    """Inside stree's compiled steps a frozen fp32 linear with rows x weight elements >=
    PACK_MIN_WORK runs oneDNN's inner product on a reordered weight (the kernel eager stree
    prepacks for), not the MKL packed GEMM inductor picks for static shapes (1.7x slower per call
    on the project's CPU); a smaller one keeps inductor's choice. Control: the same function
    compiled with freezing but outside stree's steps gets MKL for both."""
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile
    from torch._inductor.fx_passes import mkldnn_fusion
    from stree.layers.linear import PACK_MIN_WORK

    torch.manual_seed(0)
    big, small = torch.nn.Linear(512, 512), torch.nn.Linear(64, 48)
    assert 512 * 512 >= PACK_MIN_WORK > 64 * 48

    def fn(x):
        return small(big(x)[:, :64])

    def kernels(step, x):
        with torch.no_grad():
            step(x)  # compiles (freezing runs the packing ops once)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                out = step(x)
        torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-4)
        return {e.key: e.count for e in prof.key_averages()}

    x = torch.randn(1, 512)
    device_op = type(mkldnn_fusion._get_mkldnn_device_op("cpu"))
    before = (device_op.pack_linear_weight, device_op.pack_linear)
    ours = kernels(capture.compile_step(fn), x)
    assert ours.get("mkldnn::_linear_pointwise") == 1 and ours.get("mkl::_mkl_linear") == 1
    assert (device_op.pack_linear_weight, device_op.pack_linear) == before  # restored after the call

    torch._dynamo.reset()
    plain = torch.compile(fn, fullgraph=True, dynamic=False)
    with inductor_config.patch(capture.FREEZING):
        theirs = kernels(plain, x)
    assert "mkldnn::_linear_pointwise" not in theirs and theirs.get("mkl::_mkl_linear") == 2


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs PyTorch's oneDNN CPU kernels")
def test_a_weight_used_twice_in_a_compiled_step_is_packed_once():
    """A linear called twice in one compiled step (a draft's levels, each running the same
    layers) reads one packed copy of its weight, not one per call (inductor's default here)."""
    import re

    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    big = torch.nn.Linear(512, 512, bias=False)

    def fn(x):
        return big(torch.relu(big(x)))

    x = torch.randn(1, 512)
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):  # compiled here, not read back
        out, code = run_and_get_code(capture.compile_step(fn), x)
    torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-4)
    calls = re.findall(r"mkldnn\._linear_pointwise\.\w+\([^\n]*?(_frozen_param\d+)", "\n".join(code))
    assert len(calls) == 2 and len(set(calls)) == 1, calls
    torch._dynamo.reset()
