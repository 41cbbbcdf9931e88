"""TokenTree: a batch of packed, topologically ordered draft trees and the tables built from them.

A tree is given by its tokens and a parent list. Node 0 is the root: the last committed token,
which the target has not seen yet. Every other node's parent comes before it (``parents[i] < i``),
so the packing is topological and the ancestor mask is lower triangular.

Every table (depth, ancestor mask, root-to-node paths, conv windows) is built once per tree here
and shared by every layer of every model that runs over the tree.
"""
from __future__ import annotations

from typing import Sequence

import torch

MAX_TREE_NODES = 1024


class TokenTree:
    """A batch of ``b`` trees of ``n`` nodes each (one template size; parents may differ per row).

    Args:
        tokens: ``(n,)`` or ``(b, n)`` integer token ids, ``tokens[..., 0]`` is the root.
        parents: ``(n,)`` or ``(b, n)`` parent indices, ``parents[..., 0] == -1`` and
            ``0 <= parents[..., i] < i``. A 1-D parent list is shared by every row.
        vocab_size: if given, tokens must lie in ``[0, vocab_size)``.
        max_nodes: refuse trees larger than this.

    Attributes (all ``(b, ...)``, on the tokens' device):
        tokens, parents: ``(b, n)`` int64.
        depth: ``(b, n)`` int64, root depth 0.
        mask: ``(b, n, n)`` bool, ``mask[b, i, j]`` iff node j is on the root-to-i path (i included).
        paths: ``(b, n, max_depth + 1)`` int64, root-to-node node indices, -1 padded at the end.
        max_depth: int, deepest node's depth over the batch.
        max_token: int, largest token id (host-side; None for ``with_tokens(..., trusted=True)``).
        max_children: int, most children of any node (host-side).
    """

    def __init__(self, tokens, parents, *, vocab_size: int | None = None,
                 max_nodes: int = MAX_TREE_NODES):
        tokens = _as_long_tensor(tokens, "tokens")
        device = tokens.device
        # Structure is validated and its tables built on the host (a parent list is tiny), then
        # moved to the tokens' device once: no device round trips per check.
        parents = _as_long_tensor(parents, "parents").cpu()
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (n,) or (b, n), got shape {tuple(tokens.shape)}")
        b, n = tokens.shape
        if n == 0:
            raise ValueError("empty tree: a tree needs at least its root node")
        if n > max_nodes:
            raise ValueError(f"tree of {n} nodes exceeds the limit of {max_nodes} nodes")
        if parents.dim() == 1:
            parents = parents.unsqueeze(0).expand(b, -1)
        if parents.dim() != 2 or parents.shape[1] != n or parents.shape[0] not in (1, b):
            raise ValueError(
                f"parents must be (n,) or (b, n) matching tokens {tuple(tokens.shape)}, "
                f"got {tuple(parents.shape)}")
        parents = parents.expand(b, n).contiguous()
        # max_children stays host-side, for verifiers' children tables (no device read per step)
        depth, paths, self.max_children = _structure(parents.tolist())
        self.max_token = _validate_tokens(tokens, vocab_size)

        self.tokens = tokens.contiguous()
        paths = torch.tensor(paths)
        self.max_depth = paths.shape[-1] - 1
        self.parents, self.depth, self.paths, self.mask = (
            t.to(device) for t in (parents, torch.tensor(depth), paths, _ancestor_mask(paths, n)))
        self._windows: dict = {}
        self._children: list[list[list[int]]] | None = None

    def with_tokens(self, tokens, *, trusted: bool = False) -> "TokenTree":
        """A tree of the same shape with other tokens, sharing every table (no re-validation of
        the structure): how a drafter reuses one template step after step.

        ``trusted``: the tokens come from a model's own choice over its vocabulary (a drafter),
        so their range is not read back from the device (``max_token`` is then None)."""
        tokens = _as_long_tensor(tokens, "tokens")
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tuple(tokens.shape) != tuple(self.tokens.shape):
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} for a tree template of shape "
                             f"{tuple(self.tokens.shape)}")
        other = object.__new__(TokenTree)
        other.__dict__.update(self.__dict__)
        other.max_token = None if trusted else _validate_tokens(tokens, None)
        other.tokens = tokens.to(self.device).contiguous()
        return other

    # ----------------------------------------------------------------------------------- builders
    @classmethod
    def from_widths(cls, tokens, widths: Sequence[int], **kwargs) -> "TokenTree":
        """Tree whose layer ``d`` (below the root) has ``widths[d-1]`` nodes, each attached to the
        nodes of the layer above round-robin (node ``j`` of a layer hangs from node ``j % w_prev``
        of the previous one). See :func:`parents_from_widths`."""
        return cls(tokens, parents_from_widths(widths), **kwargs)

    @classmethod
    def chain(cls, tokens, **kwargs) -> "TokenTree":
        """A single path: node i's parent is i - 1."""
        t = _as_long_tensor(tokens, "tokens")
        n = t.shape[-1]
        return cls(t, torch.arange(-1, n - 1, device=t.device), **kwargs)

    # ------------------------------------------------------------------------------------ queries
    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def conv_window(self, width: int) -> torch.Tensor:
        """``(b, n, width)`` int64 gather table for a causal conv of ``width`` taps over the tree.

        Indexes ``ext = [last width-1 committed inputs, tree inputs]`` (length ``width-1+n``):
        ``window[b, i, width-1] = width-1+i`` (the node itself) and ``window[b, i, k]`` is the
        position of the ``(width-1-k)``-th ancestor, continuing into the committed inputs when the
        path above node i is shorter than the window.
        """
        if width not in self._windows:
            b, n = self.tokens.shape
            lag = torch.arange(width - 1, -1, -1, device=self.device)  # ancestor order per tap
            depth = self.depth.unsqueeze(-1)  # (b, n, 1)
            # k-th ancestor of a node at depth d is paths[d - k] when k <= d
            idx = (depth - lag).clamp(min=0)  # (b, n, width)
            in_tree = self.paths.gather(2, idx) + (width - 1)
            in_state = (width - 1) + depth - lag  # index into committed part when lag > depth
            self._windows[width] = torch.where(lag <= depth, in_tree, in_state)
        return self._windows[width]

    def conv_gather_index(self, width: int) -> torch.Tensor:
        """``(b * n * width,)`` int64: :meth:`conv_window` as row indices into
        ``cat(conv_state^T, xbc)`` flattened over the batch (the whole committed window, so no
        slice is needed), for the CPU tree conv's one ``index_select``
        (:func:`conv_gather_rows`). Cached per width."""
        key = ("gather", width)
        if key not in self._windows:
            self._windows[key] = conv_gather_rows(self.conv_window(width))
        return self._windows[key]

    def scan_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mask_f (b, n, n) float32, bias (b, 1, n, n) float32)``: the ancestor mask as 0/1 for
        the tree prefix sum ``A_tree = L @ a``, and as 0/-inf to add to exponents before ``exp``.
        Built once per tree, shared by every Mamba2 layer."""
        if "scan" not in self._windows:
            mask_f = self.mask.float()
            bias = torch.zeros_like(mask_f).masked_fill_(~self.mask, float("-inf"))
            self._windows["scan"] = (mask_f, bias[:, None])
        return self._windows["scan"]

    def earlier_siblings(self) -> torch.Tensor:
        """``(b, n, n)`` bool: ``[b, i, j]`` iff node j is a sibling of node i before it in draft
        order (same parent, ``j < i``). Built once per tree (templates share it)."""
        if "siblings" not in self._windows:
            n = self.num_nodes
            earlier = torch.ones(n, n, dtype=torch.bool, device=self.device).tril(-1)
            same_parent = self.parents[:, :, None] == self.parents[:, None, :]
            self._windows["siblings"] = same_parent & earlier
        return self._windows["siblings"]

    def conv_scan_tables(self, width: int) -> dict:
        """What a Mamba2 layer with a ``width``-tap conv reads of this tree:
        ``window`` (:meth:`conv_window`), ``mask``, and on the CPU ``gather``
        (:meth:`conv_gather_index`) and ``scan`` (:meth:`scan_tables`), else None (the Triton
        kernels read window and mask). Built (and cached) before the layers run, so a compiled
        step reads only tensors."""
        cpu = not self.tokens.is_cuda
        return dict(window=self.conv_window(width), mask=self.mask,
                    gather=self.conv_gather_index(width) if cpu else None,
                    scan=self.scan_tables() if cpu else None)

    def row(self, r: int) -> "TokenTree":
        """Row ``r`` as a one-row tree. Its structure and tables are built once per tree and
        row, and shared by every tree made from this one by :meth:`with_tokens` (a drafter's
        template), so a row of a batched draft costs nothing step after step."""
        key = ("row", r)
        if key not in self._windows:
            self._windows[key] = TokenTree(self.tokens[r:r + 1], self.parents[r:r + 1])
        return self._windows[key].with_tokens(self.tokens[r:r + 1], trusted=True)

    def children(self, row: int, node: int) -> list[int]:
        """Children of ``node`` in row ``row``, in index (= draft) order. Host-side helper."""
        if self._children is None:
            par = self.parents.tolist()
            kids = [[[] for _ in range(self.num_nodes)] for _ in range(self.batch_size)]
            for r, row_par in enumerate(par):
                for i, p in enumerate(row_par[1:], start=1):
                    kids[r][p].append(i)
            self._children = kids
        return self._children[row][node]

    def path_tokens(self, path: torch.Tensor) -> torch.Tensor:
        """Tokens along node-index paths ``(b, k)`` (-1 padded); padding gives -1."""
        tok = self.tokens.gather(1, path.clamp(min=0))
        return torch.where(path >= 0, tok, torch.full_like(tok, -1))

    def to(self, device) -> "TokenTree":
        other = object.__new__(TokenTree)
        other.__dict__.update({k: (v.to(device) if torch.is_tensor(v) else v)
                               for k, v in self.__dict__.items()})
        other._windows = {}
        return other

    def __repr__(self) -> str:
        return f"TokenTree(batch={self.batch_size}, nodes={self.num_nodes}, depth={self.max_depth})"


def parents_from_widths(widths: Sequence[int]) -> list[int]:
    """Parent list of a layered tree: root, then ``widths[0]`` children of the root, then
    ``widths[1]`` nodes hanging round-robin from the previous layer, and so on.

    ``[3, 3, 3, 3]`` gives three disjoint chains below the root (13 nodes); ``[2, 4, 8]`` a
    full binary tree of depth 3 (15 nodes).
    """
    if not widths or any(int(w) < 1 for w in widths):
        raise ValueError(f"widths must be a non-empty list of positive ints, got {list(widths)}")
    parents = [-1]
    prev = [0]
    for w in widths:
        start = len(parents)
        parents.extend(prev[j % len(prev)] for j in range(int(w)))
        prev = list(range(start, start + int(w)))
    return parents


def level_runs(parents: Sequence[int]) -> list[tuple[int, int]]:
    """What a drafter runs of a layer-ordered tree: per layer above the deepest, ``(first node,
    one past its last node with children)``. Leaves listed after a layer's last inner node (a
    caterpillar's, the unused tail of a pruned layer) are never run."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        depth[i] = depth[p] + 1
    last = {}
    for p in parents[1:]:  # parents, hence inner nodes, in index order
        last[depth[p]] = max(last.get(depth[p], p), p)
    return [(depth.index(d), last[d] + 1) for d in range(max(depth))]


