"""TreeDelta, delta replay and the chunked rule: Triton (interpreter, fp32) vs reference vs a sequential oracle;
``impl="auto"`` on these CPU tensors is the C++ op (``csrc/tree_delta.cpp``, tests/test_cpu_ops.py).

The oracle runs the gated delta rule ``S = diag(exp g) S; u = beta (v - S^T k); S += k u^T;
o = S^T q`` token by token along every root-to-node path, in float64. It shares no code with stree.
"""
import pytest
import torch

from stree.kernels import chunk_delta, delta_replay, tree_delta, tree_delta_ref
from stree.kernels._common import checks
from tests.kernel_helpers import (ancestor_mask, assert_close, chain, common_trees, padded_paths, path_to,
                                  random_tree)

TOL = (2e-5, 2e-5)
TREES = {**common_trees(), "random23": random_tree(23, seed=5), "chain64_prefill_chunk": chain(64)}


def make_inputs(rows, h=2, dk=16, dv=24, per_channel=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, n = len(rows), len(rows[0])

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = torch.nn.functional.normalize(randn(b, n, h, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(randn(b, n, h, dk), dim=-1)
    g = -torch.rand(*(b, n, h, dk) if per_channel else (b, n, h), generator=gen) * 1.5
    beta = torch.rand(b, n, h, generator=gen) * 2  # [0, 2]: OLMo Hybrid's negative eigenvalues too
    return dict(q=q, k=k, v=randn(b, n, h, dv), g=g, beta=beta, mask=ancestor_mask(rows),
                initial_state=randn(b, h, dk, dv) * 0.5)


def oracle(x, parents, row, t):
    """Output at node t and the state after it, token by token along its path (float64)."""
    S = x["initial_state"][row].double()
    for j in path_to(parents, t):
        q, k, v = (x[n][row, j].double() for n in ("q", "k", "v"))
        decay = x["g"][row, j].double().exp()
        S = S * (decay[:, None, None] if decay.dim() == 1 else decay[..., None])
        u = (v - torch.einsum("hkv,hk->hv", S, k)) * x["beta"][row, j].double()[:, None]
        S = S + k[..., None] * u[:, None, :]
    return torch.einsum("hkv,hk->hv", S, q), S


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("impl", ["ref", "triton", "auto"])
@pytest.mark.parametrize("name", TREES)
def test_every_node_and_every_replayed_path_match_the_sequential_rule(name, impl, per_channel):
    parents = TREES[name]
    rows = [parents, random_tree(len(parents), seed=7)]
    x = make_inputs(rows, per_channel=per_channel)
    with checks():
        o, u, G = tree_delta(**x, impl=impl)
    assert o.shape == x["v"].shape and G.shape == x["g"].shape
    n = len(parents)
    ends = [n - 1, n // 2]
    path = padded_paths(rows, ends, max(len(path_to(r, e)) for r, e in zip(rows, ends)))
    state = x["initial_state"].clone()
    delta_replay(state, x["k"], u, G, path, impl="ref" if impl == "ref" else "auto")  # auto: C++ on the CPU
    for b, r in enumerate(rows):
        for t in range(n):
            assert_close(o[b, t], oracle(x, r, b, t)[0], TOL, f"{name} row {b} node {t}")
        assert_close(state[b], oracle(x, r, b, ends[b])[1], TOL, f"{name} row {b} replayed state")


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_triton_kernel_writes_what_the_reference_computes(per_channel):
    rows = [random_tree(37, seed=1), chain(37)]
    x = make_inputs(rows, h=3, dk=32, dv=80, per_channel=per_channel, seed=2)  # dv over two blocks
    for got, want, what in zip(tree_delta(**x, impl="triton"), tree_delta_ref(**x), ("o", "u", "G")):
        assert_close(got, want, TOL, what)


def test_a_row_without_a_path_keeps_its_state():
    rows = [random_tree(9, seed=3)] * 2
    x = make_inputs(rows)
    _, u, G = tree_delta_ref(**x)
    state = x["initial_state"].clone()
    path = torch.tensor([[0, -1, -1], [-1, -1, -1]])
    delta_replay(state, x["k"], u, G, path)
    assert torch.equal(state[1], x["initial_state"][1])
    assert_close(state[0], oracle(x, rows[0], 0, 0)[1], TOL, "root committed")


def test_bad_arguments_are_named():
    x = make_inputs([chain(4)])
    with pytest.raises(ValueError, match="mask must be bool"):
        tree_delta_ref(**{**x, "mask": x["mask"].float()})
    with pytest.raises(ValueError, match="g must have shape"):
        tree_delta_ref(**{**x, "g": x["g"][..., None].expand(-1, -1, -1, 3)})


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("length", [1, 37, 64, 150])
def test_chunked_rule_over_a_sequence_matches_the_sequential_rule(length, per_channel):
    """``chunk_delta`` (prefill, training): outputs and the final state, across chunk borders and
    with a padded last chunk; it is differentiable."""
    parents = chain(length)
    x = make_inputs([parents], per_channel=per_channel, seed=length)
    q = x["q"].clone().requires_grad_()
    o, state = chunk_delta(q, x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    for t in range(length):
        want, S = oracle(x, parents, 0, t)
        assert_close(o[0, t], want, TOL, f"token {t}")
    assert_close(state[0], S, TOL, "final state")
    (o.sum() + state.sum()).backward()
    assert torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_outputs_come_back_in_the_values_dtype(dtype):
    """fp32 inside, the caller's dtype out (a bf16 model's next projection takes them as they are)."""
    x = make_inputs([random_tree(9, seed=4)])
    x = {**x, "q": x["q"].to(dtype), "k": x["k"].to(dtype), "v": x["v"].to(dtype)}
    o, u, G = tree_delta(**x)
    assert (o.dtype, u.dtype, G.dtype) == (dtype, torch.float32, torch.float32)
    o, state = chunk_delta(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    assert (o.dtype, state.dtype) == (dtype, torch.float32)
