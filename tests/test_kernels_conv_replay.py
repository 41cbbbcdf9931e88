"""Tree conv1d and conv replay: Triton (interpreter, fp32) and the C++ op (``impl="auto"`` on these
CPU tensors) vs reference vs a sequential oracle.

The oracle convolves the sequence [committed conv_state columns, root-to-node path tokens] one
output at a time, and builds the window table from parent lists itself (no stree code).
"""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.kernels._common import checks  # argument checks are a debug feature
from stree.kernels import conv_replay, tree_conv, tree_conv_ref
from tests.kernel_helpers import assert_close as _assert_close
from tests.kernel_helpers import (chain, common_trees, nan_filled_empty, padded_paths, path_to,
                                  random_tree)

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def assert_close(actual, expected, dtype, what):
    _assert_close(actual, expected, TOL[dtype], what)


TREES = {
    **common_trees(),
    "chain3_below_width": chain(3),
    "random100_multiblock": random_tree(100, seed=5),
}


def conv_window(rows, w):
    """(b, n, w) indices into ext = cat(conv_state[:, :, 1:], xbc^T), oldest tap first."""
    n = len(rows[0])
    window = torch.empty(len(rows), n, w, dtype=torch.int64)
    for b, parents in enumerate(rows):
        for i in range(n):
            path = path_to(parents, i)
            for k in range(w):  # k steps back from i
                window[b, i, w - 1 - k] = (w - 1 + path[-1 - k] if k < len(path)
                                           else w - 1 - (k - len(path) + 1))
    return window


def make_inputs(rows, c=6, w=4, *, bias=True, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = len(rows), len(rows[0])
    return dict(
        xbc=torch.randn(b, n, c, generator=gen).to(dtype),
        conv_state=torch.randn(b, c, w, generator=gen).to(dtype),
        weight=torch.randn(c, w, generator=gen).to(dtype),
        bias=torch.randn(c, generator=gen).to(dtype) if bias else None,
        window=conv_window(rows, w),
    )


def oracle_conv(rows, xbc, conv_state, weight, bias, activation, window=None):
    """Causal conv output at the last token of [committed columns, path tokens], per node.

    ``window`` is accepted (and ignored) so the op's argument dict can be passed as is.
    """
    b, n, c = xbc.shape
    w = weight.shape[1]
    out = torch.empty(b, n, c, dtype=torch.float64)
    for bi, parents in enumerate(rows):
        for i in range(n):
            seq = [conv_state[bi, :, j].double() for j in range(w)]
            seq += [xbc[bi, s].double() for s in path_to(parents, i)]
            acc = sum(weight[:, k].double() * seq[len(seq) - w + k] for k in range(w))
            if bias is not None:
                acc = acc + bias.double()
            out[bi, i] = F.silu(acc) if activation else acc
    return out


def batch_of(parents):
    """Two rows with different trees: the given one and a random one of the same size."""
    return [parents, random_tree(len(parents), seed=len(parents))]


# ---- tree conv ---------------------------------------------------------------------------

VARIANTS = {
    "w4-bias-silu": dict(w=4, bias=True, activation="silu"),
    "w4-nobias-noact": dict(w=4, bias=False, activation=None),
    "w2": dict(w=2, bias=True, activation="silu"),
    "w1": dict(w=1, bias=True, activation="silu"),
    "channels200": dict(w=4, bias=True, activation="silu", c=200),
}


@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_tree_conv(tree, variant):
    rows = batch_of(TREES[tree])
    opts = dict(VARIANTS[variant])
    activation = opts.pop("activation")
    args = make_inputs(rows, **opts)
    with nan_filled_empty():
        out = tree_conv(**args, activation=activation, impl="triton")
    ref = tree_conv_ref(**args, activation=activation)
    assert_close(out, ref, torch.float32, f"triton vs reference on {tree}/{variant}")
    assert_close(tree_conv(**args, activation=activation), ref, torch.float32, f"C++ vs reference on {tree}/{variant}")
    assert_close(ref, oracle_conv(rows, **args, activation=activation), torch.float32,
                 f"reference vs oracle on {tree}/{variant}")


@pytest.mark.parametrize("w", [1, 2, 4])
def test_window_table_agrees_with_token_tree(w):
    """The op's index contract, as TokenTree.conv_window builds it, matches this file's table."""
    from stree.tree import TokenTree

    rows = [TREES["binary63"], random_tree(63, seed=9)]
    tree = TokenTree(torch.zeros(2, 63, dtype=torch.int64), torch.tensor(rows))
    assert torch.equal(tree.conv_window(w), conv_window(rows, w))


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 30), w=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_tree_conv_random_trees(n, w, seed):
    rows = [random_tree(n, seed), random_tree(n, seed + 1)]
    args = make_inputs(rows, w=w, seed=seed)
    with nan_filled_empty():
        out = tree_conv(**args, impl="triton")
    ref = tree_conv_ref(**args)
    assert_close(out, ref, torch.float32, "triton vs reference")
    assert_close(tree_conv(**args), ref, torch.float32, "C++ vs reference")
    assert_close(ref, oracle_conv(rows, **args, activation="silu"), torch.float32, "ref vs oracle")


def test_tree_conv_fp16():
    rows = batch_of(TREES["binary63"])
    args = make_inputs(rows, dtype=torch.float16)
    out = tree_conv(**args, impl="triton")
    assert out.dtype == torch.float16
    assert_close(out, tree_conv_ref(**args), torch.float16, "fp16")


