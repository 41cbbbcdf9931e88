"""Attention layers' tree rows inside vLLM: each tree request's query rows attend to its committed
context and to the nodes on their own root path (the K/V vLLM wrote for the nodes, one slot each,
read in place), and at commit the accepted path's K/V move to the positions vLLM counts next.

Qwen's gated attention (its output gate, q/k norms, partial rotary) and any other layer that
hands vLLM's attention backend its rotated q/k run through this unchanged: the gate and norms
sit outside the backend, and rotary embeddings see each node's depth (:mod:`stree.vllm.runner`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from stree.kernels import cpu_ops
from stree.vllm.kv_layout import CacheLayout, memory
from stree.vllm.step import TreeGroup, TreeStep


@dataclass
class AttentionContext:
    """What an attention layer reads for one tree group: the KV slots of each request's sequence
    ``slots (b, L)`` (L the group's longest; a shorter row repeats its last slot, never attended),
    the attention mask of its queries over them ``allowed (b, m, L)`` (the context, then each
    node's ancestors, itself included), and, built on first use, where those slots' K and V sit
    in the cache's memory; shared by the layers of a step."""

    group: TreeGroup
    slots: torch.Tensor
    allowed: torch.Tensor
    _offsets: dict = field(default_factory=dict)

    def gather(self, layout, cache: torch.Tensor, value: bool = False) -> torch.Tensor:
        """``(b, kv_heads, L, head_dim)`` the K (or V) of :attr:`slots` in ``cache`` (laid out as
        ``layout`` says): one ``index_select`` over the cache's memory, at element offsets
        computed once per step (every layer's cache has the same shape and strides)."""
        key = (value, tuple(cache.shape), cache.stride())
        if key not in self._offsets:
            self._offsets[key] = layout.offsets(cache, self.slots, value)
        offsets = self._offsets[key]
        return memory(cache).index_select(0, offsets.view(-1)).view(offsets.shape)


def paged(step: TreeStep, metadata) -> list[tuple[TreeGroup, torch.Tensor, torch.Tensor]]:
    """Per tree group of an attention layer's ``metadata``: its requests' block tables ``(b, nb)``
    and sequence lengths ``(b,)``, int64, as stree's C++ tree attention reads them in place (and
    :func:`contexts` builds on). The same for every layer sharing the metadata: built once."""
    def build():
        row = {s: r for r, s in enumerate(metadata.query_start_loc.tolist()[:-1])}
        out = []
        for g in step.groups():
            rows = torch.tensor([row[tr.start] for tr in g.rows])
            out.append((g, metadata.block_table[rows].long(), metadata.seq_lens[rows].long()))
        return out

    return step.table(("paged", id(metadata.block_table)), build)


def contexts(step: TreeStep, metadata, block: int) -> list[AttentionContext]:
    """One :class:`AttentionContext` per tree group of an attention layer's ``metadata``
    (``block``: its KV block size). The same for every layer sharing the metadata: built once."""
    def build():
        out = []
        for g, table, lengths in paged(step, metadata):
            table, lengths = table.cpu(), lengths.cpu()
            m, longest = g.index.shape[1], int(lengths.max())
            pos = torch.minimum(torch.arange(longest), lengths[:, None] - 1)  # (b, L)
            slots = table.gather(1, pos // block) * block + pos % block
            allowed = torch.arange(longest) < (lengths - m)[:, None]
            allowed = allowed[:, None, :].repeat(1, m, 1)
            for r, length in enumerate(lengths.tolist()):
                allowed[r, :, length - m:length] = g.ancestors
            device = metadata.block_table.device
            out.append(AttentionContext(g, slots.to(device), allowed.to(device)))
        return out

    return step.table(("contexts", id(metadata.block_table), block), build)


def rest(step: TreeStep, metadata, build):
    """The batch's other rows (prefills, requests without a tree) as a sub-batch of an attention
    layer's ``metadata``: ``(token indices (t,), its metadata)``, the metadata made by
    ``build(rows, token index, query_start_loc, seq_lens)``; None when every row is a tree. Built
    once per step and metadata."""
    def make():
        starts = metadata.query_start_loc.tolist()
        rows = [r for r in range(len(starts) - 1) if starts[r] not in step.rows]
        if not rows:
            return None
        spans = [torch.arange(starts[r], starts[r + 1]) for r in rows]
        tokens = torch.cat(spans)
        loc = torch.tensor([0] + [len(t) for t in spans]).cumsum(0).to(metadata.query_start_loc.dtype)
        return tokens, build(torch.tensor(rows), tokens, loc, metadata.seq_lens[rows])

    return step.table(("rest", id(metadata.query_start_loc)), make)


def attention_refusal(impl) -> str | None:
    """What :func:`tree_attention` cannot compute in a layer whose vLLM attention implementation
    is ``impl`` (ALiBi, a sliding window, attention sinks, a quantised KV cache), or None."""
    if impl.alibi_slopes is not None:
        return "ALiBi"
    if impl.sliding_window not in (None, -1, (-1, -1)):
        return f"a sliding window ({impl.sliding_window})"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "is_fp8_kv_cache", False) or str(impl.kv_cache_dtype).startswith("fp8"):
        return f"a quantised KV cache ({impl.kv_cache_dtype})"
    return None


def tree_attention(impl, layer, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata,
                   output: torch.Tensor, step: TreeStep, layout=None) -> None:
    """Recompute the attention rows of tree requests under the tree mask, in place.

    query: (tokens, heads, head_dim); key_cache, value_cache: vLLM's split K and V caches, laid
    out as ``layout`` says (None: vLLM's CPU cache, ``(blocks, kv_heads, block_size, head_dim)``
    views, its in-block layout probed; :class:`FlashLayout`: FlashAttention's); metadata: vLLM's
    attention metadata (query_start_loc, seq_lens, block_table, slot_mapping). Query row ``i`` of
    a tree attends to the request's committed context and to the tree nodes on its own root path.
    Where the layout is linear in token and channel (vLLM's fp32 CPU cache) and the tensors fp32,
    stree's C++ op reads the cache in place, one call per tree shape; elsewhere each group's
    context is gathered and SDPA runs under the tree mask.
    """
    why = attention_refusal(impl)
    if why is not None:  # refused at start-up (stree.vllm.targets); kept for direct callers
        raise NotImplementedError(f"stree: tree verification in vLLM supports plain causal attention only, not {why}")
    if layout is None:
        layout = CacheLayout.probe(layer, key_cache.shape[2], key_cache.shape[3], key_cache.dtype,
                                   impl.kv_cache_dtype)
    heads = query.shape[1]
    rows = output.view(output.shape[0], heads, -1)
    if (getattr(layout, "strides", None) and not impl.logits_soft_cap
            and cpu_ops.usable(query, key_cache, value_cache, output)):
        for g, table, lengths in paged(step, metadata):  # one C++ call per tree shape, read in place
            cpu_ops.ops().tree_attention_rows(query, key_cache, value_cache, *layout.strides, table, lengths,
                                              g.index, g.ancestors, impl.scale, rows)
    else:  # the reference: each group's context gathered, SDPA under the tree mask
        for ctx in contexts(step, metadata, layout.block_size(key_cache)):
            g = ctx.group
            k, v = ctx.gather(layout, key_cache).float(), ctx.gather(layout, value_cache, value=True).float()
            q = g.take(query).transpose(1, 2).float()  # (b, heads, m, d), fp32 math
            mask = ctx.allowed[:, None]
            if impl.logits_soft_cap:  # SDPA has no soft cap: the plain formula
                k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
                scores = impl.logits_soft_cap * torch.tanh(q @ k.transpose(-1, -2) * impl.scale / impl.logits_soft_cap)
                out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=impl.scale, enable_gqa=True)
            g.put(rows, out.transpose(1, 2).to(rows.dtype))
    step.keep(KVMove(key_cache, value_cache, layout, metadata.slot_mapping))


@dataclass
class KVMove:
    """One attention layer's K and V caches in a step with trees: at commit the accepted path's
    K/V move to positions ``num_computed + 1 .. + a`` (vLLM then counts ``a + 1`` new tokens
    there). ``layout``: where a slot's K/V sit (:mod:`stree.vllm.kv_layout`); ``slot_mapping``:
    the step's KV slot of each query token."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    layout: object
    slot_mapping: torch.Tensor

    def commit(self, step: TreeStep) -> None:
        moves = step.table("kv moves", lambda: _moves(step))
        if moves is None:
            return
        for cache, value in ((self.key_cache, False), (self.value_cache, True)):
            # each cache's moves as element offsets, built once per layout, cache shape and slot
            # mapping (the layers share them): then two ops a cache (a move by block, row and
            # in-block index cost 21 us a cache, 8 caches a step on the shipped target)
            key = ("kv offsets", id(self.layout), value, tuple(cache.shape), cache.stride(), id(self.slot_mapping))
            dst, src = step.table(key, lambda: self._offsets(moves, cache, value))
            flat = memory(cache)
            flat.index_copy_(0, dst, flat.index_select(0, src))  # gathered first: they may overlap

    def _offsets(self, moves: torch.Tensor, cache: torch.Tensor, value: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(moves) // 2
        slots = self.slot_mapping[moves.to(self.slot_mapping.device)].long()
        both = self.layout.offsets(cache, slots[None], value)[0]  # (kv_heads, 2 * moves, head_dim)
        return both[:, :n].reshape(-1), both[:, n:].reshape(-1)


def _moves(step: TreeStep) -> torch.Tensor | None:
    """The query positions whose K/V move, destinations then sources: path index ``j`` <- node
    ``path[j]`` (nodes come in topological order, so ``j <= path[j]`` and a gather-then-scatter
    never reads a moved slot); None when no path moves."""
    moves = [(tr.start + j, tr.start + n) for tr in step.rows.values() for j, n in enumerate(tr.path) if j != n]
    return torch.tensor([d for d, _ in moves] + [s for _, s in moves]) if moves else None
