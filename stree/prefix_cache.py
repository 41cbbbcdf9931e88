"""``stree.PrefixCache``: committed states of earlier requests, keyed by token prefix, shared by
requests (prefix-state caching for Mamba2 and hybrid models).

An attention model reuses the K/V of a shared prefix; a Mamba2 layer also needs its recurrent
state at the prefix's end, and that state exists only where a run stopped. stree's loop commits
exactly the accepted tokens (activation replay), so its state after a turn is the exact state at
the turn's last committed token: a snapshot sits there, on no block grid.

Structure: a radix tree over token ids. A node is the prefix of its depth; its edge holds the
tokens from its parent. Per model role (``"target"``, ``"draft"``), a node may hold

* a snapshot of the fixed-size layer states at its depth (every tensor of each non-attention
  layer cache, e.g. Mamba2's ``conv_state`` and ``ssm_state``, or whatever another layer kind
  keeps in a :class:`stree.cache.MambaLayerCache`: one row, copied whole), and
* the attention K/V of its edge's positions (``(2, n_kv_heads, edge_len, head_dim)`` per layer),
  shared by every snapshot below it: snapshots at turn 1's and turn 2's ends of one
  conversation hold turn 1's K/V once.

Restoring a node writes its snapshot's states and the K/V of every edge from the root into a
cache row; the row then holds that many committed tokens. K/V of a role's edges are kept while a
snapshot of that role lies below them, so every snapshot can be restored alone, and any one can be
evicted alone.

Memory: ``nbytes`` counts every tensor held (states and K/V), on their device; the bound
``max_bytes`` is checked before a snapshot is stored, evicting least-recently-used snapshots
(inserted or restored) until it fits. A snapshot that cannot fit even in an empty cache is not
stored. The trie's own host memory (token ids of the paths to live snapshots) is not counted.

A cache is bound to one model per role on first use (held weakly, with the shapes of its
states): a request with another target or another draft is refused (``ValueError``) before
anything changes.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from stree.cache import AttentionLayerCache

ROLES = ("target", "draft")


@dataclass
class PrefixCacheStats:
    """Counters of a :class:`PrefixCache` since it was made (or cleared).

    hits, misses: target lookups that restored at least one token / none (a request row, or a
        session turn that the cache served beyond what the session held itself).
    prompt_tokens: tokens of the looked-up prompts; cached_tokens: of those, restored from the
        cache (the target's); draft_cached_tokens: the draft's, over its own lookups.
    inserted, evicted: snapshots stored and evicted; rejected: snapshots larger than
        ``max_bytes`` alone, not stored.
    """

    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    draft_cached_tokens: int = 0
    inserted: int = 0
    evicted: int = 0
    rejected: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached tokens over looked-up prompt tokens (the target's)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Node:
    """A prefix of ``depth`` tokens; ``tokens``: its edge from ``parent`` (positions
    ``[start, depth)``); ``kv[role]``: ``{layer: (2, hkv, len(tokens), d)}`` K/V of those positions;
    ``states[role]``: the snapshot at this depth; ``refs[role]``: snapshots of the role in this
    subtree (itself included)."""

    __slots__ = ("tokens", "parent", "children", "depth", "kv", "states", "refs")

    def __init__(self, tokens: list[int], parent: "_Node | None", depth: int):
        self.tokens, self.parent, self.depth = tokens, parent, depth
        self.children: dict[int, _Node] = {}
        self.kv: dict[str, dict[int, torch.Tensor]] = {}
        self.states: dict[str, _Snapshot] = {}
        self.refs: dict[str, int] = {}

    @property
    def start(self) -> int:
        return self.depth - len(self.tokens)

    def path(self) -> list["_Node"]:
        """The nodes from the root's first child down to this one."""
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        return nodes[::-1]


@dataclass
class _Snapshot:
    tensors: dict  # layer -> {field name: one row}
    nbytes: int


@dataclass
class _Walk:
    """Where ``tokens`` leave the tree: ``nodes`` fully matched (root first); ``common`` tokens
    shared with a cached path; ``partial`` the child whose edge the match ends inside, if any."""
    nodes: list[_Node]
    common: int
    partial: _Node | None


class PrefixCache:
    """Snapshots of committed states keyed by token prefix, shared by requests (see the module
    docstring). Pass one to many ``stree.generate(..., prefix_cache=)`` calls or
    :class:`stree.Session` objects; or drive it from your own loop::

        n = prefix_cache.restore(target, cache, 0, prompt)   # restores row 0: n committed tokens
        target.prefill(prompt[None, n:], cache)              # only the rest
        ...
        prefix_cache.insert(target, cache, 0, tokens)        # row 0's state, keyed tokens[:seqlen]

    Args:
        max_bytes: the most bytes of tensors (states and K/V) held; least-recently-used snapshots
            are evicted to stay within it.
        min_tokens: no snapshot of a prefix shorter than this (a recurrent state costs as much
            for 3 tokens as for 3000, and saves little prefill).
    """

    def __init__(self, max_bytes: int = 1 << 30, *, min_tokens: int = 16):
        for name, value, low in (("max_bytes", max_bytes, 0), ("min_tokens", min_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PrefixCache {name} must be an int >= {low}, got {value!r}")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.clear()

    # ------------------------------------------------------------------------------ read-outs
    def __len__(self) -> int:
        """Snapshots held (all roles)."""
        return len(self._lru)

    def __repr__(self) -> str:
        return (f"PrefixCache({len(self)} snapshots, {self.nbytes} of {self.max_bytes} bytes, "
                f"{self.stats.hits} hits, {self.stats.misses} misses)")

    def snapshots(self, role: str = "target") -> list[int]:
        """The prefix lengths that hold a snapshot of ``role``, shortest first."""
        return sorted(node.depth for node, r in self._lru if r == role)

    def clear(self) -> None:
        """Drop every snapshot, the counters and the models it is bound to."""
        self.root = _Node([], None, 0)
        self._lru: OrderedDict[tuple[_Node, str], None] = OrderedDict()
        self._bound: dict[str, tuple[weakref.ref, tuple]] = {}
        self.nbytes = 0
        self.stats = PrefixCacheStats()

    # ------------------------------------------------------------------------------ binding
    def check(self, model, role: str = "target") -> None:
        """Raise ``ValueError`` when the cache holds states of another ``role`` model."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        bound = self._bound.get(role)
        if bound is not None and bound[0]() is not model:
            owner = bound[0]()
            what = type(owner).__name__ if owner is not None else "a model that no longer exists"
            raise ValueError(f"this PrefixCache holds {role} states of another model ({what}), not of "
                             f"this {type(model).__name__}: a prefix cache serves one target (and one "
                             "draft); use one PrefixCache per model pair, or clear() it")

    def _bind(self, model, cache, role: str) -> None:
        self.check(model, role)
        signature = _signature(cache)
        if role not in self._bound:
            self._bound[role] = (weakref.ref(model), signature)
        elif self._bound[role][1] != signature:
            raise ValueError(f"this cache's layer states ({_describe(signature)}) differ from those "
                             f"the PrefixCache holds for its {role} ({_describe(self._bound[role][1])}): "
                             "was the model moved or cast? clear() the PrefixCache")

    # ------------------------------------------------------------------------------ lookups
    def _walk(self, tokens: list[int]) -> _Walk:
        node, d, nodes = self.root, 0, [self.root]
        while d < len(tokens):
            child = node.children.get(tokens[d])
            if child is None:
                return _Walk(nodes, d, None)
            edge = child.tokens
            if edge != tokens[d:d + len(edge)]:
                k = next((i for i, (a, b) in enumerate(zip(edge, tokens[d:])) if a != b),
                         min(len(edge), len(tokens) - d))
                return _Walk(nodes, d + k, child)
            node, d = child, d + len(edge)
            nodes.append(node)
        return _Walk(nodes, d, None)

    def _deepest(self, tokens: list[int], role: str, limit: int | None) -> _Node | None:
        tokens = list(tokens)
        if limit is not None:
            tokens = tokens[:max(limit, 0)]
        return next((n for n in reversed(self._walk(tokens).nodes) if role in n.states), None)

    def lookup(self, tokens, *, role: str = "target", limit: int | None = None) -> int:
        """The length of the longest prefix of ``tokens`` (at most ``limit`` tokens) with a
        ``role`` snapshot; 0 if none. Changes nothing (no counters, no recency)."""
        node = self._deepest(tokens, role, limit)
        return node.depth if node is not None else 0

    def common_prefix(self, tokens) -> int:
        """How many leading tokens of ``tokens`` some cached path shares (where a new request
        branches off an earlier one: where a snapshot would serve both)."""
        return self._walk(list(tokens)).common

    @torch.inference_mode()
    def restore(self, model, cache, row: int, tokens, *, role: str = "target",
                limit: int | None = None) -> int:
        """Restore into row ``row`` of ``cache`` (a :class:`stree.cache.TreeCache` of ``model``)
        the longest cached prefix of ``tokens`` of at most ``limit`` tokens; returns its length
        (0: nothing restored, the row untouched). The row then holds that many committed
        tokens. Counts a hit or a miss (target) and the restored tokens; binds the cache to
        ``model`` on first use.

        Raises:
            ValueError: the cache holds states of another ``role`` model, or of other shapes.
        """
        self._bind(model, cache, role)
        tokens = [int(t) for t in tokens]
        node = self._deepest(tokens, role, limit)
        depth = node.depth if node is not None else 0
        if role == "target":
            self.stats.hits += depth > 0
            self.stats.misses += depth == 0
            self.stats.prompt_tokens += len(tokens)
            self.stats.cached_tokens += depth
        else:
            self.stats.draft_cached_tokens += depth
        if node is None:
            return 0
        if depth > cache.max_seqlen:
            raise ValueError(f"a cached prefix of {depth} tokens does not fit the cache's max_seqlen "
                             f"{cache.max_seqlen}")
        cache.pool.reserve(depth)  # K/V positions for the prefix, before the tensors are read
        slot, layers = _slot(cache, row), cache.pool.layers
        for n in node.path():
            for i, seg in n.kv[role].items():
                layers[i].kv[slot, :, :, n.start:n.depth].copy_(seg)
        for i, fields in node.states[role].tensors.items():
            for name, t in fields.items():
                getattr(layers[i], name)[slot].copy_(t)
        cache.seqlens[row] = depth
        cache.lengths[row] = depth
        cache.pending = None  # an uncommitted tree of the row's old state is void
        self._lru.move_to_end((node, role))
        return depth

    def resume(self, model, cache, row: int, tokens, *, role: str = "target",
               limit: int | None = None) -> tuple[int, int]:
        """Bring row ``row`` of ``cache`` (``model``'s) as far along ``tokens`` (at most ``limit``
        of them) as this cache serves, for a request that then prefills the rest: restore the
        deepest snapshot where the row holds nothing or less; then, where ``tokens`` leave a
        cached path further on (another request shares them: a system prompt), prefill up to
        that branch point and snapshot there, so that later requests sharing it find it.
        Returns (tokens the row held before that prefill, of which restored)."""
        tokens = [int(t) for t in tokens]
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        held, restored = cache.seqlens[row], 0
        if held == 0 or self.lookup(tokens, role=role, limit=limit) > held:  # a held row: only a deeper hit counts
            restored = self.restore(model, cache, row, tokens, role=role, limit=limit)
        held = cache.seqlens[row]
        branch = min(self.common_prefix(tokens), limit)
        if branch > held and branch >= self.min_tokens:  # stop the prefill where the prompt leaves a cached path
            prefill_row(model, cache, row, tokens[held:branch])
            self.insert(model, cache, row, tokens, role=role)
        return held, restored

    # ------------------------------------------------------------------------------ inserts
    @torch.inference_mode()
    def insert(self, model, cache, row: int, tokens, *, role: str = "target") -> bool:
        """Snapshot the committed state of row ``row`` of ``cache`` (``model``'s), keyed by
        ``tokens[:cache.seqlens[row]]`` (the tokens that row committed); evicts least-recently
        used snapshots to stay within ``max_bytes``. Returns whether a snapshot is held there
        now (False: shorter than ``min_tokens``, or larger than ``max_bytes`` alone).

        Raises:
            ValueError: ``tokens`` shorter than the row's committed length; the cache holds
                states of another ``role`` model, or of other shapes.
        """
        self._bind(model, cache, role)
        p = cache.seqlens[row]
        tokens = [int(t) for t in tokens]
        if len(tokens) < p:
            raise ValueError(f"row {row} committed {p} tokens but only {len(tokens)} token ids were given")
        tokens = tokens[:p]
        if p < self.min_tokens:
            return False
        layers = cache.pool.layers
        fixed = sum(t[0].numel() * t.element_size() for i, c in layers.items()
                    if not isinstance(c, AttentionLayerCache) for t in _fields(c).values())
        per_token = sum(c.kv[0, :, :, 0].numel() * c.kv.element_size() for c in layers.values()
                        if isinstance(c, AttentionLayerCache))
        if fixed + per_token * p > self.max_bytes:  # would not fit an empty cache: evict nothing
            self.stats.rejected += 1
            return False
        while True:
            walk = self._walk(tokens)
            if walk.common == p and walk.partial is None and role in walk.nodes[-1].states:
                self._lru.move_to_end((walk.nodes[-1], role))  # held already (the same state)
                return True
            need = fixed + per_token * (p - _covered(walk, role))
            if self.nbytes + need <= self.max_bytes:
                break
            self._evict(*next(iter(self._lru)))  # then walk again: the eviction may have pruned the path
        node = self._grow(walk, tokens)
        slot = _slot(cache, row)
        path = node.path()
        for n in path:
            if role not in n.kv:
                n.kv[role] = {i: c.kv[slot, :, :, n.start:n.depth].clone() for i, c in layers.items()
                              if isinstance(c, AttentionLayerCache)}
                self.nbytes += _nbytes(n.kv[role].values())
            n.refs[role] = n.refs.get(role, 0) + 1
        node.states[role] = _Snapshot({i: {name: t[slot].clone() for name, t in _fields(c).items()}
                                       for i, c in layers.items() if not isinstance(c, AttentionLayerCache)},
                                      fixed)
        self.nbytes += fixed
        self._lru[(node, role)] = None
        self.stats.inserted += 1
        return True

    def _grow(self, walk: _Walk, tokens: list[int]) -> _Node:
        """The node at depth ``len(tokens)`` on ``tokens``' path, made by splitting the edge the
        walk ends inside and adding a leaf for the rest."""
        node = walk.nodes[-1]
        if walk.partial is not None:
            node = self._split(walk.partial, walk.common - node.depth)
        if walk.common < len(tokens):
            leaf = _Node(tokens[walk.common:], node, len(tokens))
            node.children[leaf.tokens[0]] = leaf
            node = leaf
        return node

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after its first ``k`` tokens: a new node there, ``child`` below."""
        parent = child.parent
        mid = _Node(child.tokens[:k], parent, child.start + k)
        child.tokens, child.parent = child.tokens[k:], mid
        mid.children[child.tokens[0]] = child
        parent.children[mid.tokens[0]] = mid
        mid.refs = dict(child.refs)
        for role, segs in child.kv.items():  # copies, so that each half frees its own memory
            mid.kv[role] = {i: s[:, :, :k].clone() for i, s in segs.items()}
            child.kv[role] = {i: s[:, :, k:].clone() for i, s in segs.items()}
        return mid

    def _evict(self, node: _Node, role: str) -> None:
        del self._lru[(node, role)]
        self.nbytes -= node.states.pop(role).nbytes
        n = node
        while n.parent is not None:
            left = n.refs[role] - 1
            if left:
                n.refs[role] = left
            else:  # no snapshot of the role below: its K/V go, and the node if nothing is left
                del n.refs[role]
                self.nbytes -= _nbytes(n.kv.pop(role, {}).values())
            parent = n.parent
            if not n.refs:
                del parent.children[n.tokens[0]]
            n = parent
        self.stats.evicted += 1


# ---------------------------------------------------------------------------------- helpers
def prefill_row(model, cache, row: int, tokens: list[int]) -> None:
    """Commit ``tokens`` to row ``row`` of ``cache`` (no logits)."""
    ids = torch.tensor([tokens], dtype=torch.long, device=cache.lengths.device)
    if cache.batch_size == 1:
        model.prefill(ids, cache, logits=False)
        return
    view = cache.row(row)
    model.prefill(ids, view, logits=False)
    cache.seqlens[row] = view.seqlens[0]


def _fields(layer) -> dict[str, torch.Tensor]:
    """Every tensor a (non-attention) layer cache holds: its state, whatever the layer kind."""
    return {name: t for name, t in vars(layer).items() if torch.is_tensor(t)}


def _slot(cache, row: int) -> int:
    """The pool slot of ``cache``'s row ``row``."""
    if not 0 <= row < cache.batch_size:
        raise ValueError(f"row {row} out of range for a cache of batch size {cache.batch_size}")
    return cache.first + row if cache.slots is None else int(cache.slots[row])


def _covered(walk: _Walk, role: str) -> int:
    """How many leading positions of the walked path already hold ``role``'s K/V (a role's K/V
    cover a prefix of every path: each of its snapshots keeps its edges' from the root)."""
    if walk.partial is not None and role in walk.partial.kv:
        return walk.common
    return next((n.depth for n in reversed(walk.nodes) if role in n.kv), 0)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _signature(cache) -> tuple:
    """What a snapshot's tensors must match: per layer its kind and each tensor's shape (the
    batch axis, and the K/V capacity, left out), dtype and device."""
    out = []
    for i, c in sorted(cache.pool.layers.items()):
        if isinstance(c, AttentionLayerCache):
            shape = tuple(c.kv.shape[1:3]) + tuple(c.kv.shape[4:])
            out.append((i, "kv", ((shape, c.kv.dtype, c.kv.device.type),)))
        else:
            out.append((i, type(c).__name__, tuple((name, tuple(t.shape[1:]), t.dtype, t.device.type)
                                                   for name, t in _fields(c).items())))
    return tuple(out)


def _describe(signature: tuple) -> str:
    kinds = [k for _, k, _ in signature]
    dtypes = sorted({str(f[-2]) for _, _, fields in signature for f in fields})
    return f"{len(kinds)} layers, {', '.join(dtypes)}"
