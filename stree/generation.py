"""``stree.generate`` (this module, ``stree.generation``): STree's Algorithm 1 as small steps.

    prefill target and draft on the prompts; first token from the target's prefill logits
    repeat:  draft a tree rooted at the last emitted token (seen by neither model yet)  [draft]
             target.tree_forward(tree) -> logits (b, n, v); verifier -> Verdict          [verify]
             emit accepted tokens + next token (EOS and max_new_tokens truncate)
             target cache.commit(path): activation replay                               [replay]
             draft cache.commit(path) over what the draft ran; the rest (suffix-tree
             nodes, steps without the draft) prefilled before the draft next drafts      [draft]
             root <- next token

Drafts come from the draft model, from suffix tries of the text (no draft model), or both
merged (``stree.draft``): with no draft model the draft side does nothing but read the text.

The methods share that loop and its statistics and differ only in the drafter and the target side:

* ``"tree"``: any drafter (default the Fig. 4a static tree), verified in one packed tree_forward.
* ``"chain"``: a :class:`ChainDrafter` (default 4 tokens, 1 x 5 input; speculative sampling at
  T > 0): vanilla speculative decoding with activation replay.
* ``"ar"``: the model's own autoregressive decoding (:mod:`stree.native`), the honest baseline;
  no draft model, same statistics (one target call per token).
* ``"ar-tree"``: stree's 1-node tree path (a root-only tree through ``tree_forward`` + ``commit``,
  as every step whose drafter proposes nothing) and no draft model: what the loop costs without
  drafting, not a baseline.
* ``"unrolled"``: the drafted tree's root-to-leaf paths as separate batch rows of chains (FSS on
  unrolled sequences); same drafts and verdicts as ``"tree"``, for correctness comparisons.
"""
from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from stree import capture, native
from stree.cache import SEQLEN_CHUNK
from stree.draft import ChainDrafter, Drafter, StaticTreeDrafter, parse_drafter
from stree.draft.base import MAX_LEAD, commit_draft, lead_tensor
from stree.draft.suffix_index import SuffixCache
from stree.inputs import stop_ids, token_id, token_ids, vocab_size
from stree.limits import cap_new_tokens, context_limit
from stree.prefix_cache import PrefixCache
from stree.sampling import SamplingConfig, sample
from stree.session import Session, Turn, suffix_cache_for
from stree.stats import GenerationStats, timed
from stree.tree import TokenTree
from stree.verify import default_verifier, get_verifier

METHODS = ("tree", "chain", "ar", "ar-tree", "unrolled")
COMPILED_METHODS = ("tree", "chain", "ar-tree", "ar")
# Compiled, the target's trees of a drafter whose sizes vary (suffix, merged) run padded to a
# multiple of this many nodes: one graph per padded size (a merged tree of up to 24 nodes: 3)
PAD_NODES = 8


def default_drafter(method: str, device: torch.device | str | None = None) -> str:
    """The drafter spec a method runs when none is given. For "tree", the one the device's
    costs favour (STree's Eq. 7/8, time per token = t(N) / tau): on a GPU a verify costs about the
    same for 1 or 13 nodes, so Fig. 4a's 13-node tree; elsewhere every node the draft runs costs
    a draft step, so a caterpillar whose draft runs one node per level, 3 deep: within 2% of the
    fastest fixed choice on the shipped pair over 80 prompts at T = 0 (docs/benchmarks.md)."""
    if method == "chain":
        return "chain:4"
    if method == "tree" and torch.device(device or "cpu").type != "cuda":
        return "caterpillar:2,2,2"
    return "static:fig4a"


@dataclass
class GenerationOutput:
    """sequences: ``(b, max_len)`` int64 prompt + new tokens per row, right-padded with the pad id
    (like mamba_ssm's ``generate`` when all rows have the same length); lengths: valid length of
    each row; stats: :class:`GenerationStats`."""

    sequences: Tensor
    lengths: list[int]
    stats: GenerationStats


