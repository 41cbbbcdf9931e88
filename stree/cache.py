"""Explicit inference state for tree decoding: committed states plus the last tree's activations.

Verification never writes committed state. ``tree_forward`` leaves behind, per layer, what is needed
to advance along any root-to-node path of its tree (``pending``); ``commit(path)`` then advances
every layer along the accepted path: SSM layers by activation replay, conv states by a gather of
the cached pre-conv inputs, attention layers by compacting the accepted nodes' K/V (which the tree
forward wrote as scratch after each row's committed prefix).

Each batch row reaches its committed state through a row index into a preallocated pool
(:class:`StatePool`, the way serving engines keep SSM state): ``TreeCache.slots (b,)`` maps row r
to its pool slot, or is None where row r is simply row r of the layer tensors (the default cache,
and a cache over a contiguous run of slots, which are views).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from stree.kernels import conv_replay, delta_replay, ssm_replay
from stree.kernels._common import debug_checks
from stree.kernels.replay import conv_replay_index, path_tables

# Attention K/V capacity grows on demand from SEQLEN_CHUNK positions, doubling (capped at the
# cache's max_seqlen): memory follows the real length within 2x, and a compiled step (which spans
# the whole capacity) sees a handful of sizes over a run, not one per token.
SEQLEN_CHUNK = 512


def grown_capacity(need: int, max_seqlen: int) -> int:
    """K/V positions to allocate for ``need`` tokens: ``SEQLEN_CHUNK * 2**k`` for the smallest k
    that holds them, at most ``max_seqlen``."""
    capacity = SEQLEN_CHUNK
    while capacity < need:
        capacity *= 2
    return min(capacity, max_seqlen)


@dataclass
class MambaLayerCache:
    """Committed state of one recurrent layer: a Mamba2 layer, in mamba_ssm's layout, or a gated
    delta rule layer (the same two tensors, so pools, drafting and commits treat both alike).

    conv_state: ``(b, conv_dim, d_conv)`` raw pre-conv inputs, newest in the last column.
    ssm_state: ``(b, nheads, headdim, d_state)`` (a gated delta rule layer: ``(b, H, dk, dv)``).
    """
    conv_state: torch.Tensor
    ssm_state: torch.Tensor

    @classmethod
    def zeros(cls, batch_size, conv_dim, d_conv, nheads, headdim, d_state, *, dtype, device,
              state_dtype=None):
        # channels-last conv state like mamba_ssm: causal-conv1d's update kernel expects stride(1) == 1
        conv = torch.zeros(batch_size, d_conv, conv_dim, dtype=dtype, device=device).transpose(1, 2)
        ssm = torch.zeros(batch_size, nheads, headdim, d_state, dtype=state_dtype or dtype, device=device)
        return cls(conv, ssm)

    def rows(self, start: int, stop: int) -> "MambaLayerCache":
        """Rows ``[start, stop)`` as views (sharing storage)."""
        return MambaLayerCache(self.conv_state[start:stop], self.ssm_state[start:stop])

    def gather(self, slots: torch.Tensor) -> "MambaLayerCache":
        """The states of pool slots ``slots (b,)`` as a new ``(b, ...)`` state: a copy (a Mamba
        state is small), conv state in the pool's channels-last layout."""
        return MambaLayerCache(self.conv_state.transpose(1, 2)[slots].transpose(1, 2),
                               self.ssm_state[slots])

    def scatter(self, slots: torch.Tensor, rows: "MambaLayerCache") -> None:
        """Write the ``(b, ...)`` states ``rows`` back into pool slots ``slots (b,)``."""
        self.conv_state.index_copy_(0, slots, rows.conv_state)
        self.ssm_state.index_copy_(0, slots, rows.ssm_state)

    def grow(self, capacity: int) -> None:
        pass  # a Mamba2 state has a fixed size, whatever the sequence length

    def reset(self, slots: torch.Tensor | None = None) -> None:
        """Zero every row, or only the pool slots ``slots (b,)``."""
        if slots is None:
            self.conv_state.zero_()
            self.ssm_state.zero_()
        else:
            self.conv_state.index_fill_(0, slots, 0)
            self.ssm_state.index_fill_(0, slots, 0)


