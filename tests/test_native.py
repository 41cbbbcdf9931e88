"""method="ar" is the model's own decoding (stree.native) on real tiny models: token for token the
same as stree's 1-node tree path ("ar-tree") and as the independent oracles at temperature 0, and
at temperature > 0 the same draws from the same generator (same SamplingConfig semantics)."""
import pytest
import torch

import stree
from stree import native
from stree.generation import generate
from tests.test_generate_models import PROMPTS, mamba_pair, mamba_reference, new_tokens  # noqa: F401
from tests.test_model_hybrid import make_hybrid
from tests.test_model_mamba2 import make_model

N_NEW = 48
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def hybrid():
    return stree.patch(make_hybrid((1, 3), seed=8))


def _tokens(model, method, prompts, n, seed=None, **sampling):
    g = None if seed is None else torch.Generator().manual_seed(seed)
    out = generate(model, None, prompts, n, method=method, generator=g, **sampling)
    return [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(prompts)]


def test_hybrid_native_ar_equals_tree_path_and_its_own_generate(hybrid):
    refs = [hybrid.generate(p[None], max_new_tokens=N_NEW)[0, len(p):].tolist() for p in PROMPTS]
    out = generate(hybrid, None, PROMPTS, N_NEW, method="ar")
    assert new_tokens(out) == refs
    assert _tokens(hybrid, "ar-tree", PROMPTS, N_NEW) == refs
    s = out.stats
    assert (s.tau, s.draft_calls, s.replay_s, s.new_tokens) == (1.0, 0, 0.0, 2 * N_NEW)
    assert s.target_calls == 2 * (N_NEW - 1)  # ragged prompts: each row decodes on its own


def test_mamba_native_ar_equals_sequential_decoding(mamba_pair, mamba_reference):
    target = mamba_pair[0]
    # one prompt: mamba_ssm's own prefill runs its Triton kernels in the interpreter here (slow)
    assert _tokens(target, "ar", PROMPTS[:1], 40) == [mamba_reference[0][:40]]


@pytest.mark.parametrize("which", ["hybrid", "mamba"])
def test_sampled_native_ar_makes_the_same_draws_as_the_tree_path(which, hybrid, mamba_pair):
    """Equal-length prompts: both paths draw one (b, v) sample per token from one generator, so
    they agree exactly iff both shape the distribution the same way (temperature, top-k, top-p)."""
    model = hybrid if which == "hybrid" else mamba_pair[0]
    prompts = [PROMPTS[0], PROMPTS[0].flip(0)]
    native = _tokens(model, "ar", prompts, 32, seed=3, **SAMPLED)
    tree_path = _tokens(model, "ar-tree", prompts, 32, seed=3, **SAMPLED)
    assert native == tree_path
    assert tree_path != _tokens(model, "ar-tree", prompts, 32)  # it did sample
    # a different top-k changes the draws: the comparison sees the sampling config
    assert tree_path != _tokens(model, "ar-tree", prompts, 32, seed=3, **{**SAMPLED, "top_k": 3})


def _has_flash_attn() -> bool:
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.modules import mha

    return mha.flash_attn_with_kvcache is not None


@pytest.mark.skipif(_has_flash_attn(), reason="flash-attn is installed: mamba_ssm's MHA decoding is usable")
def test_mamba_mha_native_decoding_needs_flash_attn():
    model = stree.patch(make_model(seed=1, n_layer=2, attn_layer_idx=(1,)))
    with pytest.raises(ValueError, match="flash-attn"):
        generate(model, None, PROMPTS[:1], 4, method="ar")
    assert len(_tokens(model, "ar-tree", PROMPTS[:1], 4)[0]) == 4


def test_unknown_model_family_is_named():
    class Opaque(torch.nn.Module):
        pass

    with pytest.raises(TypeError, match="no native decoding for Opaque"):
        native.session_factory(Opaque())


@pytest.mark.gpu
def test_cuda_mamba_native_ar_replays_the_cg_graph_and_equals_the_tree_path():
    """On the GPU "ar" decodes through mamba_ssm's captured graph (generate(cg=True)'s cache)."""
    model = stree.patch(make_model(seed=21, n_layer=2).to("cuda"))
    prompts = [PROMPTS[0].cuda(), PROMPTS[0].flip(0).cuda()]
    native = _tokens(model, "ar", prompts, 32)
    assert getattr(model, "_decoding_cache", None) is not None
    assert native == _tokens(model, "ar-tree", prompts, 32)
