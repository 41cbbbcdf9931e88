"""Reliability at the edges (issue 24): caches that grow with the real length instead of being
allocated for ``max_new_tokens``, requests past a context limit capped (or refused), input types
checked, and resident memory flat over long runs and many calls (small versions of
``bench/memory.py``)."""
import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import stree
from stree.cache import SEQLEN_CHUNK, grown_capacity
from stree.limits import ContextLimitWarning, context_limit
from tests.test_generate_models import noisy_copy
from tests.test_model_hybrid import VOCAB, make_hybrid

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
memory = importlib.import_module("memory")

PROMPT = [5, 17, 3, 40, 8, 22, 9]


def hybrid(limit, attn=(1,), seed=8):
    model = make_hybrid(attn, seed=seed)
    model.config.max_position_embeddings = limit
    return model


@pytest.fixture(scope="module")
def mamba_pair():
    target = make_hybrid((), n_layer=2, seed=3)  # pure Mamba2: no context limit
    return stree.patch(target), stree.patch(noisy_copy(target, 0.2, seed=4))


def kv_capacity(cache) -> int:
    return next(c.kv.shape[3] for c in cache.layers.values() if hasattr(c, "kv"))


# ------------------------------------------------------------------------------------ growth
def test_capacity_doubles_from_a_chunk_up_to_max_seqlen():
    assert [grown_capacity(n, 10**9) for n in (1, 512, 513, 1500, 5000)] == [512, 512, 1024, 2048, 8192]
    assert grown_capacity(1, 100) == 100 and grown_capacity(3000, 2048) == 2048


def test_a_huge_max_seqlen_allocates_nothing_up_front_and_grows_on_demand():
    model = stree.patch(hybrid(10**9))
    cache = model.allocate_tree_cache(2, 10**9)
    assert kv_capacity(cache) == SEQLEN_CHUNK
    ids = torch.randint(0, VOCAB, (2, 700))
    model.prefill(ids, cache)
    assert kv_capacity(cache) == 2 * SEQLEN_CHUNK and cache.capacity == 1024
    ref = model.allocate_tree_cache(2, 1024)  # the same prompt in a cache that never grew
    model.prefill(ids, ref)
    for i, c in cache.layers.items():
        for a, b in zip(vars(c).values(), vars(ref.layers[i]).values()):
            assert torch.equal(a, b), f"layer {i}"


def test_a_pool_grows_for_every_slot_and_views_follow():
    model = stree.patch(hybrid(4096))
    pool = model.allocate_state_pool(3, 4096)
    a, b = pool.cache([0]), pool.cache([1, 2])  # a contiguous run: views of the pool
    model.prefill(torch.randint(0, VOCAB, (2, 20)), b)
    kept = [c.kv[1:3, :, :, :20].clone() for c in pool.layers.values() if hasattr(c, "kv")]
    model.prefill(torch.randint(0, VOCAB, (1, 600)), a)  # grows the pool under b's views
    assert pool.capacity == 1024 and b.capacity == 1024
    assert all(torch.equal(k, c.kv[1:3, :, :, :20])
               for k, c in zip(kept, [c for c in pool.layers.values() if hasattr(c, "kv")]))
    assert all(c.kv.data_ptr() == pool.layers[i].kv[1:].data_ptr()
               for i, c in b.layers.items() if hasattr(c, "kv"))


def test_greedy_across_a_growth_equals_the_models_own_generate():
    """600 new tokens: the K/V grow from 512 to 1024 positions in the middle of decoding
    (level-by-level drafting and tree verification), output unchanged."""
    target = hybrid(2048, seed=8)
    draft = noisy_copy(target, 0.2, seed=2)
    ref = target.generate(torch.tensor([PROMPT]), max_new_tokens=600)[0, len(PROMPT):].tolist()
    stree.patch(target), stree.patch(draft)
    out = stree.generate(target, draft, torch.tensor([PROMPT]), 600, drafter="static:fig4a")
    assert out.sequences[0, len(PROMPT):].tolist() == ref


# ------------------------------------------------------------------------ length limits
def test_context_limit_is_read_only_for_models_with_attention(mamba_pair):
    assert context_limit(stree.patch(hybrid(300))) == 300
    assert context_limit(mamba_pair[0]) is None  # a Mamba2 config may name one: it does not bind


def test_a_request_past_the_context_limit_is_capped_with_a_warning():
    target = stree.patch(hybrid(128))
    with pytest.warns(ContextLimitWarning, match=r"prompt length 7 \+ max_new_tokens 1000000000 "
                                                  r"\+ tree size 1 = 1000000008 exceeds the target's "
                                                  r"context limit of 128 positions"):
        out = stree.generate(target, None, torch.tensor([PROMPT]), 10**9, method="ar-tree")
    assert out.lengths == [128 - 1]  # prompt + new tokens + one node of scratch = the limit
    with pytest.warns(ContextLimitWarning, match="at most 120 new tokens"):
        out = stree.generate(target, None, torch.tensor([PROMPT]), 10**9, method="ar")
    assert out.lengths == [127]


