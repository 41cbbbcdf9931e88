"""Explicit autoregressive inference cache of the hybrid model.

Per-layer layouts are those of the tree cache contract (docs/ARCHITECTURE.md): Mamba layers keep
mamba_ssm's ``conv_state (b, conv_dim, d_conv)`` (raw pre-conv inputs, column ``d_conv - 1`` newest,
channels-last strides like mamba_ssm so causal-conv1d kernels accept it) and ``ssm_state (b, h, p, s)``;
attention layers keep ``kv (b, 2, hkv, max_seqlen, head_dim)`` (keys, then values). All rows of a
batch hold the same number of tokens, ``seqlen``.
"""
from __future__ import annotations

from dataclasses import dataclass

from stree.cache import AttentionLayerCache, MambaLayerCache

__all__ = ["AttentionLayerCache", "InferenceCache", "MambaLayerCache"]


@dataclass
class InferenceCache:
    """State of every layer after ``seqlen`` tokens (``layers[i]`` belongs to model layer ``i``)."""

    layers: dict[int, MambaLayerCache | AttentionLayerCache]
    max_seqlen: int
    seqlen: int = 0

    @property
    def batch_size(self) -> int:
        first = next(iter(self.layers.values()))
        return (first.conv_state if isinstance(first, MambaLayerCache) else first.k).shape[0]

    def reserve(self, num_tokens: int) -> int:
        """Return the position of the first of ``num_tokens`` new tokens; raise if they do not fit."""
        if self.seqlen + num_tokens > self.max_seqlen:
            raise ValueError(f"cache overflow: {self.seqlen} cached + {num_tokens} new tokens > "
                             f"max_seqlen {self.max_seqlen}")
        return self.seqlen

    def reset(self) -> None:
        for layer in self.layers.values():
            layer.reset()
        self.seqlen = 0
