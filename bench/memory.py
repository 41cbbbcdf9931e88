"""Resident memory of long generate calls and of many short ones (issue 24), on the shipped pair.

Long runs: one ``stree.generate`` call of ``--tokens`` new tokens with EOS ignored; a streamer
reads the process's resident set size (``VmRSS``) when the output passes ``--checkpoint`` tokens
and at the end. The run passes when what resident memory gained from the checkpoint to the end,
less what the attention K/V cache gained (it grows with the sequence by design; computed from the
models' attention shapes and ``stree.cache.grown_capacity``), is within ``--tolerance`` (10%) of
the resident memory at the checkpoint.

* ``mamba-ar-tree``: the shipped Mamba2 draft as target (no context limit), method ``ar-tree``;
* ``mamba-pair``: that Mamba2 target with a noisy copy of itself as draft, method ``tree``;
* ``hybrid-pair``: the shipped hybrid target and Mamba2 draft, method ``tree``: capped at the
  target's context limit (2048 positions, a ContextLimitWarning), checkpoint at a tenth of it.

Call loops: ``--calls`` short calls (``--short-tokens`` each) per case after ``--warmup`` calls;
resident memory after the last call against after the warm-up (``--loop-tolerance-mb``).

    scripts/venv python bench/memory.py                      # 20,000 tokens, 200 calls (~30 min CPU)
    scripts/venv python bench/memory.py --tokens 2000 --checkpoint 200 --calls 50   # quick

Prints a table and writes ``bench/results/memory_<device>_<date>.{csv,json}``; exit status 1 if
a case fails its bound. ``tests/test_memory.py`` runs smaller versions with the same functions.
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stree  # noqa: E402
from stree.cache import grown_capacity  # noqa: E402
from stree.limits import ContextLimitWarning, context_limit  # noqa: E402
from stree.walk import mixers  # noqa: E402
from stree.layers import attention, recurrent  # noqa: E402

PAIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "stree-tiny")
PROMPT = [0, 1537, 264, 7, 2393, 12, 285]  # any ids: EOS is ignored


def rss_bytes() -> int:
    """Resident set size of this process now (``VmRSS`` of /proc/self/status), after a GC."""
    gc.collect()
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


@dataclass
class RssProbe:
    """A ``generate`` streamer that records resident memory when the output passes each of
    ``marks`` new tokens, and at the end (key ``"end"``)."""
    marks: list[int]
    tokens: int = -1  # the first put is the prompt
    at: dict = field(default_factory=dict)

    def put(self, tokens: torch.Tensor) -> None:
        if self.tokens < 0:
            self.tokens = 0
            return
        self.tokens += tokens.numel()
        for m in self.marks:
            if m not in self.at and self.tokens >= m:
                self.at[m] = (self.tokens, rss_bytes())

    def end(self) -> None:
        self.at["end"] = (self.tokens, rss_bytes())


def kv_bytes_per_position(model) -> int:
    """Bytes one sequence position costs in the attention K/V of a patched ``model``."""
    total = 0
    for _, mixer in mixers(model):
        if recurrent.kind(mixer) is None:
            a = attention.view(mixer)
            total += 2 * a.num_key_value_heads * a.head_dim * next(mixer.parameters()).element_size()
    return total


def cache_bytes(models, length: int) -> int:
    """K/V bytes the caches of ``models`` hold for a sequence of ``length`` positions (their
    grown capacity)."""
    limit = min((context_limit(m) or math.inf for m in models), default=math.inf)
    capacity = grown_capacity(length, limit)
    return sum(kv_bytes_per_position(m) for m in models) * int(capacity)


def load_models(device: str = "cpu"):
    """(hybrid target, Mamba2 draft, noisy copy of the draft): patched, fp32, prepacked."""
    from stree.checkpoints import load_model

    target = load_model(os.path.join(PAIR, "target"), device, torch.float32)
    draft = load_model(os.path.join(PAIR, "draft"), device, torch.float32)
    noisy = copy.deepcopy(draft)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().nan_to_num(0.02))
    return target, draft, noisy


def cases(target, draft, noisy) -> dict:
    """name -> (target, draft, method)."""
    return {"mamba-ar-tree": (draft, None, "ar-tree"), "mamba-pair": (draft, noisy, "tree"),
            "hybrid-pair": (target, draft, "tree")}


def long_run(name: str, target, draft, method: str, tokens: int, checkpoint: int,
             tolerance: float, prompt: list[int] = PROMPT) -> dict:
    """One call of ``tokens`` new tokens (EOS ignored); resident memory at ``checkpoint`` new
    tokens and at the end (see the module docstring for the bound)."""
    limit = context_limit(target)
    if limit is not None:  # runs to the context limit: the checkpoint at a tenth of what fits
        checkpoint = min(checkpoint, max(1, (limit - len(prompt)) // 10))
    probe = RssProbe([checkpoint])
    start = rss_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextLimitWarning)  # the hybrid is capped on purpose
        out = stree.generate(target, draft, torch.tensor([prompt]), tokens, method=method,
                             streamer=probe)
    made = out.lengths[0] - len(prompt)
    (at_tokens, at_rss), (_, end_rss) = probe.at[checkpoint], probe.at["end"]
    models = [m for m in (target, draft) if m is not None]
    scratch = 11 if method == "tree" else 1
    cache_growth = (cache_bytes(models, len(prompt) + made + scratch)
                    - cache_bytes(models, len(prompt) + at_tokens + scratch))
    growth = end_rss - at_rss - cache_growth
    return dict(case=name, kind="long", method=method, new_tokens=made, checkpoint=at_tokens,
                rss_start_mb=_mb(start), rss_checkpoint_mb=_mb(at_rss), rss_end_mb=_mb(end_rss),
                cache_growth_mb=_mb(cache_growth), growth_beyond_cache_mb=_mb(growth),
                growth_pct=round(100 * growth / at_rss, 2), bound_pct=100 * tolerance,
                ok=growth <= tolerance * at_rss, tokens_per_s=round(out.stats.tokens_per_s, 1))


def call_loop(name: str, target, draft, method: str, calls: int, tokens: int, warmup: int,
              tolerance_mb: float, prompt: list[int] = PROMPT) -> dict:
    """``warmup`` + ``calls`` generate calls of ``tokens`` new tokens; resident memory after the
    warm-up against after the last call."""
    ids = torch.tensor([prompt])
    for _ in range(warmup):
        stree.generate(target, draft, ids, tokens, method=method)
    before = rss_bytes()
    peak = before
    for i in range(calls):
        stree.generate(target, draft, ids, tokens, method=method)
        if i % 10 == 9:
            peak = max(peak, rss_bytes())
    after = rss_bytes()
    return dict(case=name, kind="calls", method=method, calls=calls, new_tokens=tokens,
                rss_after_warmup_mb=_mb(before), rss_end_mb=_mb(after), rss_peak_mb=_mb(peak),
                growth_mb=_mb(after - before), bound_mb=tolerance_mb,
                ok=after - before <= tolerance_mb * 2**20)


def _mb(n: int) -> float:
    return round(n / 2**20, 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--checkpoint", type=int, default=2_000)
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--loop-tolerance-mb", type=float, default=8.0)
    parser.add_argument("--cases", nargs="+", default=None, help="default: all")
    parser.add_argument("--out", default=None, help="result directory (default bench/results)")
    args = parser.parse_args(argv)

    from _common import RESULTS, metadata, result_stem, write_rows

    meta = metadata("cpu")
    models = load_models()
    rows = []
    for name, (target, draft, method) in cases(*models).items():
        if args.cases and name not in args.cases:
            continue
        rows.append({**meta, **long_run(name, target, draft, method, args.tokens, args.checkpoint,
                                        args.tolerance)})
        print(_line(rows[-1]), flush=True)
        rows.append({**meta, **call_loop(name, target, draft, method, args.calls, args.short_tokens,
                                         args.warmup, args.loop_tolerance_mb)})
        print(_line(rows[-1]), flush=True)
    paths = write_rows(rows, result_stem(args.out or RESULTS, "memory", meta))
    print("wrote", *paths)
    return 0 if all(r["ok"] for r in rows) else 1


def _line(r: dict) -> str:
    if r["kind"] == "long":
        return (f"{r['case']:<14} {r['method']:<8} {r['new_tokens']:>6} tokens: RSS "
                f"{r['rss_checkpoint_mb']:.1f} MB at {r['checkpoint']} -> {r['rss_end_mb']:.1f} MB "
                f"at the end; K/V cache +{r['cache_growth_mb']:.1f} MB; beyond it "
                f"{r['growth_beyond_cache_mb']:+.1f} MB ({r['growth_pct']:+.2f}%, bound "
                f"{r['bound_pct']:.0f}%) {'ok' if r['ok'] else 'FAIL'}; {r['tokens_per_s']} tok/s")
    return (f"{r['case']:<14} {r['method']:<8} {r['calls']} calls x {r['new_tokens']} tokens: RSS "
            f"{r['rss_after_warmup_mb']:.1f} MB after warm-up -> {r['rss_end_mb']:.1f} MB "
            f"({r['growth_mb']:+.2f} MB, bound {r['bound_mb']} MB) {'ok' if r['ok'] else 'FAIL'}")


if __name__ == "__main__":
    sys.exit(main())
