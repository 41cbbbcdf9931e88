"""Decoding inside vLLM on the shipped pair: vLLM's own decoding, stree's chains and trees (with the draft,
suffix trees without it, both merged), vLLM's ngram and, where arctic-inference is installed, vLLM's suffix.

    scripts/venv-vllm python bench/vllm.py --prompts humaneval mtbench --limit 8 --max-new-tokens 128

Per prompt set, temperature and batch size (1: one request at a time; 4: four concurrent requests),
each method (``METHODS``; stree's run under its CPU default schedule, drafting only while a
request runs alone, unless named ``-every``) runs in its own engine (a child process, as
vLLM needs; start-up is not timed), after warm-up requests (alone, and as many together as the
largest batch) on a text outside the prompt sets.
Methods whose drafts read earlier requests' outputs (suffix trees, vLLM's suffix) get a fresh
engine for every (temperature, batch) cell, so that no cell drafts from an earlier cell's outputs
for the same prompts (within a cell, later prompts may draft from earlier ones, as a server's
would). Reported: tokens/s (new tokens over wall time
of the timed requests), tau (tokens per target call: 1 + accepted / drafts, from vLLM's counters)
and mean per-request latency. Engines run in vLLM's default mode, which compiles the model
(``enforce_eager=False``; stree's proposer then compiles the draft's levels too), 1.3-1.7x faster
on this CPU than ``--enforce-eager``, which reproduces eager runs. Sampled requests carry no seed
of their own (the engine is seeded), as a serving client's would not. At T = 0 each method's tokens
are compared with vLLM's own decoding ("exact"). Methods run one after another in the same process
tree, so compare them within one run; run it on a quiet machine. The machine's speed drifts between
runs a few minutes apart (cells of one commit moved by 15% on the project's VM): ``--rounds R``
runs the whole list of methods R times in turn, each round's speedups against that round's vLLM
decoding, and prints each cell's median and range (every round's rows are kept, with their
``round``). Engines run as vLLM's ``LLM`` runs them by default: the engine core in a process of its
own, the model in a worker process (vLLM's CPU executor). Results go to
``bench/results/vllm_<device>_<date>.{csv,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# stree's methods without a schedule run under its CPU default, drafting while a request runs
# alone; the "-every" ones draft at every batch size (vLLM's schedule with one range up to 4)
METHODS = {
    "ar": None,
    # chains: stree verifies them on a CPU by default; "sps" named keeps vLLM's rejection sampler
    "stree-chain": {"method": "stree", "model": "{draft}", "tree": "chain:4"},
    "stree-chain-vllm": {"method": "stree", "model": "{draft}", "tree": "chain:4", "verifier": "sps"},
    "stree-chain-asps": {"method": "stree", "model": "{draft}", "tree": "chain:4", "verifier": "asps"},
    # the CPU default (and a bf16 draft, the default on a CPU that multiplies bf16 natively)
    "stree-tree": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2"},
    "stree-tree-fp32": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2", "draft_dtype": "float32"},
    "stree-tree-every": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2",
                         "num_speculative_tokens_per_batch_size": [[1, 4, 6]]},
    "stree-tree4": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2,2"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    # suffix trees: no draft model; merged with the default tree's draft
    "stree-suffix": {"method": "stree", "tree": "suffix:16"},
    "stree-suffix-every": {"method": "stree", "tree": "suffix:16",
                           "num_speculative_tokens_per_batch_size": [[1, 4, 15]]},
    "stree-merged": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2+suffix:16"},
    # the suffix tree alone where it scores solo (no draft model that step)
    "stree-merged-solo2": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2+suffix:16:solo=2"},
    "stree-merged-solo4": {"method": "stree", "model": "{draft}", "tree": "caterpillar:2,2,2+suffix:16:solo=4"},
    # vLLM's own SuffixDecoding (one path per request; needs the arctic-inference package)
    "vllm-suffix": {"method": "suffix", "num_speculative_tokens": 16},
}
MARK = "BENCH-RESULT "
# the warm-up request: a text in none of the prompt sets, so that no draft reads its output
WARM_UP = "The weather report for the coast this weekend says"


def _reads_outputs(spec_config) -> bool:
    """Whether a method drafts from earlier requests' outputs (a cross-request suffix cache)."""
    return bool(spec_config) and (spec_config["method"] == "suffix" or "suffix" in spec_config.get("tree", ""))


def _engine(args) -> None:
    """Child: one engine, every (temperature, batch) cell of one method."""
    # this file is named vllm.py: take its folder off the path so that `vllm` is the package
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vllm import LLM, SamplingParams

    spec = json.loads(args.child)
    llm = LLM(model=spec["target"], dtype=spec["dtype"], enforce_eager=spec["enforce_eager"], max_model_len=1024,
              max_num_seqs=4, seed=0, kv_cache_memory_bytes=1 << 29, disable_log_stats=False,
              speculative_config=spec["speculative_config"])

    def counters():
        return {m.name: m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}

    # warm-up at the largest batch too: a batch size's first steps pay one-time costs (its kernels'
    # set-up), which would fall on whichever cell runs it first
    # and at every temperature of the cells (a sampled draft's first steps compile its own graphs)
    for temperature in sorted({t for t, _ in spec["cells"]}):
        for batch in sorted({1, max(b for _, b in spec["cells"])}):
            llm.generate([WARM_UP] * batch, SamplingParams(temperature=temperature, max_tokens=16), use_tqdm=False)
    cells = []
    for temperature, batch in spec["cells"]:
        # no per-request seed (the engine has one): stree drafts a seeded sampled request alone
        params = SamplingParams(temperature=temperature, max_tokens=spec["max_new_tokens"])
        before = counters()
        tokens, latencies, start = [], [], time.perf_counter()
        for i in range(0, len(spec["prompts"]), batch):
            t0 = time.perf_counter()
            outs = llm.generate(spec["prompts"][i:i + batch], params, use_tqdm=False)
            latencies += [time.perf_counter() - t0] * len(outs)
            tokens += [list(o.outputs[0].token_ids) for o in outs]
        wall = time.perf_counter() - start
        after = counters()
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
        accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                    - before.get("vllm:spec_decode_num_accepted_tokens", 0))
        cells.append(dict(temperature=temperature, batch=batch, new_tokens=sum(map(len, tokens)),
                          wall_s=wall, tokens_per_s=sum(map(len, tokens)) / wall,
                          tau=1 + accepted / drafts if drafts else 1.0,
                          latency_s=sum(latencies) / len(latencies), tokens=tokens))
    print(MARK + json.dumps(cells), flush=True)


