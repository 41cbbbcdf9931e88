"""TreeScan and SSM replay: Triton (interpreter, fp32) vs reference vs a sequential oracle.

The oracle runs the Mamba2 recurrence ``h = exp(dt A) h + dt x (x) B; y = C . h + D x`` token by
token along every root-to-node path, in float64, from raw dt. It shares no code with stree.
"""
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.kernels._common import checks  # argument checks are a debug feature
from stree.kernels import ssm_replay, ssm_replay_ref, tree_scan, tree_scan_ref
from tests.kernel_helpers import assert_close as _assert_close
from tests.kernel_helpers import (ancestor_mask, chain, common_trees, full_binary, nan_filled_empty,
                                  padded_paths, path_to, random_tree)

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 6e-2)}
NO_LIMIT = (0.0, math.inf)


def assert_close(actual, expected, dtype, what):
    _assert_close(actual, expected, TOL[dtype], what)


# trees as parent lists, topologically packed
TREES = {
    **common_trees(),
    "chain5": chain(5),
    "chain130_multiblock": chain(130),
    "random150_multiblock": random_tree(150, seed=3),
}


def batch_of(parents, seed=0):
    """Two rows with different trees: the given one and a random one of the same size."""
    return [parents, random_tree(len(parents), seed=seed + 100)]


# ---- inputs and oracle -------------------------------------------------------------------

