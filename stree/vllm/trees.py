"""Token trees inside vLLM 0.32: one tree per request verified in one forward, committed by replay.

vLLM schedules and verifies chains only. For a tree spec (``"tree": "caterpillar:2,2,2,2"``,
``"static:..."``, ``"beam:..."``, dynamic trees), :class:`~stree.vllm.proposer.StreeProposer`
hands vLLM each request's drafted tree flattened in topological order (node ``i``'s parent has a
smaller index) as its draft tokens, so vLLM schedules the request as one query of ``1 + n``
tokens: the root (the last committed token, which neither model has run) and the ``n`` drafted
nodes, each with its own KV slot at ``num_computed + i``. The wrappers below make that query a
tree verification:

1. ``GPUModelRunner._prepare_inputs``: each node's position becomes ``num_computed + depth(i)``
   (rotary embeddings see the node's place on its own path); the slot mapping, already computed,
   keeps one KV slot per node. :class:`TreeStep` (this step's trees, keyed by the query's first
   token index) becomes current.
2. Attention (vLLM's CPU backend): the rows of tree requests are computed under the tree mask:
   committed context plus the node's ancestors (:func:`tree_attention`); vLLM's own kernel runs
   first when the batch holds other rows.
3. Mamba2 (vLLM's decode ops ``causal_conv1d_update`` / ``selective_state_update``): tree rows run
   stree's ``tree_conv`` and ``tree_scan`` from the committed state (on the CPU in fp32, stree's
   C++ ops: :mod:`stree.kernels.cpu_ops`); nothing is written, and the activations the commit needs
   are kept (:class:`_ConvGroup`, :class:`_ScanGroup`); requests whose
   trees have one shape run as one batch (:class:`TreeGroup`). Other rows, if
   any, go to vLLM's op with the tree rows masked out (their state index set to vLLM's null block).
4. ``GPUModelRunner._sample``: stree's verifier on each tree (the lossless rule for the request's
   sampling settings and the draft's mode) gives the accepted path; the request's output row
   becomes the path's tokens and the token the target emits after it (vLLM's rejection sampler
   runs first only when the batch holds other rows). A step in which no request has drafts, for
   any speculative method, is sampled by vLLM's own sampler, not its rejection sampler.
5. Commit (:meth:`TreeStep.commit`): the K/V of the path's nodes move to positions
   ``num_computed + 1 .. + a`` (vLLM then counts ``a + 1`` new tokens there), and each Mamba2
   layer's state is advanced along the path from the kept activations (``ssm_replay``,
   ``conv_replay``) into the SSM slot and conv offset vLLM reads next step:
   ``num_accepted_tokens - 1 = a``.

A chain (``"chain:K"``) is a tree and takes this path too, but where
:attr:`~stree.vllm.speculative.DraftSpec.stree_verifies` leaves it to vLLM's own rejection sampler
(SpS on a GPU, or ``"verifier": "sps"`` named: :mod:`stree.vllm.proposer`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from stree.kernels import cpu_ops
from stree.kernels.replay import conv_replay, conv_replay_index, path_tables, ssm_replay
from stree.kernels.tree_conv import tree_conv
from stree.kernels.tree_scan import tree_scan
from stree.tree import TokenTree
from stree.vllm.cpu_spec import conv_windows, start_slots
from stree.vllm.drafted import DraftedTree


@dataclass
class TreeRow:
    """One request's tree in this step: batch row, first token index of its query, its drafted
    tree, the generator vLLM keeps for it (seeded requests), and after verification the accepted
    path (node indices, root first)."""

    row: int
    start: int
    drafted: DraftedTree
    generator: torch.Generator | None
    path: list[int] | None = None


@dataclass
class TreeGroup:
    """The tree requests of a step whose trees have one shape (the same parent list): every layer
    runs them as one batch. ``index (b, n)``: the query token index of each row's nodes;
    ``parents``: the shared parent list."""

    rows: list[TreeRow]
    index: torch.Tensor
    parents: tuple[int, ...]
    _paths: torch.Tensor | None = None

    def tree(self, device) -> TokenTree:
        """A template of the group's shape for its ``b`` rows on ``device`` (the target's), whose
        tables (conv windows, scan masks) every layer reads: built once per shape, batch size and
        device (its tokens mean nothing)."""
        return _template(self.parents, len(self.rows), device)

    def paths(self) -> torch.Tensor:
        """``(b, k)`` the verified paths, root first, -1 padded (after :meth:`TreeStep.verify`)."""
        if self._paths is None:
            k = max(len(tr.path) for tr in self.rows)
            self._paths = torch.tensor([tr.path + [-1] * (k - len(tr.path)) for tr in self.rows])
        return self._paths

    def accepted(self) -> list[int]:
        """Accepted draft nodes per row (its path less the root)."""
        return [len(tr.path) - 1 for tr in self.rows]

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """``(n, n)`` bool, contiguous: node i sees node j (the C++ tree attention's mask)."""
        return self.tree("cpu").mask[0].contiguous()

    @cached_property
    def parent_index(self) -> torch.Tensor:
        """``(n,)`` int64 the shared parent list (the C++ tree scan's table)."""
        return torch.tensor(self.parents)

    @cached_property
    def span(self) -> slice | None:
        """The group's query tokens as one slice when its rows lie back to back in the batch (a
        lone request's always do), else None."""
        (b, n), first = self.index.shape, self.rows[0].start
        if [tr.start for tr in self.rows] == list(range(first, first + b * n, n)):
            return slice(first, first + b * n)
        return None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """``(b, n, ...)`` the group's rows of ``t (tokens, ...)``: a view where they lie back to
        back, else a gathered copy (so never keep it past the step's forward without a copy)."""
        if self.span is None:
            return t[self.index]
        return t[self.span].view(*self.index.shape, *t.shape[1:])

    def put(self, t: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows (b, n, ...)`` into the group's rows of ``t (tokens, ...)``."""
        if self.span is None:
            t[self.index] = rows
        else:
            t[self.span].view(*self.index.shape, *t.shape[1:]).copy_(rows)


_TEMPLATES: dict[tuple, TokenTree] = {}  # (parents, b, device) -> template; bounded (dynamic trees)


def _template(parents: tuple[int, ...], b: int, device) -> TokenTree:
    key = (parents, b, str(device))
    if key not in _TEMPLATES:
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[key] = TokenTree(torch.zeros(b, len(parents), dtype=torch.long, device=device), list(parents))
    return _TEMPLATES[key]


@dataclass
class _ConvGroup:
    group: TreeGroup
    conv_state: torch.Tensor  # vLLM's (slots, dim, width - 1 + K) conv state, written at commit
    slots: list[int]
    window: torch.Tensor  # (b, dim, width - 1) committed inputs the tree conv started from
    xbc: torch.Tensor  # (b, n, dim) the nodes' pre-conv inputs


@dataclass
class _ScanGroup:
    group: TreeGroup
    ssm_state: torch.Tensor  # vLLM's (slots, heads, headdim, dstate)
    slots: list[list[int]]  # each request's state slots; slot a receives the committed state
    h0: torch.Tensor  # (b, heads, headdim, dstate) fp32 state before the root
    x: torch.Tensor  # (b, n, heads, headdim)
    dt: torch.Tensor  # (b, n, heads) fp32 processed dt
    A: torch.Tensor  # (heads,)
    B: torch.Tensor  # (b, n, groups, dstate)

    def committed_slots(self) -> list[int]:
        """Each request's slot for the committed state: slot ``a`` of its table, ``a`` accepted
        (after :meth:`TreeStep.verify`)."""
        return [slots[a] for slots, a in zip(self.slots, self.group.accepted())]


@dataclass
class RowGroup:
    """One tree shape's requests among vLLM's Mamba2 decode rows: their state slot tables
    ``table (b, 1 + K)`` (and as host lists), the last step's accepted counts ``accepted (b,)``
    (the conv window starts at column ``num_accepted - 1``) and the SSM slot each tree starts
    from ``start (b,)``."""

    group: TreeGroup
    table: torch.Tensor
    accepted: torch.Tensor
    start: torch.Tensor
    slots: list[list[int]]

    @cached_property
    def slot_column(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b,)`` int64 each request's conv slot and the column its window starts at
        (``num_accepted - 1``), as the C++ tree conv reads them."""
        return self.table[:, 0].contiguous(), self.accepted - 1


@dataclass
class MambaRows:
    """Where this step's trees sit among vLLM's Mamba2 decode rows: what every Mamba2 layer of the
    step reads, built once per step from the (shared) Mamba metadata. groups: one
    :class:`RowGroup` per tree shape; handled: the decode rows that are trees; masked: the slot
    table with those rows set to vLLM's null block (vLLM's own ops then leave them alone), None
    when every decode row is a tree."""

    groups: list[RowGroup]
    handled: list[int]
    masked: torch.Tensor | None

    @cached_property  # read by every Mamba2 layer of the step
    def tokens(self) -> torch.Tensor:
        """``(t,)`` the query token indices of every tree node."""
        return torch.cat([rg.group.index.flatten() for rg in self.groups])


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
        return _memory(cache).index_select(0, offsets.view(-1)).view(offsets.shape)


def _memory(cache: torch.Tensor) -> torch.Tensor:
    """A flat view of ``cache``'s memory from its first element on, which a layout's element
    offsets index."""
    return cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset(),), (1,))


@dataclass
class TreeStep:
    """This engine step's trees (keyed by the first token index of each request's query), the
    per-step tables every layer shares (built once, on first use), and what the layers kept for
    the commit."""

    rows: dict[int, TreeRow]
    kv: list[tuple] = field(default_factory=list)  # (key_cache, value_cache, layout, slot_mapping)
    conv: list[_ConvGroup] = field(default_factory=list)
    scan: list[_ScanGroup] = field(default_factory=list)
    _contexts: dict = field(default_factory=dict)
    _rests: dict = field(default_factory=dict)
    _mamba: dict = field(default_factory=dict)
    _groups: list[TreeGroup] | None = None

    def groups(self) -> list[TreeGroup]:
        """The step's tree requests grouped by tree shape (built once per step)."""
        if self._groups is None:
            by_shape: dict[tuple, list[TreeRow]] = {}
            for tr in self.rows.values():
                by_shape.setdefault(tuple(tr.drafted.tree.parents[0].tolist()), []).append(tr)
            self._groups = []
            for parents, rows in by_shape.items():
                index = torch.tensor([tr.start for tr in rows])[:, None] + torch.arange(len(parents))
                self._groups.append(TreeGroup(rows, index, parents))
        return self._groups

    def mamba_rows(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                   num_accepted: torch.Tensor, null_block: int) -> MambaRows:
        """:class:`MambaRows` of vLLM's decode metadata (``query_start_loc (d + 1,)``, the slot
        table ``(d, 1 + K)``, ``num_accepted (d,)``); built once per step (the layers share the
        metadata)."""
        key = id(query_start_loc)
        if key not in self._mamba:
            decode = {start: i for i, start in enumerate(query_start_loc.tolist()[:-1]) if start in self.rows}
            if len(decode) != len(self.rows):
                raise RuntimeError("stree: a tree request is missing from vLLM's Mamba decode rows")
            groups = []
            for g in self.groups():
                rows = torch.tensor([decode[tr.start] for tr in g.rows])
                table, accepted = state_indices[rows].long(), num_accepted[rows].long()
                groups.append(RowGroup(g, table, accepted, start_slots(table, accepted), table.tolist()))
            handled = sorted(decode.values())
            masked = None
            if len(handled) < state_indices.shape[0]:
                masked = state_indices.clone()
                masked[handled] = null_block
            self._mamba[key] = MambaRows(groups, handled, masked)
        return self._mamba[key]

    def paged(self, metadata) -> list[tuple[TreeGroup, torch.Tensor, torch.Tensor]]:
        """Per tree group of an attention layer's ``metadata``: its requests' block tables
        ``(b, nb)`` and sequence lengths ``(b,)``, int64, as stree's C++ tree attention reads them
        in place (and :meth:`contexts` builds on). The same for every layer sharing the metadata:
        built once."""
        key = ("paged", id(metadata.block_table))
        if key not in self._contexts:
            row = {s: r for r, s in enumerate(metadata.query_start_loc.tolist()[:-1])}
            self._contexts[key] = []
            for g in self.groups():
                rows = torch.tensor([row[tr.start] for tr in g.rows])
                self._contexts[key].append((g, metadata.block_table[rows].long(), metadata.seq_lens[rows].long()))
        return self._contexts[key]

    def contexts(self, metadata, block: int) -> list[AttentionContext]:
        """One :class:`AttentionContext` per tree group of an attention layer's ``metadata``
        (``block``: its KV block size). The same for every layer sharing the metadata: built
        once."""
        key = (id(metadata.block_table), block)
        if key not in self._contexts:
            out = []
            for g, table, lengths in self.paged(metadata):
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
            self._contexts[key] = out
        return self._contexts[key]

    def rest(self, metadata, build):
        """The batch's other rows (prefills, requests without a tree) as a sub-batch of an
        attention layer's ``metadata``: ``(token indices (t,), its metadata)``, the metadata made
        by ``build(rows, token index, query_start_loc, seq_lens)``; None when every row is a
        tree. Built once per step and metadata."""
        key = id(metadata.query_start_loc)
        if key not in self._rests:
            starts = metadata.query_start_loc.tolist()
            rows = [r for r in range(len(starts) - 1) if starts[r] not in self.rows]
            if not rows:
                self._rests[key] = None
            else:
                spans = [torch.arange(starts[r], starts[r + 1]) for r in rows]
                tokens = torch.cat(spans)
                loc = torch.tensor([0] + [len(t) for t in spans]).cumsum(0).to(metadata.query_start_loc.dtype)
                self._rests[key] = (tokens, build(torch.tensor(rows), tokens, loc, metadata.seq_lens[rows]))
        return self._rests[key]

    def covers(self, num_rows: int) -> bool:
        """Whether all ``num_rows`` requests of a batch (or of vLLM's decode rows, where every tree
        is) are trees: then vLLM's own kernel, op or sampler has nothing left to do."""
        return len(self.rows) == num_rows

    def verify(self, logits: torch.Tensor, cu_num_sampled: list[int], sampled: torch.Tensor) -> None:
        """Verify every tree against its target logits and write the output rows in place.

        logits: (sum of 1 + n per request, vocab), request ``r``'s rows end at
        ``cu_num_sampled[r]``, row ``i`` after node ``i``; sampled: vLLM's
        (num_reqs, 1 + max drafts) output, -1 padded.
        """
        for tr in self.rows.values():
            d = tr.drafted
            m = d.tree.num_nodes
            end = cu_num_sampled[tr.row]
            if end - (cu_num_sampled[tr.row - 1] if tr.row else 0) != m:
                raise RuntimeError(f"stree: request row {tr.row} has {m} tree nodes but vLLM computed "
                                   "logits for a different number of positions")
            verdict = d.verifier.verify(d.draft, logits[end - m:end][None].float(), d.sampling, tr.generator)
            a = int(verdict.num_accepted[0])
            tr.path = verdict.path[0, :a + 1].tolist()
            tokens = d.tree.tokens[0, tr.path[1:]].tolist() + [int(verdict.next_token[0])]
            sampled[tr.row].fill_(-1)
            sampled[tr.row, :a + 1] = torch.tensor(tokens, dtype=sampled.dtype)

    def commit(self) -> None:
        """Move the accepted paths' K/V into place and replay the Mamba2 states along them."""
        # query positions whose K/V move: path index j <- node path[j] (nodes come in topological
        # order, so j <= path[j] and a gather-then-scatter never reads a moved slot)
        moves = [(tr.start + j, tr.start + n) for tr in self.rows.values() for j, n in enumerate(tr.path) if j != n]
        # each cache's moves as element offsets (destinations, sources), built once per layout,
        # cache shape and slot mapping (the layers share them): then two ops a cache (a move
        # by block, row and in-block index cost 21 us a cache, 8 caches a step on the shipped target)
        offsets = {}
        queries = torch.tensor([d for d, _ in moves] + [s for _, s in moves]) if moves else None
        for key_cache, value_cache, layout, slot_mapping in self.kv if moves else ():
            for cache, value in ((key_cache, False), (value_cache, True)):
                key = (id(layout), value, tuple(cache.shape), cache.stride(), id(slot_mapping))
                if key not in offsets:
                    slots = slot_mapping[queries.to(slot_mapping.device)].long()
                    both = layout.offsets(cache, slots[None], value)[0]  # (kv_heads, 2 * moves, head_dim)
                    offsets[key] = (both[:, :len(moves)].reshape(-1), both[:, len(moves):].reshape(-1))
                dst, src = offsets[key]
                memory = _memory(cache)
                memory.index_copy_(0, dst, memory.index_select(0, src))  # gathered first: they may overlap
        # where the layers ran stree's C++ ops: one C++ call per layer and group
        conv, conv_native = _split(self.conv, lambda c: cpu_ops.usable(c.xbc, c.conv_state))
        scan, scan_native = _split(self.scan, lambda s: cpu_ops.usable(s.x, s.ssm_state))
        accepted = {id(g): torch.tensor(g.accepted()) for g in self.groups()}
        for c in conv_native:
            cpu_ops.ops().tree_conv_commit(c.conv_state, torch.tensor(c.slots), accepted[id(c.group)],
                                           c.window.transpose(1, 2).contiguous(), c.xbc, c.group.paths())
        for s in scan_native:
            cpu_ops.ops().tree_scan_commit(s.ssm_state, torch.tensor(s.committed_slots()), s.h0, s.x, s.dt, s.A, s.B,
                                           s.group.paths())
        self._commit_eager(conv, scan)

    def _commit_eager(self, conv: list[_ConvGroup], scan: list[_ScanGroup]) -> None:
        # each group's gather tables, built once and shared by the layers
        conv_index: dict[tuple[int, int], torch.Tensor] = {}  # (group, window width) -> index
        for c in conv:
            window, accepted, paths = c.window.clone(), c.group.accepted(), c.group.paths().to(c.xbc.device)
            w = window.shape[-1]
            if (id(c.group), w) not in conv_index:
                conv_index[id(c.group), w] = conv_replay_index(paths, w)
            conv_replay(window, c.xbc, paths, index=conv_index[id(c.group), w])
            for r, (slot, a) in enumerate(zip(c.slots, accepted)):
                c.conv_state[slot, :, a:a + w] = window[r]
        scan_paths = {id(s.group): s.group.paths().to(s.x.device) for s in scan}
        scan_tables = {key: path_tables(p) for key, p in scan_paths.items()}
        for s in scan:
            state = s.h0.clone()
            ssm_replay(state, s.x, s.dt, s.A, s.B, scan_paths[id(s.group)], tables=scan_tables[id(s.group)])
            s.ssm_state[s.committed_slots()] = state.to(s.ssm_state.dtype)


