"""Tiny random Gated DeltaNet hybrids for the vLLM tests, written with transformers' ``save_pretrained``.

vLLM's CPU GDN op runs bf16 only and needs a 64-wide linear-attention head; vLLM's Qwen3-Next
class needs MoE layers (four tiny experts here). Three GDN layers and one gated attention layer,
as in the released models.
"""
from __future__ import annotations

VOCAB = 61
# how far below the fp32 model's best logit a token that differs from vLLM's own decoding may be:
# vLLM's own bf16 tokens fall up to 0.05 below it; a compiled tree run's first difference from
# eager decoding, once, 0.078; TP=2 (bf16 all-reduces) on another CPU than this one's, once, 0.165
NEAR_TIE = 0.2


def qwen3_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)


def qwen3_next(directory, seed: int = 0) -> str:
    """A random bf16 ``Qwen3NextForCausalLM`` checkpoint in ``directory``."""
    import torch
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(seed)
    Qwen3NextForCausalLM(qwen3_next_config()).to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


def qwen3_5(directory, seed: int = 0, vocab: int = VOCAB, logit_scale: float = 1.0) -> str:
    """A random bf16 ``Qwen3_5ForCausalLM`` checkpoint (text only, dense MLPs) in ``directory``;
    ``logit_scale`` sharpens its next-token distributions (the sampling tests' peaked ones)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


def qwen3_5_moe(directory, seed: int = 0) -> str:
    """A random bf16 ``Qwen3_5MoeForCausalLM`` checkpoint (text only, four tiny experts) in ``directory``."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    Qwen3_5MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


def near_tie_differences(target: str, prompts: list[list[int]], own: list[list[int]], tree: list[list[int]],
                         exact=()) -> int:
    """The number of requests whose greedy tokens ``tree`` differ from vLLM's own ``own``; asserts
    each request ran to its length, the requests of ``exact`` (indices) match, and every difference
    stays near-greedy for the fp32 model (transformers' own, teacher-forced on ``tree``'s tokens):
    at the first difference both tokens, and from there every token of ``tree``, within
    :data:`NEAR_TIE` of its best logit. Checking every later token, not the first difference only,
    is what tells bf16 rounding from a wrong state: these random models' logits are flat (a random
    token is within NEAR_TIE of the best about one time in ten), but not along 16+ tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    oracle = None
    differing = 0
    for r, (prompt, a, b) in enumerate(zip(prompts, own, tree, strict=True)):
        assert len(b) == len(a)
        if a == b:
            continue
        assert r not in exact, f"request {r}, verified by vLLM itself, differs from vLLM's own decoding"
        differing += 1
        i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
        oracle = oracle or AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + b])).logits[0, len(prompt) - 1:-1]
        gaps = (logits.max(-1).values - logits.gather(-1, torch.tensor(b)[:, None])[:, 0]).tolist()
        own_gap = (logits[i].max() - logits[i, a[i]]).item()
        assert own_gap <= NEAR_TIE, f"prompt {prompt}: token {i} differs ({a[i]} vs {b[i]}), {a[i]} {own_gap} below"
        late = [(j, round(g, 3)) for j, g in enumerate(gaps[i:], i) if g > NEAR_TIE]
        assert not late, f"prompt {prompt}: differs from token {i} on, not near-greedy at (token, gap) {late}"
    return differing
