"""Whole-model verification cost: a packed token tree through stree vs a 1-token decode step and vs
unrolling the tree into root-to-leaf rows, on full-size models with random weights (bf16, CUDA).

(a) Mamba2-2.7B shape: mamba_ssm ``MambaLMHeadModel`` (d_model 2560, 64 Mamba2 layers, d_state 128,
    headdim 64, expand 2, 1 group, vocab 50288) patched with ``stree.patch``; full binary trees of
    15, 31 and 63 nodes.
(b) Llama3.1-Mamba2-8B shape: ``stree.hybrid.MambaInLlamaForCausalLM`` (d_model 4096, 32 layers, the
    odd ones Llama attention (50%), 32 heads of 128, 8 KV heads (d_xb 1024), d_state 128, MLP 14336,
    vocab 128256, llama3 RoPE); the Fig. 4a tree (13 nodes) and full binary trees of 31 and 63 nodes.

Both run after a prefill of ``--prompt-len`` random tokens. What each row times (``method``):

* ``tree``: ``model.tree_forward(tree, cache)``, the whole tree in one pass (batch 1). STree.
* ``decode_tree_1``: ``tree_forward`` of a 1-node tree: one token through stree's path.
* ``decode_mamba_ssm`` (a): the unmodified model's own decode step, ``model(input_ids,
  inference_params=...)`` with ``seqlen_offset > 0``, i.e. ``Mamba2.step`` in every layer.
* ``decode_step`` (b): the hybrid's own 1-token decode, ``MambaInLlamaForCausalLM.step``.
* ``unrolled_step`` (a): every root-to-leaf path is a batch row (batch = leaves); the committed state
  is copied into every row, then depth + 1 decode steps of the unmodified model (``Mamba2.step``).
  The copy is timed: a step writes the state in place, so each row needs its own.
* ``unrolled_chunked`` (a): the same rows in one prefill from the copied state: conv1d + the chunked
  SSD scan from initial states (stree's prefill, because mamba_ssm's own forward cannot start from a
  state). The copy is timed, as above.
* ``unrolled_chain`` (a): the same rows as a batch of chains in one ``tree_forward`` (what
  ``stree.generate(method="unrolled")`` verifies with); the per-row state copy is made once, untimed.

Correctness first: (a) every node's logits of ``tree``, ``unrolled_chunked`` and ``unrolled_chain``
are compared with ``unrolled_step`` (the unmodified model), and ``decode_tree_1`` with
``decode_mamba_ssm``; (b) every node's tree logits with the model's own chunked forward over each
root-to-leaf path (untimed) and ``decode_tree_1`` with ``decode_step``. The max abs error is printed and
the script stops when the error relative to the largest logit exceeds ``--tol``.

Timing: CUDA events, warmup, the median of ``--repeats``; peak memory (``torch.cuda.max_memory_allocated``,
and the part above what was allocated before the call) from one untimed call. With ``--cuda-graph`` each
method is also timed as a CUDA graph replay when it has no host synchronisation (checked first); a
method that synchronises (``tree_forward`` checks its token ids on the host; stree's prefill too) keeps
an empty graph column, and a ratio uses graph times only when both sides have one.

The target ratios (issue 2: largest / smallest tree <= 1.3x and unrolled_step / tree >= 2x on the
largest tree; issue 3: Fig. 4a tree / decode step <= 1.25x, largest tree / decode step <= 1.6x) are
printed as a second table. Rows go to ``bench/results/model_verify_*.csv/.json`` and
``model_verify_*_targets.csv/.json`` with device, commit and date.

    python bench/model_verify.py --cuda-graph           # GPU, both models
    python bench/model_verify.py --tiny                  # CPU smoke check: tiny shapes, seconds
"""
from __future__ import annotations

import argparse
import gc
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):  # run as a script from anywhere: stree and _common
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import RESULTS, cpu_workarounds, metadata, result_stem, time_fn, write_rows  # noqa: E402

# stree and mamba_ssm are imported inside the functions: a tiny CPU run must switch Triton to its
# interpreter (cpu_workarounds) before they import it.

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SECTIONS = ("mamba2", "hybrid")