def generate(target, draft, input_ids, max_new_tokens: int = 128, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
             drafter: str | Drafter | None = None, verifier=None, method: str = "tree",
             generator: torch.Generator | None = None, streamer=None, pad_token_id: int | None = None,
             max_seqlen: int | None = None, compile: bool = False,
             suffix_cache: SuffixCache | None = None, session: Session | None = None,
             prefix_cache: PrefixCache | None = None) -> GenerationOutput:
    """Generate with speculative tree decoding (or a baseline) from patched target/draft models.

    Args:
        target, draft: patched models (``stree.patch``) with the same vocabulary; ``draft`` may be
            None for ``method="ar"`` / ``"ar-tree"`` and for drafters that need no draft model
            (``"suffix:16"``; ``"auto"`` then picks among those).
        input_ids: ``(b, l)`` / ``(l,)`` integer tensor, a list of ints, or a list of 1-D prompts
            of different lengths.
        max_new_tokens: exact cap on new tokens per row (an accepted path is truncated). Nothing
            is allocated for it up front (caches grow with the real length), so a large value
            means "until EOS"; past a model's context limit it is capped, with a
            :class:`stree.limits.ContextLimitWarning` (see :mod:`stree.limits`).
        temperature, top_k, top_p: target sampling (``temperature == 0``: greedy).
        eos_token_id: a row stops after emitting it (or any of a list); ids in the vocabulary.
        drafter: a spec string (``"static:fig4a"``, ``"static:A"``..``"static:E"``, ``"beam:4x3"``,
            ``"chain:4"``, ``"suffix:16"``, ``"caterpillar:2,2,2+suffix:16"``, see
            ``stree.draft.presets``) or a Drafter; default per method and device
            (:func:`default_drafter`).
        verifier: "greedy" | "mss" | "naive" | "sps" | "asps" | "mss+asps" | a verifier object;
            None picks the lossless default for the sampling config and draft mode (``mss+asps``
            for ``drafter="auto"`` at T > 0: ASpS on its chains, MSS on its trees).
        method: "tree" | "chain" | "ar" | "ar-tree" | "unrolled" (see the module docstring).
        generator: torch.Generator for all sampling (drafts and verification).
        streamer: object with ``put(tokens)`` / ``end()`` (mamba_ssm / Hugging Face style): gets the
            prompt, then the tokens of every step as they are accepted. Batch size 1 only.
        pad_token_id: pads ragged rows (default ``eos_token_id``, else 0); an id in the vocabulary.
        max_seqlen: the most tokens a cache row may hold (prompt + new tokens + one tree of
            scratch; a longer request is refused); default: the request, rounded up to a
            multiple of 512 (so that compiled steps share shapes across calls), at most the
            models' context limit. Attention K/V grow on demand up to it.
        compile: run the target's verify step and the draft levels compiled
            (``torch.compile(fullgraph=True)`` with frozen weights, see :mod:`stree.capture`;
            attention then reads the cache's whole K/V capacity under its mask): one graph per
            model, template shape and capacity (capacities double from 512, so a run sees a
            few), compiled before the first step and kept on the model. Static, suffix and merged
            drafters (trees of varying size run padded to a multiple of ``PAD_NODES`` nodes;
            ``"auto"`` over static ones) and methods "tree", "chain", "ar-tree"; with "ar", the model's own decoding step
            compiled on a static cache (``stree.hybrid`` models; :mod:`stree.native`). Where
            torch.compile is unavailable: a RuntimeWarning and eager steps.
        suffix_cache: a :class:`stree.SuffixCache` of earlier outputs, shared by the calls it is
            passed to: suffix-tree drafters (``"suffix:N"``, merged trees, ``"auto"``) also draft
            from it, and each row's output is added to it at the end. Tied to the first
            target's vocabulary size.
        session: a :class:`stree.Session`: ``input_ids`` are then this turn's new tokens (one
            prompt), appended to its conversation; the call prefills only what the target has not
            seen (the turn, and the end of the previous reply), decodes, and leaves the committed
            state in the session for the next turn. ``sequences`` holds the turn and its reply;
            ``session.tokens`` the whole conversation. Its ``suffix_cache`` serves suffix trees.
        prefix_cache: a :class:`stree.PrefixCache` shared by calls: each row starts from the
            longest cached prefix of its prompt (target and draft each) and prefills the rest;
            snapshots of the committed state where the call ends and where a prompt branches off
            a cached path. With ``session``, its first turn restores from it. Both need method
            "tree", "chain" or "ar-tree"; see ``docs/conversations.md``.
    Raises:
        TypeError: a target (or draft) that ``stree.patch`` has not patched, non-integer
            ``input_ids``, ``eos_token_id``, ``pad_token_id`` or ``top_k``, a ``generator`` that is
            no ``torch.Generator``, a ``streamer`` without ``put`` / ``end``.
        ValueError: unknown method or preset, a non-lossless drafter/verifier pair, a vocabulary
            or device mismatch between target and draft (their dtypes may differ), a
            ``suffix_cache`` of another vocabulary, an empty
            prompt, token ids outside the vocabulary, a sequence that would not fit an explicit
            ``max_seqlen``, or a prompt that leaves no room within a model's context limit;
            a session or prefix cache of other models (nothing changes), a session with a batch.
    """
    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    if method != "ar":  # the model's own decoding needs no tree API
        _check_patched(target, "target")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if streamer is not None and not all(callable(getattr(streamer, m, None)) for m in ("put", "end")):
        raise TypeError(f"streamer must have put(tokens) and end() methods, got {type(streamer).__name__}")
    device = _device(target)
    suffix_cache = suffix_cache_for(session, suffix_cache, drafter)
    drafter, verifier = resolve(method, drafter, verifier, sampling, compile, device,
                                suffix_cache=suffix_cache, draft_model=draft is not None)
    if drafter.uses_draft_model:
        _check_draft(target, draft, device)
    drafter.prepare(target, draft if drafter.uses_draft_model else None, sampling)
    # every check of the request before anything runs or is allocated
    vocab = vocab_size(target)
    prompts = _as_prompts(input_ids, device, vocab)
    shown, turn = prompts, None
    if session is not None or prefix_cache is not None:  # caches that outlive the call (stree.session)
        turn = Turn(method, target, draft if drafter.uses_draft_model else None, prompts, session=session,
                    prefix_cache=prefix_cache, max_seqlen=max_seqlen)
        prompts, max_seqlen = turn.prompts, turn.max_seqlen
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)  # numpy integers too
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    eos = stop_ids(eos_token_id, vocab)
    if pad_token_id is not None:
        token_id(pad_token_id, vocab, "pad_token_id")
    if streamer is not None and len(prompts) != 1:
        raise ValueError(f"a streamer needs batch size 1, got {len(prompts)} prompts")
    limits = {"target": context_limit(target),
              "draft": context_limit(draft) if drafter.uses_draft_model else None}
    longest = max(len(p) for p in prompts)
    _check_max_seqlen(longest, max_new_tokens, drafter.num_nodes, max_seqlen)
    max_new_tokens = cap_new_tokens(longest, max_new_tokens, drafter.num_nodes, limits)
    seqlen = _seqlen(longest, max_new_tokens, drafter.num_nodes, max_seqlen,
                     min((n for n in limits.values() if n is not None), default=None))

    stats = GenerationStats(method, drafter=getattr(drafter, "name", type(drafter).__name__),
                            verifier=getattr(verifier, "name", type(verifier).__name__),
                            batch_size=len(prompts))
    if method == "ar":  # the model's own decoding: no tree, drafter or verifier
        stats.drafter = stats.verifier = ""
        new = native.generate(target, prompts, max_new_tokens, sampling, eos, generator, streamer,
                              stats, device, compile)
        return _finish(prompts, new, stats, start, eos, pad_token_id)
    b = len(prompts)
    caches = (None, None)
    if turn is not None:  # restored or held prefixes, counted as prefill
        with timed(stats, "prefill_s", device):
            caches = turn.start(seqlen)
    side = (_UnrolledTarget(target, b, drafter.max_leaves, seqlen) if method == "unrolled"
            else _PackedTarget(target, b, seqlen, caches[0],
                               PAD_NODES if compile and not drafter.layered else 1, drafter.num_nodes))
    drafting = _DraftSide(draft if drafter.uses_draft_model else None, drafter, b, seqlen, stats, compile,
                          caches[1])
    with torch.inference_mode(), (capture.compiled(target, drafting.model) if compile
                                   else contextlib.nullcontext()):
        new = _loop(side, drafting, verifier, sampling, prompts, max_new_tokens, eos, generator,
                    streamer, stats, device, keep=turn is not None, shown=shown)
    if turn is not None:
        turn.end(new, max_new_tokens)
    return _finish(shown, new, stats, start, eos, pad_token_id)


