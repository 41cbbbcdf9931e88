"""End-to-end decoding benchmark: tau, acceptance histograms and tokens/s of each method over a prompt set.

Methods (``--methods``), all through ``stree.generate``, one request at a time (one prompt, or with
``--batch N`` N consecutive prompts, each cut to the shortest of them: the model's own decoding
batches only prompts of one length):

* ``ar``: the target's own autoregressive decoding at its best (``stree.native``: the hybrid's own
  prefill + ``step``; mamba_ssm's own forward with its ``InferenceParams``, replaying the CUDA graph
  of ``generate(cg=True)`` on a GPU), one token per target call: the baseline of every speed-up;
* ``ar-tree``: stree's 1-node tree path (a root-only tree, run as a one-node level + ``commit``), to
  show stree's own per-step overhead; not a baseline;
* ``chain:K``: vanilla speculative decoding with a K-token draft chain (speculative sampling at T > 0);
* ``tree:SPEC``: STree with drafter SPEC (``static:fig4a``, ``beam:4x3``, ``dyspec:16``,
  ``dynatree:6x2:16``, ``dynatree2``, ``suffix:16``, ``caterpillar:2,2,2+suffix:16``, ``auto``, ...
  see ``stree.draft.presets``);
* ``nodraft:SPEC``: the same with no draft model (``nodraft:auto`` picks among suffix trees);
* ``unrolled:SPEC``: the same drafts verified as separate root-to-leaf chains (a correctness baseline);
* any of these with ``@VERIFIER`` appended picks the verifier (``chain:4@asps``, ``tree:dyspec:16@naive``;
  default: the lossless default for the temperature).
* ``+compile`` appended (``tree:static:2,2,2,2+compile``) runs ``stree.generate(compile=True)``
  (tree, chain and ar-tree with a static drafter; ``ar+compile``: the model's own decoding step
  compiled on a static cache, ``stree.hybrid`` targets); ``--compile`` adds that row for every such
  method, so eager and compiled run side by side (compiling happens in the warm-up), and compiled
  rows get a speed-up over ``ar+compile`` as well.

Correctness first: at temperature 0 every method must emit exactly the same tokens for every prompt
(greedy decoding is lossless), else the script prints the first difference and exits 1 before writing
anything. Each (method, temperature) is warmed up once on the first prompt, then timed over all prompts,
prompt-major (every method on prompt i before prompt i + 1, so the machine's slow spells spread over
all methods); at T > 0 prompt i is sampled with a generator seeded ``seed + i`` for every method.

Prompt sets: ``humaneval``, ``mtbench``, a ``.jsonl`` file, or ``heldout-code``: the first
``--prompt-tokens`` tokens (default 1536) of the shipped recipe's held-out standard-library files
(``models/data.py``), a long-context code-completion workload where the context holds much of
what the model writes next. ``--repeat N`` runs the prompt list N times over (a workload of
repeated requests) and ``--suffix-cache`` gives each method one ``stree.SuffixCache`` for all its
prompts, so the repeats can draft from the first pass's outputs.

Per (method, temperature) it aggregates, over prompts: new tokens, target and draft calls, steps, tau
(tokens per step, counted the same way for every method by ``stree.stats.GenerationStats``), the merged
accepted-length histogram, tokens/s (all new tokens / all wall time, prefill included), the draft /
verify / replay time split and the speed-up over ``ar`` at the same temperature. It prints a markdown
table and writes, under ``--out``: ``e2e_*.csv/.json`` (one row per method x temperature, and per
prompt set when ``--prompts`` names several: ``e2e_humaneval+mtbench_*``),
``e2e_*_per_prompt.csv.gz`` (one row per request, method and temperature) and ``e2e_*.png`` (tau
and tokens/s bars, acceptance histograms; needs matplotlib; not committed, ``bench/replot.py``
redraws it from the JSON), every row tagged with device, commit and date.

    python bench/e2e.py --models models/stree-tiny --prompts humaneval --limit 20 --max-new-tokens 128 \\
        --temperatures 0 1 --methods ar chain:4 tree:static:fig4a tree:beam:4x3
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):  # run as a script from anywhere: stree and _common
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import RESULTS, metadata, result_stem, write_rows  # noqa: E402

from stree.generation import COMPILED_METHODS  # noqa: E402
from stree.stats import GenerationStats  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILED = "+compile"
DEFAULT_METHODS = ("ar", "chain:4", "tree:static:fig4a", "tree:beam:4x3")
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Method:
    """One benchmarked method: ``label`` as given on the command line, the ``stree.generate``
    method and its drafter spec."""

    label: str
    method: str
    drafter: str | None
    verifier: str | None = None
    compile: bool = False  # stree.generate(compile=True): a "+compile" suffix
    draft_model: bool = True  # False: "nodraft:SPEC"

    @classmethod
    def parse(cls, spec: str) -> "Method":
        if spec.endswith(COMPILED):
            m = cls.parse(spec[:-len(COMPILED)])
            if not m.compilable:
                raise ValueError(f"{spec!r}: compile applies to methods {COMPILED_METHODS} with a "
                                 "static, suffix or merged drafter (or auto over static ones)")
            return replace(m, label=spec, compile=True)
        body, _, verifier = spec.partition("@")
        kind, _, rest = body.partition(":")
        if kind in ("ar", "ar-tree") and not rest and not verifier:
            return cls(spec, kind, None)
        if kind == "chain" and rest:
            return cls(spec, "chain", body, verifier or None)
        if kind in ("tree", "unrolled") and rest:
            return cls(spec, kind, rest, verifier or None)
        if kind == "nodraft" and rest:
            return cls(spec, "tree", rest, verifier or None, draft_model=False)
        raise ValueError(f"unknown method {spec!r}: expected ar, ar-tree, chain:K, tree:SPEC, "
                         "nodraft:SPEC or unrolled:SPEC, the last four optionally with @VERIFIER")

    @property
    def compilable(self) -> bool:
        from stree.draft import parse_drafter

        return self.method in COMPILED_METHODS and (
            self.drafter is None or parse_drafter(self.drafter).compilable)


@dataclass
class BenchConfig:
    target: str
    draft: str
    prompts: list[str]
    limit: int | None
    max_new_tokens: int
    temperatures: list[float]
    methods: list[Method]
    device: str
    dtype: str
    draft_dtype: str
    seed: int
    out: Path
    no_prepack: bool = False
    prompt_tokens: int = 1536
    repeat: int = 1
    suffix_cache: bool = False
    batch: int = 1


# ---- setup -------------------------------------------------------------------------------

def parse_args(argv=None) -> BenchConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="directory holding target/ and draft/ (e.g. models/stree-tiny)")
    ap.add_argument("--target", help="target model directory (default: MODELS/target)")
    ap.add_argument("--draft", help="draft model directory (default: MODELS/draft)")
    ap.add_argument("--prompts", nargs="+", default=["humaneval"],
                    help="humaneval | mtbench | heldout-code | path to a .jsonl file; several sets run "
                         "one after another with the models loaded once, their rows in one result set")
    ap.add_argument("--prompt-tokens", type=int, default=1536,
                    help="heldout-code: tokens of each file's start (default 1536)")
    ap.add_argument("--repeat", type=int, default=1, help="run the prompt list this many times over")
    ap.add_argument("--suffix-cache", action="store_true",
                    help="one stree.SuffixCache per method, shared by all its prompts")
    ap.add_argument("--limit", type=int, default=20, help="first N prompts (default 20)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1,
                    help="prompts per request (default 1); it must divide the number of prompts")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                    help="ar | ar-tree | chain:K | tree:SPEC | unrolled:SPEC, the last three optionally "
                         "@VERIFIER (default: %(default)s)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--draft-dtype", choices=list(DTYPES), default=None,
                    help="the draft model's dtype (default: --dtype's); bf16 halves the bytes a draft "
                         "level streams, where the CPU multiplies bf16 natively")
    ap.add_argument("--dtype", choices=list(DTYPES), default=None,
                    help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--seed", type=int, default=0,
                    help="prompt i samples with seed + i at T > 0 (a batch with its first prompt's)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--compile", action="store_true",
                    help="also run every method stree can compile (ar, ar-tree, and tree or chain "
                         "with a static drafter) compiled, as a row 'METHOD+compile' (or name those "
                         "rows yourself)")
    ap.add_argument("--no-prepack", action="store_true",
                    help="CPU fp32: plain linear layers instead of prepacked weights for every row "
                         "(stree.prepack_linears; on by default, for the AR baseline as well)")
    a = ap.parse_args(argv)
    target = a.target or (a.models and os.path.join(a.models, "target"))
    draft = a.draft or (a.models and os.path.join(a.models, "draft"))
    if not target or not draft:
        ap.error("give --models DIR (with target/ and draft/) or both --target and --draft")
    try:
        methods = [Method.parse(m) for m in a.methods]
    except ValueError as err:
        ap.error(str(err))
    if a.compile:
        labels = {m.label for m in methods}
        methods += [Method.parse(m.label + COMPILED) for m in methods
                    if m.compilable and not m.compile and m.label + COMPILED not in labels]
    if a.batch < 1:
        ap.error(f"--batch must be >= 1, got {a.batch}")
    dtype = a.dtype or ("bf16" if torch.device(a.device).type == "cuda" else "fp32")
    return BenchConfig(target=target, draft=draft, prompts=a.prompts, limit=a.limit,
                       max_new_tokens=a.max_new_tokens, temperatures=a.temperatures, methods=methods,
                       device=a.device, dtype=dtype, draft_dtype=a.draft_dtype or dtype, seed=a.seed, out=a.out,
                       no_prepack=a.no_prepack, prompt_tokens=a.prompt_tokens, repeat=a.repeat,
                       suffix_cache=a.suffix_cache, batch=a.batch)


def encode_prompts(cfg: BenchConfig, prompt_set: str, tokenizer, device) -> list[torch.Tensor]:
    """Token ids of each prompt of ``prompt_set``, the target's BOS first when its config has one
    (the shipped models saw ``<|endoftext|>`` = BOS before every training file), as the CLI and
    demo do."""
    from stree.checkpoints import encode_prompt, model_config
    from stree.prompts import load_prompts

    bos = model_config(cfg.target).get("bos_token_id")
    if prompt_set == "heldout-code":
        ids = [encode_prompt(tokenizer, t, bos)[:cfg.prompt_tokens] for t in heldout_code(cfg.limit)]
    else:
        ids = [encode_prompt(tokenizer, t, bos) for t in load_prompts(prompt_set, limit=cfg.limit)]
    if not ids:
        raise SystemExit(f"prompt set {prompt_set!r} gave no prompts")
    return [torch.tensor(i, dtype=torch.long, device=device) for i in ids] * cfg.repeat


def heldout_code(limit: int | None) -> list[str]:
    """The texts of the shipped recipe's held-out files (its 5% split of this Python's standard
    library, ``models/data.py``), in path order, skipping files under 4 kB (too short to be a
    long-context prompt)."""
    from models import data

    root = data.stdlib_root()
    paths = [p for p in data.corpus_files(root)
             if data.is_heldout(p.relative_to(root).as_posix(), 5.0) and p.stat().st_size >= 4096]
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths[:limit]]


# ---- runs --------------------------------------------------------------------------------

def requests(prompts: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """``size`` consecutive prompts per request ``(size, l)``, each cut to the shortest of them."""
    if len(prompts) % size:
        raise SystemExit(f"--batch {size} does not divide the {len(prompts)} prompts")
    out = []
    for i in range(0, len(prompts), size):
        group = prompts[i:i + size]
        n = min(len(p) for p in group)
        out.append(torch.stack([p[:n] for p in group]))
    return out


def run_one(target, draft, ids, method: Method, temperature: float, eos, seed: int,
            max_new_tokens: int, suffix_cache=None):
    """One ``stree.generate`` call for one request ``ids (b, l)``; returns its GenerationOutput."""
    from stree.generation import generate

    generator = None
    if temperature > 0:
        generator = torch.Generator(device=ids.device).manual_seed(seed)
    return generate(target, draft if method.drafter and method.draft_model else None, ids,
                    max_new_tokens, temperature=temperature, eos_token_id=eos,
                    drafter=method.drafter, verifier=method.verifier, method=method.method,
                    generator=generator, compile=method.compile, suffix_cache=suffix_cache)


def first_mismatch(outputs: dict[str, list[list[int]]]) -> str | None:
    """None if every method's tokens equal the first method's for every prompt, else a message
    naming the first prompt, the two methods and the first position where they differ."""
    (ref_name, ref), *others = outputs.items()
    for name, toks in others:
        for i, (a, b) in enumerate(zip(ref, toks)):
            if a == b:
                continue
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"prompt {i}: {name!r} differs from {ref_name!r} at new token {pos} "
                    f"({_token_at(b, pos)} vs {_token_at(a, pos)}; lengths {len(b)} vs {len(a)})")
    return None


def _token_at(tokens: list[int], pos: int):
    return tokens[pos] if pos < len(tokens) else "end"


def benchmark(cfg: BenchConfig, target, draft, prompts, eos, meta):
    """Run every (temperature, method, prompt); returns (summary rows, per-prompt rows, T=0 error)."""
    summary, per_prompt = [], []
    if torch.device(cfg.device).type == "cpu":
        # stree's C++ ops build on the first multi-node tree (a minute, once per environment): a
        # method whose warm-up drafts none (``auto`` going off) would pay it in its timed run
        from stree.kernels import cpu_ops

        cpu_ops.ops()
    for temperature in cfg.temperatures:
        tokens: dict[str, list[list[int]]] = {}
        totals: dict[str, GenerationStats] = {}
        caches = {m.label: _suffix_cache(cfg, m) for m in cfg.methods}
        for method in cfg.methods:
            # warm up once: lazy initialisation, Triton or torch.compile compilation, allocator growth
            run_one(target, draft, prompts[0], method, temperature, eos, cfg.seed,
                    min(WARMUP_TOKENS, cfg.max_new_tokens))
            totals[method.label] = GenerationStats(method.label)
            tokens[method.label] = []
        # prompt-major: every method runs on a request before the next request, so a slow spell
        # of a shared machine spreads over all methods instead of landing on one
        for j, ids in enumerate(prompts):
            i = j * cfg.batch  # the request's first prompt
            for method in cfg.methods:
                out = run_one(target, draft, ids, method, temperature, eos, cfg.seed + i,
                              cfg.max_new_tokens, caches[method.label])
                l = ids.shape[1]
                tokens[method.label] += [out.sequences[r, l:out.lengths[r]].tolist() for r in range(len(ids))]
                totals[method.label].merge(out.stats)
                per_prompt.append(prompt_row(meta, method, temperature, i, l, out.stats))
        for method in cfg.methods:
            tot = totals[method.label]
            print(f"  T={temperature:g} {method.label:<22} tau {tot.tau:5.2f}  "
                  f"{tot.tokens_per_s:8.1f} tok/s", flush=True)
        error = first_mismatch(tokens) if temperature == 0 else None
        if error is not None:
            return summary, per_prompt, error
        summary += summary_rows(meta, cfg, temperature, totals)
    return summary, per_prompt, None


def _suffix_cache(cfg: BenchConfig, method: Method):
    """With ``--suffix-cache``, a new cache for a method that drafts suffix trees."""
    from stree import SuffixCache
    from stree.draft import parse_drafter

    if not cfg.suffix_cache or method.drafter is None or not parse_drafter(method.drafter).reads_context:
        return None
    return SuffixCache()


def prompt_row(meta, method: Method, temperature, index, prompt_tokens, stats) -> dict:
    return dict(meta, method=method.label, drafter=stats.drafter, verifier=stats.verifier,
                temperature=temperature, prompt_index=index, prompt_tokens=prompt_tokens,
                new_tokens=stats.new_tokens, steps=stats.steps, target_calls=stats.target_calls,
                draft_calls=stats.draft_calls, tau=stats.tau, tokens_per_s=stats.tokens_per_s,
                total_s=stats.total_s, prefill_s=stats.prefill_s, draft_s=stats.draft_s,
                verify_s=stats.verify_s, replay_s=stats.replay_s,
                accept_hist={str(k): v for k, v in sorted(stats.accept_hist.items())})


def summary_rows(meta, cfg: BenchConfig, temperature, totals: dict[str, GenerationStats]) -> list[dict]:
    ar, ar_compiled = totals.get("ar"), totals.get("ar" + COMPILED)
    rows = []
    for method in cfg.methods:
        t = totals[method.label]
        base = ar_compiled if method.compile else None
        rows.append(dict(
            meta, method=method.label, temperature=temperature, prompts=meta["n_prompts"],
            new_tokens=t.new_tokens, steps=t.steps, target_calls=t.target_calls,
            draft_calls=t.draft_calls, tau=t.tau, tokens_per_s=t.tokens_per_s,
            speedup_vs_ar=t.tokens_per_s / ar.tokens_per_s if ar else None,
            speedup_vs_compiled_ar=t.tokens_per_s / base.tokens_per_s if base else None,
            total_s=t.total_s, prefill_s=t.prefill_s, draft_s=t.draft_s, verify_s=t.verify_s,
            replay_s=t.replay_s, accept_hist={str(k): v for k, v in sorted(t.accept_hist.items())},
            t0_identical=True if temperature == 0 else None))
    return rows


# ---- report ------------------------------------------------------------------------------

def markdown_table(rows: list[dict]) -> str:
    """The summary rows as a markdown table (for the README)."""
    lines = ["| method | T | tau | tok/s | speed-up vs AR | vs compiled AR | target calls | "
             "new tokens | draft / verify / replay s | tokens per step: steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def ratio(x):
        return f"{x:.2f}x" if x is not None else "-"

    for r in rows:
        hist = " ".join(f"{k}:{v}" for k, v in r["accept_hist"].items())
        lines.append(f"| {r['method']} | {r['temperature']:g} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {ratio(r['speedup_vs_ar'])} | "
                     f"{ratio(r.get('speedup_vs_compiled_ar'))} | {r['target_calls']} | {r['new_tokens']} | "
                     f"{r['draft_s']:.2f} / {r['verify_s']:.2f} / {r['replay_s']:.2f} | {hist} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    """tau and tokens/s bars per method and the acceptance histograms, one row per temperature.
    Returns False (and says so) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written")
        return False
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(len(temps), 3, figsize=(15, 3.6 * len(temps)), squeeze=False)
    for ax_row, temp in zip(axes, temps):
        sel = [r for r in rows if r["temperature"] == temp]
        names = [r["method"] for r in sel]
        for ax, key, label in ((ax_row[0], "tau", "tau (tokens / step)"),
                               (ax_row[1], "tokens_per_s", "tokens / s")):
            ax.bar(names, [r[key] for r in sel], color="C0")
            ax.set_title(f"{label}, T = {temp:g}")
            ax.tick_params(axis="x", labelrotation=20)
        ax = ax_row[2]
        ks = sorted({int(k) for r in sel for k in r["accept_hist"]})
        width = 0.8 / max(len(sel), 1)
        for j, r in enumerate(sel):
            frac = [r["accept_hist"].get(str(k), 0) / max(r["steps"], 1) for k in ks]
            ax.bar([k + (j - (len(sel) - 1) / 2) * width for k in ks], frac, width, label=r["method"])
        ax.set_xticks(ks)
        ax.set_xlabel("tokens emitted per step")
        ax.set_ylabel("fraction of steps")
        ax.set_title(f"acceptance histogram, T = {temp:g}")
        ax.legend(fontsize="small")
    meta = rows[0]
    fig.suptitle(f"{meta['target_dir']}: {meta['prompt_set']} ({meta['n_prompts']} prompts, "
                 f"{meta['max_new_tokens']} new tokens) on {meta['device']}, {meta['commit']}, "
                 f"{meta['date']}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- main --------------------------------------------------------------------------------

def main(argv=None) -> int:
    cfg = parse_args(argv)
    from stree.checkpoints import default_eos, load_model, load_tokenizer

    device = torch.device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    tokenizer = load_tokenizer(cfg.target)
    prepack = not cfg.no_prepack
    target = load_model(cfg.target, device, dtype, prepack=prepack)
    needs_draft = any(m.drafter and m.draft_model for m in cfg.methods)
    draft = load_model(cfg.draft, device, DTYPES[cfg.draft_dtype], prepack=prepack) if needs_draft else None
    eos = default_eos(cfg.target, tokenizer)
    summary, per_prompt = [], []
    for prompt_set in cfg.prompts:
        prompts = requests(encode_prompts(cfg, prompt_set, tokenizer, device), cfg.batch)
        meta = dict(metadata(device), torch_threads=torch.get_num_threads(), dtype=cfg.dtype,
                    draft_dtype=cfg.draft_dtype,
                    target_dir=cfg.target, draft_dir=cfg.draft if needs_draft else None,
                    prompt_set=prompt_set, limit=cfg.limit, n_prompts=len(prompts) * cfg.batch,
                    batch=cfg.batch,
                    max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, eos_token_id=eos, prepack=prepack,
                    repeat=cfg.repeat, suffix_cache=cfg.suffix_cache,
                    prompt_tokens=cfg.prompt_tokens if prompt_set == "heldout-code" else None)
        print(f"# {meta['device']} | commit {meta['commit']} | {meta['date']} | {cfg.dtype} "
              f"(draft {cfg.draft_dtype}) | "
              f"{meta['torch_threads']} torch threads | {meta['n_prompts']} prompts of {prompt_set}, "
              f"batch {cfg.batch} | "
              f"max {cfg.max_new_tokens} new tokens")
        rows, prompt_rows, error = benchmark(cfg, target, draft, prompts, eos, meta)
        if error is not None:
            print(f"\nFAILED: at temperature 0 all methods must emit identical tokens; {error}. "
                  "No results written.")
            return 1
        print("\n" + markdown_table(rows) + "\n")
        summary, per_prompt = summary + rows, per_prompt + prompt_rows
    stem = result_stem(cfg.out, "e2e_" + "+".join(Path(p).stem for p in cfg.prompts), meta)
    written = (write_rows(summary, stem)
               + write_rows(per_prompt, stem.with_name(stem.name + "_per_prompt"), json_too=False))
    png = stem.with_name(stem.name + ".png")
    if len(cfg.prompts) == 1 and plot(summary, png):  # a plot shows one prompt set
        written.append(png)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
