"""Suffix tries over token sequences, and speculation trees read from them (SuffixDecoding's index).

A :class:`SuffixTrie` counts every substring of at most ``max_depth`` tokens of the sequences it
holds: node ``u`` is a substring, ``count[u]`` how often it occurs, its children the tokens that
followed it with their own counts. SuffixDecoding (Oliaro et al., arXiv 2411.04975) drafts from
such a trie: match the context's last ``p`` tokens, then grow a tree below the matched node
best-first by path probability, a child's probability being its parent's times
``count(child) / count(occurrences of the parent followed by a token)``.

Compact. A substring seen once is not stored as a chain of nodes: its parent keeps a *lazy*
pointer to the occurrence (sequence, position), and everything below it is read from the
sequence itself. A node is materialised when its substring occurs a second time. So the trie
holds the repeated substrings and one pointer per branch, not ``max_depth`` nodes per token, and
a continuation read through a pointer is not cut at ``max_depth``.

Incremental. Appending a token updates only the nodes of the context's suffixes that occurred
before (``active``: the root, then one node per suffix length), ``O(match length)`` dictionary
operations, never a rescan of the context. A sequence's active list also serves as the match for
speculation: node ``k`` is the context's last ``k`` tokens.

A read-only :class:`Matcher` follows a context through a trie it does not insert into (the cache
of earlier outputs shared by many requests), including a lazy match longer than ``max_depth``
(a context that repeats one earlier output token for token).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

# A child reference is a node id (>= 0) or a lazy pointer -(1 + (sequence id << 32 | position)):
# the one occurrence of the child's substring ends at ``position`` of that sequence.
_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


def _lazy(sid: int, pos: int) -> int:
    return -1 - ((sid << _POS_BITS) | pos)


def _unlazy(ref: int) -> tuple[int, int]:
    key = -1 - ref
    return key >> _POS_BITS, key & _POS_MASK


@dataclass
class Speculation:
    """A drafted tree below a matched context: ``tokens[i]`` with parent ``parents[i]`` (-1: the
    root, i.e. the context's last token; otherwise an earlier index), each with its path
    probability ``probs[i]`` (non-increasing along a path). ``score``: the sum of ``probs``, the
    expected number of accepted tokens if the counts were the target's probabilities;
    ``match``: length of the context suffix it was read from (0: no match, empty tree)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class SpeculationConfig:
    """How big a tree to read from a match (SuffixDecoding's knobs).

    nodes: most drafted nodes (root excluded). depth: deepest drafted node below the root.
    min_prob: a node below this path probability is not drafted (``min_token_prob``).
    factor, offset: a match of ``p`` tokens drafts at most ``factor * p + offset`` nodes
        (``max_spec_factor`` / ``max_spec_offset``): a long match earns a big tree, a one-token
        match a small one. SuffixDecoding's default factor is 1; here 8: on a CPU a verify of
        16 nodes costs little more than one of 2, and on the shipped pair (10 HumanEval and 10
        MT-Bench prompts, T = 0) ``suffix:16`` ran at 1.52x / 1.53x the model's own decoding
        with factor 1, 1.64x / 1.61x with 2, 1.68x / 1.64x with 4 and 1.68x / 1.72x with 8.
    """

    nodes: int = 16
    depth: int = 16
    min_prob: float = 0.1
    factor: float = 8.0
    offset: float = 0.0

    def __post_init__(self):
        if self.nodes < 1 or self.depth < 1:
            raise ValueError(f"a suffix tree needs nodes >= 1 and depth >= 1, got nodes="
                             f"{self.nodes}, depth={self.depth}")
        if not 0.0 <= self.min_prob <= 1.0:
            raise ValueError(f"min_prob must lie in [0, 1], got {self.min_prob}")
        if not (self.factor >= 0 and self.offset == self.offset and abs(self.offset) != float("inf")
                and self.factor != float("inf")):
            raise ValueError(f"factor must be a finite number >= 0 and offset finite, got "
                             f"factor={self.factor}, offset={self.offset}")

    def budget(self, match: int) -> int:
        return max(0, min(self.nodes, int(self.factor * match + self.offset)))


class SuffixTrie:
    """Occurrence counts of every substring of at most ``max_depth`` tokens of its sequences.

    Sequences are appended to token by token (:meth:`new_sequence`, :meth:`append`) and may be
    removed whole (:meth:`remove_sequence`, for a bounded cache). ``epoch`` changes whenever a
    removal may have freed node ids, so a :class:`Matcher` knows to re-match.
    """

    def __init__(self, max_depth: int = 32):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.kids: list[dict[int, int]] = [{}]   # node -> {token: child ref}
        self.count: list[int] = [0]              # occurrences of the node's substring
        self.cont: list[int] = [0]               # of those, followed by a token (sum of children's counts)
        self.depth: list[int] = [0]
        self.last: list[int] = [0]               # packed (sid, pos) of its latest occurrence with a
        self.free: list[int] = []                # continuation, or -1 (see _occurrence)
        self.seqs: dict[int, list[int]] = {}
        self._next_sid = 0
        self.epoch = 0

    # ------------------------------------------------------------------------------ building
    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self.free)

    def new_sequence(self) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.seqs[sid] = []
        return sid

    def append(self, sid: int, tokens, active: list[int] | None = None) -> list[int]:
        """Append ``tokens`` to sequence ``sid``; ``active``: the nodes of its current suffixes
        that occurred before (root first, as returned by the last call; None for a new
        sequence). Returns the updated list: ``active[k]`` is the node of its last ``k`` tokens,
        for every ``k`` whose substring occurred earlier too (plus the root)."""
        seq = self.seqs[sid]
        active = [0] if active is None else active
        kids, count, cont, depth, last = self.kids, self.count, self.cont, self.depth, self.last
        cap = self.max_depth
        for t in tokens:
            i = len(seq)
            seq.append(t)
            new = [0]
            count[0] += 1
            for a in active:
                if depth[a] >= cap:
                    break
                cont[a] += 1
                ch = kids[a]
                c = ch.get(t)
                if c is None:  # first occurrence of this substring (and of every longer one)
                    ch[t] = _lazy(sid, i)
                    continue
                if c < 0:  # second occurrence: materialise, the first one's continuation lazy
                    s2, j = _unlazy(c)
                    c = self._node(depth[a] + 1)
                    ch[t] = c
                    count[c] = 1
                    seq2 = self.seqs[s2]
                    if j + 1 < len(seq2) and depth[c] < cap:
                        kids[c][seq2[j + 1]] = _lazy(s2, j + 1)
                        cont[c] = 1
                    last[c] = (s2 << _POS_BITS) | j
                count[c] += 1
                new.append(c)
            # the suffixes that ended before ``t`` now have a continuation: their latest one
            if i:
                for a in active:
                    last[a] = (sid << _POS_BITS) | (i - 1)
            active = new
        return active

    def _node(self, d: int) -> int:
        if self.free:
            u = self.free.pop()
            self.kids[u], self.count[u], self.cont[u], self.depth[u], self.last[u] = {}, 0, 0, d, -1
            return u
        self.kids.append({})
        self.count.append(0)
        self.cont.append(0)
        self.depth.append(d)
        self.last.append(-1)
        return len(self.count) - 1

    def add_sequence(self, tokens) -> int:
        """Insert a whole sequence; returns its id."""
        sid = self.new_sequence()
        self.append(sid, tokens)
        return sid

    def remove_sequence(self, sid: int) -> None:
        """Remove sequence ``sid`` and every count it added; nodes left with no occurrence are
        freed (``epoch`` changes)."""
        seq = self.seqs[sid]
        kids, count, cont = self.kids, self.count, self.cont
        dead = []
        for i in range(len(seq)):
            u = 0
            count[0] -= 1
            for k in range(min(self.max_depth, len(seq) - i)):
                t = seq[i + k]
                c = kids[u][t]
                cont[u] -= 1
                if c < 0:  # its one occurrence is this one
                    del kids[u][t]
                    break
                count[c] -= 1
                if count[c] == 0:
                    dead.append((u, t, c))
                u = c
        for u, t, c in dead:
            if kids[u].get(t) == c:
                del kids[u][t]
            self.kids[c] = {}
            self.free.append(c)
        del self.seqs[sid]  # ids are never reused: a ``last`` pointing here reads as unknown
        self.epoch += 1

    # ------------------------------------------------------------------------------ reading
    def _occurrence(self, u: int) -> tuple[int, int] | None:
        """(sid, pos) of an occurrence of node ``u``'s substring followed by a token, if known:
        what a node at ``max_depth`` (no children stored) continues with."""
        packed = self.last[u]
        if packed < 0:
            return None
        sid, pos = packed >> _POS_BITS, packed & _POS_MASK
        seq = self.seqs.get(sid)
        return (sid, pos) if seq is not None and pos + 1 < len(seq) else None

    def speculate(self, start: int, match: int, budget: int,
                  config: SpeculationConfig) -> Speculation:
        """The best ``budget``-node tree below ``start`` (a node id, or a lazy pointer to an
        occurrence of the matched suffix), grown best-first by path probability. The context's
        own latest occurrence of a match has no continuation yet, so it counts in no
        child's probability (``cont``, not ``count``, is the denominator)."""
        out = Speculation(match=match)
        if budget <= 0:
            return out
        kids, count, cont, seqs = self.kids, self.count, self.cont, self.seqs
        heap: list = []
        tie = 0

        def push_children(ref: int, prob: float, parent: int, d: int) -> None:
            nonlocal tie
            if d >= config.depth:
                return
            if ref >= 0 and not kids[ref] and self.depth[ref] >= self.max_depth:
                occ = self._occurrence(ref)  # at the depth cap: continue along its latest occurrence
                ref = _lazy(*occ) if occ is not None else ref
            if ref < 0:  # one occurrence: its next token
                sid, pos = _unlazy(ref)
                seq = seqs.get(sid)
                if seq is not None and pos + 1 < len(seq) and prob >= config.min_prob:
                    tie += 1
                    heapq.heappush(heap, (-prob, tie, seq[pos + 1], _lazy(sid, pos + 1), parent, d + 1))
                return
            total = cont[ref]
            if total <= 0:
                return
            for tok, c in kids[ref].items():
                p = prob * (count[c] if c >= 0 else 1) / total
                if p >= config.min_prob:
                    tie += 1
                    heapq.heappush(heap, (-p, tie, tok, c, parent, d + 1))

        push_children(start, 1.0, -1, 0)
        while heap and len(out.tokens) < budget:
            negp, _, tok, ref, parent, d = heapq.heappop(heap)
            out.tokens.append(tok)
            out.parents.append(parent)
            out.probs.append(-negp)
            push_children(ref, -negp, len(out.tokens) - 1, d)
        return out

    def best(self, candidates: list[tuple[int, int]], config: SpeculationConfig) -> Speculation:
        """The highest-scoring speculation over ``candidates`` ((start ref, match length);
        SuffixDecoding tries every match length and keeps the best score). Matches whose node
        has the same continuation count as a longer one read the same occurrences: only the
        longest of them (the largest budget) is tried."""
        best = Speculation()
        seen_cont = None
        for ref, match in sorted(candidates, key=lambda c: -c[1]):
            if ref >= 0:
                if self.cont[ref] == seen_cont:
                    continue
                seen_cont = self.cont[ref]
            spec = self.speculate(ref, match, config.budget(match), config)
            if spec.score > best.score:
                best = spec
        return best


