"""Explicit inference state for tree decoding: committed states plus the last tree's activations.

Verification never writes committed state. ``tree_forward`` leaves behind, per layer, what is needed
to advance along any root-to-node path of its tree (``pending``); ``commit(path)`` then advances
every layer along the accepted path: SSM layers by activation replay, conv states by a gather of
the cached pre-conv inputs, attention layers by compacting the accepted nodes' K/V (which the tree
forward wrote as scratch after each row's committed prefix).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stree.kernels import conv_replay, ssm_replay
from stree.kernels._common import debug_checks
from stree.kernels.replay import conv_replay_index, path_tables


@dataclass
class MambaLayerCache:
    """Committed state of one Mamba2 layer, in mamba_ssm's layout.

    conv_state: ``(b, conv_dim, d_conv)`` raw pre-conv inputs, newest in the last column.
    ssm_state: ``(b, nheads, headdim, d_state)``.
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

    def row(self, b: int) -> "MambaLayerCache":
        return MambaLayerCache(self.conv_state[b:b + 1], self.ssm_state[b:b + 1])

    def reset(self) -> None:
        self.conv_state.zero_()
        self.ssm_state.zero_()


@dataclass
class AttentionLayerCache:
    """Committed K/V of one attention layer: ``k, v (b, n_kv_heads, max_seqlen, head_dim)``.

    Positions ``[0, lengths[b])`` are committed; a tree forward writes its nodes' K/V as scratch at
    ``lengths[b] + i``.
    """
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, batch_size, num_kv_heads, max_seqlen, head_dim, *, dtype, device):
        shape = (batch_size, num_kv_heads, max_seqlen, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    def row(self, b: int) -> "AttentionLayerCache":
        return AttentionLayerCache(self.k[b:b + 1], self.v[b:b + 1])

    def reset(self) -> None:
        pass  # lengths define what is valid; stale K/V past them is never read


@dataclass
class MambaActivations:
    """What one Mamba2 layer cached during a tree forward, for replay along any path.

    xbc: ``(b, n, conv_dim)`` raw pre-conv inputs; x: ``(b, n, h, p)``; dt: ``(b, n, h)`` processed
    (fp32); B: ``(b, n, g, s)``; A: ``(h,)`` fp32.
    """
    xbc: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    A: torch.Tensor

    def commit(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        if "path" not in shared:  # gather tables of the path, built once per commit
            shared["path"] = path_tables(path)
        w = layer.conv_state.shape[2]
        if ("conv", w) not in shared:
            shared[("conv", w)] = conv_replay_index(path, w)
        ssm_replay(layer.ssm_state, self.x, self.dt, self.A, self.B, path, tables=shared["path"])
        conv_replay(layer.conv_state, self.xbc, path, index=shared[("conv", w)])


@dataclass
class AttentionActivations:
    """Marker: the tree's K/V already sit as scratch in the layer's cache."""

    def commit(self, layer: AttentionLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        if "kv" not in shared:  # source and destination positions, once per commit
            k = path.shape[1]
            dst = lengths[:, None] + torch.arange(k, device=path.device)
            # padded slots copy the node itself onto a position past the new length: harmless
            src = torch.where(path >= 0, lengths[:, None] + path, dst)  # accepted nodes' scratch
            shared["kv"] = (src, dst)
        src, dst = shared["kv"]
        for t in (layer.k, layer.v):
            # gather first: sources and destinations overlap
            t[shared["rows"], :, dst] = t[shared["rows"], :, src]


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
    slots: int

    def commit(self, layer: MambaLayerCache, path: torch.Tensor, lengths: torch.Tensor,
               shared: dict) -> None:
        # the committed state becomes the state after the path's last node (slot 0: empty path)
        last = shared["last_slot"] + shared["rows"][:, 0] * self.slots
        layer.conv_state.copy_(self.conv.index_select(0, last))
        layer.ssm_state.copy_(self.ssm.index_select(0, last))


@dataclass
class LevelPending(PendingTree):
    """Pending state of a tree forwarded level by level (``level_forward``): per Mamba2 layer the
    :class:`NodeStates` of every forwarded node (``slots`` per row), per attention layer the K/V
    scratch as usual. ``forwarded_depth``: depth of the deepest forwarded node (host-side)."""
    slots: int = 0
    forwarded_depth: int = -1


class TreeCache:
    """All inference state of one patched model for a batch of ``b`` sequences.

    Attributes:
        layers: ``{layer_idx: MambaLayerCache | AttentionLayerCache}``.
        lengths: ``(b,)`` int64 committed tokens per row (device); ``seqlens`` is its host mirror.
        max_seqlen: capacity of the attention caches (committed tokens + one tree of scratch).
        pending: activations of the last ``tree_forward``, consumed by :meth:`commit`.
    """

    def __init__(self, layers: dict, batch_size: int, max_seqlen: int, device):
        self.layers = layers
        self.batch_size = batch_size
        self.max_seqlen = max_seqlen
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.seqlens = [0] * batch_size
        self.pending: PendingTree | None = None

    def row(self, b: int) -> "TreeCache":
        """A view of row ``b`` sharing storage (used for ragged prefill)."""
        view = TreeCache({i: c.row(b) for i, c in self.layers.items()}, 1, self.max_seqlen,
                         self.lengths.device)
        view.lengths = self.lengths[b:b + 1]
        view.seqlens = [self.seqlens[b]]
        return view

    def reset(self) -> None:
        for c in self.layers.values():
            c.reset()
        self.lengths.zero_()
        self.seqlens = [0] * self.batch_size
        self.pending = None

    def check_room(self, new_tokens: int) -> None:
        need = max(self.seqlens) + new_tokens
        if need > self.max_seqlen:
            raise ValueError(
                f"sequence length {need} (committed {max(self.seqlens)} + {new_tokens} new) exceeds "
                f"the cache's max_seqlen {self.max_seqlen}; allocate a larger cache")

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
        if counts is None or debug_checks():
            checked = _validate_path(path, tree, self.batch_size)  # reads the path on the host
            if counts is not None and list(counts) != checked:
                raise ValueError(f"counts {list(counts)} do not match the path lengths {checked}")
            counts = checked
        if isinstance(self.pending, LevelPending) and max(counts) - 1 > self.pending.forwarded_depth:
            raise ValueError(f"the path reaches depth {max(counts) - 1} but only nodes down to depth "
                             f"{self.pending.forwarded_depth} were forwarded; level_forward them first")
        shared = {"rows": torch.arange(self.batch_size, device=path.device)[:, None]}
        if isinstance(self.pending, LevelPending):
            last = torch.tensor([max(c - 1, 0) for c in counts], device=path.device)
            shared["last_slot"] = path.gather(1, last[:, None])[:, 0] + 1  # -1 (empty) -> slot 0
        for idx, acts in self.pending.layers.items():
            acts.commit(self.layers[idx], path, self.lengths, shared)
        self.advance(counts)
        self.pending = None


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
