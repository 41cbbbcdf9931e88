"""A deterministic toy LM with exactly the patched-model API, for fast, exact loop tests on CPU.

``FakeLM``: the logits after a token ``cur`` whose predecessor is ``prev`` are ``table[prev, cur]``
(a fixed random ``(v + 1, v, v)`` table; ``prev == v`` means "no predecessor"). That is an order-2
Markov model, so every root-to-node path of a tree has a closed-form answer, and the cache only
needs to remember the committed tokens. ``FakeLM(noise=...)`` perturbs the table: a draft model that
agrees with the target often but not always.

``greedy_reference`` decodes the table directly (no cache, no tree): the oracle for greedy tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stree import native
from stree.tree import TokenTree


@dataclass
class Call:
    """One model call: ``kind`` "prefill" or "tree_forward", the batch, and the tokens it ran
    (``(b, l)`` for prefill, the tree's ``(b, n)`` tokens for tree_forward)."""
    kind: str
    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    committed: list[int] = field(default_factory=list)


class FakeCache:
    """Committed tokens per row; ``commit(path)`` appends the pending tree's path tokens."""

    def __init__(self, batch_size: int, max_seqlen: int, tokens=None, lengths=None):
        self.batch_size, self.max_seqlen = batch_size, max_seqlen
        self.tokens = torch.zeros(batch_size, max_seqlen, dtype=torch.long) if tokens is None else tokens
        self.lengths = torch.zeros(batch_size, dtype=torch.long) if lengths is None else lengths
        self.pending: TokenTree | None = None

    @property
    def seqlens(self) -> list[int]:
        return self.lengths.tolist()

    def row(self, b: int) -> "FakeCache":
        return FakeCache(1, self.max_seqlen, self.tokens[b:b + 1], self.lengths[b:b + 1])

    def reserve(self, new_tokens: int | list[int]) -> None:
        """Like ``TreeCache.reserve`` (one count for every row, or one per row), without growth
        (the fake's token table is small)."""
        counts = new_tokens if isinstance(new_tokens, list) else [new_tokens] * self.batch_size
        need = max(n + c for n, c in zip(self.seqlens, counts))
        if need > self.max_seqlen:
            raise ValueError(f"sequence length {need} exceeds max_seqlen {self.max_seqlen}")

    def committed(self, b: int) -> list[int]:
        return self.tokens[b, :int(self.lengths[b])].tolist()

    def append(self, b: int, toks: list[int]) -> None:
        start = int(self.lengths[b])
        self.tokens[b, start:start + len(toks)] = torch.tensor(toks, dtype=torch.long)
        self.lengths[b] += len(toks)

    def commit(self, path, counts=None) -> None:
        """Like ``TreeCache.commit``; ``counts`` (path nodes per row, from the generate loop) must
        match the path."""
        if self.pending is None:
            raise RuntimeError("commit() needs a tree_forward() first")
        tree, self.pending = self.pending, None
        path = torch.as_tensor(path, dtype=torch.long)
        if path.shape[0] != self.batch_size or path.shape[1] > tree.max_depth + 1:
            raise ValueError(f"bad path shape {tuple(path.shape)} for {tree}")
        for b, row in enumerate(path.tolist()):
            k = next((j for j, v in enumerate(row) if v < 0), len(row))
            assert all(v < 0 for v in row[k:]), f"-1 padding only at the end: {row}"
            assert k == 0 or row[0] == 0, f"path must start at the root: {row}"
            for j in range(1, k):
                assert tree.parents[b, row[j]] == row[j - 1], f"not a path: {row}"
            assert counts is None or counts[b] == k, f"counts {counts} do not match path {row}"
            self.append(b, tree.tokens[b, row[:k]].tolist())


class FakeLM:
    """Order-2 Markov toy LM with ``allocate_tree_cache`` / ``prefill`` / ``tree_forward``.

    Args:
        vocab_size: v.
        seed: seed of the shared base table (equal seeds = the same language).
        noise: std of a perturbation drawn with ``noise_seed`` (0: the base model itself).
        scale: std of the base table; larger = peakier distributions.
    Attributes:
        calls: every prefill / tree_forward, in order (see :class:`Call`).
    """

    def __init__(self, vocab_size: int = 23, seed: int = 0, noise: float = 0.0, noise_seed: int = 1,
                 scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size + 1, vocab_size, vocab_size, generator=g) * scale
        if noise:
            g = torch.Generator().manual_seed(noise_seed)
            self.table += torch.randn(self.table.shape, generator=g) * noise
        self.vocab_size = vocab_size
        self.calls: list[Call] = []

    def allocate_tree_cache(self, batch_size: int, max_seqlen: int) -> FakeCache:
        return FakeCache(batch_size, max_seqlen)

    def _last(self, cache: FakeCache) -> torch.Tensor:
        """(b,) last committed token of each row, or v (no predecessor) for empty rows."""
        idx = (cache.lengths - 1).clamp(min=0)
        last = cache.tokens.gather(1, idx[:, None])[:, 0]
        return torch.where(cache.lengths > 0, last, self.vocab_size)

    def prefill(self, input_ids, cache: FakeCache, logits: bool = True) -> torch.Tensor | None:
        """(b, l) tensor, or a list of 1-D tensors (ragged: logits right-padded with NaN); None
        with ``logits=False`` (the call is recorded the same)."""
        cache.pending = None
        if isinstance(input_ids, (list, tuple)):
            outs = [self.prefill(torch.as_tensor(r).view(1, -1), cache.row(b))[0]
                    for b, r in enumerate(input_ids)]
            if not logits:
                return None
            width = max(o.shape[0] for o in outs)
            return torch.stack([torch.cat([o, o.new_full((width - len(o), self.vocab_size), float("nan"))])
                                for o in outs])
        ids = torch.as_tensor(input_ids).long()
        if ids.shape[1] == 0:
            raise ValueError("empty prompt: prefill needs at least one token")
        cache.reserve(ids.shape[1])
        self.calls.append(Call("prefill", ids.clone(), committed=cache.seqlens))
        prev = torch.cat([self._last(cache)[:, None], ids[:, :-1]], dim=1)
        out = self.table[prev, ids]
        for b in range(ids.shape[0]):
            cache.append(b, ids[b].tolist())
        return out if logits else None

    def tree_forward(self, tree: TokenTree, cache: FakeCache) -> torch.Tensor:
        """(b, n, v) logits; committed state untouched; the tree becomes pending."""
        if tree.batch_size != cache.batch_size:
            raise ValueError(f"tree batch {tree.batch_size} != cache batch {cache.batch_size}")
        if int(tree.tokens.max()) >= self.vocab_size:
            raise ValueError(f"tree token out of range for vocab size {self.vocab_size}")
        cache.reserve(tree.num_nodes)
        self.calls.append(Call("tree_forward", tree.tokens.clone(), tree.parents.clone(),
                               committed=cache.seqlens))
        parent_tok = tree.tokens.gather(1, tree.parents.clamp(min=0))
        prev = torch.where(tree.parents >= 0, parent_tok, self._last(cache)[:, None])
        cache.pending = tree
        return self.table[prev, tree.tokens]


class FakeNativeSession:
    """FakeLM's "own decoding" for ``stree.native``: the table read token by token, no cache."""

    def __init__(self, model: FakeLM, batch_size: int, prompt_len: int, max_seqlen: int):
        self.model, self.prev, self.cur = model, None, None
        model.calls.append(Call("native", torch.zeros(batch_size, prompt_len, dtype=torch.long)))

    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        v = self.model.vocab_size
        self.prev = input_ids[:, -2] if input_ids.shape[1] > 1 else torch.full_like(input_ids[:, 0], v)
        self.cur = input_ids[:, -1]
        return self.model.table[self.prev, self.cur]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.prev, self.cur = self.cur, tokens
        return self.model.table[self.prev, self.cur]


native.register(lambda m: isinstance(m, FakeLM), FakeNativeSession)


def greedy_reference(model: FakeLM, prompt, max_new_tokens: int,
                     eos_token_id: int | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` straight from the table (stops after EOS)."""
    seq = [int(t) for t in prompt]
    out = []
    prev = seq[-2] if len(seq) > 1 else model.vocab_size
    cur = seq[-1]
    while len(out) < max_new_tokens:
        nxt = int(model.table[prev, cur].argmax())
        out.append(nxt)
        if nxt == eos_token_id:
            break
        prev, cur = cur, nxt
    return out


def target_probs_of_prefix(model: FakeLM, prompt, length: int, temperature: float = 1.0) -> torch.Tensor:
    """Exact joint probabilities ``(v,) * length`` of the first ``length`` sampled tokens."""
    v = model.vocab_size
    seq = [int(t) for t in prompt]
    prev0 = seq[-2] if len(seq) > 1 else v
    probs = torch.ones(())
    prevs, curs = torch.tensor([prev0]), torch.tensor([seq[-1]])
    for _ in range(length):
        p = (model.table[prevs, curs] / temperature).softmax(-1)  # (m, v)
        probs = (probs.reshape(-1, 1) * p).reshape(-1)
        prevs, curs = curs.repeat_interleave(v), torch.arange(v).repeat(len(curs))
    return probs.reshape((v,) * length)