class Matcher:
    """Follows one context through a trie it does not insert into (a shared cache): the nodes of
    the context's suffixes present in the trie, and at most one lazy match (the longest suffix,
    if it occurs exactly once, possibly longer than ``max_depth``)."""

    def __init__(self, trie: SuffixTrie):
        self.trie = trie
        self.active = [0]
        self.lazy: tuple[int, int] | None = None  # (pointer to the match's last token, its length)
        self.epoch = trie.epoch

    def extend(self, tokens, context: list[int]) -> None:
        """``tokens`` were appended to ``context`` (which already holds them)."""
        trie = self.trie
        if trie.epoch != self.epoch:  # nodes may have been freed: match again from the context
            self.rematch(context)
            return
        kids, depth, cap = trie.kids, trie.depth, trie.max_depth
        for t in tokens:
            lazy = None
            if self.lazy is not None:
                sid, pos = _unlazy(self.lazy[0])
                seq = trie.seqs.get(sid)
                if seq is not None and pos + 1 < len(seq) and seq[pos + 1] == t:
                    lazy = (_lazy(sid, pos + 1), self.lazy[1] + 1)
            new = [0]
            for a in self.active:
                if depth[a] >= cap:
                    break
                c = kids[a].get(t)
                if c is None:
                    break
                if c < 0:
                    if lazy is None or lazy[1] < depth[a] + 1:
                        lazy = (c, depth[a] + 1)
                    continue
                new.append(c)
            self.active, self.lazy = new, lazy

    def rematch(self, context: list[int]) -> None:
        """Match the context's suffixes of up to ``max_depth`` tokens from the root (after a
        removal freed nodes). Shorter suffixes first: an absent one means every longer one is
        absent, and a suffix seen once (lazy) has no materialised extension."""
        trie = self.trie
        kids, n = trie.kids, len(context)
        self.epoch, self.active, self.lazy = trie.epoch, [0], None
        for k in range(1, min(trie.max_depth, n) + 1):
            u = 0
            for j in range(n - k, n):
                c = kids[u].get(context[j])
                if c is None:
                    return
                if c < 0:  # one occurrence: the rest of the suffix must follow it
                    sid, pos = _unlazy(c)
                    rest = context[j + 1:]
                    if trie.seqs[sid][pos + 1:pos + 1 + len(rest)] != rest:
                        return
                    self.lazy = (_lazy(sid, pos + len(rest)), k)
                    break
                u = c
            else:
                self.active.append(u)

    def candidates(self) -> list[tuple[int, int]]:
        """(start ref, match length) of every match, for :meth:`SuffixTrie.best`."""
        out = [(u, self.trie.depth[u]) for u in self.active[1:]]
        if self.lazy is not None:
            out.append(self.lazy)
        return out


