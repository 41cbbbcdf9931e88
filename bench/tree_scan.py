"""Per-layer microbenchmark: one Mamba2 layer's conv1d + SSM over a token tree, three ways.

* ``packed``: stree's ``tree_conv`` + ``tree_scan`` on the packed tree (one launch each).
* ``unrolled_step``: every root-to-leaf path as a batch row, ``depth + 1`` decode steps of
  ``causal_conv1d_update`` (or Mamba2.step's torch conv when causal-conv1d is missing) and
  mamba_ssm's ``selective_state_update``, from a per-row copy of the committed state.
* ``unrolled_chunk``: the leaf paths as a batch of sequences through ``causal_conv1d_fn`` (or torch
  conv1d) and ``mamba_chunk_scan_combined`` (best of several chunk sizes), from the committed state.

Full binary trees of 15, 31, 63 nodes; the default layer is Mamba2 at d_model 2560 (80 heads of 64,
d_state 128, 1 group, d_conv 4, bf16). Outputs are checked first (every method against an fp32
reference at every tree node), then each op is timed with CUDA events (warmup, median of repeats,
CUDA graphs unless ``--no-graphs``). Prints a table and writes CSV + JSON rows (device, commit,
date) to ``bench/results/``. The whole model (``--layers``, 64 by default) is estimated as that many
times the layer.

    python bench/tree_scan.py                        # GPU
    python bench/tree_scan.py --tiny                 # CPU smoke check only (Triton interpreter)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

from _common import ROOT, cpu_workarounds, metadata as run_metadata, result_stem, time_fn, write_rows


@dataclasses.dataclass(frozen=True)
class Layer:
    nheads: int = 80
    headdim: int = 64
    dstate: int = 128
    ngroups: int = 1
    d_conv: int = 4

    @property
    def channels(self) -> int:
        return self.nheads * self.headdim + 2 * self.ngroups * self.dstate


TINY = Layer(nheads=2, headdim=16, dstate=16, ngroups=1, d_conv=4)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cpu with --tiny, else cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny layer and trees (CPU smoke check)")
    ap.add_argument("--nodes", type=int, nargs="+", default=None,
                    help="full binary tree sizes, 2^k - 1 (default 15 31 63; tiny: 3 7)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    ap.add_argument("--no-graphs", action="store_true", help="time eager launches, no CUDA graphs")
    ap.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 256])
    ap.add_argument("--layers", type=int, default=64, help="layers of the whole-model estimate")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    if args.device is None:  # the tiny shapes are the CPU smoke check
        args.device = "cpu" if args.tiny else "cuda"
    if args.device == "cpu":
        if not args.tiny:
            ap.error("--device cpu only runs the --tiny smoke check")
        if args.dtype == "bf16":
            args.dtype = "fp32"  # the interpreter computes bf16 wrongly
        # The test suite's CPU workarounds: Triton interpreter, mamba_ssm's torch.cuda.device
        # wrappers, one config per autotuner (the interpreter cannot benchmark candidates).
        cpu_workarounds()
    if args.nodes is None:
        args.nodes = [3, 7] if args.tiny else [15, 31, 63]
    if args.tiny:
        args.chunk_sizes = [16]
        args.warmup, args.repeats, args.inner = 1, 3, 1
    return args


# ---- inputs ------------------------------------------------------------------------------

def full_binary_parents(n: int) -> list[int]:
    if n < 1 or (n + 1) & n:
        raise ValueError(f"a full binary tree has 2^k - 1 nodes, got {n}")
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def make_inputs(layer: Layer, n: int, dtype, device, seed=0):
    """One layer's tree inputs (batch 1) with Mamba2's parameter ranges."""
    from stree.tree import TokenTree

    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    h, p, s, w, c = layer.nheads, layer.headdim, layer.dstate, layer.d_conv, layer.channels
    # Mamba2's initialisation: dt in [1e-3, 0.1] log-uniform, A in [-16, -1].
    dt_init = torch.exp(torch.rand(h, generator=gen) * (math.log(0.1) - math.log(1e-3))
                        + math.log(1e-3))
    tree = TokenTree(torch.zeros(n, dtype=torch.int64), full_binary_parents(n)).to(device)
    return dict(
        tree=tree,
        xbc=randn(1, n, c),
        conv_state=randn(1, c, w),
        weight=randn(c, w, scale=w ** -0.5),
        bias=randn(c, scale=0.1),
        dt=randn(1, n, h, scale=0.5),
        dt_bias=(dt_init + torch.log(-torch.expm1(-dt_init))).to(device),  # inverse softplus
        A=-torch.exp(torch.rand(h, generator=gen) * math.log(16.0)).to(device),
        D=torch.ones(h, device=device),
        z=randn(1, n, h, p),
        h0=randn(1, h, p, s, scale=0.1),
    )


def split_xbc(xbc, layer: Layer):
    """(..., c) -> x (..., h, p), B (..., g, s), C (..., g, s)."""
    hp, gs = layer.nheads * layer.headdim, layer.ngroups * layer.dstate
    x, B, C = torch.split(xbc, [hp, gs, gs], dim=-1)
    return (x.unflatten(-1, (layer.nheads, layer.headdim)),
            B.unflatten(-1, (layer.ngroups, layer.dstate)),
            C.unflatten(-1, (layer.ngroups, layer.dstate)))


# ---- the three implementations -----------------------------------------------------------

def packed(inp, layer: Layer):
    """stree on the packed tree.

    Returns the op closures {"conv", "ssm", "layer"} and the layer closure -> (1, n, h, p).
    """
    from stree.kernels import tree_conv, tree_scan

    window, mask = inp["tree"].conv_window(layer.d_conv), inp["tree"].mask
    conv_args = (inp["xbc"], inp["conv_state"], inp["weight"], inp["bias"], window)

    def conv():
        return tree_conv(*conv_args, impl="triton")  # the kernel, also in the CPU smoke check

    x, B, C = split_xbc(conv(), layer)

    def ssm(x=x, B=B, C=C):
        return tree_scan(x, inp["dt"], inp["A"], B, C, mask, D=inp["D"], z=inp["z"],
                         dt_bias=inp["dt_bias"], initial_states=inp["h0"], impl="triton")[0]

    def layer_fn():
        return ssm(*split_xbc(conv(), layer))

    return {"conv": conv, "ssm": ssm, "layer": layer_fn}, layer_fn


def leaf_paths(tree):
    """(leaves, depth + 1) root-to-leaf node indices (all leaves of a full tree are deepest)."""
    paths = tree.paths[0]
    return paths[tree.depth[0] == tree.max_depth]


def conv_backend():
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        return "causal_conv1d", causal_conv1d_fn, causal_conv1d_update
    except ImportError:
        return "torch", None, None


def unrolled_step(inp, layer: Layer):
    """Every leaf path a batch row; depth + 1 steps of conv update + selective_state_update.

    Returns the op closures and the layer closure -> (leaves, depth + 1, h, p).
    """
    from stree._mamba import mamba_ssm  # noqa: F401  (registers the CUDA-extension stub)
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    _, _, conv_update = conv_backend()
    paths = leaf_paths(inp["tree"])
    rows, steps = paths.shape
    h, p, s = layer.nheads, layer.headdim, layer.dstate
    xbc = inp["xbc"][0, paths]  # (rows, steps, c): the tokens each row decodes
    dt, z = inp["dt"][0, paths], inp["z"][0, paths]
    # Mamba2.step's call: per-head scalars broadcast over headdim / d_state with stride 0.
    A = inp["A"][:, None, None].expand(h, p, s)
    dt_bias = inp["dt_bias"][:, None].expand(h, p)
    D = inp["D"][:, None].expand(h, p)

    def conv_step(x, state):
        if conv_update is not None:
            return conv_update(x, state, inp["weight"], inp["bias"], "silu")
        state.copy_(torch.roll(state, shifts=-1, dims=-1))
        state[:, :, -1] = x
        return torch.nn.functional.silu((state * inp["weight"]).sum(-1) + inp["bias"]).to(x.dtype)

    def fresh_states():
        c, w = inp["conv_state"].shape[1:]
        return (inp["conv_state"].expand(rows, c, w).clone(),
                inp["h0"].expand(rows, h, p, s).clone())

    def ssm_step(state, j, x, B, C):
        return selective_state_update(state, x, dt[:, j, :, None].expand(rows, h, p), A, B, C,
                                      D=D, z=z[:, j], dt_bias=dt_bias, dt_softplus=True)

    conv_state0, _ = fresh_states()
    conv_out = torch.stack([conv_step(xbc[:, j], conv_state0) for j in range(steps)], 1)
    x_all, B_all, C_all = split_xbc(conv_out, layer)

    def conv_only():
        state, _ = fresh_states()
        return [conv_step(xbc[:, j], state) for j in range(steps)]

    def ssm_only():
        _, state = fresh_states()
        return [ssm_step(state, j, x_all[:, j], B_all[:, j], C_all[:, j]) for j in range(steps)]

    def layer_fn():
        conv_state, state = fresh_states()
        ys = []
        for j in range(steps):
            x, B, C = split_xbc(conv_step(xbc[:, j], conv_state), layer)
            ys.append(ssm_step(state, j, x, B, C))
        return torch.stack(ys, dim=1)

    return {"conv": conv_only, "ssm": ssm_only, "layer": layer_fn}, layer_fn


def unrolled_chunk(inp, layer: Layer, chunk_size: int):
    """The leaf paths as a batch of sequences: causal conv + mamba_chunk_scan_combined.

    Returns the op closures and the layer closure -> (leaves, depth + 1, h, p).
    """
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    _, conv_fn, _ = conv_backend()
    paths = leaf_paths(inp["tree"])
    rows, steps = paths.shape
    h, p, s, w = layer.nheads, layer.headdim, layer.dstate, layer.d_conv
    xbc_t = inp["xbc"][0, paths].transpose(1, 2)  # (rows, c, steps)
    dt, z = inp["dt"][0, paths], inp["z"][0, paths]
    h0 = inp["h0"].expand(rows, h, p, s)
    committed = inp["conv_state"][:, :, 1:].expand(rows, -1, -1)

    def conv():
        # Prepending the committed columns continues the causal conv from the committed state.
        seq = torch.cat([committed, xbc_t], dim=2)
        if conv_fn is not None:
            out = conv_fn(seq, inp["weight"], inp["bias"], activation="silu")[:, :, w - 1:]
        else:  # a "valid" conv: one output per path token
            out = torch.nn.functional.silu(torch.nn.functional.conv1d(
                seq.float(), inp["weight"].float()[:, None], inp["bias"].float(),
                groups=seq.shape[1])).to(seq.dtype)
        return out.transpose(1, 2)

    x_all, B_all, C_all = split_xbc(conv(), layer)

    def ssm(x=x_all, B=B_all, C=C_all):
        return mamba_chunk_scan_combined(x, dt, inp["A"], B, C, chunk_size, D=inp["D"], z=z,
                                         dt_bias=inp["dt_bias"], initial_states=h0,
                                         dt_softplus=True)

    def layer_fn():
        return ssm(*split_xbc(conv(), layer))

    return {"conv": conv, "ssm": ssm, "layer": layer_fn}, layer_fn


def reference(inp, layer: Layer):
    """fp32 ground truth on the packed tree (the plain-PyTorch references)."""
    from stree.kernels import tree_conv_ref, tree_scan_ref

    f32 = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
           for k, v in inp.items()}
    conv = tree_conv_ref(f32["xbc"], f32["conv_state"], f32["weight"], f32["bias"],
                         inp["tree"].conv_window(layer.d_conv))
    x, B, C = split_xbc(conv, layer)
    return tree_scan_ref(x, f32["dt"], f32["A"], B, C, inp["tree"].mask, D=f32["D"], z=f32["z"],
                         dt_bias=f32["dt_bias"], initial_states=f32["h0"])[0]


# ---- checks ------------------------------------------------------------------------------

def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# ---- main --------------------------------------------------------------------------------

def metadata(device, dtype, args):
    import triton
    return dict(
        run_metadata(device), triton=triton.__version__, dtype=str(dtype).replace("torch.", ""),
        conv_backend=conv_backend()[0], cuda_graphs=not args.no_graphs and device.type == "cuda",
    )


def main():
    sys.path.insert(0, str(ROOT))
    args = parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    layer = TINY if args.tiny else Layer()
    meta = metadata(device, dtype, args)
    print(f"# {meta['device']} | commit {meta['commit']} | {meta['date']} | {meta['dtype']} | "
          f"conv: {meta['conv_backend']} | graphs: {meta['cuda_graphs']} | {layer}")
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    rows = []
    with torch.inference_mode():
        for n in args.nodes:
            inp = make_inputs(layer, n, dtype, device)
            ref = reference(inp, layer)
            paths = leaf_paths(inp["tree"])
            methods = {"packed": packed(inp, layer), "unrolled_step": unrolled_step(inp, layer)}
            for cs in args.chunk_sizes:
                methods[f"unrolled_chunk{cs}"] = unrolled_chunk(inp, layer, cs)
            for name, (ops, layer_fn) in methods.items():
                # Packed outputs are per node; unrolled ones per (leaf path r, step j): paths[r, j].
                out = layer_fn()
                err = rel_err(out[0], ref[0]) if name == "packed" else rel_err(out, ref[0, paths])
                if not err < tol:
                    raise SystemExit(f"{name} on {n} nodes is wrong: max rel error {err:.2e}")
                for op, fn in ops.items():
                    sec, graphed = time_fn(fn, device, args.warmup, args.repeats, args.inner,
                                           graphs=not args.no_graphs)
                    rows.append(dict(meta, nodes=n, leaves=paths.shape[0], depth=paths.shape[1] - 1,
                                     method=name, op=op, us=sec * 1e6, graphed=graphed,
                                     max_rel_err=err, layers=args.layers))
    report(rows, args)


def report(rows, args):
    best = {}  # fastest chunk size per (nodes, op): the chunked baseline at its best
    for r in rows:
        if r["method"].startswith("unrolled_chunk"):
            key = (r["nodes"], r["op"])
            best[key] = min(best.get(key, float("inf")), r["us"])
    packed_us = {(r["nodes"], r["op"]): r["us"] for r in rows if r["method"] == "packed"}
    print(f"\n{'nodes':>5} {'method':<18} {'op':<6} {'us':>9} {'x packed':>9} "
          f"{f'{args.layers}-layer ms':>12} {'rel err':>8}")
    for r in rows:
        key = (r["nodes"], r["op"])
        mark = "*" if r["method"].startswith("unrolled_chunk") and r["us"] == best[key] else " "
        r["speedup_of_packed"] = r["us"] / packed_us[key]
        model_ms = f"{r['us'] * r['layers'] / 1e3:.2f}" if r["op"] == "layer" else ""
        print(f"{r['nodes']:>5} {r['method']:<18}{mark}{r['op']:<6} {r['us']:>9.1f} "
              f"{r['speedup_of_packed']:>9.2f} {model_ms:>12} {r['max_rel_err']:>8.1e}")
    print("(* fastest chunk size; 'x packed' = this time / packed time; the whole-model column is "
          "layers x one layer's conv + SSM, without projections, norms or attention)")
    tag = "tiny" if args.tiny else "full"
    paths = write_rows(rows, result_stem(args.out, f"tree_scan_{tag}", rows[0]))
    print("wrote " + " and ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
