"""stree.vllm.trees without an engine: the tree rows of vLLM's Mamba2 decode ops and of its CPU
attention, and the commit, against plain per-path recurrences written here (each root-to-node
path run token by token as a sequence), on vLLM's own state and KV-cache layouts."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from stree.sampling import SamplingConfig
from stree.tree import TokenTree
from stree.vllm.trees import (CacheLayout, DraftedTree, TreeRow, TreeStep, tree_attention, tree_conv_update,
                              tree_state_update)

PARENTS = [-1, 0, 0, 1, 1, 3, 2]
PATH = [0, 1, 3, 5]  # the accepted path the commits use


def _step(start: int = 0) -> TreeStep:
    tree = TokenTree(torch.arange(len(PARENTS)), PARENTS)
    drafted = DraftedTree(tree, None, "deterministic", None, SamplingConfig())
    return TreeStep({start: TreeRow(0, start, drafted, None)})


def _path(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


def test_tree_conv_equals_each_path_as_a_sequence_and_commits_the_path():
    torch.manual_seed(0)
    m, dim, width = len(PARENTS), 12, 4
    k = m - 1
    conv_state = torch.randn(3, dim, width - 1 + k)  # vLLM: (slots, dim, width - 1 + K)
    before = conv_state.clone()
    x, weight, bias = torch.randn(m, dim), torch.randn(dim, width), torch.randn(dim)
    indices = torch.tensor([[1] + [0] * k])
    accepted = torch.tensor([2])  # last step accepted 2 tokens: the window starts at column 1
    step = _step()
    out, handled = tree_conv_update(x, conv_state, weight, bias, "silu", indices, accepted, torch.tensor([0, m]), step)
    assert handled == [0] and torch.equal(conv_state, before)  # nothing written while verifying
    window = before[1, :, 1:width]
    for node in range(m):
        seq = torch.cat([window, x[_path(node)].T], dim=1)[:, -width:]  # (dim, width) along the path
        want = F.silu((seq * weight).sum(-1) + bias)
        torch.testing.assert_close(out[node], want, rtol=1e-5, atol=1e-5)
    step.rows[0].path = PATH
    step.commit()
    a = len(PATH) - 1  # vLLM reads the next window at offset num_accepted - 1 = a
    torch.testing.assert_close(conv_state[1, :, a:a + width - 1],
                               torch.cat([window, x[PATH].T], dim=1)[:, -(width - 1):])


def test_tree_scan_equals_each_path_as_a_sequence_and_commits_the_path():
    torch.manual_seed(0)
    m, h, p, n, g = len(PARENTS), 4, 3, 5, 2
    slots = list(range(10, 10 + m))  # the request's 1 + K state slots
    state = torch.randn(20, h, p, n)
    before = state.clone()
    x, dt = torch.randn(m, h, p), torch.randn(m, h)
    A, dt_bias, D = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
    B, C = torch.randn(m, g, n), torch.randn(m, g, n)
    out = torch.zeros(m, h, p)
    step = _step()
    # vLLM's decode operands are expanded over the head dimension
    expand = (lambda t: t[:, :, None].expand(-1, -1, p))
    handled = tree_state_update(state, x, expand(dt), A[:, None, None].expand(h, p, n), B, C, D[:, None].expand(h, p),
                                dt_bias[:, None].expand(h, p), True, torch.tensor([slots]), torch.tensor([3]),
                                torch.tensor([0, m]), out, step)
    assert handled == [0] and torch.equal(state, before)

    def run(path):
        s = before[slots[2]].clone()  # num_accepted 3: the state after the last accepted token
        for i in path:
            delta = F.softplus(dt[i] + dt_bias)  # (h,)
            b_i, c_i = (v[i].repeat_interleave(h // g, 0) for v in (B, C))  # (h, n)
            s = s * torch.exp(delta * A)[:, None, None] + (delta[:, None] * x[i])[..., None] * b_i[:, None, :]
            y = (s * c_i[:, None, :]).sum(-1) + D[:, None] * x[i]
        return s, y

    for node in range(m):
        torch.testing.assert_close(out[node], run(_path(node))[1], rtol=1e-4, atol=1e-4)
    step.rows[0].path = PATH
    step.commit()
    torch.testing.assert_close(state[slots[len(PATH) - 1]], run(PATH)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size", [16, 128])  # the CPU kernel lays K out differently for these
def test_tree_attention_on_vllm_cache_and_compaction(block_size):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    torch.manual_seed(0)
    heads, kv_heads, hd, context = 4, 2, 64, 21
    m = len(PARENTS)
    length = context + m
    layer = SimpleNamespace(isa=_get_attn_isa(torch.float32, block_size, hd))
    impl = SimpleNamespace(alibi_slopes=None, sliding_window=-1, sinks=None, is_fp8_kv_cache=False, scale=hd ** -0.5,
                           logits_soft_cap=0, kv_cache_dtype="auto")
    blocks_needed = -(-length // block_size)
    block_table = torch.tensor([[5, 2, 7][:blocks_needed] + [0] * (3 - blocks_needed)], dtype=torch.int32)
    cache = torch.zeros(8, kv_heads, 2 * block_size, hd)
    key_cache, value_cache = cache.chunk(2, dim=2)
    pos = torch.arange(length)
    slot_of = (block_table[0, pos // block_size].long() * block_size + pos % block_size)
    keys, values = torch.randn(length, kv_heads, hd), torch.randn(length, kv_heads, hd)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slot_of, layer.isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    query = torch.randn(m, heads, hd)
    output = torch.zeros(m, heads, hd)
    metadata = SimpleNamespace(query_start_loc=torch.tensor([0, m]), seq_lens=torch.tensor([length]),
                               block_table=block_table, slot_mapping=slot_of[context:])
    step = _step()
    tree_attention(impl, layer, query, key_cache, value_cache, metadata, output, step)
    for node in range(m):
        seen = list(range(context)) + [context + i for i in _path(node)]
        k = keys[seen].repeat_interleave(heads // kv_heads, 1)
        v = values[seen].repeat_interleave(heads // kv_heads, 1)
        probs = (torch.einsum("hd,lhd->hl", query[node], k) * impl.scale).softmax(-1)
        torch.testing.assert_close(output[node], torch.einsum("hl,lhd->hd", probs, v), rtol=1e-5, atol=1e-5)
    step.rows[0].path = PATH
    step.commit()  # the path's K/V now sit at context + 0 .. context + a
    layout = CacheLayout.probe(layer, block_size, hd, torch.float32, "auto")
    moved = slot_of[context:context + len(PATH)]
    assert torch.equal(_read(key_cache, layout.key, moved), keys[[context + i for i in PATH]])
    assert torch.equal(_read(value_cache, layout.value, moved), values[[context + i for i in PATH]])
    assert torch.equal(_read(key_cache, layout.key, slot_of[:context]), keys[:context])  # context untouched


def _read(cache, index, slots):
    """(len(slots), kv_heads, head_dim) of the tokens in KV slots ``slots``, by the probed layout
    (which the tree attention check above exercised against vLLM's own cache writes)."""
    block = index.shape[0]
    regions = cache.reshape(cache.shape[0], cache.shape[1], -1)
    return regions[(slots // block)[:, None], :, index[slots % block]].permute(0, 2, 1)
