"""Host overhead of one decoding step: aten ops per layer by layer type, host syncs, wall time.

For every call a step makes (``tree_forward`` of 1, 13 and 63 nodes, ``commit``, one draft (all its
levels) and one verify (target ``tree_forward`` + verifier)) this reports:

* **ops per layer**, by layer type (``Mamba2``, ``Mamba2GQA``, ``MHA``, ``LlamaAttention``): the aten
  ops dispatched from Python inside that layer's mixer (``ops``: top-level aten calls, i.e. what the
  library issues; ``compute``: those of them that are not views, or are views that had to copy
  (a ``reshape`` of non-viewable strides clones), i.e. what launches a kernel on a GPU;
  ``dispatches``: every aten event including the ones aten ops call internally). A call of stree's
  C++ CPU ops (``stree.kernels.cpu_ops``) counts as one op that computes.
  Per-layer scopes come from wrapping stree's per-layer entry points in ``record_function`` here
  (nothing in the library is instrumented); ``rest`` is everything outside the mixers (embedding,
  norms, MLPs, LM head, per-tree tables, validation), per call. On CUDA ``kernels`` counts the
  kernel launches the profiler attributes to each scope.
* **host syncs per call**: reads of tensor data by the host, counted by wrapping ``Tensor.item``,
  ``tolist``, ``__bool__``, ``__int__``, ``__float__`` and ``__index__`` for the duration of the call
  (``int(t)``, ``if t.any():``, ``.tolist()`` all land there). On a GPU each is a device-to-host
  copy that waits for the stream; on this CPU they are counted the same way. The call sites are listed
  in the JSON rows.
* **wall time** per call (median over repeats, no profiler, ``--threads`` torch threads).

``--gpu-path`` counts, on this CPU, what the same calls issue on CUDA: every choice stree makes by
``is_cuda`` takes its CUDA branch (the Triton TreeConv, TreeScan and SSM-replay kernels, mamba_ssm's
Triton gated RMSNorm), the kernels running under ``TRITON_INTERPRET=1``. Each kernel launch counts
once (``launches``) and the interpreter's own work inside it is not counted; the host-side ops
around the kernels are the ones a GPU would launch. Outside the mixers (``rest``) the CPU branches
stay (mamba_ssm's fused add+norm is an autotuned kernel the interpreter cannot tune). Wall times are
not taken (the interpreter's).

Models: the shipped pair (``--models``, target and draft) and, with ``--layers``, one layer of each
full-size layer type with random weights (Mamba2-2.7B's Mamba2 and an MHA of the same width;
Llama3.1-Mamba2-8B's Mamba2GQA and Llama attention), batch 1, fp32, small vocabulary. ``--tiny``
replaces everything by tiny random models (seconds; the smoke test).

    python bench/overhead.py --models models/stree-tiny --layers --tag before
    python bench/overhead.py --tiny --out /tmp/x
    python bench/overhead.py --models models/stree-tiny --layers --gpu-path --tag gpu-path
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
for _p in (str(_HERE.parent), str(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import RESULTS, metadata, result_stem, write_rows  # noqa: E402

SCOPE = "stree::"
LAUNCH = SCOPE + "launch:"  # one Triton kernel launch (--gpu-path)
CPU_OP = SCOPE + "cpu_op:"  # one call of stree's C++ CPU ops (outside the dispatcher: one op each)
_LAUNCHING = [0]  # > 0 while the interpreter runs a kernel
# Ops that only make a new view of existing storage: host work, but no kernel on a GPU.
VIEW_OPS = {f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "t",
    "permute", "expand", "expand_as", "slice", "select", "split", "split_with_sizes", "chunk",
    "unflatten", "flatten", "narrow", "as_strided", "alias", "detach", "unbind", "view_as",
    "movedim", "diagonal", "unfold", "lift_fresh")}
COPY_OPS = {"aten::clone", "aten::copy_"}  # what makes a view op (reshape, flatten) a kernel
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


# ---------------------------------------------------------------------------- instrumentation
def _scoped(fn, name_of):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(SCOPE + name_of(*args, **kwargs)):
            return fn(*args, **kwargs)
    wrapper.__wrapped__ = fn
    return wrapper


@contextmanager
def layer_scopes():
    """Wrap stree's per-layer entry points (tree forward, draft node step and commit of each mixer
    type) in ``record_function`` scopes named after the layer type; undone on exit."""
    from stree import cache as cache_mod
    from stree.layers import attention, mamba2

    saved = []

    def swap(owner, attr, new):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    swap(mamba2, "tree_forward", _scoped(mamba2.tree_forward, lambda m, *a, **k: type(m).__name__))
    # a draft level runs its Mamba2 layers by the recurrence, one node per row
    swap(mamba2, "node_step",
         _scoped(mamba2.node_step, lambda m, *a, **k: type(m).__name__ + ".node_step"))
    swap(attention, "tree_forward", _scoped(
        attention.tree_forward, lambda a, *r, **k: type(getattr(a, "m", a)).__name__))
    for cls in _activation_classes(cache_mod):
        swap(cls, "commit", _scoped(cls.commit, lambda acts, *a, **k: type(acts).__name__.replace("Activations", "") + ".commit"))
    from stree.kernels import cpu_ops
    module = cpu_ops.ops()  # a pybind module: its calls never reach the profiler on their own
    for name in [] if module is None else [n for n in dir(module) if not n.startswith("_")]:
        swap(module, name, _scoped(getattr(module, name), lambda *a, _n=name, **k: CPU_OP[len(SCOPE):] + _n))
    try:
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)


def _activation_classes(cache_mod):
    names = ("MambaActivations", "AttentionActivations", "NodeStates")
    return [getattr(cache_mod, n) for n in names
            if hasattr(getattr(cache_mod, n, None), "commit")]


@contextmanager
def gpu_path():
    """Take stree's CUDA branches on the CPU (see the module docstring); each Triton launch is
    scoped as ``LAUNCH + kernel name``. Needs ``TRITON_INTERPRET=1`` set before triton is
    imported; undone on exit."""
    from triton.runtime.interpreter import InterpretedFunction

    from stree.hybrid import mamba as hybrid_mamba
    from stree.layers import mamba2

    saved = []

    def swap(owner, attr, new):
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    for name in ("tree_scan", "tree_conv", "replay"):  # the "auto" rule on a CUDA tensor
        swap(importlib.import_module(f"stree.kernels.{name}"), "use_triton",
             lambda impl, like: impl != "ref")
    swap(mamba2, "_gated_norm", lambda norm, y, z: norm(y, z))
    swap(torch.cuda, "device", lambda index: nullcontext())  # mamba_ssm's launchers enter it

    def hybrid_norm(self, y, z):
        return hybrid_mamba.rmsnorm_fn(y, self.weight, None, z=z, eps=self.eps,
                                       group_size=self.group_size, norm_before_gate=False)
    swap(hybrid_mamba.GatedRMSNorm, "forward", hybrid_norm)
    run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        _LAUNCHING[0] += 1  # host reads inside the interpreter are not the library's
        try:
            with torch.profiler.record_function(LAUNCH + self.__name__):
                return run(self, *args, **kwargs)
        finally:
            _LAUNCHING[0] -= 1
    swap(InterpretedFunction, "run", launch)
    try:
        yield
    finally:
        for owner, attr, old in reversed(saved):
            setattr(owner, attr, old)


@contextmanager
def count_syncs(sites: Counter):
    """Count host reads of tensor data (see the module docstring) into ``sites[file:line]``."""
    originals = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            if _LAUNCHING[0]:
                return fn(self, *args, **kwargs)
            frame = traceback.extract_stack(limit=3)[0]
            sites[f"{Path(frame.filename).name}:{frame.lineno}:{name}"] += 1
            return fn(self, *args, **kwargs)
        return counted

    for m, fn in originals.items():
        setattr(torch.Tensor, m, wrap(m, fn))
    try:
        yield
    finally:
        for m, fn in originals.items():
            setattr(torch.Tensor, m, fn)


def profile_call(fn, cuda: bool):
    """(result, {scope: {"ops", "compute", "dispatches", "kernels", "launches"}}, total top-level
    ops) of one call."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    scopes: dict[str, dict] = {}
    top_total = 0
    for e in events:
        if (e.name.startswith("aten::") and _aten_parent(e) is None and not _in_launch(e)) or e.name.startswith(CPU_OP):
            top_total += 1
        if not e.name.startswith(SCOPE) or e.name.startswith(CPU_OP) or _in_scope(e):
            continue
        ops = dispatches = kernels = compute = launches = 0
        stack = list(e.cpu_children)
        while stack:
            c = stack.pop()
            if c.name.startswith(LAUNCH):  # a kernel: one launch, its interpreter work not ops
                launches += 1
                continue
            if c.name.startswith(CPU_OP):  # one op that computes, whatever aten calls it makes
                ops, compute, dispatches = ops + 1, compute + 1, dispatches + 1
                continue
            if c.name.startswith("aten::"):
                dispatches += 1
                kernels += len(getattr(c, "kernels", []) or [])
                if _aten_parent(c) is None:
                    ops += 1
                    compute += c.name not in VIEW_OPS or _copies(c)
            stack.extend(c.cpu_children)
        agg = scopes.setdefault(e.name[len(SCOPE):], {"calls": 0, "ops": 0, "compute": 0,
                                                      "dispatches": 0, "kernels": 0, "launches": 0})
        agg["calls"] += 1
        agg["compute"] += compute
        agg["ops"] += ops
        agg["dispatches"] += dispatches
        agg["kernels"] += kernels
        agg["launches"] += launches
    return out, scopes, top_total