def make_inputs(b, n, h=2, p=4, g=1, s=8, *, D="h", z=True, dt_bias=True, h0="randn",
                dt_shift=0.0, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    args = dict(
        x=randn(b, n, h, p), dt=torch.randn(b, n, h, generator=gen) - 1.0 + dt_shift,
        A=-torch.rand(h, generator=gen) * 2 - 0.2, B=randn(b, n, g, s, scale=0.5),
        C=randn(b, n, g, s, scale=0.5),
    )
    kw = dict(
        D={"h": randn(h), "hp": randn(h, p), None: None}[D],
        z=randn(b, n, h, p) if z else None,
        dt_bias=torch.randn(h, generator=gen) if dt_bias else None,
        initial_states={"randn": randn(b, h, p, s), "zeros": torch.zeros(b, h, p, s, dtype=dtype),
                        None: None}[h0],
    )
    return args, kw


def oracle_dt(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.double() + (dt_bias.double() if dt_bias is not None else 0.0)
    if dt_softplus:
        dt = torch.log1p(torch.exp(dt))
    if tuple(dt_limit) != NO_LIMIT:
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


def oracle_step(h, x, dt, A, B):
    """One Mamba2 step for all heads. h (H, P, S), x (H, P), dt (H,), A (H,), B (H, S)."""
    return torch.exp(dt * A)[:, None, None] * h + (dt[:, None] * x)[:, :, None] * B[:, None, :]


def oracle_tree_ssm(rows, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=NO_LIMIT, initial_states=None):
    """Returns y (b, n, h, p) and the state after each node (b, n, h, p, s), float64."""
    b, n, h, p = x.shape
    s = B.shape[-1]
    rep = h // B.shape[2]
    x, A = x.double(), A.double()
    Bh = B.double().repeat_interleave(rep, dim=2)
    Ch = C.double().repeat_interleave(rep, dim=2)
    dt = oracle_dt(dt, dt_bias, dt_softplus, dt_limit)
    y = torch.zeros(b, n, h, p, dtype=torch.float64)
    states = torch.zeros(b, n, h, p, s, dtype=torch.float64)
    for bi, parents in enumerate(rows):
        for t in range(n):
            state = (initial_states[bi].double() if initial_states is not None
                     else torch.zeros(h, p, s, dtype=torch.float64))
            for node in path_to(parents, t):
                state = oracle_step(state, x[bi, node], dt[bi, node], A, Bh[bi, node])
            states[bi, t] = state
            y[bi, t] = torch.einsum("hps,hs->hp", state, Ch[bi, t])
            if D is not None:
                y[bi, t] += x[bi, t] * (D.double()[:, None] if D.dim() == 1 else D.double())
            if z is not None:
                y[bi, t] *= F.silu(z[bi, t].double())
    return y, states


def run_triton(args, kw):
    with nan_filled_empty():
        return tree_scan(**args, **kw, impl="triton")


# ---- TreeScan ----------------------------------------------------------------------------

FEATURES = {
    "plain": dict(D=None, z=False, dt_bias=False, h0=None),
    "D_h-z-bias-h0": dict(D="h", z=True, dt_bias=True, h0="randn"),
    "D_hp-h0": dict(D="hp", z=False, dt_bias=True, h0="randn"),
    "zero_h0": dict(D="h", z=True, dt_bias=True, h0="zeros"),
    "groups2": dict(D="h", z=True, dt_bias=True, h0="randn", h=4, g=2),
    "headdim16-dstate16": dict(D="hp", z=True, dt_bias=True, h0="randn", p=16, s=16),
    # dt ~ 40: per-step log-decay ~ -40 |A|, so non-ancestor differences overflow exp unless the
    # mask is applied before it.
    "large_decay": dict(D="h", z=True, dt_bias=True, h0="randn", dt_shift=40.0),
}
OPTIONS = {
    "softplus": dict(),
    "dt_limit": dict(dt_limit=(0.05, 0.4)),
    "no_softplus": dict(dt_softplus=False),
}


def _case(parents, features, options, dtype=torch.float32, seed=0):
    rows = batch_of(parents, seed)
    args, kw = make_inputs(2, len(parents), **features, dtype=dtype, seed=seed)
    if options.get("dt_softplus") is False:
        args["dt"] = args["dt"].abs() * 0.3  # raw dt must already be positive
    return rows, dict(args, mask=ancestor_mask(rows)), dict(kw, **options)


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_triton_matches_ref_per_tree(tree):
    _, args, kw = _case(TREES[tree], FEATURES["groups2"], OPTIONS["softplus"])
    y, dt_out = run_triton(args, kw)
    y_ref, dt_ref = tree_scan_ref(**args, **kw)
    assert_close(y, y_ref, torch.float32, f"y on {tree}")
    assert_close(dt_out, dt_ref, torch.float32, f"dt_out on {tree}")


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("features", list(FEATURES), ids=list(FEATURES))
def test_triton_matches_ref_per_feature(features, options):
    _, args, kw = _case(full_binary(15), FEATURES[features], OPTIONS[options])
    y, dt_out = run_triton(args, kw)
    y_ref, dt_ref = tree_scan_ref(**args, **kw)
    assert_close(y, y_ref, torch.float32, f"y with {features}/{options}")
    assert_close(dt_out, dt_ref, torch.float32, f"dt_out with {features}/{options}")


def test_triton_fp16_matches_ref():
    _, args, kw = _case(full_binary(31), FEATURES["groups2"], {}, dtype=torch.float16)
    y, _ = run_triton(args, kw)
    assert y.dtype == torch.float16
    assert_close(y, tree_scan_ref(**args, **kw)[0], torch.float16, "fp16 y")


@pytest.mark.parametrize("tree", [t for t in TREES if "multiblock" not in t])
def test_ref_matches_sequential_oracle_per_tree(tree):
    rows, args, kw = _case(TREES[tree], FEATURES["groups2"], {})
    y_ref, _ = tree_scan_ref(**args, **kw)
    args.pop("mask")
    y_oracle, _ = oracle_tree_ssm(rows, **args, **kw)
    assert_close(y_ref, y_oracle, torch.float32, f"reference vs oracle on {tree}")


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
@pytest.mark.parametrize("features", list(FEATURES), ids=list(FEATURES))
def test_ref_matches_sequential_oracle_per_feature(features, options):
    rows, args, kw = _case(full_binary(15), FEATURES[features], OPTIONS[options])
    y_ref, dt_ref = tree_scan_ref(**args, **kw)
    args.pop("mask")
    y_oracle, _ = oracle_tree_ssm(rows, **args, **kw)
    assert_close(y_ref, y_oracle, torch.float32, f"reference vs oracle with {features}/{options}")
    dt_oracle = oracle_dt(args["dt"], kw["dt_bias"], kw.get("dt_softplus", True),
                          kw.get("dt_limit", NO_LIMIT))
    assert_close(dt_ref, dt_oracle, torch.float32, "processed dt vs oracle")


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=6, deadline=None)
@given(tree=trees(), seed=st.integers(0, 2**16))
def test_random_trees(tree, seed):
    rows = [tree, random_tree(len(tree), seed)]
    args, kw = make_inputs(2, len(tree), h=4, g=2, seed=seed)
    args["mask"] = ancestor_mask(rows)
    y, _ = run_triton(args, kw)
    y_ref, _ = tree_scan_ref(**args, **kw)
    assert_close(y, y_ref, torch.float32, "triton vs reference")
    args.pop("mask")
    assert_close(y_ref, oracle_tree_ssm(rows, **args, **kw)[0], torch.float32, "ref vs oracle")


def test_chain_matches_mamba_chunk_scan():
    from stree._mamba import mamba_ssm  # noqa: F401  (registers the CUDA-extension stub)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    n = 10
    args, kw = make_inputs(1, n, h=4, g=2, D="hp")
    y_mamba = mamba_chunk_scan_combined(
        args["x"], args["dt"], args["A"], args["B"], args["C"], 16, D=kw["D"], z=kw["z"],
        dt_bias=kw["dt_bias"], initial_states=kw["initial_states"], dt_softplus=True)
    mask = ancestor_mask([chain(n)])
    for impl in ("triton", "ref"):
        y, _ = tree_scan(**args, mask=mask, **kw, impl=impl)
        assert_close(y, y_mamba, torch.float32, f"{impl} vs mamba_chunk_scan_combined")


def test_auto_uses_reference_on_cpu(monkeypatch):
    # The package re-exports the function under the module's name, so fetch the module itself.
    mod = importlib.import_module("stree.kernels.tree_scan")

    def boom(*a, **k):
        raise AssertionError("Triton launched for CPU tensors with impl='auto'")

    monkeypatch.setattr(mod, "_tree_scan_triton", boom)
    _, args, kw = _case(chain(3), FEATURES["plain"], {})
    tree_scan(**args, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n", [15, 63, 127, 256], ids=lambda n: f"n{n}")
def test_cuda_matches_ref(n, dtype):
    rows = batch_of(random_tree(n, 1))
    args, kw = make_inputs(2, n, h=8, p=64, g=2, s=128, D="h", dtype=dtype)
    args = {k: v.cuda() for k, v in dict(args, mask=ancestor_mask(rows)).items()}
    kw = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()}
    y, _ = tree_scan(**args, **kw)
    assert_close(y, tree_scan_ref(**args, **kw)[0], dtype, f"cuda {dtype}")


# ---- errors ------------------------------------------------------------------------------

def _bad(name, **change):
    return pytest.param(change, id=name)


@pytest.mark.parametrize("change", [
    _bad("x_3d", x=torch.zeros(2, 5, 2)),
    _bad("dt_shape", dt=torch.zeros(2, 5, 3)),
    _bad("A_shape", A=torch.zeros(3)),
    _bad("C_shape", C=torch.zeros(2, 5, 1, 4)),
    _bad("mask_shape", mask=torch.ones(2, 5, 4, dtype=torch.bool)),
    _bad("mask_dtype", mask=torch.ones(2, 5, 5)),
    _bad("D_shape", D=torch.zeros(3)),
    _bad("z_shape", z=torch.zeros(2, 5, 2, 3)),
    _bad("h0_shape", initial_states=torch.zeros(2, 2, 4, 4)),
    _bad("heads_not_multiple_of_groups", B=torch.zeros(2, 5, 3, 8), C=torch.zeros(2, 5, 3, 8)),
    _bad("int_x", x=torch.zeros(2, 5, 2, 4, dtype=torch.int64)),
    _bad("B_dtype_differs", B=torch.zeros(2, 5, 1, 8, dtype=torch.float16)),
    _bad("impl_name", impl="cuda"),
])
def test_bad_arguments_raise(change):
    _, args, kw = _case(chain(5), FEATURES["D_h-z-bias-h0"], {})
    merged = dict(args, **kw, impl="triton")
    merged.update(change)
    with checks(), pytest.raises(ValueError, match=r"tree_scan|impl"):
        tree_scan(**merged)


# ---- SSM replay --------------------------------------------------------------------------

def _replay_case(parents, seed, **sizes):
    """Tree activations from tree_scan (raw dt -> dt_out) and the oracle state at every node."""
    rows = batch_of(parents, seed)
    args, kw = make_inputs(2, len(parents), seed=seed, **sizes)
    _, dt_out = tree_scan_ref(**args, mask=ancestor_mask(rows), **kw)
    _, states = oracle_tree_ssm(rows, **args, **kw)
    return rows, args, kw, dt_out, states


REPLAY_TREES = {"one_node": [-1], "chain6": chain(6), "binary31": full_binary(31),
                "random40": random_tree(40, seed=7)}


@pytest.mark.parametrize("impl", ["triton", "auto", "ref"])  # auto: the C++ op on the CPU
@pytest.mark.parametrize("tree", list(REPLAY_TREES), ids=list(REPLAY_TREES))
def test_ssm_replay_every_path_length(tree, impl):
    parents = REPLAY_TREES[tree]
    rows, args, kw, dt_out, states = _replay_case(parents, seed=1, h=4, g=2)
    n = len(parents)
    depth = [len(path_to(parents, t)) - 1 for t in range(n)]
    k = max(len(path_to(tree, t)) for tree in rows for t in range(n)) + 1  # + a -1 column
    # One path per length 1 .. depth+1 along the deepest branch; the second row ends elsewhere,
    # so the rows of the batch always have different lengths.
    deepest = max(range(n), key=lambda t: depth[t])
    for end in path_to(parents, deepest):
        other = n - 1 - end
        path = padded_paths(rows, [end, other], k)
        state = kw["initial_states"].clone()
        replay = ssm_replay_ref if impl == "ref" else ssm_replay
        kwargs = {} if impl == "ref" else dict(impl=impl)
        with nan_filled_empty():
            replay(state, args["x"], dt_out, args["A"], args["B"], path, **kwargs)
        assert_close(state[0], states[0, end], torch.float32, f"row 0 state at node {end}")
        assert_close(state[1], states[1, other], torch.float32, f"row 1 state at node {other}")


def test_ssm_replay_fp16_state_is_cast_back():
    rows, args, kw, dt_out, states = _replay_case(chain(4), seed=2)
    state = kw["initial_states"].to(torch.float16)
    ssm_replay(state, args["x"], dt_out, args["A"], args["B"], padded_paths(rows, [3, 2], 4),
               impl="triton")
    assert state.dtype == torch.float16
    assert_close(state[0], states[0, 3], torch.float16, "fp16 state")


@pytest.mark.parametrize("change", [
    _bad("state_3d", ssm_state=torch.zeros(2, 2, 4)),
    _bad("x_heads", x=torch.zeros(2, 5, 3, 4)),
    _bad("dt_shape", dt=torch.zeros(2, 4, 2)),
    _bad("path_batch", path=torch.zeros(3, 2, dtype=torch.int64)),
    _bad("path_float", path=torch.zeros(2, 2)),
])
def test_ssm_replay_bad_arguments_raise(change):
    args, kw = make_inputs(2, 5)
    merged = dict(ssm_state=kw["initial_states"], x=args["x"], dt=args["dt"], A=args["A"],
                  B=args["B"], path=torch.zeros(2, 2, dtype=torch.int64))
    merged.update(change)
    with checks(), pytest.raises(ValueError, match="ssm_replay"):
        ssm_replay(**merged, impl="triton")
