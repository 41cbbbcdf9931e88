"""vLLM's own Mamba2-family classes as targets of ``method: "stree"``: tiny random checkpoints
written with transformers' ``save_pretrained``; three drafts per family (the same checkpoint, a
perturbed copy, an unrelated random model), loaded and patched by stree. Greedy output equals
vLLM's own non-speculative output token for token, four concurrent requests of different
lengths; a family's four engines one after another in one child process. (vLLM's CPU attention
needs head_dim >= 32, so these configs are wider than the main suite's.)"""
import pytest
import torch

import stree  # noqa: F401  (before transformers: its torch paths)

from tests.vllm import engine

VOCAB = 61
PROMPTS = [[5, 17, 33, 40], [7, 8, 9], list(range(3, 40)), [30, 31]]
GREEDY = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}


def _mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))


def _granite():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=64, shared_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_expand=2,
        mamba_chunk_size=8, position_embedding_type="rope", max_position_embeddings=512,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0,
        pad_token_id=0))


def _nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM
    kinds = {"M": "mamba", "*": "attention", "-": "mlp"}
    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=VOCAB, hidden_size=128, layers_block_type=[kinds[c] for c in "M*M-"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
        max_position_embeddings=512, pad_token_id=0))


def _falcon_h1():
    from transformers import FalconH1Config, FalconH1ForCausalLM
    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_ssm=128, mamba_chunk_size=8, mamba_rms_norm=True,
        mamba_norm_before_gate=False, max_position_embeddings=512, pad_token_id=0))


def _zamba2():
    from transformers import Zamba2Config, Zamba2ForCausalLM
    return Zamba2ForCausalLM(Zamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=8, mamba_headdim=16, mamba_ngroups=2,
        mamba_d_state=16, mamba_expand=2, chunk_size=8, num_mem_blocks=2, use_shared_attention_adapter=True,
        adapter_rank=8, use_mem_rope=True, layers_block_type=["mamba", "hybrid"] * 2,
        max_position_embeddings=512, pad_token_id=0))


def _perturbed(model, scale: float = 0.3):
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("build", [_mamba2, _granite, _nemotron_h, _falcon_h1, _zamba2],
                         ids=["mamba2", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2"])
def test_stree_equals_vllm_greedy_with_three_drafts(tmp_path, build):
    """Drafts: the target's own weights (a tree, verified by stree in the engine), a perturbed
    copy (a chain, verified by vLLM) and an unrelated random model of the same family (a tree)."""
    torch.manual_seed(0)
    build().save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    _perturbed(build()).save_pretrained(tmp_path / "perturbed")
    torch.manual_seed(1)
    build().save_pretrained(tmp_path / "unrelated")
    base = {"model": str(tmp_path / "target"), "skip_tokenizer_init": True}
    drafts = (("target", "caterpillar:2,2,2"), ("perturbed", "chain:4"), ("unrelated", "caterpillar:2,2,2"))
    specs = [{"engine": base, "prompts": PROMPTS, "sampling": GREEDY}]
    for draft, tree in drafts:
        spec = {"method": "stree", "model": str(tmp_path / draft), "tree": tree}
        if tree.startswith("chain"):
            spec["verifier"] = "sps"  # vLLM's rejection sampler (the CPU default verifies chains in stree)
        specs.append({"engine": {**base, "speculative_config": spec}, "prompts": PROMPTS, "sampling": GREEDY})
    ref, *outs = engine.result(engine.run({"runs": specs}))["runs"]  # one child, four engines
    accepted = {}
    for (draft, _), out in zip(drafts, outs, strict=True):
        assert out["tokens"] == ref["tokens"], draft
        counts = out["spec"]
        assert counts["vllm:spec_decode_num_drafts"] > 0  # it speculated
        accepted[draft] = counts["vllm:spec_decode_num_accepted_tokens"] / counts["vllm:spec_decode_num_drafts"]
    # the target's own weights: every level of the depth-3 tree accepted (for Mamba2 and
    # GraniteMoeHybrid only since stree groups the gated norm that transformers < 5.20 did not)
    assert accepted["target"] >= 2.9
    assert accepted["target"] > accepted["unrelated"]
