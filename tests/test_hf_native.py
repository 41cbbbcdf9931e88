"""method="ar" on transformers' Mamba2 family (stree.hf.native): token for token the model's own
``generate`` (greedy, the unmodified model) and stree's 1-node tree path ("ar-tree"), for one
prompt and for a batch of two equal-length prompts (decoded as one batch)."""
import pytest
import torch

import stree
from tests.hf_models import build
from tests.test_hf_models import KINDS

N_NEW = 32
PROMPT = [5, 17, 33, 8, 41, 12, 3, 9, 22, 4, 7]  # longer than chunk_size=8


def _new(out, l):
    return out.sequences[:, l:].tolist()


@pytest.mark.parametrize("family", sorted(KINDS))
def test_native_ar_equals_own_generate_and_tree_path(family, tmp_path):
    model, _ = build(family, tmp_path, seed=2)
    model.generation_config.eos_token_id = None  # N_NEW tokens whatever they are
    l = len(PROMPT)
    for ids in (torch.tensor([PROMPT]), torch.tensor([PROMPT, PROMPT[::-1]])):
        ref = model.generate(ids, do_sample=False, max_new_tokens=N_NEW)[:, l:].tolist()
        assert len(ref[0]) == N_NEW and (len(ref) == 1 or ref[0] != ref[1])
        out = stree.generate(model, None, ids, N_NEW, method="ar")
        assert _new(out, l) == ref
        s = out.stats
        assert (s.tau, s.draft_calls, s.new_tokens) == (1.0, 0, ids.shape[0] * N_NEW)
        assert s.target_calls == N_NEW - 1  # equal-length prompts: one batched step per token
    patched = stree.patch(model)
    assert _new(stree.generate(patched, None, ids, N_NEW, method="ar"), l) == ref
    assert _new(stree.generate(patched, None, ids, N_NEW, method="ar-tree"), l) == ref
