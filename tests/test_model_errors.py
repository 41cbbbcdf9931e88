"""Bad input to the patched-model API raises a clear error and leaves committed state intact."""
import pytest
import torch

import stree
from stree.tree import TokenTree
from tests.test_model_mamba2 import make_model


@pytest.fixture()
def ready():
    model = stree.patch(make_model(seed=11))
    cache = model.allocate_tree_cache(1, 12)
    model.prefill(torch.tensor([[1, 2, 3]]), cache)
    return model, cache


def snapshot(cache):
    return {i: [t.clone() for t in vars(c).values()] for i, c in cache.layers.items()}


def test_bad_paths_raise_and_keep_state(ready):
    model, cache = ready
    tree = TokenTree(torch.tensor([4, 5, 6, 7]), [-1, 0, 0, 1])
    model.tree_forward(tree, cache)
    before = snapshot(cache)
    for path, msg in [([[1, 3]], "start at the root"), ([[0, 3]], "not a child"),
                      ([[0, -1, 1]], "only appear at the end"), ([[0, 1, 3, 2]], "longer than"),
                      ([[0], [0]], "path must be")]:
        with pytest.raises(ValueError, match=msg):
            cache.commit(torch.tensor(path))
    after = snapshot(cache)
    assert all(torch.equal(a, b) for i in before for a, b in zip(before[i], after[i]))
    assert cache.seqlens == [3]
    cache.commit(torch.tensor([[0, 1, 3]]))
    assert cache.seqlens == [6]
    with pytest.raises(RuntimeError, match="nothing pending"):
        cache.commit(torch.tensor([[0]]))


def test_lengths_past_the_cache(ready):
    model, cache = ready
    with pytest.raises(ValueError, match="exceeds the cache's max_seqlen"):
        model.tree_forward(TokenTree(torch.zeros(10, dtype=torch.long), list(range(-1, 9))), cache)
    with pytest.raises(ValueError, match="exceeds the cache's max_seqlen"):
        model.prefill(torch.zeros(1, 10, dtype=torch.long), cache)
    assert cache.seqlens == [3]


def test_bad_tokens_prompts_and_batches(ready):
    model, cache = ready
    with pytest.raises(ValueError, match="out of range for vocab"):
        model.tree_forward(TokenTree(torch.tensor([1, 10_000]), [-1, 0]), cache)
    with pytest.raises(ValueError, match="empty prompt"):
        model.prefill(torch.zeros(1, 0, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="tree batch"):
        model.tree_forward(TokenTree(torch.zeros(2, 2, dtype=torch.long), [-1, 0]), cache)
    with pytest.raises(TypeError, match="TokenTree"):
        model.tree_forward(torch.tensor([1, 2]), cache)
    with pytest.raises(ValueError, match="token ids must lie"):
        model.prefill(torch.tensor([[10_000]]), cache)


def test_unsupported_models_and_layers():
    with pytest.raises(TypeError, match="supports mamba_ssm MambaLMHeadModel"):
        stree.patch(torch.nn.Linear(2, 2))
    for not_a_model in (None, "path/to/checkpoint"):
        with pytest.raises(TypeError, match=r"stree.patch takes a loaded model .*stree.hf.load\(path\)"):
            stree.patch(not_a_model)
    model = make_model(seed=12)
    model.backbone.layers[1].mixer = torch.nn.Linear(64, 64)
    with pytest.raises(TypeError, match="layer 1: Linear is not supported"):
        stree.patch(model)
    assert not hasattr(model, "tree_forward")


def test_loading_a_missing_directory_says_so(tmp_path):
    import stree.hf

    with pytest.raises(FileNotFoundError, match="checkpoint directory not found: .*nope"):
        stree.hf.load(str(tmp_path / "nope"))


def test_truncated_transformers_checkpoint_is_named(tmp_path):
    import stree.hf
    from stree.hybrid.checkpoint import CheckpointError
    from tests.hf_models import build

    _, directory = build("mamba2", tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot read the weights in .*truncated or corrupt"):
        stree.hf.load(str(directory))


def test_non_integer_sizes_and_dtypes_are_refused():
    from stree.hybrid import MambaInLlamaForCausalLM

    model = stree.patch(make_model(seed=11))
    with pytest.raises(TypeError, match="must be ints, got 1.5, 64"):
        model.allocate_tree_cache(1.5, 64)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        MambaInLlamaForCausalLM.from_pretrained("any/directory", dtype="bf16")  # checked first
