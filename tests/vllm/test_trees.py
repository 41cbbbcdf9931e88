"""stree.vllm's tree rows without an engine: the tree rows of the Mamba2 mixer and of the attention
backend, and the commit, against plain per-path recurrences written here (each root-to-node path
run token by token as a sequence), on vLLM's own state and KV-cache layouts. Each step holds three
requests: two trees of one shape (run as one batch) with different accepted paths, and a chain;
where the Mamba2 rows sit among vLLM's decode rows is read once per step (``recurrent_rows``)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from stree.kernels import cpu_ops
from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from stree.vllm.drafted import DraftedTree
from stree.vllm.attention_rows import tree_attention
from stree.vllm.conv_rows import tree_conv_rows
from stree.vllm.kv_layout import CacheLayout, FlashLayout
from stree.vllm.mamba2_rows import tree_scan_rows
from stree.vllm.step import TreeRow, TreeStep

PARENTS = [-1, 0, 0, 1, 1, 3, 2]
CHAIN = [-1, 0, 1, 2]
# (parents, the accepted path the commits use) per request, in batch order
REQUESTS = [(PARENTS, [0, 1, 3, 5]), (CHAIN, [0, 1]), (PARENTS, [0, 2, 6])]
STARTS = [0, len(PARENTS), len(PARENTS) + len(CHAIN)]  # each query's first token index
TOKENS = STARTS[-1] + len(PARENTS)


def _step() -> TreeStep:
    rows = {}
    for r, ((parents, _), start) in enumerate(zip(REQUESTS, STARTS)):
        tree = TokenTree(torch.arange(len(parents)), parents)
        rows[start] = TreeRow(r, start, DraftedTree(tree, None, "deterministic", None, SamplingConfig()), None)
    return TreeStep(rows)


def _accept(step: TreeStep) -> None:
    for (_, path), start in zip(REQUESTS, STARTS):
        step.rows[start].path = path


def _path(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.fixture(params=["cpp", "eager"])
def tree_rows_impl(request, monkeypatch):
    """Both CPU implementations of the Mamba2 tree rows: stree's C++ ops and the eager ops."""
    if request.param == "cpp":
        assert cpu_ops.ops() is not None, "the C++ CPU ops did not build"
    else:
        monkeypatch.setattr(cpu_ops, "usable", lambda *tensors: False)
    return request.param


def test_tree_conv_equals_each_path_as_a_sequence_and_commits_the_path(tree_rows_impl):
    torch.manual_seed(0)
    dim, width, k = 12, 4, len(PARENTS) - 1
    conv_state = torch.randn(5, dim, width - 1 + k)  # vLLM: (slots, dim, width - 1 + K)
    before = conv_state.clone()
    x, weight, bias = torch.randn(TOKENS, dim), torch.randn(dim, width), torch.randn(dim)
    slots, accepted = [1, 4, 2], [2, 1, 3]  # last step's accepted counts: windows start at column a - 1
    indices = torch.tensor([[s] + [0] * k for s in slots])
    step = _step()
    rows = step.recurrent_rows(torch.tensor(STARTS + [TOKENS]), indices, torch.tensor(accepted), -1)
    out = tree_conv_rows(x, conv_state, weight, bias, "silu", rows, step)
    assert rows.handled == [0, 1, 2] and rows.masked is None
    assert torch.equal(conv_state, before)  # nothing written while verifying
    assert len(step.groups()) == 2  # the two trees of one shape ran as one batch
    for (parents, _), start, slot, a in zip(REQUESTS, STARTS, slots, accepted):
        window = before[slot, :, a - 1:a - 1 + width - 1]
        xs = x[start:start + len(parents)]
        for node in range(len(parents)):
            seq = torch.cat([window, xs[_path(parents, node)].T], dim=1)[:, -width:]  # (dim, width) on the path
            want = F.silu((seq * weight).sum(-1) + bias)
            torch.testing.assert_close(out[start + node], want, rtol=1e-5, atol=1e-5)
    _accept(step)
    step.commit()
    for (parents, path), start, slot, a in zip(REQUESTS, STARTS, slots, accepted):
        window = before[slot, :, a - 1:a - 1 + width - 1]
        n = len(path) - 1  # vLLM reads the next window at offset num_accepted - 1 = n
        want = torch.cat([window, x[start:start + len(parents)][path].T], dim=1)[:, -(width - 1):]
        torch.testing.assert_close(conv_state[slot, :, n:n + width - 1], want)