def _run_method(args, env, prompts, method) -> list[dict]:
    """Every (temperature, batch) cell of ``method`` on ``prompts``, each engine a child process
    (one per cell for methods that read earlier outputs); a failed child ends the run with its
    status."""
    spec_config = METHODS[method] and json.loads(json.dumps(METHODS[method]).replace("{draft}", args.draft))
    all_cells = [[t, b] for t in args.temperatures for b in args.batches]
    cells = []
    for group in ([[c] for c in all_cells] if _reads_outputs(spec_config) else [all_cells]):
        child = dict(target=args.target, dtype=args.dtype, speculative_config=spec_config, prompts=prompts,
                     enforce_eager=args.enforce_eager, cells=group, max_new_tokens=args.max_new_tokens)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(child)], env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-20000:])
            raise SystemExit(proc.returncode)
        cells += json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)][-1][len(MARK):])
    return cells


def summarize(rows: list[dict]) -> list[dict]:
    """Per (prompts, method, temperature, batch): the median, lowest and highest speedup over the
    rounds (each against its own round's vLLM decoding), the median tau, and whether every
    round was exact (None where not checked)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["prompts"], r["method"], r["temperature"], r["batch"]), []).append(r)
    out = []
    for (prompts, method, temperature, batch), rs in groups.items():
        speedups = [r["speedup"] for r in rs]
        checked = [r["exact"] for r in rs if r["exact"] is not None]
        out.append(dict(prompts=prompts, method=method, temperature=temperature, batch=batch, rounds=len(rs),
                        speedup_median=statistics.median(speedups), speedup_min=min(speedups),
                        speedup_max=max(speedups), tau_median=statistics.median(r["tau"] for r in rs),
                        exact=all(checked) if checked else None))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/stree-tiny/target")
    parser.add_argument("--draft", default="models/stree-tiny/draft")
    parser.add_argument("--prompts", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--limit", type=int, default=8, help="prompts per set (a multiple of 4)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--methods", nargs="+",
                        default=["ar", "stree-chain", "stree-tree", "stree-tree-every", "ngram", "stree-suffix",
                                 "stree-suffix-every", "stree-merged"],
                        choices=list(METHODS), help="vllm-suffix needs the arctic-inference package")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every method this many times in turn, each round against its own vLLM "
                             "decoding, and print each cell's median speedup (the machine drifts between runs)")
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode (no torch.compile)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's dtype (bfloat16 for Gated DeltaNet targets: vLLM's CPU GDN op runs no other)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.child:
        _engine(args)
        return 0

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import metadata, result_stem, write_rows
    from stree.prompts import load_prompts

    meta = dict(metadata("cpu"), target=args.target, draft=args.draft, target_dtype=args.dtype)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = []
    for round_ in range(args.rounds):
        for name in args.prompts:
            prompts = load_prompts(name, args.limit)
            reference = None
            for method in args.methods:
                cells = _run_method(args, env, prompts, method)
                if method == "ar":
                    reference = {(c["temperature"], c["batch"]): c["tokens"] for c in cells}
                for c in cells:
                    same = reference and (c["temperature"] == 0) and c["tokens"] == reference.get((0.0, c["batch"]))
                    base = next((r for r in rows if r["round"] == round_ and r["prompts"] == name
                                 and r["method"] == "ar" and r["temperature"] == c["temperature"]
                                 and r["batch"] == c["batch"]), None)
                    row = dict(meta, prompts=name, method=method, round=round_,
                               vllm_mode="eager" if args.enforce_eager else "compiled",
                               temperature=c["temperature"], batch=c["batch"],
                               new_tokens=c["new_tokens"], tokens_per_s=round(c["tokens_per_s"], 1),
                               speedup=round(c["tokens_per_s"] / base["tokens_per_s"], 3) if base else 1.0,
                               tau=round(c["tau"], 2), latency_s=round(c["latency_s"], 3),
                               exact=(bool(same) if c["temperature"] == 0 else None))
                    rows.append(row)
                    print(f"round {round_} {name:10s} {method:12s} T={c['temperature']:g} batch={c['batch']} "
                          f"{row['tokens_per_s']:7.1f} tok/s {row['speedup']:5.2f}x tau {row['tau']:.2f} "
                          f"latency {row['latency_s']:.2f} s exact={row['exact']}", flush=True)
    if args.rounds > 1:
        print("median speedup over the rounds (range):")
        for s in summarize(rows):
            print(f"{s['prompts']:10s} {s['method']:12s} T={s['temperature']:g} batch={s['batch']} "
                  f"{s['speedup_median']:5.2f}x ({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) "
                  f"tau {s['tau_median']:.2f} exact={s['exact']}")
    paths = write_rows(rows, result_stem(args.out, "vllm", meta))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