def parents_caterpillar(children: Sequence[int]) -> list[int]:
    """Parent list of a chain (the spine) with leaves on it: the spine node at depth ``d`` has
    ``children[d]`` children, the first of which continues the spine; each layer lists its spine
    node first.

    ``[2, 2, 2, 2]`` gives a 4-deep chain with one extra leaf beside each chain node (9 nodes);
    ``[1, 1, 1]`` a plain chain.
    """
    if not children or any(int(c) < 1 for c in children):
        raise ValueError(f"children must be a non-empty list of positive ints, got {list(children)}")
    parents, spine = [-1], 0
    for c in children:
        start = len(parents)
        parents.extend([spine] * int(c))
        spine = start
    return parents


# --------------------------------------------------------------------------------------- helpers
def _as_long_tensor(value, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
        return value.long()
    try:
        return torch.as_tensor(value, dtype=torch.long)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a rectangular list of ints ({err})") from None


def _validate_tokens(tokens: torch.Tensor, vocab_size: int | None) -> int:
    """Check the token range; returns the largest token id (kept so that models can check it
    against their vocabulary without another device sync)."""
    lo, hi = (int(v) for v in torch.aminmax(tokens))  # one device sync for both bounds
    if lo < 0:
        raise ValueError("tokens must be non-negative")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(f"token id {hi} out of range for vocab_size {vocab_size}")
    return hi


def _structure(parents: list[list[int]]) -> tuple[list, list, int]:
    """Validate per-row parent lists and build, in plain Python (a tree is small: this is faster
    than tensor ops on the host), each node's depth, its root-to-node path (-1 padded to the
    deepest node's depth + 1) and the most children of any node."""
    if any(row[0] != -1 for row in parents):
        raise ValueError("parents[0] must be -1: node 0 is the root")
    if any(-1 in row[1:] for row in parents):
        raise ValueError("several roots: only node 0 may have parent -1")
    depths, paths, max_children = [], [], 0
    for r, row in enumerate(parents):
        depth, path, kids = [0] * len(row), [[0]], [0] * len(row)
        for i in range(1, len(row)):
            p = row[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} of row {r} has parent {p}: every parent must come "
                                 "before its child (0 <= parents[i] < i)")
            depth[i] = depth[p] + 1
            path.append(path[p] + [i])
            kids[p] += 1
        depths.append(depth)
        paths.append(path)
        max_children = max(max_children, max(kids))
    width = max(max(d) for d in depths) + 1
    return depths, [[q + [-1] * (width - len(q)) for q in path] for path in paths], max_children


def _ancestor_mask(paths: torch.Tensor, n: int) -> torch.Tensor:
    b = paths.shape[0]
    mask = torch.zeros(b, n, n + 1, dtype=torch.bool, device=paths.device)
    # -1 padding lands in the extra column n, dropped below
    mask.scatter_(2, torch.where(paths >= 0, paths, n), True)
    return mask[:, :, :n]


def conv_gather_rows(window: torch.Tensor) -> torch.Tensor:
    """``(b * n * w,)`` int64: ``window (b, n, w)`` as row indices into ``ext`` flattened to
    ``(b * (w + n), channels)``, where ext is ``cat(conv_state^T, xbc)`` over the whole committed
    window (so shifted by one against ``window``, which skips its oldest column)."""
    b, n, w = window.shape
    rows = torch.arange(b, device=window.device)[:, None, None] * (w + n)
    return (window + 1 + rows).reshape(-1)
