"""Draft checkpoints for the speculative tests, written by stree's own MambaInLlama code: the
target's own weights (every draft token accepted), a perturbed copy (some accepted) and an
unrelated random model with the same vocabulary (almost none accepted)."""
import torch

from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM


def perturbed_copy(src: str, dst: str, scale: float = 0.3, seed: int = 0) -> str:
    model = MambaInLlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(dst)
    return dst


def unrelated(vocab_size: int, dst: str, seed: int = 1) -> str:
    torch.manual_seed(seed)
    cfg = MambaInLlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, head_dim=32, attn_layers=(1,))
    MambaInLlamaForCausalLM(cfg).save_pretrained(dst)
    return dst


def mamba1_hybrid(dst) -> str:
    """A Jamba ``config.json`` (Mamba-1 layers beside attention): a kind stree never drafts with.
    No weights: a draft's kind is read from its config before anything loads."""
    from transformers import JambaConfig

    config = JambaConfig(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=1, mamba_d_state=8,
                         mamba_dt_rank=8)
    config.architectures = ["JambaForCausalLM"]  # as the model's save_pretrained writes it
    config.save_pretrained(dst)
    return str(dst)
