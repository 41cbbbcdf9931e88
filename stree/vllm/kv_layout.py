"""Where vLLM keeps a token's K and V: the in-block layout of its CPU attention cache (probed from
vLLM's own writer) and of FlashAttention's paged cache, as element offsets into a cache's memory.
The tree attention rows read the committed context through them, and the commit moves the
accepted nodes' K/V with them (:mod:`stree.vllm.attention_rows`)."""
from __future__ import annotations

import torch


def memory(cache: torch.Tensor) -> torch.Tensor:
    """A flat view of ``cache``'s memory from its first element on, which a layout's element
    offsets index."""
    return cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset(),), (1,))


class CacheLayout:
    """Where vLLM's CPU backend keeps token ``t``'s K (and V) inside a block: ``index[t, d]`` is
    the flat position of element ``d`` in one head's ``block_size * head_dim`` region. The layout
    depends on the kernel's ISA and sizes (K is stored dimension-major for some), so it is read
    once from vLLM's own ``cpu_attn_reshape_and_cache`` writing known values into a scratch block.
    """

    _cache: dict = {}

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value
        k, v = _linear(key), _linear(value)
        # (k_ts, k_es, v_ts, v_es) where token t's channel e sits at t * ts + e * es in K's and in
        # V's head regions (fp32 on x86: K channel-major, V token-major), which stree's C++ tree
        # attention reads in place; None for other layouts (the gathered path)
        self.strides = k + v if k and v else None

    @staticmethod
    def block_size(cache: torch.Tensor) -> int:
        return cache.shape[2]  # split K or V cache: (blocks, kv_heads, block_size, head_dim)

    def offsets(self, cache: torch.Tensor, slots: torch.Tensor, value: bool = False) -> torch.Tensor:
        """``(b, kv_heads, L, head_dim)`` where the K (or V) of KV slots ``slots (b, L)`` sit in
        ``cache``'s memory (element offsets from its first element)."""
        index = self.value if value else self.key
        block, head_dim = index.shape
        s_block, s_head, s_row, s_col = cache.stride()
        pos = index.to(slots.device)[slots % block]  # (b, L, head_dim) positions in a head's region
        if s_row == head_dim * s_col:  # the region is contiguous (vLLM's CPU cache is)
            inner = pos * s_col
        else:
            inner = (pos // head_dim) * s_row + (pos % head_dim) * s_col
        heads = torch.arange(cache.shape[1], device=slots.device) * s_head
        return ((slots // block) * s_block)[:, None, :, None] + heads[:, None, None] + inner[:, None]

    @classmethod
    def probe(cls, layer, block_size: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> "CacheLayout":
        k = (layer.isa, block_size, head_dim, dtype, kv_cache_dtype)
        if k not in cls._cache:
            from vllm import _custom_ops as ops

            coords = []
            for fill in (torch.arange(block_size)[:, None].expand(block_size, head_dim),   # token t
                         torch.arange(head_dim)[None, :].expand(block_size, head_dim)):    # element d
                scratch = torch.full((1, 1, 2 * block_size, head_dim), -1.0, dtype=dtype)
                key_cache, value_cache = scratch.chunk(2, dim=2)
                src = fill[:, None, :].to(dtype).contiguous()  # small integers: exact in any float dtype
                ops.cpu_attn_reshape_and_cache(src, src.clone(), key_cache, value_cache, torch.arange(block_size),
                                               layer.isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
                coords.append((key_cache.reshape(-1).long(), value_cache.reshape(-1).long()))
            maps = []
            for which in (0, 1):
                t, d = coords[0][which], coords[1][which]
                index = torch.empty(block_size, head_dim, dtype=torch.long)
                index[t, d] = torch.arange(block_size * head_dim)
                maps.append(index)
            cls._cache[k] = cls(*maps)
        return cls._cache[k]


def _linear(index: torch.Tensor) -> tuple[int, int] | None:
    """``(ts, es)`` where ``index (block_size, head_dim) == t * ts + e * es``, else None."""
    block, head_dim = index.shape
    ts = int(index[1, 0] - index[0, 0]) if block > 1 else head_dim
    es = int(index[0, 1] - index[0, 0]) if head_dim > 1 else 1
    t, e = torch.arange(block)[:, None], torch.arange(head_dim)
    return (ts, es) if ts > 0 and es > 0 and torch.equal(index, t * ts + e * es) else None


class FlashLayout:
    """vLLM's FlashAttention paged cache (GPU): ``kv_cache (blocks, kv_heads, block_size, 2 *
    head_dim)``, K in the first ``head_dim`` channels, split as ``FlashAttentionImpl.forward``
    does into K and V views ``(blocks, block_size, kv_heads, head_dim)``: token-major, so nothing
    to probe. Written against vLLM 0.32's layout and tested on CPU tensors of it; never run on a
    GPU."""

    @staticmethod
    def block_size(cache: torch.Tensor) -> int:
        return cache.shape[1]

    @staticmethod
    def offsets(cache: torch.Tensor, slots: torch.Tensor, value: bool = False) -> torch.Tensor:
        """As :meth:`CacheLayout.offsets`, for a ``(blocks, block_size, kv_heads, head_dim)`` view."""
        s_block, s_row, s_head, s_col = cache.stride()
        block, device = cache.shape[1], slots.device
        heads = torch.arange(cache.shape[2], device=device) * s_head
        cols = torch.arange(cache.shape[3], device=device) * s_col
        return ((slots // block) * s_block + (slots % block) * s_row)[:, None, :, None] + heads[:, None, None] + cols
