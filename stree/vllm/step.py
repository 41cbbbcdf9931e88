"""One engine step's trees inside vLLM 0.32: the tables every layer of the step shares, the
verification, and the commit of what the layers kept.

vLLM schedules and verifies chains only. For a tree spec (``"tree": "caterpillar:2,2,2,2"``,
``"static:..."``, ``"beam:..."``, dynamic trees), :class:`~stree.vllm.proposer.StreeProposer`
hands vLLM each request's drafted tree flattened in topological order (node ``i``'s parent has a
smaller index) as its draft tokens, so vLLM schedules the request as one query of ``1 + n``
tokens: the root (the last committed token, which neither model has run) and the ``n`` drafted
nodes, each with its own KV slot at ``num_computed + i``. A step then runs as follows:

1. The runner's input preparation (:mod:`stree.vllm.runner`) places each node at position
   ``num_computed + depth(i)`` and makes a :class:`TreeStep` of the step's trees current.
2. Each layer computes its tree requests' rows over the tree from the committed state, writes
   nothing, and keeps what the commit needs (:meth:`TreeStep.keep`): attention under the tree
   mask (:mod:`stree.vllm.attention_rows`), the short conv along each node's ancestors
   (:mod:`stree.vllm.conv_rows`), the Mamba2 scan (:mod:`stree.vllm.mamba2_rows`) and the Gated
   DeltaNet rule (:mod:`stree.vllm.delta_rows`). Requests whose trees have one shape run as one
   batch (:class:`TreeGroup`); the batch's other rows go to vLLM's own code.
3. The runner's sampling: stree's verifier on each tree (:meth:`TreeStep.verify`) gives the
   accepted path and writes the request's output row (the path's tokens and the token the
   target emits after it).
4. :meth:`TreeStep.commit`: each kept item moves the accepted path's K/V into place or replays
   its layer's state along the path into the slot and conv offset vLLM reads next step
   (``num_accepted_tokens - 1 = a``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Protocol

import torch

from stree.tree import TokenTree
from stree.vllm.cpu_spec import start_slots
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
        return template(self.parents, len(self.rows), device)

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


def template(parents: tuple[int, ...], b: int, device) -> TokenTree:
    """A tree of shape ``parents`` for ``b`` rows on ``device`` whose tables the layers read (its
    tokens mean nothing): built once per shape, batch size and device."""
    key = (parents, b, str(device))
    if key not in _TEMPLATES:
        if len(_TEMPLATES) >= 256:
            _TEMPLATES.clear()
        _TEMPLATES[key] = TokenTree(torch.zeros(b, len(parents), dtype=torch.long, device=device), list(parents))
    return _TEMPLATES[key]


@dataclass
class RowGroup:
    """One tree shape's requests among the decode rows of a recurrent layer's metadata (Mamba2 or
    Gated DeltaNet): their state slot tables ``table (b, 1 + K)`` (and as host lists), the last
    step's accepted counts ``accepted (b,)`` (the conv window starts at column
    ``num_accepted - 1``) and the state slot each tree starts from ``start (b,)``."""

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
class RecurrentRows:
    """Where this step's trees sit among a recurrent layer's decode rows: what every such layer of
    the step reads, built once per step from the (shared) metadata. groups: one :class:`RowGroup`
    per tree shape; handled: the decode rows that are trees; masked: the slot table with those
    rows set to vLLM's null block (vLLM's own ops then leave them alone), None when every decode
    row is a tree."""

    groups: list[RowGroup]
    handled: list[int]
    masked: torch.Tensor | None

    @cached_property  # read by every layer of the step
    def tokens(self) -> torch.Tensor:
        """``(t,)`` the query token indices of every tree node."""
        return torch.cat([rg.group.index.flatten() for rg in self.groups])


class Kept(Protocol):
    """What a layer's tree rows keep for the commit (:meth:`TreeStep.keep`)."""

    def commit(self, step: "TreeStep") -> None: ...


@dataclass
class TreeStep:
    """This engine step's trees (keyed by the first token index of each request's query), the
    per-step tables every layer shares (built once, on first use: :meth:`table`), and what the
    layers kept for the commit."""

    rows: dict[int, TreeRow]
    kept: list[Kept] = field(default_factory=list)
    _tables: dict = field(default_factory=dict)
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

    def table(self, key, build: Callable[[], object]):
        """The per-step table named ``key`` (built by ``build()`` on first use): what the layers
        of a step share, such as one metadata's row tables or one cache layout's offsets."""
        if key not in self._tables:
            self._tables[key] = build()
        return self._tables[key]

    def recurrent_rows(self, query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                       num_accepted: torch.Tensor, null_block: int) -> RecurrentRows:
        """:class:`RecurrentRows` of a recurrent layer's decode metadata (``query_start_loc
        (d + 1,)`` in the batch's token indices, the slot table ``(d, 1 + K)``, ``num_accepted
        (d,)``); built once per step (the layers share the metadata)."""
        def build() -> RecurrentRows:
            decode = {start: i for i, start in enumerate(query_start_loc.tolist()[:-1]) if start in self.rows}
            if len(decode) != len(self.rows):
                raise RuntimeError("stree: a tree request is missing from vLLM's recurrent decode rows")
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
            return RecurrentRows(groups, handled, masked)

        return self.table(("recurrent", id(query_start_loc)), build)

    def covers(self, num_rows: int) -> bool:
        """Whether all ``num_rows`` requests of a batch (or of vLLM's decode rows, where every tree
        is) are trees: then vLLM's own kernel, op or sampler has nothing left to do."""
        return len(self.rows) == num_rows

    def keep(self, item: Kept) -> None:
        """Keep what a layer's tree rows need at commit; ``item.commit(step)`` runs after
        :meth:`verify`, once."""
        self.kept.append(item)

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
        """Commit the accepted paths (after :meth:`verify`): every kept item, each layer's K/V or
        state."""
        for item in self.kept:
            item.commit(self)


_current: TreeStep | None = None


def current() -> TreeStep | None:
    return _current


def begin(step: TreeStep | None) -> None:
    global _current
    _current = step