def test_refusals_name_the_numbers_before_anything_runs():
    target = stree.patch(hybrid(64))
    with pytest.raises(ValueError, match="prompt length 60 \\+ tree size 13 leaves no room .* 64 "
                                         ".*shorten the prompt or draft a smaller tree"):
        stree.generate(target, stree.patch(hybrid(64, seed=2)), torch.zeros(1, 60, dtype=torch.long),
                       5, drafter="static:fig4a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit max_seqlen refuses; it does not cap
        with pytest.raises(ValueError, match="7 \\+ max_new_tokens 1000 \\+ tree size 1 = 1008 "
                                             "exceeds max_seqlen 100"):
            stree.generate(target, None, torch.tensor([PROMPT]), 1000, method="ar-tree", max_seqlen=100)


def test_no_context_limit_runs_until_eos(mamba_pair):
    target, draft = mamba_pair
    free = stree.generate(target, draft, torch.tensor([PROMPT]), 40).sequences[0, len(PROMPT):].tolist()
    eos = free[30]
    stop = free.index(eos) + 1
    out = stree.generate(target, draft, torch.tensor([PROMPT]), 10**9, eos_token_id=eos)
    assert out.sequences[0, len(PROMPT):].tolist() == free[:stop]


# ------------------------------------------------------------------------------ input types
@pytest.mark.parametrize("ids", [torch.tensor([[1.0, 2.0]]), [1.0, 2.0], [[1, 2], [3.5]],
                                 [True, False], torch.tensor([True]), "abc", None, 7],
                         ids=["float-tensor", "float-list", "ragged-float", "bools", "bool-tensor",
                              "str", "None", "int"])
def test_non_integer_input_ids_are_a_type_error(mamba_pair, ids):
    with pytest.raises(TypeError, match="input_ids must"):
        stree.generate(*mamba_pair, ids, 3)


def test_integer_input_ids_of_any_kind_are_accepted(mamba_pair):
    import numpy as np

    want = stree.generate(*mamba_pair, torch.tensor([PROMPT]), 3).sequences
    for ids in (PROMPT, [PROMPT], np.array(PROMPT), torch.tensor(PROMPT, dtype=torch.int32)):
        assert torch.equal(stree.generate(*mamba_pair, ids, 3).sequences, want)


@pytest.mark.parametrize("kwargs,error,pattern", [
    (dict(eos_token_id=VOCAB), ValueError, f"eos_token_id {VOCAB} is outside the vocabulary"),
    (dict(eos_token_id=[1, -3]), ValueError, "eos_token_id -3 is outside"),
    (dict(eos_token_id=2.0), TypeError, "eos_token_id must be an integer"),
    (dict(eos_token_id=True), TypeError, "eos_token_id must be an integer"),
    (dict(pad_token_id=VOCAB + 5), ValueError, "pad_token_id .* outside the vocabulary"),
    (dict(pad_token_id=0.5), TypeError, "pad_token_id must be an integer"),
])
def test_stop_and_pad_ids_are_checked_against_the_vocabulary(mamba_pair, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        stree.generate(*mamba_pair, torch.tensor([PROMPT]), 3, **kwargs)


def test_cli_refuses_an_eos_id_outside_the_vocabulary(capsys):
    from tests.test_cli import assert_error, gen

    assert_error(capsys, gen("--eos-token-id", "5000"), "eos_token_id 5000 is outside the vocabulary")


# ----------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("case", ["mamba-ar-tree", "mamba-pair", "hybrid-to-its-limit"])
def test_long_runs_keep_resident_memory_flat(mamba_pair, case):
    """2,000 tokens with no context limit (a Mamba2 target alone and with a draft), and a hybrid
    to its context limit (its K/V growing from 512 to 1024 positions): resident memory gained
    after the first tenth, less the K/V cache's growth, is within 10% (bench/memory.py runs
    20,000 tokens on the shipped models)."""
    target, draft = mamba_pair
    method = "tree" if case == "mamba-pair" else "ar-tree"
    if case == "hybrid-to-its-limit":
        target, draft = stree.patch(hybrid(1024, seed=5)), None
    else:
        draft = draft if method == "tree" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextLimitWarning)
        row = memory.long_run(case, target, draft, method, 2000, 200, 0.10, prompt=PROMPT)
    assert row["ok"], row
    if case == "hybrid-to-its-limit":
        assert row["new_tokens"] == 1024 - len(PROMPT) - 1


def test_many_calls_leak_nothing(mamba_pair):
    row = memory.call_loop("mamba-pair", *mamba_pair, "tree", calls=50, tokens=16, warmup=5,
                           tolerance_mb=4.0, prompt=PROMPT)
    assert row["ok"], row
