"""Small random transformers Mamba2-family models (saved and reloaded through save_pretrained /
from_pretrained) and the oracle: the unmodified model decoding one token at a time with its own
cache class and explicit ``position_ids``. Nothing in the oracle calls stree."""
from __future__ import annotations

import copy

import torch

import stree  # noqa: F401  (imported first on purpose: transformers must still take its torch paths)

VOCAB = 61


def _mamba2(vocab, layers=2):
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=2, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))


def _bamba(vocab, layers=4):
    from transformers import BambaConfig, BambaForCausalLM
    return BambaForCausalLM(BambaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3][: layers // 2],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_expand=2,
        mamba_chunk_size=8, max_position_embeddings=512, rope_parameters={"rope_type": "default",
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))


def _granite(vocab, layers=4, rope=True, experts=4):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    types = ["mamba", "attention", "mamba", "attention"][:layers]
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=48, shared_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, layer_types=types,
        num_local_experts=experts, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=16, mamba_expand=2, mamba_chunk_size=8,
        position_embedding_type="rope" if rope else None, max_position_embeddings=512,
        embedding_multiplier=1.5, residual_multiplier=0.7, attention_multiplier=0.2, logits_scaling=2.0,
        pad_token_id=0))


def _nemotron_h(vocab, pattern="M*M-ME"):
    from transformers import NemotronHConfig, NemotronHForCausalLM
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=vocab, hidden_size=64, layers_block_type=[kinds[c] for c in pattern],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, max_position_embeddings=512, pad_token_id=0))


def _falcon_h1(vocab, layers=2, rms_norm=True):
    from transformers import FalconH1Config, FalconH1ForCausalLM
    return FalconH1ForCausalLM(FalconH1Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_ssm=128, mamba_chunk_size=8, mamba_rms_norm=rms_norm,
        mamba_norm_before_gate=False, max_position_embeddings=512, pad_token_id=0,
        embedding_multiplier=1.3, lm_head_multiplier=0.8, key_multiplier=0.9, attention_in_multiplier=1.1,
        attention_out_multiplier=0.9, ssm_in_multiplier=1.2, ssm_out_multiplier=0.8,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05], mlp_multipliers=[1.1, 0.9]))


def _zamba2(vocab, layers=6):
    from transformers import Zamba2Config, Zamba2ForCausalLM
    return Zamba2ForCausalLM(Zamba2Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=8, mamba_headdim=16, mamba_ngroups=2,
        mamba_d_state=16, mamba_expand=2, chunk_size=8, num_mem_blocks=2, use_shared_attention_adapter=True,
        adapter_rank=8, use_mem_rope=True, layers_block_type=["mamba", "hybrid"] * (layers // 2),
        max_position_embeddings=512, pad_token_id=0))


# Gated DeltaNet hybrids: 2 key heads serving 4 value heads (grouped), partial rotary on Qwen's
# gated attention, three linear-attention layers to one attention layer
_GDN = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)


def _types(layers):
    return (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) + ["linear_attention"] * (layers % 4)


def _rope(partial=0.5):
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


def _qwen3_5(vocab, layers=4):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(vocab_size=vocab, num_hidden_layers=layers, layer_types=_types(layers),
                                                rope_parameters=_rope(), **_GDN))


def _qwen3_5_moe(vocab, layers=4):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(
        vocab_size=vocab, num_hidden_layers=layers, layer_types=_types(layers), rope_parameters=_rope(),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        **{k: v for k, v in _GDN.items() if k != "intermediate_size"}))


def _qwen3_next(vocab, layers=4):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=vocab, num_hidden_layers=layers, layer_types=_types(layers), rope_parameters=_rope(),
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        mlp_only_layers=[1], **_GDN))


def _olmo_hybrid(vocab, layers=4, rope=True, neg_eigval=True):
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM
    return OlmoHybridForCausalLM(OlmoHybridConfig(
        vocab_size=vocab, num_hidden_layers=layers, layer_types=_types(layers), linear_allow_neg_eigval=neg_eigval,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0} if rope else None,
        **{k: v for k, v in _GDN.items() if k != "head_dim"}))


def _kimi_linear(vocab, layers=4, q_lora=True):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    return KimiLinearForCausalLM(KimiLinearConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers, layer_types=_types(layers),
        mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24 if q_lora else None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_token=2,
        moe_intermediate_size=32, num_shared_experts=1, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))


BUILDERS = {"zamba2": _zamba2, "mamba2": _mamba2, "bamba": _bamba, "granite": _granite, "nemotron_h": _nemotron_h,
            "falcon_h1": _falcon_h1, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe, "qwen3_next": _qwen3_next,
            "olmo_hybrid": _olmo_hybrid, "kimi_linear": _kimi_linear}


def build(family: str, tmp_path, seed: int = 0, vocab: int = VOCAB, **kw):
    """A random model of ``family``, saved with save_pretrained and loaded back with from_pretrained
    (fp32, eval). Weights are scaled up from the init so every path matters."""
    torch.manual_seed(seed)
    model = BUILDERS[family](vocab, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.1)
            elif name.endswith("D") or name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("norm.weight") and p.abs().max() == 0:  # zero-centred norms (Qwen's)
                p.normal_(0, 0.2)
    directory = tmp_path / f"{family}-{seed}-{vocab}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"
    model.save_pretrained(directory)
    return type(model).from_pretrained(directory, dtype=torch.float32).eval(), directory


class StepOracle:
    """The model's own cached decoding, one token per call, positions passed explicitly; forkable."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.length = 0
        self.mamba_only = type(model).__name__ == "Mamba2ForCausalLM"

    def fork(self):
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        return other

    @torch.no_grad()
    def feed(self, tokens):
        out = []
        for t in tokens:
            ids = torch.tensor([[int(t)]])
            if self.mamba_only:  # Mamba2ForCausalLM names its cache cache_params and has no positions
                res = self.model(input_ids=ids, cache_params=self.cache, use_cache=True)
                self.cache = res.cache_params
            else:
                res = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                                 position_ids=torch.tensor([[self.length]]))
                self.cache = res.past_key_values
            self.length += 1
            out.append(res.logits[0, -1].float())
        return torch.stack(out)

    def node_logits(self, tree, row=0):
        out = []
        for i in range(tree.num_nodes):
            path = [int(j) for j in tree.paths[row, i] if j >= 0]
            out.append(self.fork().feed([int(tree.tokens[row, j]) for j in path])[-1])
        return torch.stack(out)
