"""Cost of the suffix index behind ``suffix:N`` (``stree.draft.suffix_index``), without any model.

A context of L tokens of real code (this Python's standard library, tokenized by the shipped
pair's tokenizer) is indexed, then 256 decoding steps follow the text: each step reads the tree
for the context (``ContextIndex.speculate``, the lookup), the tokens the text continues with are
"accepted" as far as the tree holds them plus one, and the index is updated with them (the
update). Reported per context length: lookup and update time per step (median and 95th
percentile, microseconds), building the index over the context (microseconds per token), the
trie's materialised nodes and the Python heap it holds (``tracemalloc``), and the tokens drafted
and accepted per step. With ``--cache`` the same runs also match a :class:`stree.SuffixCache`
holding ``--cache-outputs`` earlier outputs of 128 tokens from the same files.

    python bench/suffix_index.py --lengths 1024 2048 4096 8192 32768
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import RESULTS, metadata, result_stem, write_rows  # noqa: E402

STEPS = 256


def code_tokens(tokenizer_dir: str, count: int) -> list[int]:
    """The first ``count`` tokens of the standard library's files (path order), concatenated."""
    from models import data
    from stree.checkpoints import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    out: list[int] = []
    for path in data.corpus_files():
        out += tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if len(out) >= count:
            break
    return out[:count]


def follow(index, config, text: list[int], start: int, steps: int):
    """Decode ``steps`` steps along ``text`` from position ``start`` (the context is
    ``text[:start]``); returns per-step lookup and update seconds, drafted and accepted tokens."""
    lookup, update, drafted, accepted = [], [], [], []
    pos = start
    for _ in range(steps):
        t0 = time.perf_counter()
        index.root([text[pos]])  # the root: the last token the model emitted
        spec = index.speculate(config)[0]
        t1 = time.perf_counter()
        node, k = -1, 0
        while pos + 1 + k < len(text):  # accepted: the text's continuation as far as the tree holds it
            nxt = next((i for i, (t, p) in enumerate(zip(spec.tokens, spec.parents))
                        if p == node and t == text[pos + 1 + k]), None)
            if nxt is None:
                break
            node, k = nxt, k + 1
        t2 = time.perf_counter()
        index.rows[0].push(text[pos + 1:pos + 1 + k])  # what observe() appends after the root
        index._rooted, index._specs = False, {}
        t3 = time.perf_counter()
        lookup.append(t1 - t0)
        update.append(t3 - t2)
        drafted.append(len(spec))
        accepted.append(k)
        pos += 1 + k
    return lookup, update, drafted, accepted


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="models/stree-tiny/target")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768])
    ap.add_argument("--tree", default="suffix:16")
    ap.add_argument("--cache", action="store_true", help="also match a cache of earlier outputs")
    ap.add_argument("--cache-outputs", type=int, default=512)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)

    from stree import SuffixCache
    from stree.draft import parse_drafter
    from stree.draft.suffix import ContextIndex

    config = parse_drafter(a.tree).config
    need = max(a.lengths) + 4 * STEPS * 4 + (a.cache_outputs * 128 if a.cache else 0)
    text = code_tokens(a.tokenizer, need)
    meta = metadata("cpu")
    rows = []
    print(f"# {meta['device']} | commit {meta['commit']} | {meta['date']} | {a.tree}")
    print(f"{'context':>8} {'cache':>6} {'lookup us p50/p95':>18} {'update us p50/p95':>18} "
          f"{'build us/tok':>12} {'nodes':>8} {'heap MB':>8} {'drafted':>8} {'accepted':>9}")
    for cached in ([False, True] if a.cache else [False]):
        cache = None
        if cached:
            cache = SuffixCache()
            base = max(a.lengths) + 4 * STEPS * 4
            for j in range(a.cache_outputs):
                cache.add(text[base + 128 * j: base + 128 * (j + 1)])
        for length in a.lengths:
            index = ContextIndex(cache)
            tracemalloc.start()
            t0 = time.perf_counter()
            index.start([text[:length]])
            build = (time.perf_counter() - t0) / length
            heap = tracemalloc.get_traced_memory()[0] / 2 ** 20
            tracemalloc.stop()
            lookup, update, drafted, accepted = follow(index, config, text, length, STEPS)
            q = statistics.quantiles
            row = dict(meta, tree=a.tree, context=length, cache_outputs=a.cache_outputs if cached else 0,
                       lookup_us_p50=statistics.median(lookup) * 1e6, lookup_us_p95=q(lookup, n=20)[-1] * 1e6,
                       update_us_p50=statistics.median(update) * 1e6, update_us_p95=q(update, n=20)[-1] * 1e6,
                       build_us_per_token=build * 1e6, trie_nodes=index.rows[0].trie.num_nodes,
                       heap_mb=heap, drafted_per_step=statistics.mean(drafted),
                       accepted_per_step=statistics.mean(accepted), steps=STEPS)
            rows.append(row)
            print(f"{length:>8} {row['cache_outputs']:>6} {row['lookup_us_p50']:>8.1f}/{row['lookup_us_p95']:<9.1f}"
                  f"{row['update_us_p50']:>8.1f}/{row['update_us_p95']:<9.1f}{row['build_us_per_token']:>12.2f}"
                  f"{row['trie_nodes']:>8}{row['heap_mb']:>9.1f}{row['drafted_per_step']:>8.2f}"
                  f"{row['accepted_per_step']:>9.2f}", flush=True)
    written = write_rows(rows, result_stem(a.out, "suffix-index", meta))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
