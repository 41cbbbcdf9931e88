"""stree's C++ CPU tree-row ops against the eager tree conv, tree scan and replays (themselves
checked against mamba-ssm's step along every root-to-node path in test_kernels_conv_replay.py and
test_kernels_tree_scan.py), on trees scattered among other tokens and on state caches with vLLM's
layouts. tests/vllm/test_trees.py runs both implementations inside the vLLM layers. The gated
delta rule's op against its eager reference (itself checked against the rule run token by token
in test_kernels_tree_delta.py, which runs the op there too). The commits of stree's own loop
(csrc/replay.cpp) against the eager replays, on strided states; the kernel tests also run them
against their token-by-token oracles (impl="auto")."""
import pytest
import torch
import torch.nn.functional as F

from stree.kernels.cpu_ops import ops
from stree.kernels.replay import conv_replay, delta_replay, ssm_replay, ssm_replay_ref
from stree.kernels.tree_conv import tree_conv_ref
from stree.kernels.tree_delta import tree_delta_ref
from stree.kernels.tree_scan import tree_scan_ref
from stree.tree import TokenTree

PARENTS = [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 4, 4, 0, 8]]


@pytest.fixture(scope="module")
def cpu_ops():
    module = ops()
    assert module is not None, "the C++ CPU ops did not build (see the warning)"
    return module


def _scattered(b, n, tokens, gen):
    """(b, n) distinct token rows in a batch of ``tokens`` rows, not in order."""
    return torch.randperm(tokens, generator=gen)[:b * n].view(b, n)


