"""Per-step profile of decoding inside vLLM: where one engine step's time goes, per method.

    scripts/venv-vllm python bench/vllm_profile.py --methods ar stree-tree stree-suffix

One in-process engine per method (vLLM's default compiled mode, greedy or sampled at
``--temperature`` with a seed per prompt, the first ``--limit``
HumanEval prompts ``--batch`` at a time (default 1), after warm-up requests at that batch), with
wall-clock timers wrapped around the engine's step and the parts of it that stree adds or replaces: the model runner's input
preparation (with stree's tree tables), the model forward (with the tree rows of the registered
attention backend and Mamba2 mixer, timed separately), the sampling (with stree's verification
and commit) and the proposer (the draft's levels and its catch-up). Milliseconds per engine step,
averaged over every step of the timed requests (their few prefill steps included). The timers
add a little host work to each call; compare methods within one run, on a quiet machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timers():
    """Wrap the step's parts; return the accumulator {label: [seconds, calls]}."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import stree.vllm.attention as attention
    import stree.vllm.mixer as mixer
    from stree.vllm.proposer import StreeProposer
    from stree.vllm.step import TreeStep

    acc = {}

    def wrap(owner, name, label):
        inner = getattr(owner, name)
        acc[label] = [0.0, 0]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                acc[label][0] += time.perf_counter() - t0
                acc[label][1] += 1
        setattr(owner, name, timed)

    parts = [(LLMEngine, "step", "engine step"),
             (GPUModelRunner, "_prepare_inputs", "  prepare inputs (+ stree tree tables)"),
             (GPUModelRunner, "_model_forward", "  model forward"),
             (attention, "tree_attention", "    tree rows: attention"),
             (mixer, "tree_conv_rows", "    tree rows: Mamba2 conv"),
             (mixer, "tree_scan_rows", "    tree rows: Mamba2 scan"),
             (GPUModelRunner, "_sample", "  sample (+ stree verify and commit)"),
             (TreeStep, "verify", "    stree verify"),
             (TreeStep, "commit", "    stree commit"),
             (GPUModelRunner, "propose_draft_token_ids", "  propose"),
             (StreeProposer, "_catch_up", "    draft catch-up"),
             (StreeProposer, "_draft", "    drafting (draft levels, suffix lookups)")]
    for owner, name, label in parts:
        wrap(owner, name, label)
    return acc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["ar", "stree-tree", "stree-suffix"])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="prompts submitted together (at most 4)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (seeded per prompt)")
    parser.add_argument("--method", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.method is None:  # one child process per method: one engine per process
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, where the timers are
        for method in args.methods:
            code = subprocess.run([sys.executable, __file__, "--method", method, "--limit", str(args.limit),
                                   "--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.batch),
                                   "--temperature", str(args.temperature)],
                                  env=env).returncode
            if code:
                return code
        return 0

    here = Path(__file__).resolve().parent  # this folder holds vllm.py: keep `vllm` the package
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    from vllm import LLM, SamplingParams

    from stree.prompts import load_prompts

    spec = importlib.util.spec_from_file_location("bench_vllm", here / "vllm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = bench.METHODS[args.method]
    if config:
        config = {k: (str(ROOT / "models/stree-tiny/draft") if v == "{draft}" else v) for k, v in config.items()}
    llm = LLM(model=str(ROOT / "models/stree-tiny/target"), dtype="float32", max_model_len=1024, max_num_seqs=4,
              seed=0, kv_cache_memory_bytes=1 << 29, speculative_config=config)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens)
    llm.generate([bench.WARM_UP] * args.batch, params, use_tqdm=False)  # the batch's one-time costs untimed
    acc = _timers()
    tokens = 0
    prompts = load_prompts("humaneval", args.limit)
    for i in range(0, len(prompts), args.batch):
        seeded = [SamplingParams(temperature=args.temperature, seed=i + j, max_tokens=args.max_new_tokens)
                  for j in range(len(prompts[i:i + args.batch]))]
        outputs = llm.generate(prompts[i:i + args.batch], seeded, use_tqdm=False)
        tokens += sum(len(out.outputs[0].token_ids) for out in outputs)
    steps = acc["engine step"][1]
    print(f"\n{args.method}: {tokens} tokens in {steps} engine steps ({tokens / steps:.2f} tokens per step)")
    for label, (seconds, _) in acc.items():
        print(f"  {label:40s} {1e3 * seconds / steps:6.2f} ms per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