def _finish(prompts, new, stats, start: float, eos: set[int], pad_token_id) -> GenerationOutput:
    stats.new_tokens = sum(len(t) for t in new)
    stats.total_s = time.perf_counter() - start
    pad = pad_token_id if pad_token_id is not None else (min(eos) if eos else 0)
    return _pack(prompts, new, pad, stats)


def resolve(method: str, drafter, verifier, sampling: SamplingConfig, compile: bool = False,
            device=None, *, suffix_cache: SuffixCache | None = None, draft_model: bool = True):
    """The (drafter with its draft mode fixed, verifier) pair ``generate`` will run on ``device``
    (which picks the default drafter, :func:`default_drafter`). ``suffix_cache`` goes to the
    suffix trees of a spec string; without a ``draft_model``, ``"auto"`` picks among drafters
    that need none.

    With no verifier, the drafter's preferred mode and its default lossless verifier. With a
    verifier, top-k children where it is lossless with them (greedy sampling, naive), else the
    first sampled mode it accepts. Raises ValueError for a pair that would not be lossless, and
    with ``compile`` for a method or drafter whose draft shapes vary (``Drafter.compilable``).
    """
    if method in ("ar", "ar-tree"):
        if drafter is not None or verifier is not None:
            raise ValueError(f"method {method!r} drafts and verifies nothing: leave drafter and verifier None")
        drafter = StaticTreeDrafter((-1,), mode="deterministic", name="none")
    else:
        if suffix_cache is not None and not isinstance(drafter, (str, type(None))):
            raise ValueError("suffix_cache goes with a drafter spec string; a Drafter object "
                             "carries its own (stree.draft.ContextIndex(cache))")
        drafter = parse_drafter(drafter if drafter is not None else default_drafter(method, device),
                                device, suffix_cache=suffix_cache, draft_model=draft_model)
    if method == "chain" and not isinstance(drafter, ChainDrafter):
        raise ValueError(f"method 'chain' needs a chain drafter ('chain:K'), got {drafter.name!r}")
    modes = drafter.modes(sampling)
    if verifier is None:
        mode = modes[0]
        verifier = default_verifier(sampling, mode)
        if verifier.name == "mss" and drafter.mixes_chains:  # ASpS for its chains
            verifier = get_verifier("mss+asps")
    else:
        verifier = get_verifier(verifier)
        ranked = sorted(modes, key=lambda m: m != "deterministic")
        mode = next((m for m in ranked if _accepts(verifier, m, sampling)), modes[0])
    verifier.check(mode, sampling)  # raises ValueError for a non-lossless pair
    name = getattr(verifier, "name", None)
    if name in ("sps", "asps") and drafter.num_nodes != drafter.depth + 1:
        raise ValueError(f"the {name!r} verifier needs a chain drafter, got {drafter.name!r}; "
                         "use 'mss' or 'naive' for trees")
    if compile and (method not in COMPILED_METHODS or not drafter.compilable):
        raise ValueError(f"compile=True needs fixed draft shapes: methods {COMPILED_METHODS} with a "
                         f"static, suffix or merged drafter (or auto over static ones), got method {method!r}, "
                         f"drafter {drafter.name!r}")
    return drafter.with_mode(mode), verifier