@pytest.mark.parametrize("parents", PARENTS)
@pytest.mark.parametrize("dim_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_tree_conv_rows_match_the_eager_tree_conv(cpu_ops, parents, dim_first, bias):
    gen = torch.Generator().manual_seed(len(parents))
    b, n, c, w, spec = 3, len(parents), 24, 4, 3
    tree = TokenTree(torch.zeros(b, n, dtype=torch.long), parents)
    tokens = b * n + 5
    x = torch.randn(tokens, c, generator=gen)
    slots_total, length = 7, w - 1 + spec
    if dim_first:
        conv_state = torch.randn(slots_total, c, length, generator=gen)
    else:  # vLLM's other layout: (slots, length, c) in memory, read as (slots, c, length)
        conv_state = torch.randn(slots_total, length, c, generator=gen).transpose(1, 2)
    weight = torch.randn(c, w, generator=gen)
    bias_t = torch.randn(c, generator=gen) if bias else None
    slots, col0 = torch.tensor([4, 0, 6]), torch.tensor([0, 2, 1])
    index = _scattered(b, n, tokens, gen)
    out = torch.full_like(x, 7.0)
    before = conv_state.clone()
    xbc, win = cpu_ops.tree_conv_rows(x, conv_state, slots, col0, index, tree.conv_window(w)[0].contiguous(),
                                      weight, bias_t if bias else torch.empty(0), True, out)
    committed = torch.stack([conv_state[s, :, a:a + w - 1] for s, a in zip(slots.tolist(), col0.tolist())])
    want = tree_conv_ref(x[index], F.pad(committed, (1, 0)), weight, bias_t, tree.conv_window(w), "silu")
    torch.testing.assert_close(out[index], want, rtol=1e-5, atol=1e-5)
    others = torch.ones(tokens, dtype=torch.bool)
    others[index.flatten()] = False
    assert (out[others] == 7.0).all(), "rows outside the trees were written"
    assert torch.equal(xbc, x[index]) and torch.equal(win, committed.transpose(1, 2))
    assert torch.equal(conv_state, before), "the conv state was written"


@pytest.mark.parametrize("parents", PARENTS)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_tree_scan_rows_match_the_eager_tree_scan(cpu_ops, parents, groups):
    gen = torch.Generator().manual_seed(10 * len(parents) + groups)
    b, n, h, p, s = 2, len(parents), 4, 8, 12  # s not a multiple of the op's 8 lanes: the tail runs
    tree = TokenTree(torch.zeros(b, n, dtype=torch.long), parents)
    tokens = b * n + 3
    conv = torch.randn(tokens, h * p + 2 * groups * s, generator=gen)  # x, B, C as views of one buffer
    x, B, C = torch.split(conv, [h * p, groups * s, groups * s], dim=-1)
    x, B, C = x.view(tokens, h, p), B.view(tokens, groups, s), C.view(tokens, groups, s)
    dt = torch.randn(tokens, h + 3, generator=gen)[:, 1:h + 1]  # a strided view, as vLLM's split gives
    A, D, dt_bias = -torch.rand(h, generator=gen) - 0.1, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    ssm_state = torch.randn(5, h, p, s, generator=gen)
    start, index = torch.tensor([3, 1]), _scattered(b, n, tokens, gen)
    out = torch.full((tokens, h, p), 7.0)
    before = ssm_state.clone()
    h0, xs, dts, bs = cpu_ops.tree_scan_rows(x, dt, B, C, ssm_state, start, index,
                                             torch.tensor(parents), A, D, dt_bias, out)
    want, want_dt = tree_scan_ref(x[index], dt[index], A, B[index], C[index], tree.mask, D=D, dt_bias=dt_bias,
                                  dt_softplus=True, initial_states=ssm_state[start])
    torch.testing.assert_close(out[index], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dts, want_dt, rtol=1e-5, atol=1e-6)
    others = torch.ones(tokens, dtype=torch.bool)
    others[index.flatten()] = False
    assert (out[others] == 7.0).all(), "rows outside the trees were written"
    assert torch.equal(h0, ssm_state[start]) and torch.equal(xs, x[index]) and torch.equal(bs, B[index])
    assert torch.equal(ssm_state, before), "the SSM state was written"


PATHS = [[[0, 1, 3, 6], [0, 8, 9, -1]], [[0, -1, -1, -1], [0, 2, 5, -1]]]  # root first, -1 padded


@pytest.mark.parametrize("paths", PATHS)
def test_tree_conv_commit_matches_conv_replay(cpu_ops, paths):
    gen = torch.Generator().manual_seed(3)
    b, n, c, w, spec = 2, 10, 16, 4, 4
    conv_state = torch.randn(6, spec + w - 1, c, generator=gen).transpose(1, 2)  # (slots, c, L), c fastest
    win, xbc = torch.randn(b, w - 1, c, generator=gen), torch.randn(b, n, c, generator=gen)
    slots, cols, path = torch.tensor([5, 2]), torch.tensor([3, 0]), torch.tensor(paths)
    want = conv_state.clone()
    windows = win.transpose(1, 2).clone()  # (b, c, w - 1), conv_replay's layout
    conv_replay(windows, xbc, path, impl="ref")
    for r in range(b):
        want[slots[r], :, cols[r]:cols[r] + w - 1] = windows[r]
    cpu_ops.tree_conv_commit(conv_state, slots, cols, win, xbc, path)
    assert torch.equal(conv_state, want)


@pytest.mark.parametrize("paths", PATHS)
def test_tree_scan_commit_matches_ssm_replay(cpu_ops, paths):
    gen = torch.Generator().manual_seed(4)
    b, n, h, p, s, g = 2, 10, 4, 8, 16, 2
    ssm_state = torch.randn(5, h, p, s, generator=gen)
    h0, xs = torch.randn(b, h, p, s, generator=gen), torch.randn(b, n, h, p, generator=gen)
    dts, bs = torch.rand(b, n, h, generator=gen), torch.randn(b, n, g, s, generator=gen)
    A, slots, path = -torch.rand(h, generator=gen), torch.tensor([4, 1]), torch.tensor(paths)
    want = ssm_state.clone()
    state = h0.clone()
    ssm_replay_ref(state, xs, dts, A, bs, path)
    want[slots] = state
    cpu_ops.tree_scan_commit(ssm_state, slots, h0, xs, dts, A, bs, path)
    torch.testing.assert_close(ssm_state, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parents", PARENTS)
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_tree_delta_rows_match_the_eager_rule(cpu_ops, parents, per_channel):
    """Two rows of differently shaped trees; q, k, v read as views of wider rows (the layer
    splits them out of one projection), the state a view of a pool's slots."""
    gen = torch.Generator().manual_seed(len(parents))
    b, n, h, dk, dv = 2, len(parents), 3, 16, 24
    other = parents if n < 4 else [-1] + [0] * (n - 1)
    mask = torch.cat([TokenTree(torch.zeros(1, n, dtype=torch.long), p).mask for p in (parents, other)])
    qkv = torch.randn(b, n, h, 2 * dk + dv + 5, generator=gen)
    q = F.normalize(qkv[..., :dk], dim=-1) * dk ** -0.5
    k, v = F.normalize(qkv[..., dk:2 * dk], dim=-1), qkv[..., 2 * dk:2 * dk + dv]
    g = -torch.rand(*(b, n, h, dk) if per_channel else (b, n, h), generator=gen) * 1.5
    beta = torch.rand(b, n, h, generator=gen) * 2
    s0 = torch.randn(b + 1, h, dk, dv, generator=gen)[1:] * 0.5
    for got, want, what in zip(cpu_ops.tree_delta_rows(q, k, v, g, beta, mask, s0),
                               tree_delta_ref(q, k, v, g, beta, mask, s0), ("o", "u", "G")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("paths", PATHS + [[[0, 4, -1, -1], [-1, -1, -1, -1]]])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_replay_ops_match_the_eager_replays(cpu_ops, paths, per_channel):
    """conv, Mamba2 and gated delta rule states advanced along paths of different lengths (a row
    of -1 keeps its state), each state a strided view (slots of a pool, a conv window read
    channel-last), the activations views of wider rows, against the eager references."""
    gen = torch.Generator().manual_seed(5 + per_channel)
    b, n, path = 2, 10, torch.tensor(paths)

    def both(run, *states):  # the op (impl="auto") and the reference on copies of the same views
        pools = [(s._base if s._base is not None else s) for s in states]
        copies = [p.clone() for p in pools]
        run("auto", *states)
        views = [torch.as_strided(c, s.shape, s.stride(), s.storage_offset()) for c, s in zip(copies, states)]
        run("ref", *views)
        for got, want in zip(pools, copies):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    c, w = 12, 4
    conv = torch.randn(b + 1, w, c, generator=gen)[1:].transpose(1, 2)  # (b, c, w), channels fastest
    xbc = torch.randn(b, n, c + 3, generator=gen)[..., :c]
    both(lambda impl, s: conv_replay(s, xbc, path, impl=impl), conv)

    h, p, st, g = 4, 8, 16, 2
    ssm = torch.randn(b + 2, h, p, st, generator=gen)[1:-1]
    x = torch.randn(b, n, h, p + 2, generator=gen)[..., :p]
    dt, A = torch.rand(b, n, h, generator=gen), -torch.rand(h, generator=gen)
    B = torch.randn(b, n, g, st, generator=gen)
    both(lambda impl, s: ssm_replay(s, x, dt, A, B, path, impl=impl) if impl == "auto"
         else ssm_replay_ref(s, x, dt, A, B, path), ssm)

    dk, dv = 16, 24
    state = torch.randn(b + 1, h, dk, dv, generator=gen)[1:]
    k = F.normalize(torch.randn(b, n, h, dk + 5, generator=gen)[..., :dk], dim=-1)
    u = torch.randn(b, n, h, dv, generator=gen)
    G = -torch.rand(*(b, n, h, dk) if per_channel else (b, n, h), generator=gen).cumsum(1)
    both(lambda impl, s: delta_replay(s, k, u, G, path, impl=impl), state)


def test_replays_take_activations_laid_out_nodes_fastest(cpu_ops, monkeypatch):
    """A compiled tree step returns ``u`` and ``G`` with the nodes fastest: the commit still runs
    the C++ op (counted) on dense copies, with the reference's result."""
    gen = torch.Generator().manual_seed(11)
    b, n, h, dk, dv = 2, 7, 4, 16, 24
    path = torch.tensor([[0, 2, 5, -1], [0, 1, -1, -1]])
    k = F.normalize(torch.randn(b, n, h, dk, generator=gen), dim=-1)
    u = torch.randn(b, h, dv, n, generator=gen).permute(0, 3, 1, 2)  # (b, n, h, dv), nodes fastest
    G = -torch.rand(b, h, n, generator=gen).cumsum(2).transpose(1, 2)  # (b, n, h)
    assert u.stride(-1) != 1 and G.stride(-1) != 1
    state = torch.randn(b, h, dk, dv, generator=gen)
    want = state.clone()
    delta_replay(want, k, u, G, path, impl="ref")
    calls = []

    class Counted:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(cpu_ops, name)

    monkeypatch.setattr("stree.kernels.replay.cpu_ops.ops", lambda: Counted())
    delta_replay(state, k, u, G, path)
    assert calls == ["delta_replay_rows"]
    torch.testing.assert_close(state, want, rtol=1e-5, atol=1e-5)


def test_bad_inputs_get_clear_errors(cpu_ops):
    def scan(start, parents):  # a two-node tree of 4 tokens, 2 heads, 1 group, state size 8
        cpu_ops.tree_scan_rows(torch.randn(4, 2, 4), torch.randn(4, 2), torch.randn(4, 1, 8), torch.randn(4, 1, 8),
                               torch.randn(2, 2, 4, 8), torch.tensor([start]), torch.tensor([[0, 1]]),
                               torch.tensor(parents), -torch.ones(2), torch.ones(2), torch.zeros(2),
                               torch.empty(4, 2, 4))

    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.tree_conv_rows(x.double(), torch.randn(2, 8, 3).double(), torch.tensor([0]), torch.tensor([0]),
                               torch.tensor([[0]]), torch.tensor([[0, 0, 0]]), torch.randn(8, 3), torch.empty(0),
                               True, x.double())
    with pytest.raises(RuntimeError, match="topological"):
        scan(0, [-1, 1])
    with pytest.raises(RuntimeError, match="a token row out of range"):
        cpu_ops.tree_conv_rows(x, torch.randn(2, 8, 3), torch.tensor([0]), torch.tensor([0]), torch.tensor([[4]]),
                               torch.tensor([[0, 1, 2]]), torch.randn(8, 3), torch.empty(0), True, x.clone())
    with pytest.raises(RuntimeError, match="a state slot out of range"):
        scan(2, [-1, 0])
    scan(1, [-1, 0])  # the same call with a valid slot runs
    with pytest.raises(RuntimeError, match="past the conv state"):
        cpu_ops.tree_conv_commit(torch.zeros(2, 8, 4), torch.tensor([0]), torch.tensor([2]), torch.zeros(1, 3, 8),
                                 torch.zeros(1, 2, 8), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="tree_delta_rows: q must be a float32"):
        x = torch.randn(1, 2, 1, 4, dtype=torch.float64)
        cpu_ops.tree_delta_rows(x, x, x, torch.zeros(1, 2, 1), torch.ones(1, 2, 1), torch.ones(1, 2, 2).bool().tril(),
                                torch.zeros(1, 1, 4, 4))
    with pytest.raises(RuntimeError, match="delta_replay_rows: path node out of range"):
        cpu_ops.delta_replay_rows(torch.zeros(1, 1, 4, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4),
                                  torch.zeros(1, 2, 1), torch.tensor([[0, 2]]))
    with pytest.raises(RuntimeError, match="conv_replay_rows: path must be a contiguous"):
        cpu_ops.conv_replay_rows(torch.zeros(1, 4, 3), torch.zeros(1, 2, 4), torch.tensor([[0, 1]]).int())
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.tree_scan_commit(torch.zeros(2, 2, 4, 8), torch.tensor([0]), torch.zeros(1, 2, 4, 8),
                                 torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2), -torch.ones(2), torch.zeros(1, 2, 1, 8),
                                 torch.tensor([[0, 2]]))


def _paged(values, tables, blocks, block_size, ts, es):
    """A ``(blocks, kv_heads, block_size, d)`` cache whose head regions hold token t's channel e at
    ``t * ts + e * es``, with request r's ``values[r] (length, kv_heads, d)`` at its blocks ``tables[r]``."""
    kv_heads, d = values[0].shape[1:]
    memory = torch.full((blocks * kv_heads * block_size * d,), float("nan"))  # unwritten: never read
    cache = memory.as_strided((blocks, kv_heads, block_size, d), (kv_heads * block_size * d, block_size * d, ts, es))
    for vals, table in zip(values, tables):
        for pos in range(len(vals)):
            block, t = table[pos // block_size], pos % block_size
            for h in range(kv_heads):
                base = block * cache.stride(0) + h * cache.stride(1) + t * ts
                memory[base + torch.arange(d) * es] = vals[pos, h]
    return cache


@pytest.mark.parametrize("channel_major_k", [True, False], ids=["k-channel-major", "k-token-major"])
@pytest.mark.parametrize("parents", PARENTS[1:])
@pytest.mark.parametrize("block_size, d, contexts", [(8, 16, [13, 0, 13]), (83, 88, [150, 0, 160])],
                         ids=["small", "tiled"])
def test_tree_attention_rows_match_a_softmax_per_node(cpu_ops, channel_major_k, parents, block_size, d, contexts):
    """Each node against its own softmax over its request's context and its root path, on a paged
    cache laid out as vLLM's CPU backend lays fp32 out (K channel-major, V token-major) and the
    other way round; requests whose nodes straddle a block, one with no context at all. "tiled":
    blocks and heads long enough for the op's register tiles (64 and 16 tokens or channels) and
    their tails, query rows per KV head not a multiple of the tile's 4 rows (m = 10)."""
    gen = torch.Generator().manual_seed(len(parents))
    heads, kv_heads, m = 6, 2, len(parents)
    lengths = [c + m for c in contexts]
    order = torch.randperm(sum(-(-n // block_size) for n in lengths) + 2, generator=gen).tolist()
    tables = []
    for n in lengths:  # each request's blocks, scattered (two blocks no request holds)
        tables.append(order[:-(-n // block_size)])
        order = order[len(tables[-1]):]
    keys = [torch.randn(n, kv_heads, d, generator=gen) for n in lengths]
    values = [torch.randn(n, kv_heads, d, generator=gen) for n in lengths]
    k_strides = (1, block_size) if channel_major_k else (d, 1)
    v_strides = (d, 1) if channel_major_k else (1, block_size)
    blocks = len(order) + sum(map(len, tables))
    key_cache = _paged(keys, tables, blocks, block_size, *k_strides)
    value_cache = _paged(values, tables, blocks, block_size, *v_strides)
    tokens = 3 * m + 5
    index = _scattered(3, m, tokens, gen)
    query = torch.randn(tokens, heads, d, generator=gen)
    out = torch.zeros(tokens, heads, d)
    mask = TokenTree(torch.zeros(1, m, dtype=torch.long), parents).mask[0]
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cpu_ops.tree_attention_rows(query, key_cache, value_cache, *k_strides, *v_strides, block_table,
                                torch.tensor(lengths), index, mask, d ** -0.5, out)
    for r, context in enumerate(contexts):
        for i in range(m):
            seen = list(range(context)) + [context + j for j in range(m) if mask[i, j]]
            k = keys[r][seen].repeat_interleave(heads // kv_heads, 1)  # (seen, heads, d)
            v = values[r][seen].repeat_interleave(heads // kv_heads, 1)
            probs = (torch.einsum("hd,lhd->hl", query[index[r, i]], k) * d ** -0.5).softmax(-1)
            torch.testing.assert_close(out[index[r, i]], torch.einsum("hl,lhd->hd", probs, v), rtol=1e-5, atol=1e-5)
    untouched = torch.ones(tokens, dtype=torch.bool)
    untouched[index.flatten()] = False
    assert not out[untouched].any()  # rows of other tokens are left alone


def test_tree_attention_rows_reject_bad_tables(cpu_ops):
    cache = torch.zeros(2, 1, 4, 8)
    query, out = torch.randn(3, 2, 8), torch.zeros(3, 2, 8)

    def call(table=(0, 1), length=5, index=(2, 1), mask=((True, False), (True, True))):
        cpu_ops.tree_attention_rows(query, cache, cache, 1, 4, 8, 1, torch.tensor([table]), torch.tensor([length]),
                                    torch.tensor([index]), torch.tensor(mask), 1.0, out)

    call()  # valid
    with pytest.raises(RuntimeError, match="a KV block out of range"):
        call(table=(0, 2))
    with pytest.raises(RuntimeError, match="a sequence length out of range"):
        call(length=9)
    with pytest.raises(RuntimeError, match="a token row out of range"):
        call(index=(3, 1))
    with pytest.raises(RuntimeError, match="see itself"):
        call(mask=((True, False), (True, False)))
    with pytest.raises(RuntimeError, match="past its storage"):
        cpu_ops.tree_attention_rows(query, cache, cache, 1, 8, 8, 1, torch.tensor([[0, 1]]), torch.tensor([5]),
                                    torch.tensor([[2, 1]]), torch.tensor([[True, False], [True, True]]), 1.0, out)
