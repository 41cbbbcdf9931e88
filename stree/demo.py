"""``stree demo``: the main job on the small target/draft pair the project ships (``models/``).

Generates from a real prompt (a HumanEval problem) with STree, prints the text, then decodes the
same prompt with the target's own autoregressive decoding (its own prefill and ``step``, see
``stree.native``: the baseline), vanilla chain speculative decoding (4 drafted tokens) and STree
at temperature 0, prints tau, tokens/s and the speed-up over the model's own decoding side by
side, and checks that every run's text is identical (exactness: all must equal the target's greedy
output).

The tree is chosen for the device, as STree's cost analysis (Eq. 7/8: time per token = t(N) / tau)
says: on a GPU a verify pass costs about the same for 1 or 63 nodes, so the bushier Fig. 4a tree
(13 nodes) pays; on a 2-core CPU the target's verify cost grows with the node count (the matmuls
become compute-bound), so the narrowest branching tree of the chain's depth (the root's two best
children, each continued as a chain: 9 nodes) pays. Both have the chain's depth of 4.

Each method runs ``--repeats`` times, the methods interleaved (AR, chain, tree, AR, ...), and the
table reports the median run, so a slow moment of a shared machine does not land on one method.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

DEFAULT_MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "models", "stree-tiny")
FALLBACK_PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
TREES = {"cuda": ("STree (fig4a)", "static:fig4a"), "cpu": ("STree (2 chains x 4)", "static:2,2,2,2")}


def methods(device: torch.device) -> list[tuple[str, str, str | None]]:
    """(label, generate method, drafter) of the three rows, the tree chosen for the device."""
    label, tree = TREES["cuda" if device.type == "cuda" else "cpu"]
    return [("autoregressive (model's own)", "ar", None), ("chain SD (K=4)", "chain", "chain:4"),
            (label, "tree", tree)]


def build_parser(parser=None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="stree demo", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help="directory holding target/ and draft/ (default: the shipped pair)")
    parser.add_argument("--prompt", default=None, help="prompt text (default: HumanEval/0)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per method, interleaved; the median is reported (default 3)")
    from stree.cli import add_debug_flag

    add_debug_flag(parser)
    return parser


def default_prompt() -> str:
    try:
        from stree.prompts import load_prompts

        return load_prompts("humaneval", limit=1)[0]
    except (ImportError, FileNotFoundError):
        return FALLBACK_PROMPT


def run(args) -> int:
    from stree.cli import default_eos, encode_prompt, load_role, load_tokenizer, model_config
    from stree.generate import generate

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
    prompt = args.prompt if args.prompt is not None else default_prompt()
    if not prompt:
        raise ValueError("the prompt is empty (--prompt): generation needs at least one prompt token")
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(target_dir)
    # the shipped models saw <|endoftext|> (= bos) before every training file
    ids = torch.tensor([encode_prompt(tokenizer, prompt, model_config(target_dir).get("bos_token_id"))],
                       device=device)
    target = load_role("target", target_dir, device, dtype)
    draft = load_role("draft", draft_dir, device, dtype)
    eos = default_eos(target_dir, tokenizer)
    print(f"target: {_describe(target)}\ndraft:  {_describe(draft)}\n")
    print("=" * 30 + " prompt " + "=" * 30 + f"\n{prompt}")

    rows_of = methods(device)
    # warm every method up once so no timed run pays for lazy initialisation
    for _, method, drafter in rows_of:
        generate(target, draft, ids, 8, method=method, drafter=drafter, eos_token_id=eos)
    runs: dict[str, list] = {name: [] for name, _, _ in rows_of}
    texts = set()  # every run's text: one element iff all are identical
    for _ in range(args.repeats):
        for name, method, drafter in rows_of:
            out = generate(target, draft, ids, args.max_new_tokens, method=method, drafter=drafter,
                           eos_token_id=eos)
            text = tokenizer.decode(out.sequences[0, ids.shape[1]:out.lengths[0]].tolist())
            texts.add(text)
            runs[name].append(out.stats)
    rows = [(name, sorted(st, key=lambda s: s.tokens_per_s)[len(st) // 2]) for name, st in runs.items()]
    print("=" * 24 + " STree continuation " + "=" * 24 + f"\n{text}\n" + "=" * 68)

    print(f"\ntemperature 0, {args.max_new_tokens} new tokens at most, device {device}, "
          f"{torch.get_num_threads()} torch threads; median of {args.repeats} interleaved runs")
    print(f"{'method':<30}{'tokens':>8}{'tau':>8}{'tok/s':>10}{'vs AR':>8}"
          f"{'draft s':>9}{'verify s':>10}{'replay s':>10}")
    base = rows[0][1].tokens_per_s
    for name, s in rows:
        print(f"{name:<30}{s.new_tokens:>8}{s.tau:>8.2f}{s.tokens_per_s:>10.1f}"
              f"{s.tokens_per_s / base:>7.2f}x{s.draft_s:>9.2f}{s.verify_s:>10.2f}{s.replay_s:>10.2f}")
    same = len(texts) == 1
    print("\nall texts identical (lossless at temperature 0):", "YES" if same else "NO")
    return 0 if same else 1


def _describe(model) -> str:
    n = sum(p.numel() for p in model.parameters())
    kinds = {}
    from stree.patch import _stree_mixers  # the patched model's sequence mixers

    for _, m in _stree_mixers(model):
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    layers = ", ".join(f"{v} x {k}" for k, v in kinds.items())
    return f"{n / 1e6:.2f}M parameters, {layers}"


def main(argv=None) -> int:
    from stree.cli import guarded

    return guarded(run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
