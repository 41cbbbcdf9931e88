"""MambaInLlama-style hybrid causal LM: Llama decoder layers whose mixer is either Llama attention or
MambaInLlama's GQA-shaped Mamba2, with the public checkpoint's parameter names.

Three forward paths share the same modules:
- ``forward(input_ids)``: whole sequence from an empty state, differentiable (training, scoring);
- ``forward(input_ids, cache)`` / ``prefill``: continue from a cache and advance it (chunked scan);
- ``step(input_ids, cache)``: one token by the recurrence (autoregressive decoding).
"""
from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stree.sampling import SamplingConfig, sample

from .attention import LlamaAttention
from .cache import AttentionLayerCache, InferenceCache
from .checkpoint import check_state_dict, load_state_dict, refuse_mamba1, save_state_dict
from .config import MambaInLlamaConfig
from .mamba import Mamba2GQA


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 and cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:  # no casts to dispatch
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        return F.rms_norm(x.float(), x.shape[-1:], self.weight.float(), self.eps).to(x.dtype)


class MLP(nn.Module):
    """Llama SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block; the mixer is ``self_attn`` (attention layers) or ``mamba``."""

    def __init__(self, config: MambaInLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_attention = config.is_attention_layer(layer_idx)
        if self.is_attention:
            self.self_attn = LlamaAttention(config.hidden_size, config.num_attention_heads,
                                            config.num_key_value_heads, config.head_dim, config.rope_theta,
                                            config.rope_scaling, layer_idx=layer_idx)
        else:
            self.mamba = Mamba2GQA(config.hidden_size, config.d_inner, config.d_xb, config.d_state,
                                   config.d_conv, config.dt_limit, config.chunk_size, layer_idx=layer_idx)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def mixer(self) -> LlamaAttention | Mamba2GQA:
        return self.self_attn if self.is_attention else self.mamba

    def allocate_cache(self, batch_size: int, max_seqlen: int, *, dtype, device):
        if self.is_attention:
            attn = self.self_attn
            return AttentionLayerCache.zeros(batch_size, attn.num_key_value_heads, max_seqlen, attn.head_dim,
                                             dtype=dtype, device=device)
        return self.mamba.allocate_cache(batch_size, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden_states (b, l, d) -> (b, l, d); ``mix`` runs this layer's mixer on the normed input."""
        hidden_states = hidden_states + mix(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


# How one layer's mixer is run: (layer index, decoder layer, normed hidden states (b, l, d)) -> (b, l, d).
MixFn = Callable[[int, DecoderLayer, torch.Tensor], torch.Tensor]


class MambaInLlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of checkpoint keys)."""

    def __init__(self, config: MambaInLlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, mix: MixFn) -> torch.Tensor:
        """input_ids (b, l) -> final hidden states (b, l, d), each mixer run through ``mix``."""
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, lambda x, i=i, layer=layer: mix(i, layer, x))
        return self.norm(h)


class MambaInLlamaForCausalLM(nn.Module):
    """Hybrid causal LM. Checkpoint keys: ``model.embed_tokens.weight``, ``model.layers.{i}.*``,
    ``model.norm.weight``, ``lm_head.weight`` (shared with the embedding if ``tie_word_embeddings``)."""

    def __init__(self, config: MambaInLlamaConfig):
        super().__init__()
        self.config = config
        self.model = MambaInLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self) -> None:
        # HF Llama's initialisation (normal, initializer_range) for projections and embeddings; the
        # Mamba-specific parameters (conv, dt_bias, A_log, D) keep mamba_ssm's init from Mamba2GQA.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.config.initializer_range)

    # -- forward paths --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: InferenceCache | None = None,
                num_last_tokens: int = 0) -> torch.Tensor:
        """input_ids (b, l) -> logits (b, l, v) (or (b, num_last_tokens, v) if num_last_tokens > 0).

        Without ``cache``: the sequence starts at position 0 from an empty state (differentiable).
        With ``cache``: it continues after the cached tokens (chunked scan) and the cache is advanced by l.
        """
        h = self._run(input_ids, cache, recurrent=False)
        if num_last_tokens > 0:
            h = h[:, -num_last_tokens:]
        return self.lm_head(h)

    def step(self, input_ids: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """One token per row: input_ids (b, 1) -> logits (b, 1, v); Mamba layers use the recurrence."""
        if input_ids.shape[1] != 1:
            raise ValueError(f"step takes one token per row, got input_ids of shape {tuple(input_ids.shape)}")
        return self.lm_head(self._run(input_ids, cache, recurrent=True))

    def step_at(self, input_ids: torch.Tensor, cache: InferenceCache, position: torch.Tensor) -> torch.Tensor:
        """``step`` with static shapes, for ``torch.compile``: input_ids (b, 1) at ``position (b,)``
        (int64 tensor, the tokens' positions) -> logits (b, 1, v). Attention reads the cache's
        whole ``max_seqlen`` under a mask (:meth:`LlamaAttention.step_at`); the caller advances
        ``cache.seqlen``, which this method never reads (a Python int would fix a graph to it)."""
        def mix(i, layer, h):
            if layer.is_attention:
                return layer.self_attn.step_at(h, position, cache.layers[i])
            return layer.mamba.step(h, cache.layers[i])

        return self.lm_head(self.model(input_ids, mix))

    def _run(self, input_ids: torch.Tensor, cache: InferenceCache | None, recurrent: bool) -> torch.Tensor:
        """Final hidden states (b, l, d); ``recurrent``: Mamba layers by the single-token recurrence."""
        b, l = input_ids.shape
        start = 0 if cache is None else cache.reserve(l)
        positions = torch.arange(start, start + l, device=input_ids.device).expand(b, l)

        def mix(i, layer, h):
            state = None if cache is None else cache.layers[i]
            if layer.is_attention:
                return layer.self_attn(h, positions, state, start)
            return layer.mamba.step(h, state) if recurrent else layer.mamba(h, state)

        h = self.model(input_ids, mix)
        if cache is not None:
            cache.seqlen += l
        return h

    # -- hooks for stree.patch (tree decoding runs the same layers with its own mixer calls) ------
    def stree_mixers(self) -> list[tuple[int, LlamaAttention | Mamba2GQA]]:
        """``[(layer index, sequence mixer)]``."""
        return [(i, layer.mixer) for i, layer in enumerate(self.model.layers)]

    def stree_walk(self, input_ids: torch.Tensor, run_mixer, head: bool = True) -> torch.Tensor | None:
        """Logits (b, l, v) fp32 of ``input_ids (b, l)`` with every mixer call replaced by
        ``run_mixer(layer index, mixer, normed hidden states (b, l, d)) -> (b, l, d)``; None with
        ``head=False`` (the head is not run)."""
        h = self.model(input_ids, lambda i, layer, h: run_mixer(i, layer.mixer, h))
        return self.lm_head(h).float() if head else None

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: torch.dtype | None = None,
                                 device: torch.device | str | None = None) -> InferenceCache:
        """Empty cache for ``batch_size`` rows of up to ``max_seqlen`` tokens (model dtype/device by default;
        Mamba SSM states are always fp32)."""
        ref = self.model.embed_tokens.weight
        dtype, device = dtype or ref.dtype, device or ref.device
        layers = {i: layer.allocate_cache(batch_size, max_seqlen, dtype=dtype, device=device)
                  for i, layer in enumerate(self.model.layers)}
        return InferenceCache(layers, max_seqlen)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Autoregressive decoding: prompt (b, l) -> tokens (b, l + n), n <= max_new_tokens.

        Stops early once every row has produced an EOS; rows that finished earlier are padded with
        ``eos_token_id`` (its first id if a list). All rows share the prompt length (no padding support).
        Sampling: ``temperature == 0`` greedy, else softmax(logits / temperature) after top-k / top-p.
        """
        b, l = input_ids.shape
        sampling = SamplingConfig(temperature, top_k, top_p)
        eos = torch.tensor([] if eos_token_id is None else
                           [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id),
                           dtype=torch.long, device=input_ids.device)
        if max_new_tokens <= 0:
            return input_ids
        tokens = [input_ids]
        cache = self.allocate_inference_cache(b, l + max_new_tokens)
        logits = self(input_ids, cache, num_last_tokens=1)
        finished = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            nxt = sample(logits[:, -1], sampling, generator)
            if eos.numel():
                nxt = torch.where(finished, eos[0], nxt)
                finished |= torch.isin(nxt, eos)
            tokens.append(nxt[:, None])
            if i == max_new_tokens - 1 or bool(finished.all()):
                break
            logits = self.step(nxt[:, None], cache)
        return torch.cat(tokens, dim=1)

    # -- checkpoint IO --------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "MambaInLlamaForCausalLM":
        """Load a local checkpoint directory (``config.json``, ``mamba_config.json``, weights).

        dtype None keeps the dtype of the stored embedding; the model is returned in eval mode.
        Raises FileNotFoundError for a missing directory/file, CheckpointError naming the file for an
        unreadable (truncated) weight file, naming Mamba-1 weights (not supported), or naming the key
        for a missing or unexpected tensor or a shape mismatch.
        """
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
        try:
            config, config_error = MambaInLlamaConfig.from_pretrained(directory), None
        except ValueError as err:  # a Mamba-1 checkpoint fails the Mamba2 size checks; say why below
            config, config_error = None, err
        state_dict = load_state_dict(directory, device="cpu" if device is None else device)
        refuse_mamba1(state_dict)
        if config_error is not None:
            raise config_error
        # Old HF Llama checkpoints stored the (recomputed) RoPE frequencies; they carry no weights.
        state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if config.tie_word_embeddings:
            state_dict.pop("lm_head.weight", None)
        with torch.device("meta"):  # no allocation or random init for weights about to be replaced
            model = cls(config)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        check_state_dict(expected, state_dict, optional={"lm_head.weight"} if config.tie_word_embeddings else set())
        model.load_state_dict(state_dict, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        dtype = dtype or state_dict["model.embed_tokens.weight"].dtype
        return model.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, directory: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
        """Write ``config.json``, ``mamba_config.json`` and ``model.safetensors`` (or shards + index)."""
        self.config.save_pretrained(directory)
        state_dict = self.state_dict()
        if self.config.tie_word_embeddings:  # safetensors refuses shared storage; HF omits the tied head
            state_dict.pop("lm_head.weight")
        save_state_dict(state_dict, directory, max_shard_bytes=max_shard_bytes)
