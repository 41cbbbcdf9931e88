"""Depthwise causal conv1d along each tree node's ancestor chain, reading into the committed state.

With ext = cat(conv_state[:, :, 1:], xbc^T) along time (length w - 1 + nodes), node i's window is
``window[b, i, :]`` (w indices into ext, oldest first, ``window[b, i, w - 1] = w - 1 + i``):

    out[b, i, c] = act(bias[c] + sum_k weight[c, k] * ext[b, c, window[b, i, k]])

For a chain this is mamba_ssm's causal conv continued from conv_state. ``TokenTree.conv_window(w)``
builds the table: ancestors of i by depth, then the newest committed columns above the root.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stree.kernels import cpu_ops
from stree.kernels._common import (check_device, check_float, debug_checks, check_index, check_ndim,
                                   check_shape, use_triton)
from stree.tree import conv_gather_rows

_OP = "tree_conv"
_ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _tree_conv_kernel(
    xbc_ptr, state_ptr, weight_ptr, bias_ptr, window_ptr, out_ptr,
    n, channels,
    stride_xbc_b, stride_xbc_n, stride_xbc_c,
    stride_state_b, stride_state_c, stride_state_w,
    stride_weight_c, stride_weight_w,
    stride_window_b, stride_window_n, stride_window_w,
    stride_out_b, stride_out_n, stride_out_c,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    n_in = offs_n < n
    c_in = offs_c < channels
    xbc_ptr += pid_b * stride_xbc_b
    state_ptr += pid_b * stride_state_b
    window_ptr += pid_b * stride_window_b

    if HAS_BIAS:
        acc = tl.load(bias_ptr + offs_c, mask=c_in, other=0.0).to(tl.float32)[None, :]
        acc = tl.broadcast_to(acc, (BLOCK_N, BLOCK_C))
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(W):
        idx = tl.load(window_ptr + offs_n * stride_window_n + k * stride_window_w, mask=n_in,
                      other=0)
        # ext index < W - 1: column idx + 1 of conv_state; otherwise tree node idx - (W - 1).
        in_state = idx < W - 1
        from_state = tl.load(state_ptr + offs_c[None, :] * stride_state_c
                             + (idx[:, None] + 1) * stride_state_w,
                             mask=(n_in & in_state)[:, None] & c_in[None, :], other=0.0)
        from_tree = tl.load(xbc_ptr + (idx[:, None] - (W - 1)) * stride_xbc_n
                            + offs_c[None, :] * stride_xbc_c,
                            mask=(n_in & ~in_state)[:, None] & c_in[None, :], other=0.0)
        wk = tl.load(weight_ptr + offs_c * stride_weight_c + k * stride_weight_w, mask=c_in,
                     other=0.0).to(tl.float32)
        acc += (from_state.to(tl.float32) + from_tree.to(tl.float32)) * wk[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + pid_b * stride_out_b + offs_n[:, None] * stride_out_n
             + offs_c[None, :] * stride_out_c, acc.to(out_ptr.dtype.element_ty),
             mask=n_in[:, None] & c_in[None, :])


def _check_args(xbc, conv_state, weight, bias, window, activation):
    check_ndim(_OP, "xbc", xbc, 3, "(batch, nodes, channels)")
    b, n, c = xbc.shape
    check_ndim(_OP, "conv_state", conv_state, 3, "(batch, channels, width)")
    w = conv_state.shape[2]
    check_shape(_OP, "conv_state", conv_state, (b, c, w), "(batch, channels, width)")
    check_shape(_OP, "weight", weight, (c, w), "(channels, width)")
    if bias is not None:
        check_shape(_OP, "bias", bias, (c,), "(channels,)")
    check_shape(_OP, "window", window, (b, n, w), "(batch, nodes, width)")
    if n == 0 or w == 0:
        raise ValueError(f"{_OP}: need at least one node and a conv width >= 1")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{_OP}: activation must be one of {_ACTIVATIONS}, got {activation!r}")
    check_float(_OP, xbc=xbc, conv_state=conv_state, weight=weight, bias=bias)
    check_index(_OP, window=window)
    check_device(_OP, xbc.device, conv_state=conv_state, weight=weight, bias=bias, window=window)


def _tree_conv_triton(xbc, conv_state, weight, bias, window, activation):
    b, n, c = xbc.shape
    w = weight.shape[1]
    out = torch.empty_like(xbc)
    BLOCK_N = min(64, triton.next_power_of_2(n))
    BLOCK_C = 128
    grid = (b, triton.cdiv(n, BLOCK_N), triton.cdiv(c, BLOCK_C))
    _tree_conv_kernel[grid](
        xbc, conv_state, weight, bias, window, out, n, c,
        *xbc.stride(), *conv_state.stride(), *weight.stride(), *window.stride(), *out.stride(),
        W=w, HAS_BIAS=bias is not None, SILU=activation is not None,
        BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C, num_warps=4,
    )
    return out


def _tree_conv_ref(xbc, conv_state, weight, bias, window, activation, gather_index=None):
    b, n, c = xbc.shape
    w = weight.shape[1]
    # ext over the whole committed window (w columns, no slice): indices are window + 1
    ext = torch.cat([conv_state.transpose(1, 2), xbc], dim=1)  # (b, w + n, c)
    if ext.dtype != torch.float32:
        ext = ext.float()
    if gather_index is None:
        gather_index = conv_gather_rows(window)
    # whole rows of ext (index_select), then one multiply-add per tap: an element-wise gather
    # and a (b, n, w, c) product cost about twice as much on the CPU
    taps = ext.view(b * (w + n), c).index_select(0, gather_index).view(b, n, w, c)
    wt = _f32(weight).t().contiguous()  # (w, c): each tap's weights contiguous
    out = torch.mul(taps[:, :, 0], wt[0]) if bias is None else torch.addcmul(_f32(bias), taps[:, :, 0], wt[0])
    for k in range(1, w):
        out.addcmul_(taps[:, :, k], wt[k])
    if activation is not None:
        out = F.silu(out, inplace=True)
    return out if out.dtype == xbc.dtype else out.to(xbc.dtype)


def _f32(t):
    return t if t.dtype == torch.float32 else t.float()


def tree_conv(xbc, conv_state, weight, bias, window, activation="silu", impl="auto",
              gather_index=None):
    """Causal depthwise conv1d + bias + activation along each node's ancestor chain.

    Args:
        xbc: (batch, nodes, channels) pre-conv inputs of the tree nodes.
        conv_state: (batch, channels, width) committed inputs, mamba layout (column width-1 newest).
        weight: (channels, width); bias: (channels,) or None.
        window: (batch, nodes, width) int64 indices into ext = cat(conv_state[:, :, 1:], xbc^T)
            (``TokenTree.conv_window(width)``).
        activation: "silu" (or its alias "swish") or None.
        impl: "auto" (Triton on CUDA tensors; on the CPU the C++ ``tree_conv_rows`` of
            ``csrc/tree_rows.cpp`` for fp32 inputs outside ``torch.compile``, else the
            reference), "triton" or "ref".
        gather_index: ``TokenTree.conv_gather_index(width)`` (``conv_gather_rows`` of the
            window, shared by every layer of a tree); derived from ``window`` when None.
    Returns:
        out: (batch, nodes, channels) in xbc.dtype.
    """
    if debug_checks():
        _check_args(xbc, conv_state, weight, bias, window, activation)
    if use_triton(impl, xbc):
        return _tree_conv_triton(xbc, conv_state, weight, bias, window, activation)
    if (impl == "auto" and not torch.compiler.is_compiling() and window.dtype == torch.int64
            and cpu_ops.usable(xbc, conv_state, weight, *([] if bias is None else [bias]))):
        return _tree_conv_cpu(xbc, conv_state, weight, bias, window, activation)
    return _tree_conv_ref(xbc, conv_state, weight, bias, window, activation, gather_index)


def _tree_conv_cpu(xbc, conv_state, weight, bias, window, activation):
    # the serving engines' C++ tree conv (one call where the reference takes about ten ops), its
    # trees here the batch's rows: row r's committed window is columns 1.. of conv_state[r]
    b, n, c = xbc.shape
    out = torch.empty_like(xbc)
    rows = torch.arange(b, device=xbc.device)
    cpu_ops.ops().tree_conv_rows(xbc.reshape(b * n, c), conv_state, rows, torch.ones_like(rows),
                                 torch.arange(b * n, device=xbc.device).view(b, n), window.contiguous(), weight,
                                 torch.empty(0) if bias is None else bias, activation is not None,
                                 out.view(b * n, c))
    return out


def tree_conv_ref(xbc, conv_state, weight, bias, window, activation="silu"):
    """Plain-PyTorch tree conv (torch.gather, fp32 compute): same arguments as ``tree_conv``."""
    _check_args(xbc, conv_state, weight, bias, window, activation)
    return _tree_conv_ref(xbc, conv_state, weight, bias, window, activation)