def _copies(e) -> bool:
    """Whether an op copied data somewhere inside it (a view op that could not be a view)."""
    stack = list(e.cpu_children)
    while stack:
        c = stack.pop()
        if c.name in COPY_OPS:
            return True
        stack.extend(c.cpu_children)
    return False


def _ancestor(e, prefix: str):
    """The nearest enclosing profiler event whose name starts with ``prefix``, or None."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(prefix):
            return p
        p = p.cpu_parent
    return None


def _aten_parent(e):
    return _ancestor(e, "aten::")


def _in_launch(e):
    return _ancestor(e, LAUNCH) is not None


def _in_scope(e):
    return _ancestor(e, SCOPE) is not None


def measure(name: str, fn, setup, args, cuda: bool) -> dict:
    """One row: per-layer-type op counts, host syncs and wall time of ``fn`` (``setup`` before each)."""
    setup()
    fn()  # warm: per-module constants and per-tree tables are built on first use, then reused
    setup()
    with layer_scopes():
        _, scopes, total = profile_call(fn, cuda)
    setup()
    sites: Counter = Counter()
    with count_syncs(sites):
        fn()
    samples = []
    for _ in range(0 if args.gpu_path else args.repeats + 1):  # no interpreter timings
        setup()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    per_layer = {k: {"layers": v["calls"], "ops": v["ops"] // max(v["calls"], 1),
                     "compute": v["compute"] // max(v["calls"], 1),
                     "dispatches": v["dispatches"] // max(v["calls"], 1),
                     "kernels": v["kernels"] // max(v["calls"], 1),
                     "launches": v["launches"] // max(v["calls"], 1)} for k, v in sorted(scopes.items())}
    in_layers = sum(v["ops"] for v in scopes.values())
    return dict(call=name, per_layer=per_layer, ops_total=total, ops_rest=total - in_layers,
                host_syncs=sum(sites.values()), sync_sites=dict(sites),
                wall_ms=1e3 * statistics.median(samples[1:]) if samples[1:] else math.nan)


# ---------------------------------------------------------------------------------- scenarios
def tree_of(nodes: int, device, vocab: int, gen):
    from stree.tree import TokenTree, parents_from_widths
    widths = {1: None, 13: (3, 3, 3, 3), 63: (2, 4, 8, 16, 32)}[nodes]
    parents = [-1] if widths is None else parents_from_widths(widths)
    tokens = torch.randint(0, vocab, (1, len(parents)), generator=gen).to(device)
    return TokenTree(tokens, parents)


def model_rows(label: str, model, args, device, cuda: bool, prompt_len: int, vocab: int,
               draft=None) -> list[dict]:
    """tree_forward (1/13/63), commit, and with a draft model: one draft and one verify."""
    from stree.draft import parse_drafter
    from stree.sampling import SamplingConfig
    from stree.verify import get_verifier

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=gen).to(device)
    cache = model.allocate_tree_cache(1, prompt_len + 256)
    model.prefill(prompt, cache)
    rows = []
    for n in (1, 13, 63):
        tree = tree_of(n, device, vocab, gen)
        rows.append(measure(f"tree_forward_{n}", lambda: model.tree_forward(tree, cache),
                            lambda: None, args, cuda))
    tree = tree_of(13, device, vocab, gen)
    path = tree.paths[:, -1]  # a deepest root-to-leaf path (5 nodes)
    snapshot = _snapshot(cache)

    def setup_commit():
        _restore(cache, snapshot)
        model.tree_forward(tree, cache)
    rows.append(measure("commit_5", lambda: cache.commit(path), setup_commit, args, cuda))
    _restore(cache, snapshot)
    if draft is not None:
        dcache = draft.allocate_tree_cache(1, prompt_len + 256)
        draft.prefill(prompt, dcache)
        sampling = SamplingConfig()
        drafter = parse_drafter("static:fig4a").with_mode("deterministic")
        roots = prompt[:, -1]
        rows.append(measure(f"draft_fig4a_{drafter.depth}_levels",
                            lambda: drafter.draft(draft, dcache, roots, sampling),
                            lambda: None, args, cuda))
        # the same draft with every level re-running the whole partial tree (tree_forward only)
        rows.append(measure(f"draft_fig4a_{drafter.depth}_levels_rerun",
                            lambda: drafter.draft(_TreeForwardOnly(draft), dcache, roots, sampling),
                            lambda: None, args, cuda))
        d = drafter.draft(draft, dcache, roots, sampling)
        verifier = get_verifier("greedy")

        def verify():
            return verifier.verify(d, model.tree_forward(d.tree, cache), sampling)
        rows.append(measure("verify_fig4a", verify, lambda: None, args, cuda))
    for r in rows:
        r["model"] = label
    return rows


class _TreeForwardOnly:
    """A draft model seen without ``level_forward``: drafters then re-run the whole partial tree
    at every level (the way before level-by-level drafting), for a side-by-side comparison."""

    def __init__(self, model):
        self.tree_forward = model.tree_forward


def _snapshot(cache):
    return ({i: {k: v.clone() for k, v in vars(c).items() if torch.is_tensor(v)}
             for i, c in cache.layers.items()}, cache.lengths.clone(), list(cache.seqlens))


def _restore(cache, snap):
    layers, lengths, seqlens = snap
    for i, tensors in layers.items():
        for k, v in tensors.items():
            getattr(cache.layers[i], k).copy_(v)
    cache.lengths.copy_(lengths)
    cache.seqlens = list(seqlens)
    cache.pending = None


def step_syncs(target, draft, args, device, vocab: int) -> dict:
    """Host syncs per generate step (draft + verify + both commits), over a short generation."""
    import stree
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, 16), generator=gen).to(device)
    sites: Counter = Counter()
    with count_syncs(sites):
        out = stree.generate(target, draft, prompt, max_new_tokens=args.step_tokens,
                             drafter="static:fig4a")
    steps = max(out.stats.target_calls, 1)
    return dict(model="pair", call="generate_step", host_syncs=sum(sites.values()) / steps,
                sync_sites={k: v / steps for k, v in sites.items()}, per_layer={},
                target_calls=out.stats.target_calls)


# ---------------------------------------------------------------------------------- models
def load_pair(directory: str, device):
    """The shipped pair as ``stree demo`` runs it: fp32 on CPU, bf16 on CUDA."""
    import stree
    from stree.hybrid import MambaInLlamaForCausalLM
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return tuple(stree.patch(MambaInLlamaForCausalLM.from_pretrained(Path(directory) / name,
                                                                     dtype=dtype, device=device))
                 for name in ("target", "draft"))


def tiny_pair(device):
    import stree
    from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM
    torch.manual_seed(0)
    cfg = MambaInLlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, attn_layers=(1,), d_state=16)
    dcfg = MambaInLlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, d_state=16)
    return (stree.patch(MambaInLlamaForCausalLM(cfg).eval().to(device)),
            stree.patch(MambaInLlamaForCausalLM(dcfg).eval().to(device)))


def layer_models(device, tiny: bool):
    """``[(label, patched model)]``: one layer of each full-size type (Mamba2-2.7B's Mamba2, an MHA
    of the same width; Llama3.1-Mamba2-8B's Mamba2GQA and Llama attention), vocab 256."""
    import stree
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
    from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM

    d, state, hd, heads, kv, mlp = (2560, 128, 64, 20, 4, 0) if not tiny else (64, 16, 16, 4, 2, 0)
    d8, heads8, kv8, hd8 = (4096, 32, 8, 128) if not tiny else (64, 4, 2, 16)
    torch.manual_seed(0)
    mcfg = MambaConfig(d_model=d, n_layer=2, vocab_size=256, d_intermediate=mlp,
                       ssm_cfg={"layer": "Mamba2", "d_state": state, "headdim": hd, "ngroups": 1},
                       attn_layer_idx=[1], attn_cfg={"num_heads": heads, "num_heads_kv": kv,
                                                     "causal": True, "qkv_proj_bias": False},
                       pad_vocab_size_multiple=8)
    mamba = stree.patch(MambaLMHeadModel(mcfg).eval().to(device))
    hcfg = MambaInLlamaConfig(vocab_size=256, hidden_size=d8, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=heads8, num_key_value_heads=kv8, head_dim=hd8,
                              attn_layers=(1,), d_state=hd8,
                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192})
    with torch.device(device):
        hybrid = stree.patch(MambaInLlamaForCausalLM(hcfg).eval())
    return [("mamba2-2.7B-layers" if not tiny else "mamba2-tiny-layers", mamba),
            ("llama3.1-mamba2-8B-layers" if not tiny else "hybrid-tiny-layers", hybrid)]