# ------------------------------------------------------------------------------------ the loop
def _loop(side, drafting, verifier, sampling, prompts, max_new_tokens, eos, generator, streamer,
          stats, device, *, keep: bool = False, shown=None) -> list[list[int]]:
    """Run Algorithm 1 until every row is done; returns each row's new tokens. ``keep``: the
    caller keeps the target's cache (a conversation), so the last step's emitted path is
    committed too; ``shown``: the prompts the streamer gets (default ``prompts``)."""
    b = len(prompts)
    new: list[list[int]] = [[] for _ in range(b)]
    if streamer is not None:
        streamer.put((prompts if shown is None else shown)[0][None].cpu())
    done = [max_new_tokens == 0] * b
    if not all(done):
        with timed(stats, "prefill_s", device):
            roots = sample(side.prefill(prompts), sampling, generator)
        # the first token needs the target's prefill alone: it reaches the streamer before the
        # draft's prefill (and the suffix index) run
        for r, tok in enumerate(roots.tolist()):
            done[r] = _emit(new[r], [tok], max_new_tokens, eos, streamer)
        with timed(stats, "prefill_s", device):
            drafting.prefill(prompts)
    while not all(done):
        with timed(stats, "draft_s", device):
            d = drafting.draft(roots, sampling, generator)
        with timed(stats, "verify_s", device):
            logits = side.logits(d.tree)
            verdict = verifier.verify(d, logits, sampling, generator)
        stats.target_calls += 1
        # the step's one device read: accepted tokens, the next token and the path of every row
        k = verdict.path.shape[1]
        read = torch.cat([d.tree.path_tokens(verdict.path)[:, 1:], verdict.next_token[:, None],
                          verdict.path], dim=1).tolist()
        accepted, next_tokens = [r[:k - 1] for r in read], [r[k - 1] for r in read]
        nodes = [r[k:] for r in read]
        # path nodes per row, from the tokens already on the host (no further device sync)
        counts = [0 if done[r] else 1 + sum(t >= 0 for t in toks) for r, toks in enumerate(accepted)]
        emitted = [0] * b
        for r, (toks, nxt) in enumerate(zip(accepted, next_tokens)):
            if done[r]:
                continue
            before = len(new[r])
            done[r] = _emit(new[r], [t for t in toks if t >= 0] + [nxt], max_new_tokens, eos, streamer)
            emitted[r] = len(new[r]) - before
            stats.record_step(emitted[r])
        if all(done):
            if keep:  # commit the root and the accepted nodes this step emitted (not the next token)
                kept = [min(c, 1 + e) for c, e in zip(counts, emitted)]
                cols = torch.arange(verdict.path.shape[1], device=verdict.path.device)
                last = verdict.path.masked_fill(cols >= torch.tensor(kept, device=cols.device)[:, None], -1)
                with timed(stats, "replay_s", device):
                    side.commit(d.tree, last, kept)
            break
        # Finished rows stop advancing (their later trees are padding).
        path = verdict.path
        if any(done):
            path = path.masked_fill(torch.tensor(done, device=path.device)[:, None], -1)
            counts = [0 if done[r] else c for r, c in enumerate(counts)]
        with timed(stats, "replay_s", device):
            side.commit(d.tree, path, counts)
        with timed(stats, "draft_s", device):
            drafting.commit(d.tree, path, counts, nodes)
        roots = verdict.next_token
    drafting.finish(new)
    if streamer is not None:
        streamer.end()
    return new