@dataclass
class AttentionLayerCache:
    """Committed K/V of one attention layer: ``kv (b, 2, n_kv_heads, capacity, head_dim)``, keys
    at ``kv[:, 0]`` (:attr:`k`), values at ``kv[:, 1]`` (:attr:`v`).

    Positions ``[0, lengths[b])`` are committed; a tree forward writes its nodes' K/V as scratch at
    ``lengths[b] + i``. K and V share one tensor, row-major, so a commit moves both with one
    gather and one scatter, and a run of rows (or a pool slot) stays one contiguous block.
    ``capacity`` grows on demand (:meth:`grow`, driven by :meth:`StatePool.reserve`).
    """
    kv: torch.Tensor

    @classmethod
    def zeros(cls, batch_size, num_kv_heads, capacity, head_dim, *, dtype, device):
        return cls(torch.zeros(batch_size, 2, num_kv_heads, capacity, head_dim, dtype=dtype,
                               device=device))

    def grow(self, capacity: int) -> None:
        """Reallocate ``kv`` with ``capacity`` positions, keeping every position it held (tree
        scratch included). New positions are zero, not uninitialised: a static-shape step reads
        the whole capacity under its mask, and a masked NaN would still poison the softmax."""
        b, two, heads, old, d = self.kv.shape
        if capacity > old:
            kv = self.kv.new_zeros(b, two, heads, capacity, d)
            kv[:, :, :, :old] = self.kv
            self.kv = kv

    @property
    def k(self) -> torch.Tensor:
        """``(b, n_kv_heads, capacity, head_dim)`` keys (a view)."""
        return self.kv[:, 0]

    @property
    def v(self) -> torch.Tensor:
        """``(b, n_kv_heads, capacity, head_dim)`` values (a view)."""
        return self.kv[:, 1]

    def rows(self, start: int, stop: int) -> "AttentionLayerCache":
        """Rows ``[start, stop)`` as views (sharing storage)."""
        return AttentionLayerCache(self.kv[start:stop])

    def gather(self, slots: torch.Tensor) -> "PooledAttentionCache":
        """The K/V of pool slots ``slots (b,)``, read and written in place (no copy)."""
        return PooledAttentionCache(self.kv, slots)

    def scatter(self, slots: torch.Tensor, rows) -> None:
        pass  # written in place through the slot index

    def index(self, rows: torch.Tensor) -> torch.Tensor:
        """The index into the first axis of ``kv`` that reaches the batch rows ``rows (b, 1)``
        (``arange(b)[:, None]``): the rows themselves here, their slots in a pooled cache."""
        return rows

    def flat_index(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``(b, l, 2, n_kv_heads)`` indices into ``kv.view(-1, head_dim)`` of the keys
        (``[:, :, 0]``) and values (``[:, :, 1]``) of the batch rows ``rows (b, 1)`` at positions
        ``pos (b, l)``: with them a write of K or V is one ``index_put_`` and a move of both one
        ``index_select`` + ``index_copy_``."""
        _, _, heads, capacity, _ = self.kv.shape
        base = self.index(rows) * (2 * heads * capacity) + pos
        offsets = torch.arange(2 * heads, device=pos.device).view(2, heads) * capacity
        return base[..., None, None] + offsets

    @property
    def layout(self) -> tuple[int, int]:
        """``(n_kv_heads, capacity)``: what :meth:`flat_index` depends on besides the rows, so
        layers of equal layout share one table per step."""
        return self.kv.shape[2], self.kv.shape[3]

    def keys(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v (b, n_kv_heads, span, head_dim)`` of the rows: views of positions ``[0, span)``."""
        return self.kv[:, :, :, :span].unbind(1)

    def reset(self, slots: torch.Tensor | None = None) -> None:
        pass  # lengths define what is valid; stale K/V past them is never read


@dataclass
class PooledAttentionCache(AttentionLayerCache):
    """The K/V of ``b`` rows kept in the slots ``slots (b,)`` int64 of a pool's
    ``kv (num_slots, 2, n_kv_heads, capacity, head_dim)``: writes go to ``kv[slots[r], :, :,
    pos]`` in place; reads gather the rows' ``[0, span)`` positions for attention (one copy of
    the span per layer and step, the size of what attention reads anyway; an engine's paged
    attention kernel would read the pool by the same index instead)."""
    slots: torch.Tensor

    def index(self, rows: torch.Tensor) -> torch.Tensor:
        return self.slots[:, None]

    def keys(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[self.slots, :, :, :span].unbind(1)


class _ReplayedActivations:
    """A recurrent layer's activations: its commit replays the state along the path
    (:meth:`replay`, the layer kind's rule) and shifts the path's pre-conv inputs ``xbc`` into the
    conv window; the gather tables of both are built once per commit and shared."""

    def tables(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        # built on first use: the C++ replays (fp32 CPU) read the path itself and need neither
        if "path" not in shared:
            shared["path"] = functools.cache(lambda: path_tables(path))
        w = layer.conv_state.shape[2]
        if ("conv", w) not in shared:
            shared[("conv", w)] = functools.cache(lambda: conv_replay_index(path, w))

    def commit(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        self.replay(layer.ssm_state, path, shared["path"])
        conv_replay(layer.conv_state, self.xbc, path, index=shared[("conv", layer.conv_state.shape[2])])


@dataclass
class MambaActivations(_ReplayedActivations):
    """What one Mamba2 layer cached during a tree forward, for replay along any path.

    xbc: ``(b, n, conv_dim)`` raw pre-conv inputs; x: ``(b, n, h, p)``; dt: ``(b, n, h)`` processed
    (fp32); B: ``(b, n, g, s)``; A: ``(h,)`` fp32.
    """
    xbc: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    A: torch.Tensor

    def replay(self, state: torch.Tensor, path: torch.Tensor, tables) -> None:
        ssm_replay(state, self.x, self.dt, self.A, self.B, path, tables=tables)


@dataclass
class DeltaActivations(_ReplayedActivations):
    """What one gated delta rule layer (Gated DeltaNet, KDA) cached during a tree forward, for
    replay along any path: xbc ``(b, n, conv_dim)`` raw pre-conv inputs; k ``(b, n, H, dk)``
    normalised keys, u ``(b, n, H, dv)`` and G ``(b, n, H)`` or ``(b, n, H, dk)`` (fp32, from
    ``tree_delta``). Its layer's state is a :class:`MambaLayerCache` whose ``ssm_state`` is the
    ``(b, H, dk, dv)`` recurrent state."""
    xbc: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor

    def replay(self, state: torch.Tensor, path: torch.Tensor, tables) -> None:
        delta_replay(state, self.k, self.u, self.G, path, tables=tables)


@dataclass
class AttentionActivations:
    """Marker: the tree's K/V already sit as scratch in the layer's cache."""

    def tables(self, layer: AttentionLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        """Add to ``shared`` the flat source and destination indices of the accepted nodes'
        K and V (per cache layout), once per commit."""
        key = ("kv", layer.layout)
        if key not in shared and path.shape[1] > 1:
            dst = lengths[:, None] + torch.arange(path.shape[1], device=path.device)
            # padded slots copy the node itself onto a position past the new length: harmless
            src = torch.where(path >= 0, lengths[:, None] + path, dst)  # accepted nodes' scratch
            shared[key] = (layer.flat_index(shared["rows"], src).flatten(),
                           layer.flat_index(shared["rows"], dst).flatten())

    def commit(self, layer: AttentionLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        if path.shape[1] == 1:  # the root alone: its scratch slot is its committed position
            return
        src, dst = shared["kv", layer.layout]
        flat = layer.kv.view(-1, layer.kv.shape[-1])
        flat.index_copy_(0, dst, flat.index_select(0, src))  # gathered first: they overlap


@dataclass
class PendingTree:
    tree: "object"  # stree.tree.TokenTree
    layers: dict = field(default_factory=dict)  # layer index -> *Activations


@dataclass
class NodeStates:
    """Materialised state of every forwarded node of one Mamba2 layer (level-by-level drafting).

    conv, ssm: ``(b * slots, ...)`` conv / SSM state after each node, row-major: row r's slot 0
    (flat index ``r * slots``) holds its committed state (the root's parent), node i sits in slot
    i + 1. Flat, so that a level reads and writes its nodes with one ``index_select`` /
    ``index_copy_`` per tensor.
    """
    conv: torch.Tensor
    ssm: torch.Tensor

    def tables(self, layer, path, lengths, shared) -> None:
        pass  # its one table (each row's last slot) needs the host-side path lengths: TreeCache.commit

    def commit(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        # the committed state becomes the state after the path's last node (flat index, built
        # once per commit by TreeCache.commit; slot 0 for an empty path)
        layer.conv_state.copy_(self.conv.index_select(0, shared["last_slot"]))
        layer.ssm_state.copy_(self.ssm.index_select(0, shared["last_slot"]))


@dataclass
class NextState:
    """A recurrent layer's state after the root of a root-only tree (``tree_forward``'s step
    without drafts): conv ``(b, c, w)`` and ssm ``(b, ...)``, in the committed state's dtypes.
    The commit copies it into the rows that accept the root; nothing is replayed."""
    conv: torch.Tensor
    ssm: torch.Tensor

    def tables(self, layer, path, lengths, shared) -> None:
        if "root_rows" not in shared:  # None: every row accepts its root (the host knows from counts)
            shared["root_rows"] = None if shared["every_row"] else (path[:, 0] >= 0)

    def commit(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        rows = shared["root_rows"]
        for old, new in ((layer.conv_state, self.conv), (layer.ssm_state, self.ssm)):
            old.copy_(new if rows is None else torch.where(rows.view(-1, *[1] * (new.dim() - 1)), new, old))


@dataclass
class LevelPending(PendingTree):
    """Pending state of a tree forwarded level by level (``level_forward``): per Mamba2 layer the
    :class:`NodeStates` of every forwarded node (``slots`` per row), per attention layer the K/V
    scratch as usual. ``forwarded_depth``: depth of the deepest forwarded node (host-side)."""
    slots: int = 0
    forwarded_depth: int = -1
    lead: list[int] | None = None  # per row, tokens run before the root (``draft_levels``' lead)


class TreeCache:
    """All inference state of one patched model for a batch of ``b`` sequences: ``b`` rows of a
    :class:`StatePool`, which owns the tensors (and grows the attention K/V on demand).

    Attributes:
        pool: the :class:`StatePool` holding the rows.
        layers: ``{layer_idx: MambaLayerCache | AttentionLayerCache}``: the rows' states, or with
            ``slots`` the pool's (``num_slots`` rows). Rebuilt after the pool grows.
        slots: ``(b,)`` int64 (device): row r's state is row ``slots[r]`` of every layer's tensors
            (a :class:`StatePool`'s); None: row r is pool slot ``first + r`` (the default, and a
            cache over a contiguous run of slots, whose layers are views of the pool).
        lengths: ``(b,)`` int64 committed tokens per row (device); ``seqlens`` is its host mirror.
        max_seqlen: the most tokens a row may hold (committed tokens + one tree of scratch).
        capacity: K/V positions allocated now (<= ``max_seqlen``): what a static-shape step spans.
        pending: activations of the last ``tree_forward``, consumed by :meth:`commit`.
    """

    def __init__(self, pool: "StatePool", batch_size: int, *, first: int = 0,
                 slots: torch.Tensor | None = None):
        self.pool, self.batch_size, self.first, self.slots = pool, batch_size, first, slots
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=pool.device)
        self.seqlens = [0] * batch_size
        self.pending: PendingTree | None = None
        self._layers, self._generation = None, -1

    @property
    def layers(self) -> dict:
        if self._generation != self.pool.generation:  # new or grown pool tensors: new views
            whole = self.slots is not None or (self.first == 0 and self.batch_size == self.pool.num_slots)
            self._layers = self.pool.layers if whole else {
                i: c.rows(self.first, self.first + self.batch_size) for i, c in self.pool.layers.items()}
            self._generation = self.pool.generation
        return self._layers

    @property
    def max_seqlen(self) -> int:
        return self.pool.max_seqlen

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def row(self, b: int) -> "TreeCache":
        """A view of row ``b`` sharing storage (used for ragged prefill)."""
        if self.slots is None:
            view = TreeCache(self.pool, 1, first=self.first + b)
        else:
            view = TreeCache(self.pool, 1, slots=self.slots[b:b + 1])
        view.lengths = self.lengths[b:b + 1]
        view.seqlens = [self.seqlens[b]]
        return view

    def states(self, mamba: bool = True) -> dict:
        """``{layer_idx: state of the b rows}`` that the layer functions run on: ``layers``
        itself without ``slots`` (no op); with them each Mamba2 layer's rows gathered from the
        pool (a copy, written back by :meth:`store`; left out with ``mamba=False``) and each
        attention layer's :class:`PooledAttentionCache` (in place)."""
        if self.slots is None:
            return self.layers
        return {i: c.gather(self.slots) for i, c in self.layers.items()
                if mamba or not isinstance(c, MambaLayerCache)}

    def store(self, states: dict) -> None:
        """Write states from :meth:`states` that a step advanced back into the pool slots."""
        if self.slots is not None:
            for i, c in self.layers.items():
                c.scatter(self.slots, states[i])

    def reset(self) -> None:
        """Empty every row (with ``slots``: only the rows' pool slots are zeroed)."""
        for c in self.layers.values():
            c.reset(self.slots)
        self.lengths.zero_()
        self.seqlens = [0] * self.batch_size
        self.pending = None

    def reserve(self, new_tokens: int | list[int]) -> None:
        """Make room for ``new_tokens`` more tokens in every row (or ``new_tokens[r]`` in row r):
        the pool's K/V grow when they do not fit (:meth:`StatePool.reserve`).

        Raises:
            ValueError: a row would pass ``max_seqlen``; nothing is allocated or changed.
        """
        extra = new_tokens if isinstance(new_tokens, list) else [new_tokens] * self.batch_size
        need, row = max((s + n, r) for r, (s, n) in enumerate(zip(self.seqlens, extra)))
        if need > self.max_seqlen:
            which = f"row {row}: " if self.batch_size > 1 else ""
            raise ValueError(
                f"sequence length {need} ({which}committed {self.seqlens[row]} + {extra[row]} new) "
                f"exceeds the cache's max_seqlen {self.max_seqlen}; allocate a larger cache")
        self.pool.reserve(need)

    def _check_forwarded(self, counts: list[int]) -> None:
        """After level forwards, a path may not reach below the deepest forwarded level."""
        if isinstance(self.pending, LevelPending) and max(counts) - 1 > self.pending.forwarded_depth:
            raise ValueError(f"the path reaches depth {max(counts) - 1} but only nodes down to depth "
                             f"{self.pending.forwarded_depth} were forwarded; level_forward them first")

    def advance(self, counts: list[int]) -> None:
        """Record that row b committed ``counts[b]`` more tokens."""
        self.seqlens = [s + c for s, c in zip(self.seqlens, counts)]
        self.lengths += torch.tensor(counts, dtype=torch.long, device=self.lengths.device)

    def commit(self, path, counts: list[int] | None = None) -> None:
        """Advance every layer along the accepted path of the last tree.

        Args:
            path: ``(b, k)`` node indices from the root (``path[:, 0] == 0``), each a child of the
                previous one, -1 padded at the end for rows that accepted fewer nodes. A row of
                all -1 commits nothing (a finished sequence).
            counts: the number of valid nodes of each row of ``path``, known to a caller whose path
                comes from a verifier (the generate loop): the path is then trusted and not read
                on the host (no device sync; checked only under ``STREE_DEBUG=1``). Without it the
                path is validated and its lengths read on the host.
        """
        if self.pending is None:
            raise RuntimeError("commit() needs a tree_forward() first (nothing pending)")
        tree = self.pending.tree
        path = torch.as_tensor(path, dtype=torch.long, device=self.lengths.device)
        if path.dim() == 1:
            path = path.unsqueeze(0)
        if counts is not None:
            self._check_forwarded(counts)  # before the debug checks: the more telling error
        if counts is None or debug_checks():
            checked = _validate_path(path, tree, self.batch_size)  # reads the path on the host
            if counts is not None and list(counts) != checked:
                raise ValueError(f"counts {list(counts)} do not match the path lengths {checked}")
            counts = checked
            self._check_forwarded(counts)
        shared = {"rows": torch.arange(self.batch_size, device=path.device)[:, None],
                  "every_row": all(c > 0 for c in counts)}
        if isinstance(self.pending, LevelPending):
            last = torch.tensor([max(c - 1, 0) for c in counts], device=path.device)
            # each row's last path node's flat NodeStates slot (-1, an empty path: slot 0)
            shared["last_slot"] = (path.gather(1, last[:, None])[:, 0] + 1
                                   + shared["rows"][:, 0] * self.pending.slots)
        states = self.states()
        for idx, acts in self.pending.layers.items():  # per-commit tables first, then the layers
            acts.tables(states[idx], path, self.lengths, shared)
        for idx, acts in self.pending.layers.items():
            acts.commit(states[idx], path, self.lengths, shared)
        self.store(states)
        lead = getattr(self.pending, "lead", None)  # tokens run before the root: a non-empty path commits them
        self.advance(counts if lead is None else [c + n if c else 0 for c, n in zip(counts, lead)])
        self.pending = None


@dataclass
class StatePool:
    """Committed state of ``num_slots`` sequences, per layer, that caches index by slot (the way
    serving engines keep SSM state: vLLM's per-request state indices, SGLang's Mamba state pool).
    Built by ``model.allocate_state_pool(num_slots, max_seqlen)``.

    Mamba2 states have a fixed size and are allocated once. Attention K/V start at
    ``capacity = grown_capacity(1, max_seqlen)`` positions per slot and grow when a cache needs
    more (:meth:`reserve`), doubling up to ``max_seqlen``; every slot moves with them.

    Attributes:
        layers: ``{layer_idx: MambaLayerCache | AttentionLayerCache}`` with ``num_slots`` on the
            batch axis: ``conv_state (P, c, w)``, ``ssm_state (P, h, p, s)``,
            ``kv (P, 2, hkv, capacity, d)``.
        max_seqlen: the most tokens a slot may hold (a model's context limit, or a request's
            length); nothing is allocated for it up front.
        capacity: K/V positions per slot allocated now.
        generation: bumped by every growth, so that caches holding views of the old tensors
            rebuild them.
    """
    layers: dict
    max_seqlen: int
    capacity: int
    generation: int = 0

    def reserve(self, need: int) -> None:
        """Grow the attention K/V (every slot, contents kept) to hold ``need`` tokens per slot:
        to :func:`grown_capacity` ``(need, max_seqlen)`` positions. The caller has checked
        ``need <= max_seqlen``. Every position moves to the new tensors, pending tree scratch
        included (a drafter's later levels may grow the K/V its earlier levels wrote)."""
        if need <= self.capacity:
            return
        self.capacity = grown_capacity(need, self.max_seqlen)
        for c in self.layers.values():
            c.grow(self.capacity)
        self.generation += 1

    @property
    def num_slots(self) -> int:
        return self._first_tensor().shape[0]

    @property
    def device(self) -> torch.device:
        return self._first_tensor().device

    def _first_tensor(self) -> torch.Tensor:
        first = next(iter(self.layers.values()))
        return first.conv_state if isinstance(first, MambaLayerCache) else first.k

    def cache(self, slots, seqlens: list[int] | None = None) -> TreeCache:
        """A :class:`TreeCache` whose batch row r lives in pool slot ``slots[r]``.

        Args:
            slots: ``(b,)`` integer tensor (or list) of distinct slots in ``[0, num_slots)``; read
                on the host once, here. Every other slot is untouched, and stays so through
                every step of the cache (prefill, tree_forward, level_forward, commit, reset).
            seqlens: None: the rows start empty (their slots' Mamba states are zeroed). Else
                ``b`` ints: slot ``slots[r]`` already holds the state of ``seqlens[r]`` committed
                tokens (left there by an earlier cache over it), and row r resumes from it with
                nothing zeroed: how a caller regroups sequences from step to step (an engine's
                changing batch).
        Raises:
            ValueError: ``slots`` not a 1-D integer sequence, out of range, or repeated;
                ``seqlens`` of another length than ``slots``, or outside ``[0, max_seqlen]``.
        """
        slots = _check_slots(slots, self.num_slots)
        b, first = len(slots), slots[0]
        if seqlens is not None:
            seqlens = [int(s) for s in seqlens]
            if len(seqlens) != b or not all(0 <= s <= self.max_seqlen for s in seqlens):
                raise ValueError(f"seqlens must hold one length in [0, {self.max_seqlen}] per slot "
                                 f"({b}), got {seqlens}")
        if slots == list(range(first, first + b)):  # a contiguous run: views, no index
            cache = TreeCache(self, b, first=first)
        else:
            cache = TreeCache(self, b, slots=torch.tensor(slots, dtype=torch.long, device=self.device))
        if seqlens is None:
            cache.reset()
        else:
            cache.seqlens = seqlens
            cache.lengths = torch.tensor(seqlens, dtype=torch.long, device=self.device)
        return cache


def _check_slots(slots, num_slots: int) -> list[int]:
    """``slots`` as host ints after checking shape, dtype, range and uniqueness."""
    if torch.is_tensor(slots):
        if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
            raise ValueError(f"slots must be an integer tensor, got dtype {slots.dtype}")
        if slots.dim() != 1:
            raise ValueError(f"slots must be 1-D (one pool slot per batch row), got shape "
                             f"{tuple(slots.shape)}")
        slots = slots.tolist()
    else:
        try:
            slots = list(slots)
        except TypeError:
            raise ValueError(f"slots must be a 1-D sequence of ints, got {type(slots).__name__}") from None
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in slots):
            raise ValueError(f"slots must be a 1-D sequence of ints, got {slots}")
    if not slots:
        raise ValueError("slots must name at least one pool slot")
    bad = [s for s in slots if not 0 <= s < num_slots]
    if bad:
        raise ValueError(f"slots {bad} out of range for a pool of {num_slots} slots")
    if len(set(slots)) != len(slots):
        raise ValueError(f"slots must be distinct (rows would share a state), got {slots}")
    return slots


def _validate_path(path: torch.Tensor, tree, batch_size: int) -> list[int]:
    if path.dim() != 2 or path.shape[0] != batch_size or path.shape[1] < 1:
        raise ValueError(f"path must be (batch={batch_size}, k>=1), got {tuple(path.shape)}")
    if path.shape[1] > tree.max_depth + 1:
        raise ValueError(f"path of {path.shape[1]} nodes is longer than the tree's depth + 1 "
                         f"({tree.max_depth + 1})")
    p = path.tolist()
    parents = tree.parents.tolist()
    counts = []
    for b, row in enumerate(p):
        k = next((j for j, v in enumerate(row) if v < 0), len(row))
        if any(v >= 0 for v in row[k:]):
            raise ValueError(f"path row {b}: -1 padding must only appear at the end: {row}")
        if k and row[0] != 0:
            raise ValueError(f"path row {b} must start at the root (node 0), got {row[0]}")
        for j in range(1, k):
            if not 0 < row[j] < tree.num_nodes or parents[b][row[j]] != row[j - 1]:
                raise ValueError(f"path row {b}: node {row[j]} is not a child of node {row[j - 1]}")
        counts.append(k)
    return counts