# ---------------------------------------------------------------------------------- report
def print_rows(rows: list[dict]) -> None:
    print(f"{'model':<28} {'call':<24} {'layer type':<15} {'ops/layer':>9} {'compute':>7} {'disp/layer':>10} "
          f"{'kernels':>7} {'launch':>6} {'rest ops':>8} {'syncs':>6} {'wall ms':>8}")
    for r in rows:
        types = r["per_layer"] or {"-": {"ops": "", "compute": "", "dispatches": "", "kernels": "",
                                         "launches": ""}}
        for j, (t, v) in enumerate(types.items()):
            tail = (f"{r.get('ops_rest', ''):>8} {r['host_syncs']:>6.4g} {r.get('wall_ms', float('nan')):>8.2f}"
                    if j == 0 else "")
            print(f"{r['model'] if j == 0 else '':<28} {r['call'] if j == 0 else '':<24} {t:<15} "
                  f"{v['ops']:>9} {v['compute']:>7} {v['dispatches']:>10} {v['kernels']:>7} "
                  f"{v['launches']:>6} {tail}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="models/stree-tiny", help="directory with target/ and draft/")
    p.add_argument("--layers", action="store_true", help="also one layer of each 2.7B/8B layer type")
    p.add_argument("--tiny", action="store_true", help="tiny random models only (smoke test)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--step-tokens", type=int, default=48, help="tokens generated to count syncs per step")
    p.add_argument("--gpu-path", action="store_true",
                   help="count stree's CUDA branches on this CPU, Triton kernels interpreted "
                        "(op and launch counts only, see the module docstring)")
    p.add_argument("--tag", default="", help="label stored in every row (e.g. before / after)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.gpu_path:
        if cuda:
            raise SystemExit("--gpu-path counts the CUDA path on a CPU; on a GPU run without it")
        if os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules:
            raise SystemExit("--gpu-path needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    if not cuda:
        torch.set_num_threads(args.threads)
    meta = metadata(device)
    meta.update(threads=args.threads if not cuda else None, tag=args.tag, gpu_path=args.gpu_path)
    with gpu_path() if args.gpu_path else nullcontext():
        rows = _rows(args, device, cuda)
    rows = [{**meta, **r} for r in rows]
    print_rows(rows)
    name = "overhead_tiny" if args.tiny else "overhead"
    paths = write_rows(rows, result_stem(args.out, name + (f"_{args.tag}" if args.tag else ""), meta))
    print("wrote", *map(str, paths))
    return 0


def _rows(args, device, cuda: bool) -> list[dict]:
    rows = []
    with torch.inference_mode():
        target, draft = tiny_pair(device) if args.tiny else load_pair(args.models, device)
        vocab = target.lm_head.weight.shape[0]
        rows += model_rows("target", target, args, device, cuda, args.prompt_len, vocab, draft=draft)
        rows += model_rows("draft", draft, args, device, cuda, args.prompt_len, vocab)
    rows.append(step_syncs(target, draft, args, device, vocab))
    if args.layers or args.tiny:
        with torch.inference_mode():
            for label, model in layer_models(device, args.tiny):
                rows += model_rows(label, model, args, device, cuda, 16, 256)
                del model
    return rows


if __name__ == "__main__":
    sys.exit(main())
