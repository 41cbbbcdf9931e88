"""TreeDelta: the gated delta rule (Gated DeltaNet, Kimi Delta Attention) over a packed token tree,
from a committed state; writes no state.

The rule, in fla's convention (state ``S`` is ``dk x dv``): ``S_t = diag(a_t) S_{t-1}``, then
``u_t = beta_t (v_t - S_t^T k_t)`` and ``S_t += k_t u_t^T``, ``o_t = S_t^T q_t``, with
``a_t = exp(g_t)`` (``g`` a scalar per head for Gated DeltaNet, per key channel for KDA). For node i
of a topologically packed tree with ancestor-or-self mask L (``L[i, j]`` iff j is on the root-to-i
path) and ``G = L @ g`` (the decay along each node's path, STree's ``A_tree``):

    u_i = beta_i (v_i - (e^{G_i} k_i) . S0 - sum_{j strict ancestor of i} <k_i e^{G_i - G_j}, k_j> u_j)
    o_i = (e^{G_i} q_i) . S0 + sum_{j in L[i]} <q_i e^{G_i - G_j}, k_j> u_j

Ancestry is transitive and ancestors come first, so the first line is a unit lower-triangular
system in node order: the chunked kernel's UT transform with every block masked by ancestry.
With L = tril(ones) this is the chunked gated delta rule over one chunk with an initial state.
``u`` and ``G`` are returned: with the nodes' ``k`` they are what ``replay.delta_replay`` needs to
commit any root-to-node path (``S_a = e^{G_a} S0 + sum_{j on the path} e^{G_a - G_j} k_j u_j^T``);
a chunk-final state would mix siblings, so none is formed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from stree.kernels import cpu_ops
from stree.kernels._common import (check_device, check_float, check_ndim, check_shape, debug_checks,
                                   use_triton)

_OP = "tree_delta"


@triton.jit
def _tree_delta_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, mask_ptr, s0_ptr, o_ptr, u_ptr, G_ptr,
    n, dk, dv,
    stride_q_b, stride_q_n, stride_q_h, stride_q_k,
    stride_k_b, stride_k_n, stride_k_h, stride_k_k,
    stride_v_b, stride_v_n, stride_v_h, stride_v_v,
    stride_g_b, stride_g_n, stride_g_h, stride_g_k,
    stride_beta_b, stride_beta_n, stride_beta_h,
    stride_mask_b, stride_mask_i, stride_mask_j,
    stride_s0_b, stride_s0_h, stride_s0_k, stride_s0_v,
    stride_o_b, stride_o_n, stride_o_h, stride_o_v,
    stride_u_b, stride_u_n, stride_u_h, stride_u_v,
    stride_G_b, stride_G_n, stride_G_h, stride_G_k,
    PER_CHANNEL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One program per (row, value head, block of value channels): the whole tree in one tile.
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_in = offs_n < n
    k_in = offs_k < dk
    v_in = offs_v < dv
    nk = n_in[:, None] & k_in[None, :]
    nv = n_in[:, None] & v_in[None, :]

    anc = tl.load(mask_ptr + pid_b * stride_mask_b + offs_n[:, None] * stride_mask_i
                  + offs_j[None, :] * stride_mask_j, mask=n_in[:, None] & (offs_j < n)[None, :],
                  other=0) != 0
    strict = anc & (offs_n[:, None] != offs_j[None, :])
    ancf = anc.to(tl.float32)
    q = tl.load(q_ptr + pid_b * stride_q_b + pid_h * stride_q_h + offs_n[:, None] * stride_q_n
                + offs_k[None, :] * stride_q_k, mask=nk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + pid_b * stride_k_b + pid_h * stride_k_h + offs_n[:, None] * stride_k_n
                + offs_k[None, :] * stride_k_k, mask=nk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + pid_b * stride_v_b + pid_h * stride_v_h + offs_n[:, None] * stride_v_n
                + offs_v[None, :] * stride_v_v, mask=nv, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + pid_b * stride_beta_b + pid_h * stride_beta_h + offs_n * stride_beta_n,
                   mask=n_in, other=0.0).to(tl.float32)
    s0 = tl.load(s0_ptr + pid_b * stride_s0_b + pid_h * stride_s0_h + offs_k[:, None] * stride_s0_k
                 + offs_v[None, :] * stride_s0_v, mask=k_in[:, None] & v_in[None, :],
                 other=0.0).to(tl.float32)
    g_base = g_ptr + pid_b * stride_g_b + pid_h * stride_g_h
    G_base = G_ptr + pid_b * stride_G_b + pid_h * stride_G_h
    if PER_CHANNEL:
        g = tl.load(g_base + offs_n[:, None] * stride_g_n + offs_k[None, :] * stride_g_k, mask=nk,
                    other=0.0).to(tl.float32)
        G = tl.dot(ancf, g, input_precision=DOT_PRECISION)  # (n, dk): decay along each path
        # exp(G_i - G_j) per channel, only where j is an ancestor (elsewhere it may overflow)
        diff = G[:, None, :] - G[None, :, :]
        decay = tl.exp(tl.where(anc[:, :, None], diff, float("-inf")))
        kk = tl.sum(k[:, None, :] * decay * k[None, :, :], axis=2)
        qk = tl.sum(q[:, None, :] * decay * k[None, :, :], axis=2)
        eG = tl.exp(G)
        ks0 = tl.dot(k * eG, s0, input_precision=DOT_PRECISION)
        qs0 = tl.dot(q * eG, s0, input_precision=DOT_PRECISION)
        if pid_v == 0:
            tl.store(G_base + offs_n[:, None] * stride_G_n + offs_k[None, :] * stride_G_k, G, mask=nk)
    else:
        g = tl.load(g_base + offs_n * stride_g_n, mask=n_in, other=0.0).to(tl.float32)
        G = tl.sum(ancf * g[None, :], axis=1)  # (n,)
        decay = tl.exp(tl.where(anc, G[:, None] - G[None, :], float("-inf")))
        kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * decay
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        eG = tl.exp(G)
        ks0 = tl.dot(k, s0, input_precision=DOT_PRECISION) * eG[:, None]
        qs0 = tl.dot(q, s0, input_precision=DOT_PRECISION) * eG[:, None]
        if pid_v == 0:
            tl.store(G_base + offs_n * stride_G_n, G, mask=n_in)
    a = tl.where(strict, kk, 0.0) * beta[:, None]  # unit lower-triangular system (I + a) u = rhs
    rhs = beta[:, None] * (v - ks0)
    # forward substitution in node order: row i needs only the rows of its ancestors (j < i)
    u = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for i in range(n):
        sel = offs_n == i
        a_i = tl.sum(tl.where(sel[:, None], a, 0.0), axis=0)  # (n,) row i, over j
        r_i = tl.sum(tl.where(sel[:, None], rhs, 0.0), axis=0)  # (dv,)
        u_i = r_i - tl.sum(a_i[:, None] * u, axis=0)
        u = tl.where(sel[:, None], u_i[None, :], u)
    o = qs0 + tl.dot(tl.where(anc, qk, 0.0), u, input_precision=DOT_PRECISION)
    tl.store(o_ptr + pid_b * stride_o_b + pid_h * stride_o_h + offs_n[:, None] * stride_o_n
             + offs_v[None, :] * stride_o_v, o.to(o_ptr.dtype.element_ty), mask=nv)
    tl.store(u_ptr + pid_b * stride_u_b + pid_h * stride_u_h + offs_n[:, None] * stride_u_n
             + offs_v[None, :] * stride_u_v, u, mask=nv)


def _check_args(q, k, v, g, beta, mask, initial_state):
    check_ndim(_OP, "q", q, 4, "(batch, nodes, heads, dk)")
    b, n, h, dk = q.shape
    check_shape(_OP, "k", k, (b, n, h, dk), "(batch, nodes, heads, dk)")
    check_ndim(_OP, "v", v, 4, "(batch, nodes, heads, dv)")
    dv = v.shape[3]
    check_shape(_OP, "v", v, (b, n, h, dv), "(batch, nodes, heads, dv)")
    if g.dim() == 3:
        check_shape(_OP, "g", g, (b, n, h), "(batch, nodes, heads)")
    else:
        check_shape(_OP, "g", g, (b, n, h, dk), "(batch, nodes, heads) or (batch, nodes, heads, dk)")
    check_shape(_OP, "beta", beta, (b, n, h), "(batch, nodes, heads)")
    check_shape(_OP, "mask", mask, (b, n, n), "(batch, nodes, nodes)")
    if mask.dtype != torch.bool:
        raise ValueError(f"{_OP}: mask must be bool, got {mask.dtype}")
    check_shape(_OP, "initial_state", initial_state, (b, h, dk, dv), "(batch, heads, dk, dv)")
    check_float(_OP, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    check_device(_OP, q.device, k=k, v=v, g=g, beta=beta, mask=mask, initial_state=initial_state)


def _tree_delta_triton(q, k, v, g, beta, mask, initial_state):
    b, n, h, dk = q.shape
    dv = v.shape[3]
    per_channel = g.dim() == 4
    o = torch.full_like(v, float("nan"))
    u = torch.full(v.shape, float("nan"), dtype=torch.float32, device=v.device)
    G = torch.full(g.shape, float("nan"), dtype=torch.float32, device=g.device)
    g4, G4 = (g, G) if per_channel else (g[..., None], G[..., None])
    BLOCK_N = max(16, triton.next_power_of_2(n))  # tl.dot needs every dimension >= 16
    BLOCK_K = max(16, triton.next_power_of_2(dk))
    BLOCK_V = max(16, min(64, triton.next_power_of_2(dv)))
    s0 = initial_state if initial_state.dtype == torch.float32 else initial_state.float()
    grid = (b, h, triton.cdiv(dv, BLOCK_V))
    _tree_delta_kernel[grid](
        q, k, v, g4, beta, mask, s0, o, u, G4, n, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *g4.stride(), *beta.stride(), *mask.stride(),
        *s0.stride(), *o.stride(), *u.stride(), *G4.stride(),
        PER_CHANNEL=per_channel,
        # fp32 callers get fp32 products (exactness against a step-by-step oracle), not tf32.
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else None,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    return o, u, G


def _tree_delta_ref(q, k, v, g, beta, mask, initial_state):
    # Batched PyTorch in fp32, (batch, heads, nodes, nodes) products: the CPU path and the oracle
    # of the Triton kernel. Heads first: (b, h, n, ...); k's and q's products in one each.
    f32, dtype = torch.float32, v.dtype
    b, n, h, dk = q.shape
    k, v = k.to(f32).transpose(1, 2), v.to(f32).transpose(1, 2)
    kq = torch.cat([k, q.to(f32).transpose(1, 2)], dim=2)  # (b, h, 2n, dk)
    beta = beta.to(f32).transpose(1, 2)[..., None]  # (b, h, n, 1)
    hidden = ~mask[:, None]  # (b, 1, n, n): not an ancestor (exp(-inf) = 0 below)
    s0 = initial_state.to(f32)
    ancf = mask.to(f32)
    if g.dim() == 3:
        G = torch.einsum("bij,bjh->bhi", ancf, g.to(f32))  # (b, h, n)
        decay = (G[..., :, None] - G[..., None, :]).masked_fill_(hidden, float("-inf")).exp_()
        prods = (kq @ k.transpose(-1, -2)).view(b, h, 2, n, n).mul_(decay[:, :, None])
        from_s0 = (kq @ s0).view(b, h, 2, n, -1).mul_(G.exp()[:, :, None, :, None])
    else:
        G = torch.einsum("bij,bjhc->bhic", ancf, g.to(f32))  # (b, h, n, dk)
        decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill_(hidden[..., None], float("-inf")).exp_()
        prods = torch.einsum("bhxic,bhijc,bhjc->bhxij", kq.view(b, h, 2, n, dk), decay, k)
        from_s0 = (kq.view(b, h, 2, n, dk) * G.exp()[:, :, None]) @ s0[:, :, None]
    (kk, qk), (ks0, qs0) = prods.unbind(2), from_s0.unbind(2)
    # (I + beta kk) u = beta (v - ks0), kk masked to ancestors: the solve reads the strictly lower
    # part (unitriangular: the diagonal is taken as 1)
    u = torch.linalg.solve_triangular(kk.mul_(beta), (v - ks0).mul_(beta), upper=False, unitriangular=True)
    o = qs0 + qk @ u
    return o.transpose(1, 2).to(dtype), u.transpose(1, 2), G.transpose(1, 2)


def tree_delta(q, k, v, g, beta, mask, initial_state, impl="auto"):
    """The gated delta rule over a packed token tree from a committed state; writes no state.

    Args:
        q, k: ``(batch, nodes, heads, dk)`` queries (L2-normalised and scaled, as the rule reads
            them) and L2-normalised keys, one per value head (grouped heads already repeated).
        v: ``(batch, nodes, heads, dv)``.
        g: ``(batch, nodes, heads)`` per-head log-decay (Gated DeltaNet) or ``(batch, nodes,
            heads, dk)`` per-key-channel (KDA); fp32.
        beta: ``(batch, nodes, heads)`` write strength.
        mask: ``(batch, nodes, nodes)`` bool ancestor-or-self mask, nodes packed topologically.
        initial_state: ``(batch, heads, dk, dv)`` committed state.
        impl: "auto" (Triton on CUDA tensors; on the CPU the C++ op ``csrc/tree_delta.cpp`` for
            fp32 inputs outside ``torch.compile``, else the reference), "triton" or "ref".
    Returns:
        ``o (batch, nodes, heads, dv)`` in v's dtype; ``u (batch, nodes, heads, dv)`` fp32 and
        ``G`` (g's shape, fp32): with ``k``, what :func:`~stree.kernels.replay.delta_replay`
        commits a path from.
    """
    if debug_checks():
        _check_args(q, k, v, g, beta, mask, initial_state)
    if use_triton(impl, v):
        return _tree_delta_triton(q, k, v, g, beta, mask, initial_state)
    if impl == "auto" and not torch.compiler.is_compiling() and cpu_ops.usable(q, k, v, g, beta, initial_state):
        # one call instead of the reference's ~20 batched ops (a 16-node tree of four 64-channel
        # heads: about 40 us against 180); a compiled step fuses the reference instead
        return tuple(cpu_ops.ops().tree_delta_rows(q, k, v, g, beta, mask, initial_state))
    return _tree_delta_ref(q, k, v, g, beta, mask, initial_state)


def tree_delta_ref(q, k, v, g, beta, mask, initial_state):
    """Plain-PyTorch ``tree_delta`` (same arguments and returns; fp32, a triangular solve)."""
    _check_args(q, k, v, g, beta, mask, initial_state)
    return _tree_delta_ref(q, k, v, g, beta, mask, initial_state)
