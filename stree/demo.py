"""``stree demo``: the main job on the small target/draft pair the project ships (``models/``).

Generates from real prompts (the first ``--prompts`` HumanEval problems, or ``--prompt``) with the
target's own autoregressive decoding (its own prefill and ``step``, see ``stree.native``: the
baseline), vanilla chain speculative decoding (4 drafted tokens), STree with the draft's tree,
STree with a suffix tree and no draft model (``suffix:16``) and STree ``auto`` (the draft's trees
and suffix trees, chosen per step: the fastest on the shipped pair) at temperature 0, prints the
first prompt's text, then tau, tokens/s and the speed-up over the model's own decoding summed over
the prompts, and checks that every run's text is identical to the other methods' on the same
prompt (exactness: all must equal the target's greedy output).

Several prompts, not one: how much a tree adds over a chain depends on the text (on the shipped
pair the 4-deep caterpillar's tau is 3-20% above ``chain:4``'s from one HumanEval problem to the
next), so one prompt would show the prompt more than the method.

The tree is chosen for the device (``stree.default_drafter``, also the library's and the
CLI's default), as STree's cost analysis (Eq. 7/8: time per token = t(N) / tau)
says: on a GPU a verify pass costs about the same for 1 or 63 nodes, so the bushier Fig. 4a tree
(13 nodes) pays; on a 2-core CPU every node the draft runs costs a draft step, and a draft level of
2 nodes costs close to two of 1. So the CPU tree is a caterpillar (``caterpillar:2,2,2``): the
draft's top-1 chain of depth 3, with the draft's second choice beside every chain node as a leaf.
The draft runs one node per level, as for a chain, and never runs the leaves; the target verifies 7
nodes, and a rejected chain token is often rescued by its sibling. With the shipped pair's draft,
which agrees with the target's greedy text 75% of the time on these problems, the rescue is worth
about the chain's fourth draft call: over 80 HumanEval problems at T = 0 the tree and ``chain:4``
ran within 1% of each other (docs/benchmarks.md).

Each method runs ``--repeats`` times over the prompts, the methods interleaved per prompt (AR,
chain, tree on prompt 1, then prompt 2, ...), and the table reports each method's median repeat (of
an even number, the faster middle one), so a slow moment of a shared machine does not land on one
method.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

DEFAULT_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "models", "stree-tiny")
FALLBACK_PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


def methods(device: torch.device, compile: bool = False) -> list[tuple[str, str, str | None]]:
    """(label, generate method, drafter) of the rows, the draft model's tree chosen for the
    device: the model's own decoding, chain SD, STree with the draft's tree, with a suffix tree
    alone (no draft model) and ``auto`` (the draft's trees and suffix trees, chosen per step).
    ``auto`` over suffix trees does not compile (``stree.generate``'s ``compile``), so
    ``compile`` leaves its row out."""
    from stree.generation import default_drafter

    tree = default_drafter("tree", device)
    rows = [("autoregressive (model's own)", "ar", None), ("chain SD (K=4)", "chain", "chain:4"),
            (f"STree ({tree.removeprefix('static:')})", "tree", tree),
            ("STree (suffix:16, no draft)", "tree", "suffix:16")]
    if not compile:
        rows.append(("STree (auto: draft + suffix)", "tree", "auto"))
    return rows


def build_parser(parser=None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="stree demo", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="directory holding target/ and draft/ (default: the shipped pair)")
    parser.add_argument("--prompt", default=None, help="one prompt text (default: HumanEval problems)")
    parser.add_argument("--prompts", type=int, default=5,
                        help="how many HumanEval problems, from the first (default 5; ignored with --prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs per method over all prompts, interleaved; the median is "
                             "reported (default 2)")
    parser.add_argument("--compile", action="store_true",
                        help="run every method compiled (stree.generate(compile=True): frozen weights; the "
                             "model's own decoding on a static cache); the first run compiles, tens of "
                             "seconds")
    parser.add_argument("--no-prepack", action="store_true",
                        help="CPU fp32: keep PyTorch's plain linear layers instead of prepacked "
                             "weights (stree.prepack_linears), for every method")
    from stree.errors import add_debug_flag

    add_debug_flag(parser)
    return parser


def _which_run(repeats: int) -> str:
    """Which of each method's runs the table shows (``sorted(...)[repeats // 2]`` by tokens/s)."""
    if repeats % 2:
        return f"median of {repeats} interleaved runs"
    return f"the faster {'' if repeats == 2 else 'middle one '}of {repeats} interleaved runs"


def default_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval problems (a fixed code prompt where the data set is missing)."""
    try:
        from stree.prompts import load_prompts

        return load_prompts("humaneval", limit=n)
    except (ImportError, FileNotFoundError):
        return [FALLBACK_PROMPT]


def run(args) -> int:
    from stree.checkpoints import default_eos, encode_prompt, load_role, load_tokenizer, model_config
    from stree.generation import generate
    from stree.inputs import available_device

    target_dir, draft_dir = (os.path.join(args.models, d) for d in ("target", "draft"))
    for d in (target_dir, draft_dir):
        if not os.path.isdir(d):
            raise FileNotFoundError(f"{d} not found: --models needs a directory holding target/ and "
                                    "draft/ (the shipped pair is models/stree-tiny; rebuild it with "
                                    "`python models/recipe.py --out models/stree-tiny`)")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1, got {args.prompts}")
    prompts = [args.prompt] if args.prompt is not None else default_prompts(args.prompts)
    if not all(prompts):
        raise ValueError("the prompt is empty (--prompt): generation needs at least one prompt token")
    torch.manual_seed(0)
    device = available_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(target_dir)
    # the shipped models saw <|endoftext|> (= bos) before every training file
    bos = model_config(target_dir).get("bos_token_id")
    ids = [torch.tensor([encode_prompt(tokenizer, p, bos)], device=device) for p in prompts]
    target = load_role("target", target_dir, device, dtype, prepack=not args.no_prepack)
    draft = load_role("draft", draft_dir, device, dtype, prepack=not args.no_prepack)
    eos = default_eos(target_dir, tokenizer)
    print(f"target: {_describe(target)}\ndraft:  {_describe(draft)}\n")
    print("=" * 30 + " prompt " + "=" * 30 + f"\n{prompts[0]}")

    rows_of = methods(device, args.compile)
    # warm every method up once so no timed run pays for lazy initialisation (auto measures
    # the models' costs once, cached on disk)
    for _, method, drafter in rows_of:
        generate(target, _draft_for(drafter, draft), ids[0], 8, method=method, drafter=drafter,
                 eos_token_id=eos, compile=args.compile)
    runs: dict[str, list] = {name: [] for name, _, _ in rows_of}
    texts = [set() for _ in ids]  # every run's text per prompt: one element iff all are identical
    for _ in range(args.repeats):
        totals = {}  # method -> its stats summed over the prompts
        for i, prompt_ids in enumerate(ids):
            for name, method, drafter in rows_of:
                out = generate(target, _draft_for(drafter, draft), prompt_ids, args.max_new_tokens,
                               method=method, drafter=drafter, eos_token_id=eos, compile=args.compile)
                text = tokenizer.decode(out.sequences[0, prompt_ids.shape[1]:out.lengths[0]].tolist())
                texts[i].add(text)
                if i == 0:
                    shown = text  # every text is the same at T = 0 (checked below)
                if name in totals:
                    totals[name].merge(out.stats)
                else:
                    totals[name] = out.stats
        for name, st in totals.items():
            runs[name].append(st)
    rows = [(name, sorted(st, key=lambda s: s.tokens_per_s)[len(st) // 2]) for name, st in runs.items()]
    print("=" * 27 + " continuation " + "=" * 27 + f"\n{shown}\n" + "=" * 68)

    print(f"\ntemperature 0, {len(ids)} prompt(s), {args.max_new_tokens} new tokens at most each, "
          f"device {device}, {torch.get_num_threads()} torch threads, "
          f"{'every method compiled' if args.compile else 'eager'}; {_which_run(args.repeats)}")
    print(f"{'method':<32}{'tokens':>8}{'tau':>8}{'tok/s':>10}{'vs AR':>8}"
          f"{'draft s':>9}{'verify s':>10}{'replay s':>10}")
    base = rows[0][1].tokens_per_s
    for name, s in rows:
        print(f"{name:<32}{s.new_tokens:>8}{s.tau:>8.2f}{s.tokens_per_s:>10.1f}"
              f"{s.tokens_per_s / base:>7.2f}x{s.draft_s:>9.2f}{s.verify_s:>10.2f}{s.replay_s:>10.2f}")
    if args.compile:
        print("(auto over suffix trees does not compile: row left out)")
    same = all(len(t) == 1 for t in texts)
    print("\nall texts identical per prompt (lossless at temperature 0):", "YES" if same else "NO")
    return 0 if same else 1


def _draft_for(drafter: str | None, draft):
    """The draft model, or None for a tree that needs none (a suffix tree)."""
    return None if drafter is not None and drafter.startswith("suffix:") else draft


def _describe(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    kinds = {}
    from stree.walk import mixers  # the model's sequence mixers

    for _, m in mixers(model):
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    layers = ", ".join(f"{v} x {k}" for k, v in kinds.items())
    return f"{n / 1e6:.2f}M parameters, {layers}"


def main(argv=None) -> int:
    from stree.errors import guarded

    return guarded(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