def _emit(row: list[int], tokens: list[int], max_new_tokens: int, eos: set[int], streamer) -> bool:
    """Append ``tokens`` to ``row`` up to ``max_new_tokens`` and the first EOS; True if done."""
    tokens = tokens[:max_new_tokens - len(row)]
    stop = next((i for i, t in enumerate(tokens) if t in eos), None)
    if stop is not None:
        tokens = tokens[:stop + 1]
    row.extend(tokens)
    if streamer is not None and tokens:
        streamer.put(torch.tensor(tokens, dtype=torch.long))
    return stop is not None or len(row) >= max_new_tokens


# ------------------------------------------------------------------------------- draft side
class _DraftSide:
    """The drafter, and the draft model with its cache, kept in step with the target's committed
    sequence: the draft cache holds every committed token before the root, except a backlog of
    tokens the draft never ran (accepted suffix-tree nodes, steps drafted without the model, and
    where the drafter takes a lead the accepted nodes of its never-run deepest level), which the
    next draft runs as its lead (in its roots' pass) or, where it takes none or the backlog is
    longer than ``MAX_LEAD``, which is prefilled in one call when the model next drafts.

    Compiled (``compile``), a draft that takes a lead has a graph per lead width beside the one
    without (a lead of one token, the accepted node of a never-run deepest level; with suffix
    nodes merged in, every width ``lead_tensor`` makes); all are compiled at the first draft, so
    that no step whose draft is behind stops to compile mid-generation."""

    def __init__(self, model, drafter: Drafter, batch_size: int, max_seqlen: int,
                 stats: GenerationStats, compile: bool = False, cache=None):
        self.model, self.drafter, self.stats = model, drafter, stats
        if model is None:
            cache = None
        elif cache is None:
            cache = model.allocate_tree_cache(batch_size, max_seqlen)
        self.cache = cache  # given: rows holding a prefix of their prompts (stree.session)
        self.backlog: list[list[int]] = [[] for _ in range(batch_size)]
        self.takes_lead = False  # whether drafts take a lead (set by draft: it depends on the sampling)
        self.unwarmed = compile  # the lead's graph is still to be compiled (see above)

    def prefill(self, prompts: list[Tensor]) -> None:
        if self.model is not None:  # the draft's state only: its logits are not read
            _prefill(self.model, self.cache, prompts, logits=False)
        if self.drafter.reads_context:
            self.drafter.start([p.tolist() for p in prompts])

    def draft(self, roots: Tensor, sampling: SamplingConfig, generator):
        self.takes_lead = self.model is not None and self.drafter.takes_lead(self.model, sampling)
        if self.unwarmed and self.takes_lead:
            self._warm_lead(roots, sampling)
        lead = None
        if self.model is not None and any(self.backlog) and self.drafter.wants_draft_model(roots):
            if self.takes_lead and max(map(len, self.backlog)) <= MAX_LEAD:  # committed with the next commit
                lead, self.backlog = lead_tensor(self.backlog), [[] for _ in self.backlog]
            else:
                self._catch_up()
        args = (self.model, self.cache, roots, sampling, generator)
        d = self.drafter.draft(*args) if lead is None else self.drafter.draft(*args, lead=lead)
        self.stats.draft_calls += self.drafter.draft_runs  # a dynamic drafter's: per draft
        return d

    def commit(self, tree: TokenTree, path: Tensor, counts: list[int], nodes: list[list[int]]) -> None:
        """Advance the draft along the target's accepted ``path`` (b, k), -1 padded, of
        ``counts[r]`` nodes per row, ``nodes`` its host copy (no device sync)."""
        self.drafter.observe(tree, path)
        if self.model is None:
            return
        ran = self.drafter.ran
        # the draft model runs the whole path, unless it did not run this step (``auto`` off)
        if not (self.drafter.reads_context or self.takes_lead or self.drafter.num_forwarded == 0):
            last_nodes = [row[c - 1] if c else -1 for row, c in zip(nodes, counts)]
            if commit_draft(self.model, self.cache, tree, path, counts, last_nodes, ran):
                return
            # A tree_forward-only draft model whose path reaches the never-run deepest layer:
            # run the path as a chain.
            chain = TokenTree.chain(tree.path_tokens(path).clamp(min=0))  # padding: never committed
            self.model.tree_forward(chain, self.cache)
            self.stats.draft_calls += 1
            steps = torch.arange(path.shape[1], device=path.device).expand_as(path)
            self.cache.commit(torch.where(path >= 0, steps, -1), counts)
            return
        # Suffix and merged trees, drafts that take a lead, steps without a draft: commit the
        # part of each row's path the draft ran, keep the rest for the next lead or catch-up.
        runs = [next((j for j, u in enumerate(row[:c]) if not ran(u)), c) for row, c in zip(nodes, counts)]
        if any(runs):
            cols = torch.arange(path.shape[1], device=path.device)
            inside = cols[None, :] < torch.tensor(runs, device=path.device)[:, None]
            commit_draft(self.model, self.cache, tree, path.masked_fill(~inside, -1), runs,
                         [row[j - 1] if j else -1 for row, j in zip(nodes, runs)], ran)
        if any(j < c for j, c in zip(runs, counts)):
            tokens = tree.path_tokens(path).tolist()
            for r, (j, c) in enumerate(zip(runs, counts)):
                self.backlog[r].extend(tokens[r][j:c])

    def _warm_lead(self, roots: Tensor, sampling: SamplingConfig) -> None:
        """Compile the draft's graphs with a lead (see the class docstring) on a scratch cache
        of the same shapes (a draft leaves its committed state as it was, so one serves every
        width); a generator of its own leaves the request's random stream as it was."""
        self.unwarmed = False
        b, device = roots.shape[0], roots.device
        scratch = self.model.allocate_tree_cache(b, self.cache.max_seqlen)
        self.model.prefill(torch.zeros(b, 2, dtype=torch.long, device=device), scratch, logits=False)
        generator = None if sampling.is_greedy else torch.Generator(device).manual_seed(0)
        widths = [1 << i for i in range(MAX_LEAD.bit_length())] if self.drafter.reads_context else [1]
        for width in widths:
            self.drafter.draft(self.model, scratch, roots, sampling, generator,
                               lead=torch.zeros(b, width, dtype=torch.long, device=device))

    def _catch_up(self) -> None:
        """Prefill every row's backlog (the tokens committed since the draft last ran)."""
        rows = self.backlog
        device = self.cache.lengths.device
        if len({len(r) for r in rows}) == 1 and len(set(self.cache.seqlens)) == 1:  # one (b, l) prefill
            self.model.prefill(torch.tensor(rows, device=device), self.cache, logits=False)
        else:
            self.cache.reserve([len(r) for r in rows])  # grow once, before the row views
            for b, r in enumerate(rows):
                if r:
                    row = self.cache.row(b)
                    self.model.prefill(torch.tensor([r], device=device), row, logits=False)
                    self.cache.seqlens[b] = row.seqlens[0]
        self.stats.draft_calls += 1
        self.backlog = [[] for _ in rows]

    def finish(self, outputs: list[list[int]]) -> None:
        if self.drafter.reads_context:
            self.drafter.finish(outputs)