class SuffixCache:
    """Outputs of earlier requests, shared by every request that drafts from it (SuffixDecoding's
    global tree): pass one object to many ``generate`` calls (``suffix_cache=``), or let the vLLM
    plugin keep one per engine.

    Bounded: at most ``max_requests`` outputs and ``max_tokens`` tokens in all; the oldest are
    evicted first. Bound to one vocabulary on first use: a target whose vocabulary size differs is
    refused (its token ids would mean other tokens).
    """

    def __init__(self, max_requests: int = 1024, max_tokens: int = 1 << 18, max_depth: int = 32):
        for name, value in (("max_requests", max_requests), ("max_tokens", max_tokens),
                            ("max_depth", max_depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SuffixCache {name} must be an int >= 1, got {value!r}")
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.trie = SuffixTrie(max_depth)
        self.vocab_size: int | None = None
        self._order: deque[int] = deque()  # sequence ids, oldest first
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def bind(self, vocab_size: int | None) -> None:
        """Tie the cache to a vocabulary size (the first target's); another is a ValueError."""
        if vocab_size is None:
            return
        if self.vocab_size is None:
            self.vocab_size = int(vocab_size)
        elif self.vocab_size != int(vocab_size):
            raise ValueError(f"this SuffixCache holds outputs of a model with a vocabulary of "
                             f"{self.vocab_size} tokens; the target has {vocab_size}: use one "
                             "cache per tokenizer")

    def add(self, tokens) -> None:
        """Insert one finished output (a list of token ids), evicting the oldest as needed."""
        tokens = [int(t) for t in tokens][-self.max_tokens:]
        if not tokens:
            return
        while self._order and (len(self._order) >= self.max_requests
                               or self._tokens + len(tokens) > self.max_tokens):
            sid = self._order.popleft()
            self._tokens -= len(self.trie.seqs[sid])
            self.trie.remove_sequence(sid)
        self._order.append(self.trie.add_sequence(tokens))
        self._tokens += len(tokens)

    def clear(self) -> None:
        while self._order:
            self.trie.remove_sequence(self._order.popleft())
        self._tokens = 0