@dataclass(frozen=True)
class MambaShape:
    """A mamba_ssm MambaLMHeadModel of Mamba2 layers (default: Mamba2-2.7B)."""

    d_model: int = 2560
    n_layer: int = 64
    d_state: int = 128
    headdim: int = 64
    expand: int = 2
    ngroups: int = 1
    vocab_size: int = 50288
    chunk_size: int = 256


@dataclass(frozen=True)
class HybridShape:
    """A MambaInLlama hybrid, attention in every odd layer (default: Llama3.1-Mamba2-8B)."""

    d_model: int = 4096
    n_layer: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    d_state: int = 128
    intermediate_size: int = 14336
    vocab_size: int = 128256
    max_position_embeddings: int = 131072


TINY_MAMBA = MambaShape(d_model=64, n_layer=2, d_state=16, headdim=16, vocab_size=256, chunk_size=16)
TINY_HYBRID = HybridShape(d_model=64, n_layer=2, num_heads=4, num_kv_heads=2, head_dim=16, d_state=16,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=512)

WHAT = {
    "tree": "stree tree_forward of the packed tree, batch 1",
    "decode_tree_1": "stree tree_forward of a 1-node tree",
    "decode_mamba_ssm": "unmodified model's decode step (inference_params, Mamba2.step)",
    "decode_step": "hybrid's own 1-token decode (MambaInLlamaForCausalLM.step)",
    "unrolled_step": "leaf paths as batch rows: state copy + depth+1 unmodified decode steps",
    "unrolled_chunked": "leaf paths as batch rows: state copy + one chunked-SSD prefill from state",
    "unrolled_chain": "leaf paths as batch rows: one tree_forward over a batch of chains",
}


@dataclass
class Settings:
    """How to run: device and dtype, prefilled tokens, timing, graphs, output tolerance."""

    device: torch.device
    dtype: torch.dtype
    prompt_len: int
    warmup: int
    repeats: int
    inner: int
    graphs: bool
    tol: float


@dataclass
class Tree:
    """A benchmarked tree: its label, the TokenTree (batch 1) and its root-to-leaf node paths."""

    label: str
    tree: object  # stree.tree.TokenTree
    paths: torch.Tensor  # (leaves, depth + 1)

    @property
    def tokens(self) -> torch.Tensor:
        """(leaves, depth + 1) the tokens along each root-to-leaf path."""
        return self.tree.tokens[0, self.paths]