def test_chain_matches_torch_conv1d():
    """A chain is an ordinary causal conv continued from conv_state."""
    rows = [chain(7)]
    args = make_inputs(rows)
    seq = torch.cat([args["conv_state"][:, :, 1:], args["xbc"].transpose(1, 2)], dim=2)
    expected = F.silu(F.conv1d(seq, args["weight"][:, None, :], args["bias"],
                               groups=seq.shape[1])).transpose(1, 2)
    assert_close(tree_conv(**args, impl="triton"), expected, torch.float32, "chain vs conv1d")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tree_conv_cuda(dtype):
    rows = batch_of(random_tree(63, 0))
    args = {k: v.cuda() for k, v in make_inputs(rows, c=2560 + 256, dtype=dtype).items()}
    assert_close(tree_conv(**args), tree_conv_ref(**args), dtype, f"cuda {dtype}")


@pytest.mark.parametrize("change", [
    pytest.param(dict(xbc=torch.zeros(2, 5)), id="xbc_2d"),
    pytest.param(dict(conv_state=torch.zeros(2, 5, 4)), id="state_channels"),
    pytest.param(dict(weight=torch.zeros(6, 3)), id="weight_width"),
    pytest.param(dict(bias=torch.zeros(5)), id="bias_shape"),
    pytest.param(dict(window=torch.zeros(2, 4, 4, dtype=torch.int64)), id="window_nodes"),
    pytest.param(dict(window=torch.zeros(2, 5, 4)), id="window_float"),
    pytest.param(dict(xbc=torch.zeros(2, 5, 6, dtype=torch.int32)), id="int_xbc"),
    pytest.param(dict(activation="relu"), id="activation"),
])
def test_tree_conv_bad_arguments_raise(change):
    args = dict(make_inputs(batch_of(chain(5))), activation="silu", impl="triton")
    args.update(change)
    with checks(), pytest.raises(ValueError, match="tree_conv"):
        tree_conv(**args)


# ---- conv replay -------------------------------------------------------------------------

def oracle_conv_replay(conv_state, xbc, path):
    out = conv_state.clone()
    w = conv_state.shape[2]
    for b in range(conv_state.shape[0]):
        nodes = [int(i) for i in path[b] if i >= 0]
        seq = [conv_state[b, :, j] for j in range(w)] + [xbc[b, i] for i in nodes]
        out[b] = torch.stack(seq[-w:], dim=1)
    return out


@pytest.mark.parametrize("impl", ["auto", "ref"])  # auto: the C++ op on these fp32 CPU tensors
@pytest.mark.parametrize("w", [1, 2, 4])
@pytest.mark.parametrize("tree", ["one_node", "deep_chain12", "binary63"])
def test_conv_replay_every_path_length(tree, w, impl):
    rows = batch_of(TREES[tree])
    args = make_inputs(rows, w=w)
    n = len(rows[0])
    length = [len(path_to(rows[0], t)) for t in range(n)]
    deepest = max(range(n), key=lambda t: length[t])
    k = max(len(path_to(parents, t)) for parents in rows for t in range(n)) + 1  # + a -1 column
    # Path lengths 1 .. depth+1 on row 0; row 1 ends elsewhere, so lengths differ within the batch.
    for end in path_to(rows[0], deepest):
        path = padded_paths(rows, [end, n - 1 - end], k)
        state = args["conv_state"].clone()
        conv_replay(state, args["xbc"], path, impl=impl)
        assert_close(state, oracle_conv_replay(args["conv_state"], args["xbc"], path),
                     torch.float32, f"conv_state after path to node {end}")


@pytest.mark.parametrize("impl", ["auto", "ref"])
@pytest.mark.parametrize("w", [2, 4])
def test_conv_replay_arbitrary_node_lists(w, impl):
    """Replay takes any node list, not only root-first paths."""
    args = make_inputs(batch_of(chain(8)), w=w)
    path = torch.tensor([[3, 1, 6, -1, -1], [7, 2, 5, 0, 4]])
    state = args["conv_state"].clone()
    conv_replay(state, args["xbc"], path, impl=impl)
    assert_close(state, oracle_conv_replay(args["conv_state"], args["xbc"], path), torch.float32,
                 "conv_state")


def test_conv_replay_then_conv_continues_the_sequence():
    """After replaying a path, a 1-node tree's conv equals the oracle conv of the path's child."""
    rows = [chain(6)]
    args = make_inputs(rows)
    state = args["conv_state"].clone()
    conv_replay(state, args["xbc"], padded_paths(rows, [4], 6))
    one = dict(args, xbc=args["xbc"][:, 5:6], conv_state=state, window=conv_window([[-1]], 4))
    expected = oracle_conv(rows, **args, activation="silu")[:, 5:6]
    assert_close(tree_conv(**one, impl="triton"), expected, torch.float32, "continued conv")


@pytest.mark.parametrize("change", [
    pytest.param(dict(conv_state=torch.zeros(2, 6)), id="state_2d"),
    pytest.param(dict(xbc=torch.zeros(2, 5, 7)), id="xbc_channels"),
    pytest.param(dict(path=torch.zeros(3, 2, dtype=torch.int64)), id="path_batch"),
    pytest.param(dict(path=torch.zeros(2, 2)), id="path_float"),
])
def test_conv_replay_bad_arguments_raise(change):
    args = make_inputs(batch_of(chain(5)))
    merged = dict(conv_state=args["conv_state"], xbc=args["xbc"],
                  path=torch.zeros(2, 2, dtype=torch.int64))
    merged.update(change)
    with checks(), pytest.raises(ValueError, match="conv_replay"):
        conv_replay(**merged)
