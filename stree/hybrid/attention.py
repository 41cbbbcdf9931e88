"""Llama attention (GQA, no bias, RoPE with HF rope_scaling) with an explicit-position KV cache."""
from __future__ import annotations

import torch
from torch import nn

from stree.layers.sdpa import attention, causal_after, fold_mask

from .cache import AttentionLayerCache
from .rotary import RotaryEmbedding, rotate, signed_tables


class LlamaAttention(nn.Module):
    """Parameters ``{q,k,v,o}_proj.weight`` as in HF Llama checkpoints.

    q, k and v are held as one ``qkv_proj`` (rows q, then k, then v): one GEMM per step instead
    of three. ``state_dict`` and ``load_state_dict`` still speak the checkpoint's names (hooks
    split and join the rows), so checkpoints and shape checks see ``q_proj.weight`` etc.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_key_value_heads: int, head_dim: int,
                 rope_theta: float = 10000.0, rope_scaling: dict | None = None, layer_idx: int | None = None):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = num_heads, num_key_value_heads, head_dim
        self.softmax_scale = head_dim ** -0.5
        self.layer_idx = layer_idx
        self.qkv_sizes = (num_heads * head_dim, num_key_value_heads * head_dim, num_key_value_heads * head_dim)
        self.qkv_proj = nn.Linear(hidden_size, sum(self.qkv_sizes), bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta, rope_scaling)
        self.register_state_dict_post_hook(_split_qkv)
        self.register_load_state_dict_pre_hook(_join_qkv)

    def project_heads(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (b, l, d) -> ``(b, l, hq + 2 * hkv, hd)``: the q heads, then k's, then
        v's, before rotary (one view of the fused projection)."""
        return self.qkv_proj(hidden_states).unflatten(-1, (-1, self.head_dim))

    def project_qkv(self, hidden_states: torch.Tensor):
        """hidden_states (b, l, d) -> q (b, l, hq, hd), k, v (b, l, hkv, hd), before rotary."""
        hkv = self.num_key_value_heads
        return self.project_heads(hidden_states).split((self.num_heads, hkv, hkv), dim=2)

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate q (b, l, hq, hd) and k (b, l, hkv, hd) to ``positions (b, l)``."""
        tables = self.rotary_tables(positions)
        return rotate(q, tables), rotate(k, tables)

    def rotary_tables(self, positions: torch.Tensor):
        """``(cos, signed sin)`` for ``positions (b, l)`` (see ``rotary.signed_tables``); the same
        for every layer with an equal ``rotary_key``, so tree decoding builds them once per tree."""
        return signed_tables(*self.rotary(positions))

    @property
    def rotary_key(self):
        return ("llama", self.head_dim, self.rotary.theta, repr(self.rotary.scaling))

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                cache: AttentionLayerCache | None = None, start: int = 0) -> torch.Tensor:
        """hidden_states (b, l, d), positions (b, l) -> (b, l, d).

        Without ``cache``: causal attention within the sequence. With ``cache``: the new K/V are written
        at ``[start, start + l)`` and each query attends to every cached key up to its own slot.
        """
        l = hidden_states.shape[1]
        q, k, v = self.project_qkv(hidden_states)
        q, k = self.apply_rotary(q, k, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, l, hd)
        if cache is None:
            return self.o_proj(causal_after(q, k, v, self.softmax_scale))
        cache.k[:, :, start:start + l] = k
        cache.v[:, :, start:start + l] = v
        k, v = cache.keys(start + l)
        return self.o_proj(causal_after(q, k, v, self.softmax_scale, start))

    def step_at(self, hidden_states: torch.Tensor, position: torch.Tensor,
                cache: AttentionLayerCache) -> torch.Tensor:
        """One token per row at ``position (b,)`` (int64 tensor): hidden_states (b, 1, d) -> (b, 1, d).

        The static-shape form of ``forward`` with a cache (gpt-fast's and transformers'
        static-cache step): K/V are written at ``position`` and the query reads the cache's whole
        capacity, later positions masked, so no shape depends on the length and
        ``torch.compile`` keeps one graph for a whole generation.
        """
        q, k, v = self.project_qkv(hidden_states)
        q, k = self.apply_rotary(q, k, position[:, None])
        rows = torch.arange(q.shape[0], device=q.device)
        cache.k[rows, :, position] = k[:, 0]
        cache.v[rows, :, position] = v[:, 0]
        keys, values = cache.keys(cache.kv.shape[3])
        visible = torch.arange(keys.shape[2], device=q.device) <= position[:, None]  # (b, capacity)
        mask = fold_mask(visible[:, None, None, :], self.num_heads // self.num_key_value_heads)
        return self.o_proj(attention(q.transpose(1, 2), keys, values, self.softmax_scale, mask=mask))


_QKV_NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def _split_qkv(module: LlamaAttention, state_dict, prefix, local_metadata) -> None:
    """``state_dict`` post-hook: ``qkv_proj.weight`` as the checkpoint's three tensors (views)."""
    fused = state_dict.pop(prefix + "qkv_proj.weight")
    for name, part in zip(_QKV_NAMES, fused.split(module.qkv_sizes, dim=0)):
        state_dict[prefix + name] = part


def _join_qkv(module: LlamaAttention, state_dict, prefix, local_metadata, strict, missing_keys,
              unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook: the checkpoint's q/k/v weights as one ``qkv_proj.weight``.
    Left alone unless all three are present (stree's loaders name a missing checkpoint key
    before loading; a strict ``load_state_dict`` then reports the fused name as missing)."""
    keys = [prefix + name for name in _QKV_NAMES]
    if all(key in state_dict for key in keys):
        state_dict[prefix + "qkv_proj.weight"] = torch.cat([state_dict.pop(key) for key in keys], dim=0)
