"""MambaInLlama checkpoints (the shipped pair) run in vLLM without speculation: greedy tokens equal
the model's own decoding in stree (plain PyTorch, ``method="ar"``) token for token, four concurrent
requests of different lengths (one of 300 tokens: with vLLM's default Mamba prefix caching that
prompt crashed the CPU build's prefill, which the plugin fixes, see stree/vllm/cpu_prefix_cache.py).
One engine per model."""
import pytest
import torch

import stree
import stree.hybrid

from tests.vllm import engine

PROMPTS = [[5, 17, 33, 80, 100], [7, 8, 9], list(range(20, 320)), [300, 301, 302, 303, 304, 305, 306]]
N_NEW = 64


def _own_greedy(directory):
    model = stree.hybrid.MambaInLlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return [stree.generate(model, None, torch.tensor([p]), N_NEW, method="ar").sequences[0, len(p):].tolist()
            for p in PROMPTS]


@pytest.mark.parametrize("directory", ["models/stree-tiny/target", "models/stree-tiny/draft"])
def test_greedy_equals_own_decoding(directory):
    proc = engine.run({"engine": {"model": directory}, "prompts": PROMPTS,
                       "sampling": {"temperature": 0.0, "max_tokens": N_NEW, "ignore_eos": True}})
    assert engine.result(proc)["tokens"] == _own_greedy(directory)
