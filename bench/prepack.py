"""What prepacked linear weights (``stree.prepack_linears``) change on the CPU, side by side.

1. Per weight shape of the pair, the time of one linear call with ``rows`` rows (1 = a decoding
   step, 5 = a chain verify, 9/13 = small trees) through PyTorch's ``F.linear`` and through the
   packed kernel (best of 5 repeats of 200 calls).
2. End to end: the pair loaded twice, plain and prepacked; for every prompt the methods of both
   variants run interleaved (plain AR, plain chain, plain tree, packed AR, ...), so the variants
   share the machine's slow and fast moments. Speed-ups are against the same variant's AR row and
   against plain AR.
3. The crossover (``stree.layers.linear.PACK_MIN_WORK``): each model's own one-token decoding
   step (its weights streamed from memory, as in decoding, unlike the per-call loop of 1.) with
   one-row calls packed from each candidate crossover, per torch thread count, the candidates
   interleaved in every round (median over rounds of the mean of 64 steps).

    python bench/prepack.py --models models/stree-tiny --limit 5 --max-new-tokens 128
    python bench/prepack.py --crossover-only

Rows go to ``bench/results/prepack_{device}_{date}.{csv,json}`` (device, commit, date in each).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, best_us, metadata, result_stem, write_rows  # noqa: E402

METHODS = (("ar", "ar", None), ("chain:4", "chain", "chain:4"),
           ("tree:static:2,2,2,2", "tree", "static:2,2,2,2"))


def linear_rows(models) -> list[dict]:
    shapes = sorted({tuple(m.weight.shape) for model in models for m in model.modules()
                     if isinstance(m, torch.nn.Linear)})
    rows = []
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        for n in (1, 2, 5, 9, 13):
            x = torch.randn(n, in_f)
            rows.append(dict(kind="linear", shape=f"{out_f}x{in_f}", rows=n,
                             f_linear_us=best_us(lambda: F.linear(x, w)),
                             packed_us=best_us(lambda: torch.ops.mkldnn._linear_pointwise(
                                 x, packed, None, "none", [], ""))))
    return rows


def e2e_rows(args) -> list[dict]:
    from stree.checkpoints import default_eos, encode_prompt, load_model, load_tokenizer, model_config
    from stree.generation import generate
    from stree.prompts import load_prompts

    target_dir, draft_dir = (os.path.join(args.models, d) for d in ("target", "draft"))
    cpu = torch.device("cpu")
    pairs = {v: (load_model(target_dir, cpu, torch.float32, prepack=v == "prepacked"),
                 load_model(draft_dir, cpu, torch.float32, prepack=v == "prepacked"))
             for v in ("plain", "prepacked")}
    tokenizer = load_tokenizer(target_dir)
    bos = model_config(target_dir).get("bos_token_id")
    prompts = [torch.tensor([encode_prompt(tokenizer, p, bos)])
               for p in load_prompts(args.prompts, limit=args.limit)]
    eos = default_eos(target_dir, tokenizer)
    totals, texts = {}, {}
    for v, (t, d) in pairs.items():  # warm-up
        for _, method, drafter in METHODS:
            generate(t, d, prompts[0], 8, method=method, drafter=drafter, eos_token_id=eos)
    for i, ids in enumerate(prompts):
        for v, (t, d) in pairs.items():
            for label, method, drafter in METHODS:
                out = generate(t, d, ids, args.max_new_tokens, method=method, drafter=drafter,
                               eos_token_id=eos)
                texts.setdefault(i, set()).add(tuple(out.sequences[0, :out.lengths[0]].tolist()))
                if (v, label) in totals:
                    totals[v, label].merge(out.stats)
                else:
                    totals[v, label] = out.stats
    plain_ar = totals["plain", "ar"].tokens_per_s
    rows = []
    for (v, label), s in totals.items():
        rows.append(dict(kind="e2e", variant=v, method=label, prompts=len(prompts), tau=s.tau,
                         tokens_per_s=s.tokens_per_s,
                         vs_own_ar=s.tokens_per_s / totals[v, "ar"].tokens_per_s,
                         vs_plain_ar=s.tokens_per_s / plain_ar,
                         draft_ms_per_step=1e3 * s.draft_s / max(s.target_calls, 1),
                         verify_ms_per_step=1e3 * s.verify_s / max(s.target_calls, 1),
                         identical_texts=all(len(x) == 1 for x in texts.values())))
    return rows


def crossover_rows(args, models) -> list[dict]:
    import statistics

    from stree.layers import linear
    from stree.native import session_factory

    for m in models:
        linear.prepack_linears(m)
    prompt = torch.randint(0, models[0].lm_head.weight.shape[0], (1, 100),
                           generator=torch.Generator().manual_seed(0))
    saved = (linear.PACK_MIN_WORK, torch.get_num_threads())

    def step_ms(model, steps: int = 64) -> float:
        session = session_factory(model)(model, 1, prompt.shape[1], prompt.shape[1] + steps + 8)
        session.prefill(prompt)
        token = torch.tensor([5])
        for _ in range(4):
            session.step(token)
        t = time.perf_counter()
        for _ in range(steps):
            session.step(token)
        return (time.perf_counter() - t) / steps * 1e3

    rows = []
    try:
        with torch.inference_mode():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                times = {}
                for _ in range(args.rounds):
                    for crossover in (1 << 19, 1 << 18, 1 << 17, 1 << 16, 0):
                        linear.PACK_MIN_WORK = crossover
                        for name, m in zip(("target", "draft"), models):
                            times.setdefault((name, crossover), []).append(step_ms(m))
                for (name, crossover), ms in times.items():
                    rows.append(dict(kind="crossover", model=name, threads=threads,
                                     crossover=crossover, step_ms=statistics.median(ms),
                                     step_ms_all=ms))
    finally:
        linear.PACK_MIN_WORK = saved[0]
        torch.set_num_threads(saved[1])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[1] / "models" / "stree-tiny"))
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the crossover part")
    ap.add_argument("--crossover-only", action="store_true", help="only part 3 (the crossover)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from stree.layers.linear import prepack_available

    if not prepack_available():
        print("this torch build has no oneDNN packed linear: nothing to compare", file=sys.stderr)
        return 1
    meta = dict(metadata("cpu"), torch_threads=torch.get_num_threads())
    from stree.checkpoints import load_model

    models = [load_model(os.path.join(args.models, d), torch.device("cpu"), torch.float32, prepack=False)
              for d in ("target", "draft")]
    parts = [] if args.crossover_only else linear_rows(models) + e2e_rows(args)
    rows = [dict(meta, **r) for r in parts + crossover_rows(args, models)]
    for r in rows:
        if r["kind"] == "crossover":
            print(f"crossover {r['crossover']:>7} threads {r['threads']} {r['model']:>6} own step "
                  f"{r['step_ms']:.2f} ms (rounds: {', '.join(f'{x:.2f}' for x in r['step_ms_all'])})")
        elif r["kind"] == "linear":
            print(f"linear {r['shape']:>10} rows {r['rows']:>2}: F.linear {r['f_linear_us']:7.1f} us, "
                  f"packed {r['packed_us']:7.1f} us")
        else:
            print(f"{r['variant']:>9} {r['method']:<22} tau {r['tau']:.2f} {r['tokens_per_s']:7.1f} tok/s "
                  f"{r['vs_own_ar']:.2f}x own AR {r['vs_plain_ar']:.2f}x plain AR "
                  f"draft {r['draft_ms_per_step']:.2f} verify {r['verify_ms_per_step']:.2f} ms/step "
                  f"identical {r['identical_texts']}")
    paths = write_rows(rows, result_stem(args.out, "prepack", meta))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