# ------------------------------------------------------------------------------ target sides
class _PackedTarget:
    """STree: the whole tree in one ``tree_forward``; commit replays the accepted path.

    With ``pad_nodes`` (compiled steps, trees of varying size up to ``max_nodes``) every tree runs
    padded to a multiple of it, and each padded size's graph is compiled before the first tree,
    so that no step stops to compile mid-generation."""

    def __init__(self, model, batch_size: int, max_seqlen: int, cache=None, pad_nodes: int = 1,
                 max_nodes: int = 1):
        self.model = model  # a given cache's rows hold a prefix of their prompts (stree.session)
        self.cache = cache if cache is not None else model.allocate_tree_cache(batch_size, max_seqlen)
        self.pad_nodes, self.unwarmed = pad_nodes, pad_nodes > 1
        self.max_nodes = max_nodes

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        return _prefill(self.model, self.cache, prompts)

    def logits(self, tree: TokenTree) -> Tensor:
        if self.pad_nodes == 1:  # (models wrapped by callers may not know the argument)
            return self.model.tree_forward(tree, self.cache)
        if self.unwarmed:
            self._warm(tree)
        return self.model.tree_forward(tree, self.cache, pad_nodes=self.pad_nodes)

    def _warm(self, tree: TokenTree) -> None:
        """Run a root alone (a suffix tree without a match) and a star of every padded size once
        from the committed state (their scratch is overwritten by the next tree; nothing is
        committed)."""
        self.unwarmed = False
        # strides of a root-only tree's own tokens (compiled graphs guard on them)
        roots = tree.tokens[:, :1].clone(memory_format=torch.contiguous_format)
        sizes = range(self.pad_nodes, self.max_nodes + self.pad_nodes, self.pad_nodes)
        for n in dict.fromkeys([1] + [min(size, self.max_nodes) for size in sizes]):
            self.model.tree_forward(TokenTree(roots.expand(-1, n), [-1] + [0] * (n - 1)), self.cache,
                                    pad_nodes=self.pad_nodes)
        self.cache.pending = None

    def commit(self, tree: TokenTree, path: Tensor, counts: list[int]) -> None:
        # only the columns some row fills (a view): replay's work follows the accepted length,
        # not the tree's depth
        self.cache.commit(path[:, :max(max(counts), 1)], counts)


