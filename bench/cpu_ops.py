"""stree's C++ tree-row ops (``stree/kernels/csrc``) one call at a time, at the shipped target's
layer shapes, beside the eager PyTorch that runs where they cannot.

Per tree (``caterpillar:2,2,2``: 7 nodes; a 16-token chain: 17 nodes, a suffix tree's largest)
and committed context (attention only), microseconds per call (best of 5 repeats of 500 calls,
one torch thread, as vLLM's CPU worker runs on this machine):

- ``tree_conv_rows``: a Mamba2 layer's tree conv (conv dim 1152, width 4), gathers included;
- ``tree_scan_rows``: its tree scan (6 heads of 64 x 64 states);
- ``tree_attention_rows``: an attention layer's tree rows (6 query heads on 2 KV heads of 64
  channels) read in place from a paged cache laid out as vLLM's fp32 CPU cache (blocks of 128
  tokens, K channel-major, V token-major), against the eager baseline: the context gathered and
  SDPA under the tree mask (the gathered path of ``stree.vllm.attention_rows.tree_attention``).

    python bench/cpu_ops.py

Rows go to ``bench/results/cpu_ops_{device}_{date}.{csv,json}`` (device, commit, date in each).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import RESULTS, best_us, metadata, result_stem, write_rows  # noqa: E402
from stree.kernels.cpu_ops import ops  # noqa: E402
from stree.tree import TokenTree  # noqa: E402

TREES = {"caterpillar:2,2,2": [-1, 0, 0, 1, 1, 3, 3], "chain:16": [-1] + list(range(16))}
CONTEXTS = (128, 320)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 128  # the shipped target's attention; vLLM's CPU block
SSM_HEADS, SSM_STATE, GROUPS, WIDTH = 6, 64, 6, 4  # its Mamba2 layers (d_inner 384, ngroups 6)


CALLS = 500  # per timed repeat (``--calls``), best of 5 repeats


def _mamba_rows(module, parents: list[int], calls: int) -> list[dict]:
    n = len(parents)
    tree = TokenTree(torch.zeros(1, n, dtype=torch.long), parents)
    index = torch.arange(n)[None]
    conv_dim = SSM_HEADS * HEAD_DIM + 2 * GROUPS * SSM_STATE
    x = torch.randn(n, conv_dim)
    conv_state = torch.randn(4, conv_dim, WIDTH - 1 + 16)
    weight, bias = torch.randn(conv_dim, WIDTH), torch.randn(conv_dim)
    window0, out = tree.conv_window(WIDTH)[0].contiguous(), torch.empty_like(x)
    conv = best_us(lambda: module.tree_conv_rows(x, conv_state, torch.tensor([1]), torch.tensor([0]), index, window0,
                                                 weight, bias, True, out), calls)
    xs, B, C = torch.split(torch.randn(n, conv_dim), [SSM_HEADS * HEAD_DIM, GROUPS * SSM_STATE, GROUPS * SSM_STATE], -1)
    xs, B, C = xs.view(n, SSM_HEADS, HEAD_DIM), B.view(n, GROUPS, SSM_STATE), C.view(n, GROUPS, SSM_STATE)
    dt, A = torch.randn(n, SSM_HEADS), -torch.rand(SSM_HEADS)
    D, dt_bias = torch.randn(SSM_HEADS), torch.randn(SSM_HEADS)
    ssm_state, y = torch.randn(4, SSM_HEADS, HEAD_DIM, SSM_STATE), torch.empty(n, SSM_HEADS, HEAD_DIM)
    par = torch.tensor(parents)
    scan = best_us(lambda: module.tree_scan_rows(xs, dt, B, C, ssm_state, torch.tensor([1]), index, par, A, D,
                                                 dt_bias, y), calls)
    return [dict(op="tree_conv_rows", nodes=n, context=None, us=conv),
            dict(op="tree_scan_rows", nodes=n, context=None, us=scan)]


def _attention_rows(module, parents: list[int], context: int, calls: int) -> list[dict]:
    n = len(parents)
    mask = TokenTree(torch.zeros(1, n, dtype=torch.long), parents).mask[0].contiguous()
    length = context + n
    blocks = -(-length // BLOCK)
    # vLLM's fp32 CPU cache: (blocks, kv_heads, block, head_dim) views over K channel-major and V
    # token-major head regions; the request's blocks in reverse order, as a block table scatters them
    k_memory = torch.randn(blocks + 1, KV_HEADS, HEAD_DIM, BLOCK)
    v_cache = torch.randn(blocks + 1, KV_HEADS, BLOCK, HEAD_DIM)
    k_cache = k_memory.transpose(2, 3)
    table = torch.arange(blocks, 0, -1)[None]
    lengths, index = torch.tensor([length]), torch.arange(n)[None]
    query, out = torch.randn(n, HEADS, HEAD_DIM), torch.empty(n, HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    op = best_us(lambda: module.tree_attention_rows(query, k_cache, v_cache, 1, BLOCK, HEAD_DIM, 1, table, lengths,
                                                    index, mask, scale, out), calls)
    allowed = torch.ones(n, length, dtype=torch.bool)
    allowed[:, context:] = mask
    # the eager path per layer: K and V gathered at element offsets built once per step (one
    # index_select each over the cache's memory), SDPA under the mask
    pos = torch.arange(length)
    region = table[0, pos // BLOCK][None, :, None] * (KV_HEADS * BLOCK * HEAD_DIM) \
        + torch.arange(KV_HEADS)[:, None, None] * (BLOCK * HEAD_DIM)  # (kv_heads, L, 1): block and head
    k_off = region + (pos % BLOCK)[None, :, None] + torch.arange(HEAD_DIM) * BLOCK  # channel-major
    v_off = region + (pos % BLOCK)[None, :, None] * HEAD_DIM + torch.arange(HEAD_DIM)  # token-major
    k_flat, v_flat = k_memory.view(-1), v_cache.view(-1)

    def gathered():
        k = k_flat.index_select(0, k_off.view(-1)).view(KV_HEADS, length, HEAD_DIM)
        v = v_flat.index_select(0, v_off.view(-1)).view(KV_HEADS, length, HEAD_DIM)
        return F.scaled_dot_product_attention(query.transpose(0, 1)[None], k[None], v[None], attn_mask=allowed,
                                              scale=scale, enable_gqa=True)

    torch.testing.assert_close(gathered()[0].transpose(0, 1), out, rtol=1e-4, atol=1e-4)  # same math
    eager = best_us(gathered, calls)
    return [dict(op="tree_attention_rows", nodes=n, context=context, us=op, eager_us=eager)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per timed repeat")
    args = parser.parse_args(argv)
    module = ops()
    if module is None:
        print("stree's C++ CPU ops are unavailable here (see the warning)", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    meta = metadata("cpu")
    rows = []
    for name, parents in TREES.items():
        found = _mamba_rows(module, parents, args.calls)
        found += [r for c in CONTEXTS for r in _attention_rows(module, parents, c, args.calls)]
        rows += [dict(meta, tree=name, **r) for r in found]
    for r in rows:
        eager = f"  eager {r['eager_us']:7.1f} us" if "eager_us" in r else ""
        context = f", context {r['context']}" if r["context"] else ""
        print(f"{r['op']:20s} {r['tree']:18s} ({r['nodes']} nodes{context}): {r['us']:7.1f} us{eager}")
    for path in write_rows(rows, result_stem(args.out, "cpu_ops", meta)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