def _split(items: list, native) -> tuple[list, list]:
    """``items`` as (those ``native`` rejects, those it takes)."""
    taken = [native(item) for item in items]
    return [i for i, t in zip(items, taken) if not t], [i for i, t in zip(items, taken) if t]


_current: TreeStep | None = None


def current() -> TreeStep | None:
    return _current


def begin(step: TreeStep | None) -> None:
    global _current
    _current = step


# -- the layers ----------------------------------------------------------------------------------

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
        for g, table, lengths in step.paged(metadata):  # one C++ call per tree shape, read in place
            cpu_ops.ops().tree_attention_rows(query, key_cache, value_cache, *layout.strides, table, lengths,
                                              g.index, g.ancestors, impl.scale, rows)
    else:  # the reference: each group's context gathered, SDPA under the tree mask
        for ctx in step.contexts(metadata, layout.block_size(key_cache)):
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
            g.put(rows, out.transpose(1, 2))
    step.kv.append((key_cache, value_cache, layout, metadata.slot_mapping))


def tree_conv_rows(x, conv_state, weight, bias, activation, rows: MambaRows, step: TreeStep) -> torch.Tensor:
    """Tree conv of the tree rows of vLLM's decode tokens, one call per tree shape.

    x: (tokens, dim) pre-conv inputs; conv_state: vLLM's (slots, dim, width - 1 + K), read from
    each tree's window at column ``num_accepted - 1``, not written; weight (dim, width). Returns
    (tokens, dim), the tree tokens' rows written; the inputs the commit replays are kept."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    act = "silu" if activation in ("silu", "swish", True) else None
    native = cpu_ops.usable(x, conv_state, weight, *([] if bias is None else [bias]))
    for rg in rows.groups:
        g = rg.group
        if native:  # one C++ call: the same math, gathers and copies included
            window0 = g.tree(x.device).conv_window(width)[0]
            xbc, window = cpu_ops.ops().tree_conv_rows(x, conv_state, *rg.slot_column, g.index, window0, weight,
                                                       torch.empty(0) if bias is None else bias, act is not None, out)
            step.conv.append(_ConvGroup(g, conv_state, [t[0] for t in rg.slots], window.transpose(1, 2), xbc))
            continue
        window = conv_windows(conv_state, rg.table[:, 0], rg.accepted, width)
        committed = F.pad(window, (1, 0))  # mamba layout: width columns, the first unused
        tables = g.tree(x.device).conv_scan_tables(width)  # cached on the template
        xbc = g.take(x).clone()  # kept for the commit: x is vLLM's buffer
        g.put(out, tree_conv(xbc, committed.to(x.dtype), weight, bias, tables["window"], activation=act,
                             gather_index=tables["gather"]))
        step.conv.append(_ConvGroup(g, conv_state, [t[0] for t in rg.slots], window, xbc))
    return out


def tree_scan_rows(ssm_state, x, dt, A, B, C, D, dt_bias, rows: MambaRows, step: TreeStep, out) -> None:
    """Tree scan of the tree rows of vLLM's decode tokens, one call per tree shape: x and
    ``out`` (tokens, h, p), dt (tokens, h) before softplus and bias, A, D, dt_bias (h,), B, C
    (tokens, g, n); each tree starts from the SSM slot the last step's accepted tokens left.
    Writes the tree tokens' rows of ``out``; the state is not written, what the commit replays
    is kept: the tree rows of x and B as views where they lie back to back, so x and B must not
    change before the commit (the mixer passes the tree conv's own output, which nothing else
    writes)."""
    a_h = A.float()
    native = cpu_ops.usable(x, dt, B, C, ssm_state, out)
    for rg in rows.groups:
        g = rg.group
        if native:  # one C++ call: the same math, gathers and copies included
            h0, xs, dt_out, bs = cpu_ops.ops().tree_scan_rows(x, dt, B, C, ssm_state, rg.start, g.index,
                                                              g.parent_index, a_h, D, dt_bias, out)
            step.scan.append(_ScanGroup(g, ssm_state, rg.slots, h0, xs, dt_out, a_h, bs))
            continue
        h0 = ssm_state[rg.start].float()
        xs, bs = g.take(x), g.take(B)  # kept for the commit (see the docstring)
        tree = g.tree(x.device)
        y, dt_out = tree_scan(xs, g.take(dt), a_h, bs, g.take(C), tree.mask, D=D, dt_bias=dt_bias, dt_softplus=True,
                              initial_states=h0, tables=None if x.is_cuda else tree.scan_tables())
        g.put(out, y)
        step.scan.append(_ScanGroup(g, ssm_state, rg.slots, h0, xs, dt_out, a_h, bs))


def verified_by_stree(params) -> bool:
    """Whether stree's verifiers honour all that a request's ``SamplingParams`` ask for:
    temperature, top-k, top-p, seed. A request that also asks for what only vLLM's sampler applies
    (penalties, min-p, logit bias, allowed or bad words, min tokens, structured output, logprobs)
    is left to vLLM: it verifies the flattened tree as a chain of proposed tokens (the rows run
    causally, as vLLM schedules them), which is still lossless, only accepting less."""
    if params is None:
        return True
    return (params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and params.min_p == 0 and not params.logit_bias and not params.allowed_token_ids
            and not params.bad_words and not params.min_tokens and params.logprobs is None
            and getattr(params, "structured_outputs", None) is None)


# -- the wrappers --------------------------------------------------------------------------------

def _tree_proposer(runner):
    """The runner's :class:`~stree.vllm.proposer.StreeProposer` where stree verifies, else None;
    known by its ``stree_verifies``, not imported (the proposer imports the layer check,
    :mod:`stree.vllm.targets`, which imports this module)."""
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "stree_verifies", False) else None


def patch_trees() -> None:
    """Install the runner's two hooks of the module docstring (steps without trees go to vLLM's
    own code); the layers' tree rows are the registered attention backend's and Mamba2 mixer's
    (:mod:`stree.vllm.attention`, :mod:`stree.vllm.mixer`)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original_prepare = GPUModelRunner._prepare_inputs
    if getattr(original_prepare, "_stree", False):
        return
    original_sample = GPUModelRunner._sample

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original_prepare(self, scheduler_output, num_scheduled_tokens)
        begin(None)
        proposer, spec = _tree_proposer(self), result[1]
        if proposer is None or spec is None:
            return result
        rows = {}
        computed = self.input_batch.num_computed_tokens_cpu
        starts = self.query_start_loc.np
        cu_draft = [0] + spec.cu_num_draft_tokens.tolist()
        drafts = spec.draft_token_ids.tolist()
        for r, rid in enumerate(self.input_batch.req_ids):
            n = spec.num_draft_tokens[r]
            drafted = proposer.drafted.get(rid)
            if n <= 0 or drafted is None or not verified_by_stree(getattr(self.requests.get(rid), "sampling_params",
                                                                          None)):
                continue
            drafted = drafted.prefix(1 + n)
            if drafted.tree.tokens[0, 1:].tolist() != drafts[cu_draft[r]:cu_draft[r + 1]]:
                raise RuntimeError(f"stree: request {rid}'s scheduled draft tokens are not the tree it drafted")
            start = int(starts[r])
            self.positions[start:start + 1 + n] = int(computed[r]) + drafted.tree.depth[0].to(self.positions.device)
            rows[start] = TreeRow(r, start, drafted, self.input_batch.generators.get(r))
        begin(TreeStep(rows) if rows else None)
        return result

    def _sample(self, logits, spec_decode_metadata):
        from vllm.v1.outputs import SamplerOutput

        step = current()
        begin(None)
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            # no request has drafts (a batch-size schedule turned drafting off, or none drafted):
            # the rejection sampler would only sample each row's bonus token; vLLM's own sampler
            # does that alone (0.1-0.2 ms less per step on this CPU)
            spec_decode_metadata = None
        if step is None or spec_decode_metadata is None:
            return original_sample(self, logits, spec_decode_metadata)
        if step.covers(self.input_batch.num_reqs):  # no rejection sampler needed
            output = SamplerOutput(torch.full((len(step.rows), spec_decode_metadata.max_spec_len + 1), -1,
                                              dtype=torch.int32, device=logits.device), None)
        else:
            output = original_sample(self, logits, spec_decode_metadata)
        step.verify(logits, spec_decode_metadata.cu_num_sampled_tokens.tolist(), output.sampled_token_ids)
        step.commit()
        return output

    _prepare_inputs._stree = True
    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner._sample = _sample
