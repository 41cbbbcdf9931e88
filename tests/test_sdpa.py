"""stree.layers.sdpa: grouped-query attention against attention written from its definition
(K/V repeated per query head, softmax of scaled scores plus mask), and on a GPU the proof that
no call falls back to SDPA's math kernel."""
from __future__ import annotations

import math

import pytest
import torch

from stree.layers.sdpa import attention, causal_after, fold_mask


def reference(q, k, v, scale, visible):
    """``visible (b or 1, 1, l, s)`` bool; heads h read K/V head h // rep."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = scores.softmax(-1) @ v.double()
    return out.transpose(1, 2).flatten(2)


def inputs(b, hq, hkv, l, s, d=8, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device, dtype)
               for h, n in ((hq, l), (hkv, s), (hkv, s)))
    return q, k, v


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_masked_gqa_matches_the_definition(hq, hkv):
    b, l, s, d = 2, 5, 11, 8
    q, k, v = inputs(b, hq, hkv, l, s, d)
    visible = torch.rand(b, 1, l, s, generator=torch.Generator().manual_seed(1)) < 0.6
    visible[..., 0] = True  # every query sees at least one key
    additive = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    expected = reference(q, k, v, 0.3, visible)
    for mask in (visible, additive):  # bool or additive, folded per query group
        got = attention(q, k, v, 0.3, mask=fold_mask(mask, hq // hkv))
        assert torch.allclose(got.double(), expected, atol=1e-5)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2)])
def test_causal_and_unmasked_gqa_match_the_definition(hq, hkv):
    q, k, v = inputs(1, hq, hkv, 7, 7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    assert torch.allclose(attention(q, k, v, 0.5, causal=True).double(),
                          reference(q, k, v, 0.5, causal), atol=1e-5)
    q1 = q[:, :, -1:]  # one decoding query sees every key
    assert torch.allclose(attention(q1, k, v, 0.5).double(),
                          reference(q1, k, v, 0.5, torch.ones(1, 1, 1, 7, dtype=torch.bool)), atol=1e-5)


@pytest.mark.parametrize("start, l", [(0, 6), (5, 1), (5, 4)])
def test_causal_after_a_prefix_matches_the_definition(start, l):
    """Queries at positions start..start+l-1 see the keys up to their own position."""
    q, k, v = inputs(2, 6, 2, l, start + l, seed=start + l)
    visible = torch.arange(start + l)[None, :] <= (start + torch.arange(l))[:, None]
    assert torch.allclose(causal_after(q, k, v, 0.4, start).double(),
                          reference(q, k, v, 0.4, visible[None, None]), atol=1e-5)


def test_fold_mask_rows_are_the_group_heads_queries():
    mask = torch.arange(2 * 3 * 4).view(2, 1, 3, 4)
    folded = fold_mask(mask, 2)
    assert folded.shape == (2, 1, 6, 4)
    assert torch.equal(folded[:, :, :3], mask) and torch.equal(folded[:, :, 3:], mask)
    assert fold_mask(mask, 1) is mask
    with pytest.raises(ValueError, match="not both"):
        attention(*inputs(1, 2, 2, 3, 3), 1.0, mask=torch.ones(3, 3, dtype=torch.bool), causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_call_falls_back_to_the_math_kernel_on_cuda(dtype):
    """The tree step's masked GQA (8B shape: 32 query heads, 8 K/V heads, head_dim 128), a
    one-token step and a causal prompt run with the math kernel disabled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, hq, hkv, d, span, n = 1, 32, 8, 128, 1000, 13
    scale = 1 / math.sqrt(d)
    q, k, v = inputs(b, hq, hkv, n, span, d, dtype, "cuda")
    visible = torch.ones(b, 1, n, span, dtype=torch.bool, device="cuda")
    visible[..., -n:] = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    additive = torch.zeros(visible.shape, dtype=dtype, device="cuda").masked_fill_(~visible, float("-inf"))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        tree = attention(q, k, v, scale, mask=fold_mask(additive, hq // hkv))
        step = attention(q[:, :, :1], k, v, scale)
        prompt = attention(*inputs(b, hq, hkv, 64, 64, d, dtype, "cuda"), scale, causal=True)
    expected = reference(q, k, v, scale, visible)
    assert (tree.double() - expected).abs().max().item() < 2e-2
    assert step.shape == (b, 1, hq * d) and prompt.shape == (b, 64, hq * d)
