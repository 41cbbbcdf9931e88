"""Activation replay: advance the committed SSM and conv states along an accepted path, in place.

``path`` (batch, k) holds node indices root first, -1 padded at the end; rows may differ in length.
For each valid node j of a row, with g the group of head h:

    ssm_state[h] <- exp(dt[j, h] A[h]) ssm_state[h] + dt[j, h] outer(x[j, h], B[j, g])
    conv_state   <- last width columns of [conv_state, xbc[path nodes]]

The inputs are the activations cached by the tree forward (x after conv, processed dt, B, raw xbc),
so replay costs one read and one write of each state. ``delta_replay`` does the same for a gated
delta rule layer (Gated DeltaNet, KDA) from what ``tree_delta`` kept:

    S <- e^{G_a} S + sum_{j on the path} e^{G_a - G_j} k_j u_j^T        (a: the path's last node)

Each runs as a Triton kernel on CUDA tensors (``ssm_replay``), as one C++ call per layer on fp32
CPU tensors (``csrc/replay.cpp``: a commit's dozen small eager ops cost more than its arithmetic),
and as batched PyTorch ops otherwise (the references, and what a compiled step fuses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import cpu_ops
from stree.kernels._common import (check_device, check_float, debug_checks, check_index, check_ndim,
                                   check_shape, use_triton)


@triton.jit
def _ssm_replay_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr,
    k, hdim, dstate, heads_per_group,
    stride_state_b, stride_state_h, stride_state_p, stride_state_s,
    stride_x_b, stride_x_n, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_n, stride_dt_h,
    stride_B_b, stride_B_n, stride_B_g, stride_B_s,
    stride_path_b, stride_path_k,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_g = pid_h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    p_in = offs_p < hdim
    s_in = offs_s < dstate
    state_ptrs = (state_ptr + pid_b * stride_state_b + pid_h * stride_state_h
                  + offs_p[:, None] * stride_state_p + offs_s[None, :] * stride_state_s)
    x_ptr += pid_b * stride_x_b + pid_h * stride_x_h
    dt_ptr += pid_b * stride_dt_b + pid_h * stride_dt_h
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    path_ptr += pid_b * stride_path_b

    A = tl.load(A_ptr + pid_h).to(tl.float32)
    h = tl.load(state_ptrs, mask=p_in[:, None] & s_in[None, :], other=0.0).to(tl.float32)
    for j in range(k):
        node = tl.load(path_ptr + j * stride_path_k)
        valid = node >= 0
        node = tl.maximum(node, 0)
        # A padded step (-1) is the identity: dt = 0 gives decay 1 and no input.
        dt = tl.where(valid, tl.load(dt_ptr + node * stride_dt_n).to(tl.float32), 0.0)
        x = tl.load(x_ptr + node * stride_x_n + offs_p * stride_x_p, mask=p_in,
                    other=0.0).to(tl.float32)
        b = tl.load(B_ptr + node * stride_B_n + offs_s * stride_B_s, mask=s_in,
                    other=0.0).to(tl.float32)
        h = tl.exp(dt * A) * h + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptrs, h.to(state_ptr.dtype.element_ty), mask=p_in[:, None] & s_in[None, :])


def _check_ssm_args(ssm_state, x, dt, A, B, path):
    op = "ssm_replay"
    check_ndim(op, "ssm_state", ssm_state, 4, "(batch, heads, headdim, dstate)")
    b, h, p, s = ssm_state.shape
    check_ndim(op, "x", x, 4, "(batch, nodes, heads, headdim)")
    n = x.shape[1]
    check_ndim(op, "B", B, 4, "(batch, nodes, groups, dstate)")
    g = B.shape[2]
    check_shape(op, "x", x, (b, n, h, p), "(batch, nodes, heads, headdim)")
    check_shape(op, "dt", dt, (b, n, h), "(batch, nodes, heads)")
    check_shape(op, "A", A, (h,), "(heads,)")
    check_shape(op, "B", B, (b, n, g, s), "(batch, nodes, groups, dstate)")
    check_ndim(op, "path", path, 2, "(batch, steps)")
    if path.shape[0] != b:
        raise ValueError(f"{op}: path must have batch size {b}, got shape {tuple(path.shape)}")
    if g == 0 or h % g != 0:
        raise ValueError(f"{op}: heads ({h}) must be a multiple of groups ({g})")
    check_float(op, ssm_state=ssm_state, x=x, dt=dt, A=A, B=B)
    check_index(op, path=path)
    check_device(op, ssm_state.device, x=x, dt=dt, A=A, B=B, path=path)


def _ssm_replay_triton(ssm_state, x, dt, A, B, path):
    b, h, p, s = ssm_state.shape
    BLOCK_P = min(16, triton.next_power_of_2(p))
    BLOCK_S = triton.next_power_of_2(s)
    grid = (b, h, triton.cdiv(p, BLOCK_P))
    _ssm_replay_kernel[grid](
        ssm_state, x, dt, A.contiguous(), B, path, path.shape[1], p, s, h // B.shape[2],
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *path.stride(),
        BLOCK_P=BLOCK_P, BLOCK_S=BLOCK_S, num_warps=4,
    )


def _cpu_args(path, *acts, state=None) -> tuple[torch.Tensor, ...] | None:
    """The activations ``acts`` as ``csrc/replay.cpp`` reads them (dense last axes), or None where
    it does not take this commit: fp32 CPU tensors, a contiguous int64 path and a ``state``
    (updated in place) with a dense last axis, outside a compiled graph (which fuses the reference
    instead). A compiled tree step may return activations nodes fastest (its triangular solve's
    layout), which would send every commit to the reference (0.9 ms a step over the Gated
    DeltaNet target's six layers); a tree's activations are small, so a copy costs microseconds."""
    ok = (not torch.compiler.is_compiling() and path.is_contiguous() and path.dtype == torch.int64
          and (state is None or (state.stride(-1) == 1 and cpu_ops.usable(state))) and cpu_ops.usable(*acts))
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in acts) if ok else None


def _table(table, make):
    """A commit's table where a reference needs it: ``table`` itself, or built by it when it is a
    zero-argument callable (a commit shares one, ``functools.cache``d, among its layers, so the
    C++ path, which reads the path directly, never builds it), or ``make()`` when None."""
    if table is None:
        return make()
    return table() if callable(table) else table


def path_tables(path):
    """``(rows (b, 1), node (b, k) clamped to >= 0, valid (b, k) bool)`` for gathers along a path;
    built once per commit and shared by every layer."""
    return (torch.arange(path.shape[0], device=path.device)[:, None], path.clamp(min=0), path >= 0)


def _ssm_replay_ref(ssm_state, x, dt, A, B, path, tables=None):
    # Closed form of the k steps h <- exp(dt_j A) h + dt_j x_j B_j^T: with la_j = dt_j A and
    # S_j = sum_{i > j} la_i, h_k = exp(sum la) h_0 + sum_j exp(S_j) dt_j x_j B_j^T (one matmul).
    # Padded steps (-1) have dt = 0: decay 1, no input.
    b, h, p, s = ssm_state.shape
    g, k = B.shape[2], path.shape[1]
    rows, node, valid = _table(tables, lambda: path_tables(path))
    dt_k = torch.where(valid[..., None], dt[rows, node], 0.0)  # (b, k, h) fp32
    la = dt_k * A
    total = la.sum(1)  # (b, h)
    weight = (total[:, None] - la.cumsum(1)).exp_().mul_(dt_k)  # exp(S_j) dt_j, (b, k, h)
    xw = x[rows, node].float().mul_(weight[..., None]).view(b, k, g, h // g * p)
    # one (r p, k) @ (k, s) product per group (3-D bmm: matmul's broadcasting dispatches more)
    upd = torch.bmm(xw.permute(0, 2, 3, 1).reshape(b * g, -1, k),
                    B[rows, node].float().transpose(1, 2).reshape(b * g, k, s))
    if ssm_state.dtype == torch.float32:
        ssm_state.mul_(total.exp()[..., None, None]).add_(upd.view(b, h, p, s))
    else:
        ssm_state.copy_(ssm_state.float() * total.exp()[..., None, None] + upd.view(b, h, p, s))


def ssm_replay(ssm_state, x, dt, A, B, path, impl="auto", tables=None):
    """Advance ``ssm_state`` in place along ``path`` from cached tree activations.

    Args:
        ssm_state: (batch, heads, headdim, dstate) committed state, updated in place.
        x: (batch, nodes, heads, headdim) SSM input of the tree nodes.
        dt: (batch, nodes, heads) processed dt (``tree_scan``'s dt_out).
        A: (heads,); B: (batch, nodes, groups, dstate).
        path: (batch, k) int64 node indices, root first, -1 padded at the end.
        impl: "auto" (Triton on CUDA tensors; on the CPU the C++ ``ssm_replay_rows`` for fp32
            tensors, else the reference), "triton" or "ref".
        tables: :func:`path_tables` of ``path`` (shared by the layers of one commit; or a
            callable that builds it), or None.
    """
    if debug_checks():
        _check_ssm_args(ssm_state, x, dt, A, B, path)
    if use_triton(impl, ssm_state):
        _ssm_replay_triton(ssm_state, x, dt, A, B, path)
    elif impl == "auto" and (acts := _cpu_args(path, x, dt, A, B, state=ssm_state)) is not None:
        cpu_ops.ops().ssm_replay_rows(ssm_state, *acts, path)
    else:
        _ssm_replay_ref(ssm_state, x, dt, A, B, path, tables)


def ssm_replay_ref(ssm_state, x, dt, A, B, path):
    """Plain-PyTorch ``ssm_replay`` (fp32 compute, one torch step per path column)."""
    _check_ssm_args(ssm_state, x, dt, A, B, path)
    _ssm_replay_ref(ssm_state, x, dt, A, B, path)


def _check_conv_args(conv_state, xbc, path):
    op = "conv_replay"
    check_ndim(op, "conv_state", conv_state, 3, "(batch, channels, width)")
    b, c, w = conv_state.shape
    check_ndim(op, "xbc", xbc, 3, "(batch, nodes, channels)")
    check_shape(op, "xbc", xbc, (b, xbc.shape[1], c), "(batch, nodes, channels)")
    check_ndim(op, "path", path, 2, "(batch, steps)")
    if path.shape[0] != b:
        raise ValueError(f"{op}: path must have batch size {b}, got shape {tuple(path.shape)}")
    check_float(op, conv_state=conv_state, xbc=xbc)
    check_index(op, path=path)
    check_device(op, conv_state.device, xbc=xbc, path=path)


def conv_replay(conv_state, xbc, path, index=None, impl="auto"):
    """Shift the accepted path's pre-conv inputs into ``conv_state``, in place.

    Args:
        conv_state: (batch, channels, width), column width-1 newest; becomes the last width
            columns of [conv_state, xbc[path nodes]] per row (short paths keep older columns).
        xbc: (batch, nodes, channels) pre-conv inputs of the tree nodes.
        path: (batch, k) int64 node indices, root first, -1 padded at the end.
        index: :func:`conv_replay_index` of ``path`` (shared by the layers of one commit; or a
            callable that builds it), or None.
        impl: "auto" (on the CPU the C++ ``conv_replay_rows`` for fp32 tensors, which needs no
            ``index``; elsewhere a torch gather) or "ref" (the gather).
    """
    if debug_checks():
        _check_conv_args(conv_state, xbc, path)
    b, c, w = conv_state.shape
    if path.shape[1] == 0:
        return
    # the conv window's layout is the op's to read (channels fastest, as the cache keeps it)
    if impl == "auto" and cpu_ops.usable(conv_state) and (acts := _cpu_args(path, xbc)) is not None:
        cpu_ops.ops().conv_replay_rows(conv_state, *acts, path)
        return
    index = _table(index, lambda: conv_replay_index(path, w))
    # src (b, w + n, c): committed columns, then the tree nodes (conv_state^T is contiguous)
    src = torch.cat([conv_state.transpose(1, 2), xbc], dim=1)
    conv_state.transpose(1, 2).copy_(src.gather(1, index[:, :, None].expand(b, w, c)))


def conv_replay_index(path, w: int):
    """``(b, w)`` int64: for each row, which columns of ``cat(conv_state, xbc^T)`` (column q < w is
    conv_state[q], w + i is node i) make the new conv state: sequence positions L .. L + w - 1 of
    [conv_state columns, path nodes], L = the row's path length. Shared by the layers of a commit."""
    length = (path >= 0).sum(dim=1, keepdim=True)  # (b, 1), stays on device
    pos = length + torch.arange(w, device=path.device)  # (b, w)
    node = path.gather(1, (pos - w).clamp(min=0, max=path.shape[1] - 1))
    return torch.where(pos < w, pos, w + node)


def delta_replay(state, k, u, G, path, tables=None, impl="auto") -> None:
    """Commit the accepted path into ``state``, in place, from the tree's kept activations:
    ``S <- e^{G_a} S + sum_{j on the path} e^{G_a - G_j} k_j u_j^T`` with ``a`` the path's last
    node (per key channel for a per-channel ``G``).

    Args:
        state: ``(batch, heads, dk, dv)`` committed state, updated in place.
        k: ``(batch, nodes, heads, dk)`` the nodes' normalised keys; u: ``(batch, nodes, heads,
            dv)`` fp32 and G: ``(batch, nodes, heads)`` or ``(batch, nodes, heads, dk)`` fp32,
            from :func:`tree_delta`.
        path: ``(batch, steps)`` int64 node indices, root first, -1 padded at the end; a row of
            -1 leaves its state as it was.
        tables: :func:`path_tables` of ``path``, shared by the layers of a commit (or a callable
            that builds it), or None.
        impl: "auto" (on the CPU the C++ ``delta_replay_rows`` for fp32 tensors; elsewhere the
            batched products) or "ref" (the batched products).
    """
    if impl == "auto" and (acts := _cpu_args(path, k, u, G, state=state)) is not None:
        cpu_ops.ops().delta_replay_rows(state, *acts, path)
        return
    rows, node, valid = _table(tables, lambda: path_tables(path))
    f32 = torch.float32
    steps = valid.sum(1)  # (b,)
    last = node.gather(1, (steps - 1).clamp(min=0)[:, None])[:, 0]  # (b,) the path's last node
    Gp = G[rows, node]  # (b, k, h[, dk])
    G_last = torch.where((steps > 0).view(-1, *[1] * (G.dim() - 2)), G[rows[:, 0], last], 0.0)
    if G.dim() == 3:
        w = (G_last[:, None] - Gp).masked_fill_(~valid[..., None], float("-inf")).exp_()  # (b, k, h)
        kw = k[rows, node].to(f32) * w[..., None]
        decay = G_last.exp()[..., None, None]  # (b, h, 1, 1)
    else:
        w = (G_last[:, None] - Gp).masked_fill_(~valid[..., None, None], float("-inf")).exp_()
        kw = k[rows, node].to(f32) * w
        decay = G_last.exp()[..., None]  # (b, h, dk, 1)
    update = torch.einsum("bjhc,bjhd->bhcd", kw, u[rows, node])
    new = state.to(f32) * decay + update
    state.copy_(new if state.dtype == f32 else new.to(state.dtype))
