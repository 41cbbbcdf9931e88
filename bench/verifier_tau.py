"""Accepted tokens per step of sampling verifiers on the same drafts (no timing).

For each drafter and each "driver" verifier, ``stree.generate`` runs at T = 1 over the first
``--prompts`` HumanEval prompts (batch 1, ``--max-new-tokens``, one fixed seed per prompt). Two
numbers per verifier:

* ``own``: ``out.stats.tau`` of the run that verifier drives (its drafts differ from the other
  runs' after the first step);
* ``same``: every draft of the driver's run is also verified ``--repeats`` times by each verifier
  of the group (its own generator, so the driver's run is unchanged); 1 + their mean accepted
  tokens: tokens per step on identical drafts, a paired comparison.

    python bench/verifier_tau.py --prompts 5 --max-new-tokens 64
    python bench/verifier_tau.py --groups chain:4 --repeats 32
"""
from __future__ import annotations

import argparse
import json

import torch

# drafter -> (verifiers that drive a run, verifiers that also verify every draft)
GROUPS = {
    "chain:4": (["sps", "asps", "block"], ["sps", "asps", "block", "mss", "traversal"]),
    "caterpillar:2,2,2": (["mss", "traversal"], ["mss", "traversal"]),
    "caterpillar:2,2,2:iid": (["mss", "traversal"], ["mss", "traversal"]),
    "static:fig4a": (["mss", "traversal"], ["mss", "traversal"]),
    "caterpillar:2,2,2+suffix:16": (["mss", "traversal"], ["mss", "traversal"]),
}


def repeated(draft, r: int):
    """``draft`` (one row) as ``r`` identical rows."""
    from stree.draft_types import Draft
    from stree.tree import TokenTree

    t = draft.tree
    tree = TokenTree(t.tokens.expand(r, -1).contiguous(), t.parents.expand(r, -1).contiguous())

    def rows(x):
        return None if x is None else x.expand(r, *x.shape[1:]).contiguous()

    return Draft(tree, rows(draft.q), draft.mode, rows(draft.fixed), rows(draft.drawn))


class Shadowed:
    """A verifier object: ``driver``'s verdicts; every verifier of ``others`` also verifies each
    draft ``repeats`` times and its mean accepted tokens are kept per step."""

    def __init__(self, driver: str, others: list[str], repeats: int):
        from stree.verify import get_verifier

        self.driver, self.name = get_verifier(driver), driver
        self.others = {name: get_verifier(name) for name in others}
        self.repeats, self.generator = repeats, torch.Generator().manual_seed(12345)
        self.accepted = {name: [] for name in others}

    def check(self, draft_mode, sampling):
        self.driver.check(draft_mode, sampling)

    def verify(self, draft, target_logits, sampling, generator=None):
        verdict = self.driver.verify(draft, target_logits, sampling, generator)
        many = repeated(draft, self.repeats)
        logits = target_logits.expand(self.repeats, -1, -1).contiguous()
        for name, verifier in self.others.items():
            got = verifier.verify(many, logits, sampling, self.generator).num_accepted
            self.accepted[name].append(float(got.double().mean()))
        return verdict


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", default="models/stree-tiny", help="directory with target/ and draft/")
    p.add_argument("--prompts", type=int, default=5, help="first N HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=256, help="verifications of each draft")
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS),
                   help="drafters to run")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import stree
    from stree.hybrid import MambaInLlamaForCausalLM
    from stree.prompts import load_prompts
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    load = lambda role: stree.patch(MambaInLlamaForCausalLM.from_pretrained(  # noqa: E731
        f"{args.pair}/{role}", dtype=torch.float32))
    target, draft = load("target"), load("draft")
    tokenizer = Tokenizer.from_file(f"{args.pair}/target/tokenizer.json")
    prompts = [torch.tensor([[0] + tokenizer.encode(text).ids])
               for text in load_prompts("humaneval", limit=args.prompts)]
    print(f"{'drafter':<30} {'driver':<10} {'own':>6}  same drafts")
    for drafter in args.groups:
        drivers, others = GROUPS[drafter]
        for driver in drivers:
            tokens = steps = 0
            same = {name: [] for name in others}
            for i, ids in enumerate(prompts):
                verifier = Shadowed(driver, others, args.repeats)
                out = stree.generate(target, draft, ids, max_new_tokens=args.max_new_tokens,
                                     temperature=1.0, drafter=drafter, verifier=verifier,
                                     generator=torch.Generator().manual_seed(1000 + i))
                tokens += out.stats.tau * out.stats.steps
                steps += out.stats.steps
                for name in others:
                    same[name] += verifier.accepted[name]
            row = dict(drafter=drafter, driver=driver, own=tokens / steps, steps=steps,
                       same={name: 1 + sum(a) / len(a) for name, a in same.items()})
            cells = "  ".join(f"{name} {tau:.3f}" for name, tau in row["same"].items())
            print(f"{drafter:<30} {driver:<10} {row['own']:>6.3f}  {cells}")
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
