"""Conversations in stree's loop: a :class:`Session` keeps one conversation's committed state
between ``stree.generate`` calls, and a :class:`stree.PrefixCache` shares states among requests.

    chat = stree.Session(prefix_cache=shared)                  # shared: optional
    out = stree.generate(target, draft, turn_ids, session=chat)  # turn_ids: this turn's new tokens

A turn prefills only what the target has not seen: the turn's tokens and the end of the previous
reply that the loop had not committed (its last emitted token). The draft catches up the same
way. Everything else runs the loop of :mod:`stree.generation` unchanged, so every drafter and
verifier works through it.

With a prefix cache, a request (a ``generate`` call, or a session's first turn) starts from the
longest cached prefix of its prompt, for target and draft each (at most all but the prompt's last
token: the first new token needs the last one's logits), and prefills the rest. Snapshots are
taken where a turn ends (the committed state after it) and where a request branches off a cached
path (the prefill stops there once: the next request that shares that much hits it), and after a
turn of ``max_new_tokens=0`` (its tokens committed: a system prompt, a tool result).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stree.draft.suffix_index import SuffixCache
from stree.limits import context_limit
from stree.prefix_cache import PrefixCache, prefill_row

STATEFUL_METHODS = ("tree", "chain", "ar-tree")
UNBOUNDED = 1 << 40  # a session's max_seqlen for models without a context limit (nothing is allocated for it)


@dataclass
class TurnStats:
    """What one turn of a :class:`Session` prefilled and reused.

    input_tokens: the turn's new tokens; context_tokens: the whole prompt it continued (the
    conversation so far and them); reused_tokens: prompt tokens the target did not prefill (held
    by the session, or restored); restored_tokens: of those, restored from the prefix cache;
    prefilled_tokens, draft_prefilled_tokens: tokens each model ran before decoding (the draft's
    0 when the turn ran no draft model); new_tokens: generated.
    """

    input_tokens: int
    context_tokens: int
    reused_tokens: int = 0
    restored_tokens: int = 0
    prefilled_tokens: int = 0
    draft_prefilled_tokens: int = 0
    new_tokens: int = 0


@dataclass(eq=False)
class Session:
    """One conversation: the committed state of its target (and draft) model between
    ``stree.generate(..., session=)`` calls, its tokens, and the caches its turns share.

    Bound on first use to the target (and the first draft model a turn runs): a turn with another
    model is refused (``ValueError``), the session unchanged. One conversation: batch size 1.

    Attributes:
        prefix_cache: a :class:`stree.PrefixCache` the session's first turn restores from and
            every turn leaves its end state in (shared with other sessions and requests); None:
            the session keeps only its own state.
        suffix_cache: a :class:`stree.SuffixCache` that suffix-tree drafters (``"suffix:16"``,
            merged trees, ``"auto"``) of every turn draft from and add each reply to; default: one
            of the session's own, carried from turn to turn.
        max_seqlen: the most tokens the conversation may reach (default: the models' context
            limit; none for attention-free models). A turn past it is refused.
        tokens: the conversation so far (every turn's tokens and every reply).
        turns: a :class:`TurnStats` per finished turn.
        target, draft, target_cache, draft_cache: the bound models and their caches.
    """

    prefix_cache: PrefixCache | None = None
    suffix_cache: SuffixCache | None = None
    max_seqlen: int | None = None
    tokens: list[int] = field(init=False, default_factory=list)
    turns: list[TurnStats] = field(init=False, default_factory=list)
    target: object = field(init=False, default=None, repr=False)
    draft: object = field(init=False, default=None, repr=False)
    target_cache: object = field(init=False, default=None, repr=False)
    draft_cache: object = field(init=False, default=None, repr=False)
    _dirty: bool = field(init=False, default=False, repr=False)  # a turn began and did not finish

    def __post_init__(self):
        if self.prefix_cache is not None and not isinstance(self.prefix_cache, PrefixCache):
            raise TypeError(f"prefix_cache must be a stree.PrefixCache, got {type(self.prefix_cache).__name__}")
        if self.suffix_cache is None:
            self.suffix_cache = SuffixCache()
        elif not isinstance(self.suffix_cache, SuffixCache):
            raise TypeError(f"suffix_cache must be a stree.SuffixCache, got {type(self.suffix_cache).__name__}")
        if self.max_seqlen is not None and (isinstance(self.max_seqlen, bool) or not isinstance(self.max_seqlen, int)
                                            or self.max_seqlen < 2):
            raise ValueError(f"max_seqlen must be an int >= 2, got {self.max_seqlen!r}")

    def __len__(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        """Forget the conversation (the models stay bound; the prefix cache keeps its snapshots)."""
        self.tokens, self.turns = [], []
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.reset()
        self._dirty = False


def suffix_cache_for(session: Session | None, suffix_cache: SuffixCache | None, drafter) -> SuffixCache | None:
    """The suffix cache a call drafts from: the one given, else the session's (for a drafter
    spec string; a Drafter object carries its own)."""
    if session is not None and not isinstance(session, Session):
        raise TypeError(f"session must be a stree.Session, got {type(session).__name__}")
    if suffix_cache is None and session is not None and isinstance(drafter, (str, type(None))):
        return session.suffix_cache
    return suffix_cache


class Turn:
    """One ``generate`` call that keeps state: checks everything on creation (nothing changes if
    it raises), :meth:`start` brings the caches to the prompt, :meth:`end` records what the call
    left behind.

    Attributes:
        prompts: the whole prompt of each row (a session's conversation, then the turn's tokens).
        max_seqlen: the bound ``generate`` checks the request against (None: the context limits).
    """

    def __init__(self, method: str, target, draft, prompts: list[torch.Tensor], *,
                 session: Session | None, prefix_cache: PrefixCache | None, max_seqlen: int | None):
        if method not in STATEFUL_METHODS:
            raise ValueError(f"method {method!r} keeps no state between calls: session= and prefix_cache= "
                             f"need one of {STATEFUL_METHODS}")
        if prefix_cache is not None and not isinstance(prefix_cache, PrefixCache):
            raise TypeError(f"prefix_cache must be a stree.PrefixCache, got {type(prefix_cache).__name__}")
        if session is not None:
            if prefix_cache is not None and session.prefix_cache is not None and prefix_cache is not session.prefix_cache:
                raise ValueError("this session has a prefix cache of its own: pass prefix_cache to the Session only")
            prefix_cache = prefix_cache or session.prefix_cache
            if len(prompts) != 1:
                raise ValueError(f"a session is one conversation (batch size 1), got {len(prompts)} prompts")
            if max_seqlen is not None:
                raise ValueError("a session's caches outlive the call: give max_seqlen to the Session")
            for role, model, bound in (("target", target, session.target), ("draft", draft, session.draft)):
                if model is not None and bound is not None and model is not bound:
                    raise ValueError(f"this session's conversation was run with another {role} model "
                                     f"({type(bound).__name__}); a session continues with the models it "
                                     "began with (start a new Session for other models)")
            prompts = [torch.cat([torch.tensor(session.tokens, dtype=torch.long, device=prompts[0].device),
                                  prompts[0]])]
            max_seqlen = session.max_seqlen
        if prefix_cache is not None:
            prefix_cache.check(target, "target")
            if draft is not None:
                prefix_cache.check(draft, "draft")
        self.target, self.draft, self.session, self.prefix_cache = target, draft, session, prefix_cache
        self.prompts, self.max_seqlen = prompts, max_seqlen
        self.input_tokens = [len(p) for p in prompts] if session is None else [len(prompts[0]) - len(session.tokens)]
        self.caches = (None, None)
        self.stats: list[TurnStats] = []

    def start(self, seqlen: int):
        """The target's and the draft's caches (the draft's None without a draft model), each
        row holding a prefix of its prompt: what the session holds, or the longest cached
        prefix; a snapshot made where the prompt branches off a cached path."""
        s, target, draft = self.session, self.target, self.draft
        if s is None:
            b = len(self.prompts)
            tc = target.allocate_tree_cache(b, seqlen)
            dc = draft.allocate_tree_cache(b, seqlen) if draft is not None else None
        else:
            if s.target is None:
                s.target, s.target_cache = target, target.allocate_tree_cache(1, _session_seqlen(s, target))
            if draft is not None and s.draft is None:
                s.draft, s.draft_cache = draft, draft.allocate_tree_cache(1, _session_seqlen(s, draft))
            if s._dirty:  # the last turn stopped midway (an error, an interrupt): its state is void
                for cache in (s.target_cache, s.draft_cache):
                    if cache is not None:
                        cache.reset()
            s._dirty = True
            tc, dc = s.target_cache, (s.draft_cache if draft is not None else None)
        for r, prompt in enumerate(self.prompts):
            tokens = prompt.tolist()
            stats = TurnStats(self.input_tokens[r], len(tokens))
            stats.reused_tokens, stats.restored_tokens = self._resume(target, "target", tc, r, tokens)
            stats.prefilled_tokens = len(tokens) - stats.reused_tokens
            if dc is not None:
                stats.draft_prefilled_tokens = len(tokens) - self._resume(draft, "draft", dc, r, tokens)[0]
            self.stats.append(stats)
        self.caches = (tc, dc)
        return tc, dc

    def _resume(self, model, role: str, cache, row: int, tokens: list[int]) -> tuple[int, int]:
        """Bring row ``row`` to the longest prefix of ``tokens`` it can have without a prefill
        (at most all but the last token); returns (tokens held, of which restored)."""
        if self.prefix_cache is None:
            return cache.seqlens[row], 0
        return self.prefix_cache.resume(model, cache, row, tokens, role=role, limit=len(tokens) - 1)

    def end(self, new: list[list[int]], max_new_tokens: int) -> None:
        """Record the call's end: with ``max_new_tokens=0`` (nothing decoded, nothing prefilled)
        the prompts are committed; snapshots of every row's committed state; the session's
        tokens and turn statistics."""
        tc, dc = self.caches
        rows = [p.tolist() + n for p, n in zip(self.prompts, new)]
        for model, role, cache in ((self.target, "target", tc), (self.draft, "draft", dc)):
            if cache is None:
                continue
            for r, tokens in enumerate(rows):
                if max_new_tokens == 0 and cache.seqlens[r] < len(tokens):
                    prefill_row(model, cache, r, tokens[cache.seqlens[r]:])
                if self.prefix_cache is not None:
                    self.prefix_cache.insert(model, cache, r, tokens, role=role)
        for stats, n in zip(self.stats, new):
            stats.new_tokens = len(n)
        if self.session is not None:
            self.session.tokens = rows[0]
            self.session.turns.append(self.stats[0])
            self.session._dirty = False


def _session_seqlen(session: Session, model) -> int:
    return session.max_seqlen or context_limit(model) or UNBOUNDED