class _UnrolledTarget:
    """Baseline: each root-to-leaf path of the tree is its own batch row, run as a chain.

    Row ``r * U + j`` holds its own copy of row r's state (U = the drafter's ``max_leaves``; rows
    beyond a tree's leaf count repeat its first path). Instead of replaying along the accepted
    path, which most copies did not run, the accepted tokens become a prefix ("backlog") of every
    copy's next chain and are committed from that forward.
    """

    def __init__(self, model, batch_size: int, leaves: int, max_seqlen: int):
        self.model, self.leaves = model, leaves
        self.cache = model.allocate_tree_cache(batch_size * leaves, max_seqlen)
        self.backlog: list[list[int]] = [[] for _ in range(batch_size)]
        self.width = 0  # length of the last forward's chains

    def prefill(self, prompts: list[Tensor]) -> Tensor:
        last = _prefill(self.model, self.cache, [p for p in prompts for _ in range(self.leaves)])
        return last[::self.leaves]

    def logits(self, tree: TokenTree) -> Tensor:
        """(b, n, v): node i's logits from the first chain through it."""
        b, n = tree.tokens.shape
        U = self.leaves
        tokens, paths, depth = tree.tokens.tolist(), tree.paths.tolist(), tree.depth.tolist()
        chains = []
        src = [[None] * n for _ in range(b)]
        for r in range(b):
            inner = set(tree.parents[r, 1:].tolist())
            leaves = [i for i in range(n) if i not in inner]
            if len(leaves) > U:
                raise ValueError(f"tree has {len(leaves)} leaves, more than the {U} rows per prompt")
            leaves += leaves[:1] * (U - len(leaves))
            for j, leaf in enumerate(leaves):
                nodes = [i for i in paths[r][leaf] if i >= 0]
                chains.append(self.backlog[r] + [tokens[r][i] for i in nodes])
                for i in nodes:
                    src[r][i] = src[r][i] or (r * U + j, len(self.backlog[r]) + depth[r][i])
        self.width = max(len(c) for c in chains)
        padded = torch.tensor([c + [0] * (self.width - len(c)) for c in chains], device=tree.device)
        logits = self.model.tree_forward(TokenTree.chain(padded), self.cache)
        rows, pos = torch.tensor(src, device=logits.device).unbind(-1)
        return logits[rows, pos]

    def commit(self, tree: TokenTree, path: Tensor, counts: list[int]) -> None:
        """Commit each copy's backlog; the accepted path becomes the next backlog."""
        U = self.leaves
        cpath = torch.full((len(self.backlog) * U, self.width), -1, dtype=torch.long)
        for r, toks in enumerate(tree.path_tokens(path).tolist()):
            if toks[0] < 0:  # finished row
                continue
            k = len(self.backlog[r])
            cpath[r * U:(r + 1) * U, :k] = torch.arange(k)
            self.backlog[r] = [t for t in toks if t >= 0]
        if (cpath >= 0).any():
            self.cache.commit(cpath.to(path.device))


# ---------------------------------------------------------------------------------- helpers
def _prefill(model, cache, prompts: list[Tensor], logits: bool = True) -> Tensor | None:
    """Prefill and commit every prompt past what its cache row holds (``cache.seqlens``: a
    prefix of it, none in a new cache); returns the last position's logits ``(b, v)`` (None with
    ``logits=False``: the head is not run)."""
    held = cache.seqlens
    if any(held):
        prompts = [p[n:] for p, n in zip(prompts, held)]
    lengths = [len(p) for p in prompts]
    ragged = len(set(lengths)) > 1 or len(set(held)) > 1  # then rows are prefilled separately
    out = model.prefill(list(prompts) if ragged else torch.stack(prompts), cache, logits=logits)
    if out is None:
        return None
    return out[torch.arange(len(prompts)), torch.tensor(lengths) - 1]