def test_tree_scan_equals_each_path_as_a_sequence_and_commits_the_path(tree_rows_impl):
    torch.manual_seed(0)
    h, p, n, g = 4, 3, 5, 2
    k = len(PARENTS) - 1
    slots = [list(range(s, s + 1 + k)) for s in (10, 0, 20)]  # each request's 1 + K state slots
    accepted = [3, 1, 2]
    state = torch.randn(30, h, p, n)
    before = state.clone()
    x, dt = torch.randn(TOKENS, h, p), torch.randn(TOKENS, h)
    A, dt_bias, D = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
    B, C = torch.randn(TOKENS, g, n), torch.randn(TOKENS, g, n)
    step = _step()
    rows = step.recurrent_rows(torch.tensor(STARTS + [TOKENS]), torch.tensor(slots), torch.tensor(accepted), -1)
    out = torch.zeros(TOKENS, h, p)
    tree_scan_rows(state, x, dt, A, B, C, D, dt_bias, rows, step, out)
    assert rows.handled == [0, 1, 2] and torch.equal(state, before)

    def run(h0, tokens):
        s = h0.clone()
        for i in tokens:
            delta = F.softplus(dt[i] + dt_bias)  # (h,)
            b_i, c_i = (v[i].repeat_interleave(h // g, 0) for v in (B, C))  # (h, n)
            s = s * torch.exp(delta * A)[:, None, None] + (delta[:, None] * x[i])[..., None] * b_i[:, None, :]
            y = (s * c_i[:, None, :]).sum(-1) + D[:, None] * x[i]
        return s, y

    for (parents, _), start, own, a in zip(REQUESTS, STARTS, slots, accepted):
        h0 = before[own[a - 1]]  # the state after the last accepted token: slot num_accepted - 1
        for node in range(len(parents)):
            tokens = [start + i for i in _path(parents, node)]
            torch.testing.assert_close(out[start + node], run(h0, tokens)[1], rtol=1e-4, atol=1e-4)
    _accept(step)
    step.commit()
    for (parents, path), start, own, a in zip(REQUESTS, STARTS, slots, accepted):
        want = run(before[own[a - 1]], [start + i for i in path])[0]
        torch.testing.assert_close(state[own[len(path) - 1]], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout, block_size", [("cpu", 16), ("cpu", 128), ("flash", 16)],
                         ids=["cpu-16", "cpu-128", "flash-16"])  # the CPU kernel lays K out differently for 16, 128
@pytest.mark.parametrize("cap", [0.0, 2.0], ids=["no-cap", "soft-cap"])
def test_tree_attention_on_vllm_cache_and_compaction(layout, block_size, cap, tree_rows_impl):
    """On vLLM's CPU cache (written by vLLM's own op, its layout probed; read in place by stree's
    C++ op, or gathered) and on FlashAttention's GPU layout (written here on CPU tensors:
    ``(blocks, kv_heads, block_size, 2 * head_dim)``, K first), which no GPU has run."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    heads, kv_heads, hd = 4, 2, 64
    contexts = [21, 40, 3]  # committed tokens per request
    layer = SimpleNamespace(isa=_get_attn_isa(torch.float32, block_size, hd))
    impl = SimpleNamespace(alibi_slopes=None, sliding_window=-1 if layout == "cpu" else (-1, -1), sinks=None,
                           scale=hd ** -0.5, logits_soft_cap=cap, kv_cache_dtype="auto")
    tables = [[5, 2, 7], [1, 6, 3, 4], [8]]  # each request's blocks, in order
    lengths = [c + len(parents) for c, (parents, _) in zip(contexts, REQUESTS)]
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    if layout == "cpu":
        cache = torch.zeros(9, kv_heads, 2 * block_size, hd)
        key_cache, value_cache = cache.chunk(2, dim=2)
    else:
        cache = torch.zeros(9, kv_heads, block_size, 2 * hd)
        key_cache, value_cache = cache.transpose(1, 2).split(hd, dim=-1)  # as FlashAttentionImpl.forward
    keys, values, slot_of = [], [], []
    for r, length in enumerate(lengths):
        pos = torch.arange(length)
        slot_of.append(block_table[r, pos // block_size].long() * block_size + pos % block_size)
        keys.append(torch.randn(length, kv_heads, hd))
        values.append(torch.randn(length, kv_heads, hd))
        if layout == "cpu":
            ops.cpu_attn_reshape_and_cache(keys[r], values[r], key_cache, value_cache, slot_of[r], layer.isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        else:
            block, offset = slot_of[r] // block_size, slot_of[r] % block_size
            cache[block, :, offset] = torch.cat([keys[r], values[r]], dim=-1)
    query = torch.randn(TOKENS, heads, hd)
    output = torch.zeros(TOKENS, heads * hd)
    metadata = SimpleNamespace(query_start_loc=torch.tensor(STARTS + [TOKENS]), seq_lens=torch.tensor(lengths),
                               block_table=block_table,
                               slot_mapping=torch.cat([s[c:] for s, c in zip(slot_of, contexts)]))
    if layout == "cpu" and not cap and tree_rows_impl == "cpp":  # fp32 on x86: the C++ op reads it in place
        assert CacheLayout.probe(layer, block_size, hd, torch.float32, "auto").strides is not None
    step = _step()
    tree_attention(impl, layer, query, key_cache, value_cache, metadata, output, step,
                   FlashLayout if layout == "flash" else None)
    out = output.view(TOKENS, heads, hd)
    for (parents, _), start, context, ks, vs in zip(REQUESTS, STARTS, contexts, keys, values):
        for node in range(len(parents)):
            seen = list(range(context)) + [context + i for i in _path(parents, node)]
            k = ks[seen].repeat_interleave(heads // kv_heads, 1)
            v = vs[seen].repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,lhd->hl", query[start + node], k) * impl.scale
            probs = (cap * torch.tanh(scores / cap) if cap else scores).softmax(-1)
            torch.testing.assert_close(out[start + node], torch.einsum("hl,lhd->hd", probs, v), rtol=1e-5, atol=1e-5)
    _accept(step)
    step.commit()  # each path's K/V now sit at context + 0 .. context + a
    if layout == "cpu":
        probed = CacheLayout.probe(layer, block_size, hd, torch.float32, "auto")
        read_k, read_v = (lambda s: _read(key_cache, probed.key, s)), (lambda s: _read(value_cache, probed.value, s))
    else:
        read_k, read_v = ((lambda s, half=half: cache[s // block_size, :, s % block_size][..., half])
                          for half in (slice(None, hd), slice(hd, None)))
    for (_, path), context, slots, ks, vs in zip(REQUESTS, contexts, slot_of, keys, values):
        moved = slots[context:context + len(path)]
        assert torch.equal(read_k(moved), ks[[context + i for i in path]])
        assert torch.equal(read_v(moved), vs[[context + i for i in path]])
        assert torch.equal(read_k(slots[:context]), ks[:context])  # context untouched


def _read(cache, index, slots):
    """(len(slots), kv_heads, head_dim) of the tokens in KV slots ``slots``, by the probed layout
    (which the tree attention check above exercised against vLLM's own cache writes)."""
    block = index.shape[0]
    regions = cache.reshape(cache.shape[0], cache.shape[1], -1)
    return regions[(slots // block)[:, None], :, index[slots % block]].permute(0, 2, 1)


def test_rows_of_other_requests_are_left_to_vllm():
    """A decode row without a tree (here the fourth, a request vLLM drafts for as a chain) keeps
    its slots for vLLM's own ops; the tree rows' are set to the null block, which those ops
    skip. Built once per step: every layer reads the same object."""
    step = _step()
    table = torch.tensor([[1, 0], [4, 0], [2, 0], [7, 0]])
    starts = torch.tensor(STARTS + [TOKENS, TOKENS + 2])
    rows = step.recurrent_rows(starts, table, torch.tensor([1, 1, 1, 1]), -1)
    assert rows.handled == [0, 1, 2]
    assert rows.masked.tolist() == [[-1, -1], [-1, -1], [-1, -1], [7, 0]] and table[0, 0] == 1
    assert step.recurrent_rows(starts, table, torch.tensor([1, 1, 1, 1]), -1) is rows