# ---- setup -------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cpu with --tiny, else cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and trees (CPU smoke check)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--mamba-trees", nargs="+", default=None,
                    help="full binary tree sizes 2^k - 1 or static preset names (default 15 31 63)")
    ap.add_argument("--hybrid-trees", nargs="+", default=None, help="default fig4a 31 63")
    ap.add_argument("--prompt-len", type=int, default=None, help="prefilled tokens (default 512)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=1, help="calls per timed sample")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="also time CUDA graph replays of the methods that allow capture")
    ap.add_argument("--tol", type=float, default=None,
                    help="max error relative to the largest logit (default 5e-2 bf16/fp16, 1e-3 fp32)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.device is None:  # the tiny shapes are the CPU smoke check
        args.device = "cpu" if args.tiny else "cuda"
    if args.device == "cpu":
        if not args.tiny:
            ap.error("--device cpu only runs the --tiny smoke check")
        args.dtype = "fp32"  # CPU smoke runs check the maths in fp32
        cpu_workarounds()
    if args.tiny:
        args.warmup, args.repeats, args.inner = 1, 2, 1
    args.mamba_trees = args.mamba_trees or (["7", "15"] if args.tiny else ["15", "31", "63"])
    args.hybrid_trees = args.hybrid_trees or (["fig4a", "15"] if args.tiny else ["fig4a", "31", "63"])
    args.prompt_len = args.prompt_len or (16 if args.tiny else 512)
    if args.tol is None:
        args.tol = 1e-3 if args.dtype == "fp32" else 5e-2
    return args


def tree_label(spec: str) -> str:
    return f"binary{spec}" if spec.isdigit() else spec


def make_tree(spec: str, vocab_size: int, device, seed: int) -> Tree:
    """``spec``: a full binary tree size (2^k - 1) or a static preset name (``fig4a``)."""
    from stree.draft.presets import STATIC_TREES
    from stree.tree import TokenTree, parents_from_widths

    if spec in STATIC_TREES:
        widths = STATIC_TREES[spec]
    elif spec.isdigit() and int(spec) >= 3 and not (int(spec) + 1) & int(spec):
        widths = [2 ** k for k in range(1, (int(spec) + 1).bit_length() - 1)]
    else:
        raise SystemExit(f"tree {spec!r}: expected a full binary tree size 2^k - 1 >= 3 or a preset name")
    parents = parents_from_widths(widths)
    gen = torch.Generator().manual_seed(seed)
    tree = TokenTree(torch.randint(vocab_size, (len(parents),), generator=gen), parents).to(device)
    deepest = tree.depth[0] == tree.max_depth
    leaves = len(parents) - len(set(parents[1:]))
    if int(deepest.sum()) != leaves:  # unrolled rows must all have depth + 1 tokens
        raise SystemExit(f"tree {spec!r}: every leaf must be at the deepest level")
    return Tree(tree_label(spec), tree, tree.paths[0][deepest])


def build_mamba2(shape: MambaShape, s: Settings):
    import stree
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    ssm_cfg = {"layer": "Mamba2", "d_state": shape.d_state, "headdim": shape.headdim,
               "expand": shape.expand, "ngroups": shape.ngroups, "chunk_size": shape.chunk_size}
    cfg = MambaConfig(d_model=shape.d_model, n_layer=shape.n_layer, d_intermediate=0,
                      vocab_size=shape.vocab_size, ssm_cfg=ssm_cfg, rms_norm=True,
                      residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16)
    torch.manual_seed(0)
    return stree.patch(MambaLMHeadModel(cfg, device=s.device, dtype=s.dtype).eval())


def build_hybrid(shape: HybridShape, s: Settings):
    import stree
    from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM

    cfg = MambaInLlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.d_model,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.n_layer,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, d_state=shape.d_state, attn_layers=tuple(range(1, shape.n_layer, 2)),
        rope_theta=500000.0, max_position_embeddings=shape.max_position_embeddings,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device(s.device):  # initialise on the device: 8B parameters are slow on a CPU
        model = MambaInLlamaForCausalLM(cfg)
    return stree.patch(model.to(s.dtype).eval())


# ---- measuring ---------------------------------------------------------------------------

def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    out, ref = out.float(), ref.float()
    err = (out - ref).abs().max().item()
    return dict(max_abs_err=err, rel_err=err / max(ref.abs().max().item(), 1e-30),
                argmax_agree=(out.argmax(-1) == ref.argmax(-1)).float().mean().item())


def measure(s: Settings, name: str, fn, *, view=None, ref=None, against: str | None = None):
    """Run ``fn`` once (peak memory, output check against ``ref`` after ``view``), then time it.

    Returns (row fields, the first call's output). Stops the script on a wrong output.
    """
    cuda = s.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    out = fn()
    row = dict(method=name, what=WHAT[name], checked_against=against)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        row.update(peak_gib=peak / 2 ** 30, extra_gib=(peak - before) / 2 ** 30)
    if ref is not None:
        row.update(compare(view(out) if view else out, ref))
        if not row["rel_err"] <= s.tol:
            raise SystemExit(f"{name} is wrong against {against}: max abs error {row['max_abs_err']:.3g} "
                             f"= {row['rel_err']:.2e} of the largest logit > tol {s.tol:g} (--tol)")
    eager, _ = time_fn(fn, s.device, s.warmup, s.repeats, s.inner, graphs=False)
    row["eager_ms"] = eager * 1e3
    row["graph_ms"] = None
    if s.graphs and cuda:
        sec, graphed = time_fn(fn, s.device, s.warmup, s.repeats, s.inner, graphs=True)
        row["graph_ms"] = sec * 1e3 if graphed else None
    return row, out


def copy_committed(dst_conv, dst_ssm, src) -> None:
    """Broadcast one committed ``MambaLayerCache`` (batch 1) into every row of ``dst``."""
    dst_conv.copy_(src.conv_state.expand_as(dst_conv))
    dst_ssm.copy_(src.ssm_state.expand_as(dst_ssm))


def mamba_ssm_params(model, cache, rows: int, prompt_len: int):
    """mamba_ssm InferenceParams for ``rows`` rows holding ``cache``'s committed state; returns
    (params, reload) where ``reload()`` copies the committed state in again."""
    from mamba_ssm.utils.generation import InferenceParams

    params = InferenceParams(max_seqlen=prompt_len + 64, max_batch_size=rows)
    params.key_value_memory_dict = model.allocate_inference_cache(rows, prompt_len + 64)

    def reload():
        for i, (conv, ssm) in params.key_value_memory_dict.items():
            copy_committed(conv, ssm, cache.layers[i])
        params.seqlen_offset = prompt_len  # > 0: Mamba2.forward takes its decode step

    reload()
    return params, reload


def prefill(model, s: Settings, vocab_size: int):
    """A cache of batch 1 holding ``prompt_len`` random tokens; returns (prompt, cache)."""
    prompt = torch.randint(vocab_size, (1, s.prompt_len), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(s.device)
    cache = model.allocate_tree_cache(1, s.prompt_len + 128)
    model.prefill(prompt, cache)
    return prompt, cache


# ---- (a) Mamba2 --------------------------------------------------------------------------

def run_mamba2(args, s: Settings) -> list[dict]:
    from stree.tree import TokenTree

    shape = TINY_MAMBA if args.tiny else MambaShape()
    model = build_mamba2(shape, s)
    _, cache = prefill(model, s, shape.vocab_size)
    trees = [make_tree(spec, shape.vocab_size, s.device, seed=10 + i)
             for i, spec in enumerate(args.mamba_trees)]
    base = dict(model="mamba2", shape=asdict(shape), prompt_len=s.prompt_len)
    root = trees[0].tree.tokens[:, :1]

    params, _ = mamba_ssm_params(model, cache, 1, s.prompt_len)
    decode, oracle = measure(s, "decode_mamba_ssm", lambda: model(
        root, inference_params=params, num_last_tokens=1).logits)
    one = TokenTree(root[0], [-1])
    tree1, _ = measure(s, "decode_tree_1", lambda: model.tree_forward(one, cache), ref=oracle[:, -1],
                       view=lambda out: out[:, 0], against="decode_mamba_ssm")
    rows = [dict(base, tree="-", nodes=1, leaves=1, depth=0, **r) for r in (decode, tree1)]
    for t in trees:
        print(f"  mamba2 {t.label}", flush=True)
        rows += [dict(base, tree=t.label, nodes=t.tree.num_nodes, leaves=t.paths.shape[0],
                      depth=t.paths.shape[1] - 1, **r) for r in mamba2_tree(model, cache, t, s)]
    return rows


def mamba2_tree(model, cache, t: Tree, s: Settings) -> list[dict]:
    """The packed tree and the three unrolled baselines on one tree (their per-row caches are
    freed on return)."""
    from stree.tree import TokenTree

    L, tokens, (leaves, steps) = s.prompt_len, t.tokens, t.paths.shape
    params, reload = mamba_ssm_params(model, cache, leaves, L)

    def unrolled_step():
        reload()
        outs = []
        for j in range(steps):
            outs.append(model(tokens[:, j:j + 1], inference_params=params,
                              num_last_tokens=1).logits[:, -1])
            params.seqlen_offset += 1
        return torch.stack(outs, 1)

    chunk_cache = model.allocate_tree_cache(leaves, L + steps)

    def unrolled_chunked():
        for i, layer in chunk_cache.layers.items():
            copy_committed(layer.conv_state, layer.ssm_state, cache.layers[i])
        chunk_cache.seqlens, chunk_cache.pending = [L] * leaves, None
        chunk_cache.lengths.fill_(L)
        return model.prefill(tokens, chunk_cache)

    chain_cache = model.allocate_tree_cache(leaves, L + steps)
    for i, layer in chain_cache.layers.items():
        copy_committed(layer.conv_state, layer.ssm_state, cache.layers[i])
    chain_cache.advance([L] * leaves)
    chains = TokenTree.chain(tokens)

    step_row, oracle = measure(s, "unrolled_step", unrolled_step)
    check = dict(ref=oracle, against="unrolled_step")
    tree_row, _ = measure(s, "tree", lambda: model.tree_forward(t.tree, cache),
                          view=lambda out: out[0, t.paths], **check)
    chunk_row, _ = measure(s, "unrolled_chunked", unrolled_chunked, **check)
    chain_row, _ = measure(s, "unrolled_chain", lambda: model.tree_forward(chains, chain_cache), **check)
    return [tree_row, step_row, chunk_row, chain_row]


# ---- (b) hybrid --------------------------------------------------------------------------

def own_forward_oracle(model, prompt, tokens) -> torch.Tensor:
    """The hybrid's own chunked forward over each root-to-leaf path after the prompt: (rows, steps, v)."""
    rows, steps = tokens.shape
    own = model.allocate_inference_cache(rows, prompt.shape[1] + steps)
    model(prompt.expand(rows, -1), own, num_last_tokens=1)
    return model(tokens, own).float()


def run_hybrid(args, s: Settings) -> list[dict]:
    from stree.tree import TokenTree

    shape = TINY_HYBRID if args.tiny else HybridShape()
    model = build_hybrid(shape, s)
    L = s.prompt_len
    prompt, cache = prefill(model, s, shape.vocab_size)
    trees = [make_tree(spec, shape.vocab_size, s.device, seed=20 + i)
             for i, spec in enumerate(args.hybrid_trees)]
    base = dict(model="hybrid", shape=asdict(shape), prompt_len=L)
    root = trees[0].tree.tokens[:, :1]

    own = model.allocate_inference_cache(1, L + 1)
    model(prompt, own, num_last_tokens=1)

    def decode_step():
        own.seqlen = L  # the same position every call: static shapes, no cache overflow
        return model.step(root, own)

    decode, oracle = measure(s, "decode_step", decode_step)
    one = TokenTree(root[0], [-1])
    tree1, _ = measure(s, "decode_tree_1", lambda: model.tree_forward(one, cache), ref=oracle[:, -1],
                       view=lambda out: out[:, 0], against="decode_step")
    rows = [dict(base, tree="-", nodes=1, leaves=1, depth=0, **r) for r in (decode, tree1)]
    for t in trees:
        print(f"  hybrid {t.label}", flush=True)
        oracle = own_forward_oracle(model, prompt, t.tokens)
        row, _ = measure(s, "tree", lambda t=t: model.tree_forward(t.tree, cache), ref=oracle,
                         view=lambda out, t=t: out[0, t.paths], against="own forward over leaf paths")
        rows.append(dict(base, tree=t.label, nodes=t.tree.num_nodes, leaves=t.paths.shape[0],
                         depth=t.paths.shape[1] - 1, **row))
        del oracle
    return rows


# ---- report ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """A ratio of two rows' times with the goal an issue sets for it (None: informational)."""

    model: str
    num: tuple[str, str]  # (method, tree label)
    den: tuple[str, str]
    goal: tuple[str, float] | None = None  # ("<=", 1.3) or (">=", 2.0)
    issue: str = ""


def targets(args) -> list[Target]:
    m_small, m_big = tree_label(args.mamba_trees[0]), tree_label(args.mamba_trees[-1])
    h_first, h_big = tree_label(args.hybrid_trees[0]), tree_label(args.hybrid_trees[-1])
    out = []
    if "mamba2" in args.sections:
        out += [Target("mamba2", ("tree", m_big), ("tree", m_small), ("<=", 1.3), "2"),
                Target("mamba2", ("unrolled_step", m_big), ("tree", m_big), (">=", 2.0), "2"),
                Target("mamba2", ("unrolled_chunked", m_big), ("tree", m_big)),
                Target("mamba2", ("unrolled_chain", m_big), ("tree", m_big)),
                Target("mamba2", ("tree", m_small), ("decode_mamba_ssm", "-")),
                Target("mamba2", ("tree", m_big), ("decode_mamba_ssm", "-")),
                Target("mamba2", ("decode_tree_1", "-"), ("decode_mamba_ssm", "-"))]
    if "hybrid" in args.sections:
        out += [Target("hybrid", ("tree", h_first), ("decode_step", "-"), ("<=", 1.25), "3"),
                Target("hybrid", ("tree", h_big), ("decode_step", "-"), ("<=", 1.6), "3"),
                Target("hybrid", ("decode_tree_1", "-"), ("decode_step", "-"))]
    return out


def ratio_rows(rows: list[dict], args, meta: dict) -> list[dict]:
    """Each target's measured ratio: graph times when both rows have one, else eager times."""
    by = {(r["model"], r["method"], r["tree"]): r for r in rows}
    out = []
    for t in targets(args):
        a, b = by[(t.model, *t.num)], by[(t.model, *t.den)]
        mode = "graph" if a["graph_ms"] is not None and b["graph_ms"] is not None else "eager"
        value = a[f"{mode}_ms"] / b[f"{mode}_ms"]
        met = None
        if t.goal is not None:
            op, bound = t.goal
            met = value <= bound if op == "<=" else value >= bound
        out.append(dict(meta, model=t.model, ratio=f"{t.num[0]}[{t.num[1]}] / {t.den[0]}[{t.den[1]}]",
                        value=value, timing=mode, goal=f"{t.goal[0]} {t.goal[1]}" if t.goal else None,
                        met=met, issue=t.issue or None))
    return out


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_tables(rows: list[dict], ratios: list[dict], tiny: bool) -> None:
    print(f"\n{'model':<7} {'tree':<9} {'nodes':>5} {'leaves':>6} {'method':<17} {'eager ms':>9} "
          f"{'graph ms':>9} {'max|err|':>9} {'rel err':>8} {'argmax':>7} {'peak GiB':>9} {'+GiB':>7}")
    for r in rows:
        print(f"{r['model']:<7} {r['tree']:<9} {r['nodes']:>5} {r['leaves']:>6} {r['method']:<17} "
              f"{r['eager_ms']:>9.3f} {_fmt(r['graph_ms'], '9.3f'):>9} "
              f"{_fmt(r.get('max_abs_err'), '9.2e'):>9} {_fmt(r.get('rel_err'), '8.1e'):>8} "
              f"{_fmt(r.get('argmax_agree'), '7.3f'):>7} {_fmt(r.get('peak_gib'), '9.2f'):>9} "
              f"{_fmt(r.get('extra_gib'), '7.3f'):>7}")
    print("\nmethods:")
    for name in dict.fromkeys(r["method"] for r in rows):
        print(f"  {name:<17} {WHAT[name]}")
    print("\n| model | ratio | value | timing | goal | met | issue |\n|---|---|---:|---|---|---|---|")
    for r in ratios:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"| {r['model']} | {r['ratio']} | {r['value']:.2f}x | {r['timing']} | "
              f"{r['goal'] or '-'} | {met} | {r['issue'] or '-'} |")
    if tiny:
        print("(tiny smoke run: the ratios say nothing about the full-size models)")


def main(argv=None) -> int:
    args = parse_args(argv)
    s = Settings(device=torch.device(args.device), dtype=DTYPES[args.dtype], prompt_len=args.prompt_len,
                 warmup=args.warmup, repeats=args.repeats, inner=args.inner,
                 graphs=args.cuda_graph, tol=args.tol)
    meta = dict(metadata(s.device), dtype=args.dtype, tiny=args.tiny, cuda_graphs=args.cuda_graph,
                warmup=s.warmup, repeats=s.repeats, inner=s.inner)
    print(f"# {meta['device']} | commit {meta['commit']} | {meta['date']} | {args.dtype} | "
          f"prompt {s.prompt_len} tokens | CUDA graphs: {args.cuda_graph}")
    rows = []
    runners = {"mamba2": run_mamba2, "hybrid": run_hybrid}
    with torch.inference_mode():
        for section in args.sections:
            rows += [dict(meta, **r) for r in runners[section](args, s)]
            gc.collect()  # free the model before building the next one
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
    ratios = ratio_rows(rows, args, meta)
    print_tables(rows, ratios, args.tiny)
    stem = result_stem(args.out, f"model_verify_{'tiny' if args.tiny else 'full'}", meta)
    written = write_rows(rows, stem) + write_rows(ratios, stem.with_name(stem.name + "_targets"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
