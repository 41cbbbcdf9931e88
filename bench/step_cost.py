"""What one tree step costs against one decoding step, on a checkpoint's target (fixed cost of a
tree step is what decides a CPU's gain).

After a ``--prefill``-token prompt (a held-out stretch of text, any content), side by side in one
process, interleaved, medians of ``--repeats``:

* ``own step``: the model's own cached one-token decoding step (``stree.generate(method="ar")``'s
  session: transformers' ``generate`` path, or the hybrid's own ``step``);
* ``stree step``: stree's one-node path (a root alone through ``tree_forward`` and ``commit``,
  method ``ar-tree``);
* ``tree_forward(N)``: a ``--nodes``-node tree (the shape of ``--tree``'s template, or a full
  binary tree) from the same committed state, without the commit.

    scripts/venv python bench/step_cost.py --models models/stree-gdn --prefill 200 --nodes 16
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stree  # noqa: E402
from stree import checkpoints  # noqa: E402
from stree.native import session_factory  # noqa: E402


def _time(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(target, prefill: int, nodes: int, repeats: int = 30, seed: int = 0) -> dict:
    """Seconds of the three calls (see the module docstring) on a patched ``target``."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.lm_head.weight.shape[0]
    prompt = torch.randint(0, vocab, (1, prefill), generator=gen)
    token = torch.randint(0, vocab, (1,), generator=gen)
    own = session_factory(target)(target, 1, prefill, prefill + 4 * repeats + 8)
    own.prefill(prompt)
    cache = target.allocate_tree_cache(1, prefill + nodes + repeats * 4 + 8)
    target.prefill(prompt, cache, logits=False)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    tree = stree.TokenTree(torch.randint(0, vocab, (nodes,), generator=gen), parents)
    root = stree.TokenTree(token, [-1])

    def stree_step():
        target.tree_forward(root, cache)
        cache.commit(torch.tensor([[0]]), [1])

    def tree_step():
        target.tree_forward(tree, cache)
        cache.pending = None

    with torch.inference_mode():
        for fn in (lambda: own.step(token), stree_step, tree_step):  # warm-up
            fn()
        rounds = {"own step": [], "stree step": [], f"tree_forward({nodes})": []}
        for _ in range(3):  # interleaved rounds, each a median of `repeats`
            rounds["own step"].append(_time(lambda: own.step(token), repeats))
            rounds["stree step"].append(_time(stree_step, repeats))
            rounds[f"tree_forward({nodes})"].append(_time(tree_step, repeats))
    return {k: statistics.median(v) for k, v in rounds.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="a directory holding target/ (a shipped pair)")
    p.add_argument("--prefill", type=int, default=200)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = stree.patch(checkpoints.load_model(str(Path(args.models) / "target"), "cpu", torch.float32))
    t = measure(target, args.prefill, args.nodes, args.repeats)
    base = min(t["own step"], t["stree step"])
    for k, v in t.items():
        print(f"{k:>20}: {v * 1e3:7.2f} ms  ({v / base:.2f}x the faster decoding step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
