"""Qwen3.5 in stree's vLLM environment: vLLM's ``Qwen3_5ForCausalLM`` imports its Qwen3-VL module,
whose image processors import torchvision (``scripts/venv-vllm`` keeps torchvision 0.28.0, its C++
ops unloaded). A tiny random checkpoint loads and decodes greedily, each token the fp32 model's
argmax up to bf16 rounding (vLLM's CPU GDN op runs bf16 only); ``method: "stree"`` on it is
refused at start-up (Gated DeltaNet layers)."""
import pytest
import torch

import stree  # noqa: F401  (before transformers: its torch paths)

from tests.vllm import engine, gdn

PROMPTS = [[5, 17, 33, 40, 5, 17, 33, 40, 5, 17], [7, 8, 9, 7, 8, 9, 7, 8], list(range(3, 40))]
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
# how far below the fp32 model's best logit vLLM's bf16 token may be (its bf16 GDN and attention)
NEAR_TIE = 0.05


def test_torchvision_imports_without_its_cpp_ops():
    import torchvision
    from torchvision.transforms.v2 import functional

    assert torchvision.__version__.startswith("0.28.0")
    assert functional.resize(torch.ones(3, 8, 8), [4, 4]).shape == (3, 4, 4)
    with pytest.raises(RuntimeError, match="Couldn't load custom C\\+\\+ ops"):
        torchvision.ops.nms(torch.tensor([[0.0, 0.0, 1.0, 1.0]]), torch.tensor([1.0]), 0.5)


def test_qwen3_5_decodes_in_vllm_to_the_fp32_argmax(tmp_path):
    from transformers import Qwen3_5ForCausalLM

    target = gdn.qwen3_5(tmp_path / "qwen3_5")
    base = {"model": target, "skip_tokenizer_init": True, "dtype": "bfloat16"}
    out = engine.result(engine.run({"engine": base, "prompts": PROMPTS, "sampling": GREEDY}))
    oracle = Qwen3_5ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for prompt, tokens in zip(PROMPTS, out["tokens"]):
        assert len(tokens) == GREEDY["max_tokens"]
        with torch.no_grad():  # teacher-forced on vLLM's tokens
            logits = oracle(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        gaps = logits.max(-1).values - logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        assert gaps.max() <= NEAR_TIE, f"prompt {prompt}: vLLM's tokens fall {gaps.tolist()} below the fp32 argmax"
    spec = {**base, "speculative_config": {"method": "stree", "tree": "suffix:16"}}
    proc = engine.run({"engine": spec, "prompts": PROMPTS, "sampling": GREEDY, "processes": True})
    assert proc.returncode != 0 and engine.MARK not in proc.stdout and "EngineCore" not in proc.stderr
    assert ("stree cannot verify trees on a Qwen3_5ForCausalLM target inside vLLM (its Gated DeltaNet layers)"
            in proc.stderr)