def _pack(prompts, new, pad: int, stats) -> GenerationOutput:
    rows = [torch.cat([p.cpu(), torch.tensor(t, dtype=torch.long)]) for p, t in zip(prompts, new)]
    lengths = [len(r) for r in rows]
    seq = torch.full((len(rows), max(lengths)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        seq[i, :len(r)] = r
    return GenerationOutput(seq.to(prompts[0].device), lengths, stats)


def _accepts(verifier, mode: str, sampling: SamplingConfig) -> bool:
    try:
        verifier.check(mode, sampling)
    except ValueError:
        return False
    return True


def _check_draft(target, draft, device: torch.device) -> None:
    """The draft must exist, share the target's vocabulary and sit on its device. Its dtype may
    differ (a bf16 draft for an fp32 target): drafts are token ids, and the distributions they were
    drawn from reach the verifiers in fp32, so only acceptance depends on the draft's dtype."""
    if draft is None:
        raise ValueError("this method needs a draft model (only methods 'ar' and 'ar-tree' run without one)")
    _check_patched(draft, "draft")
    vt, vd = vocab_size(target), vocab_size(draft)
    if vt is not None and vd is not None and vt != vd:
        raise ValueError(f"vocabulary mismatch: target logits have {vt} entries, draft {vd}; "
                         "speculative decoding needs the same tokenizer and vocabulary size")
    where = _device(draft)
    if where != device:
        raise ValueError(f"device mismatch: the target is on {device}, the draft on {where}; "
                         "move both to one device")


def _check_patched(model, role: str) -> None:
    if not callable(getattr(model, "allocate_tree_cache", None)):  # the tree API stree.patch adds
        raise TypeError(f"the {role} ({type(model).__name__}) has no tree API: call stree.patch(model) on it "
                        "first")


def _device(model) -> torch.device:
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return param.device if param is not None else torch.device(getattr(model, "device", "cpu"))


def _as_prompts(input_ids, device, vocab: int | None) -> list[Tensor]:
    """Prompts as a list of 1-D int64 tensors on ``device``, checked: integer ids (TypeError
    otherwise), in ``[0, vocab)``, at least one per prompt."""
    if not isinstance(input_ids, (list, tuple)):  # a tensor or an array
        if not hasattr(input_ids, "__len__") or isinstance(input_ids, (str, bytes)):
            raise TypeError(f"input_ids must be an integer tensor, a list of ints or a list of "
                            f"prompts, got {type(input_ids).__name__}")
        ids = token_ids(input_ids, device)
        if ids.dim() not in (1, 2):
            raise ValueError(f"input_ids must be (l,) or (b, l), got {tuple(ids.shape)}")
        rows = [ids] if ids.dim() == 1 else list(ids)
    elif input_ids and not hasattr(input_ids[0], "__len__"):
        rows = [token_ids(input_ids, device)]  # one prompt as a flat list of ints
    else:
        rows = [token_ids(r, device) for r in input_ids]
        for i, r in enumerate(rows):
            if r.dim() != 1:
                raise ValueError(f"input_ids: prompt {i} of the list has shape {tuple(r.shape)}; each prompt "
                                 "of a list must be 1-D (pass a batch as one (b, l) tensor)")
    if not rows:
        raise ValueError("no prompts given")
    for i, p in enumerate(rows):
        if p.numel() == 0:
            raise ValueError(f"empty prompt (row {i}): generation needs at least one prompt token")
        low, high = p.aminmax()
        if int(low) < 0 or (vocab is not None and int(high) >= vocab):
            raise ValueError(f"input_ids row {i}: token ids must lie in [0, {vocab}), got "
                             f"{int(low) if int(low) < 0 else int(high)}")
    return rows


def _check_max_seqlen(prompt_len: int, max_new_tokens: int, scratch: int,
                      max_seqlen: int | None) -> None:
    """An explicit ``max_seqlen`` is the caller's bound: a longer request is refused."""
    need = prompt_len + max_new_tokens + scratch
    if max_seqlen is not None and need > max_seqlen:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} + tree "
                         f"size {scratch} = {need} exceeds max_seqlen {max_seqlen}")


def _seqlen(prompt_len: int, max_new_tokens: int, scratch: int, max_seqlen: int | None,
            limit: int | None) -> int:
    """The caches' ``max_seqlen``: committed tokens never exceed prompt + max_new_tokens - 2
    before a tree of ``scratch`` nodes is forwarded. Default: that, rounded up to a multiple
    of ``SEQLEN_CHUNK`` (compiled steps span the capacity, which is capped here: one size for
    most calls), at most the models' context ``limit``. Nothing is allocated for it up front."""
    if max_seqlen is not None:
        return max_seqlen
    need = -(-(prompt_len + max_new_tokens + scratch) // SEQLEN_CHUNK) * SEQLEN_CHUNK
    return need if limit is None else min(need, limit)
