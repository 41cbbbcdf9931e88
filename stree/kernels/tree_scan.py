"""TreeScan: Mamba2's single-chunk SSD over a packed token tree, starting from a committed state.

For node t of a topologically packed tree with ancestor mask L (``L[t, s]`` iff s is on the
root-to-t path, t included) and head h of group g = h // (heads / groups):

    a[t, h]  = dt[t, h] * A[h]
    Atree    = L @ a                                              (tree prefix sum)
    y[t, h]  = exp(Atree[t, h]) * (C[t, g] . h0[h])
             + sum_s L[t, s] exp(Atree[t, h] - Atree[s, h]) (C[t, g] . B[s, g]) dt[s, h] x[s, h]
             + D[h] x[t, h]
    y       *= silu(z[t, h])                                      (when z is given)

With L = tril(ones) this is mamba_ssm's chunk scan with an initial state. No state is written back:
after verification, ``replay.ssm_replay`` advances the committed state along the accepted path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stree.kernels._common import (NO_DT_LIMIT, check_device, debug_checks, check_float, check_ndim, check_shape,
                                   process_dt, use_triton)

_OP = "tree_scan"


@triton.jit
def _processed_dt(dt_ptr, stride_dt_n, offs, n, dt_bias, dt_min, dt_max,
                  DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr):
    """dt + dt_bias, softplus, clamp (mamba_ssm's chunked path, same softplus formula); 0 past n."""
    dt = tl.load(dt_ptr + offs * stride_dt_n, mask=offs < n, other=0.0).to(tl.float32) + dt_bias
    if DT_SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(tl.exp(dt) + 1.0), dt)
    if HAS_DT_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return tl.where(offs < n, dt, 0.0)


@triton.jit
def _tree_cumsum(mask_ptr, stride_mask_t, stride_mask_s, dt_ptr, stride_dt_n, dt_bias, dt_min,
                 dt_max, A, r0, n, DT_SOFTPLUS: tl.constexpr, HAS_DT_LIMIT: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Atree[r] = A * sum_c L[r, c] dt[c] for the nodes r0 .. r0 + BLOCK_R - 1."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    atree = tl.zeros((BLOCK_R,), dtype=tl.float32)
    # Topological packing: every ancestor of r has an index <= r, so later columns are all zero.
    for c0 in range(0, tl.minimum(r0 + BLOCK_R, n), BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        dt = _processed_dt(dt_ptr, stride_dt_n, offs_c, n, dt_bias, dt_min, dt_max,
                           DT_SOFTPLUS, HAS_DT_LIMIT)
        anc = tl.load(mask_ptr + offs_r[:, None] * stride_mask_t + offs_c[None, :] * stride_mask_s,
                      mask=(offs_r[:, None] < n) & (offs_c[None, :] < n), other=0)
        atree += tl.sum(tl.where(anc != 0, dt[None, :], 0.0), axis=1)
    return atree * A


@triton.jit
def _tree_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, mask_ptr, D_ptr, z_ptr, dt_bias_ptr, h0_ptr,
    y_ptr, dt_out_ptr,
    n, hdim, dstate, heads_per_group, dt_min, dt_max,
    stride_x_b, stride_x_n, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_n, stride_dt_h,
    stride_B_b, stride_B_n, stride_B_g, stride_B_s,
    stride_C_b, stride_C_n, stride_C_g, stride_C_s,
    stride_mask_b, stride_mask_t, stride_mask_s,
    stride_D_h,
    stride_z_b, stride_z_n, stride_z_h, stride_z_p,
    stride_h0_b, stride_h0_h, stride_h0_p, stride_h0_s,
    stride_y_b, stride_y_n, stride_y_h, stride_y_p,
    stride_dto_b, stride_dto_n, stride_dto_h,
    HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, HAS_INITIAL: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    HAS_DT_LIMIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One program: one (batch row, head, headdim block, node block). For trees of up to 64 nodes
    # there is a single node block, so a program holds the whole tree.
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    num_p_blocks = tl.cdiv(hdim, BLOCK_P)
    pid_p = tl.program_id(2) % num_p_blocks
    pid_t = tl.program_id(2) // num_p_blocks
    pid_g = pid_h // heads_per_group

    x_ptr += pid_b * stride_x_b + pid_h * stride_x_h
    dt_ptr += pid_b * stride_dt_b + pid_h * stride_dt_h
    B_ptr += pid_b * stride_B_b + pid_g * stride_B_g
    C_ptr += pid_b * stride_C_b + pid_g * stride_C_g
    mask_ptr += pid_b * stride_mask_b

    A = tl.load(A_ptr + pid_h).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(dt_bias_ptr + pid_h).to(tl.float32)
    else:
        dt_bias = 0.0

    t0 = pid_t * BLOCK_T
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_k = tl.arange(0, BLOCK_K)
    t_in = offs_t < n
    p_in = offs_p < hdim
    k_in = offs_k < dstate

    dt_t = _processed_dt(dt_ptr, stride_dt_n, offs_t, n, dt_bias, dt_min, dt_max,
                         DT_SOFTPLUS, HAS_DT_LIMIT)
    atree_t = _tree_cumsum(mask_ptr, stride_mask_t, stride_mask_s, dt_ptr, stride_dt_n, dt_bias,
                           dt_min, dt_max, A, t0, n, DT_SOFTPLUS, HAS_DT_LIMIT, BLOCK_T, BLOCK_S)
    c = tl.load(C_ptr + offs_t[:, None] * stride_C_n + offs_k[None, :] * stride_C_s,
                mask=t_in[:, None] & k_in[None, :], other=0.0)

    if HAS_INITIAL:
        h0 = tl.load(h0_ptr + pid_b * stride_h0_b + pid_h * stride_h0_h
                     + offs_p[:, None] * stride_h0_p + offs_k[None, :] * stride_h0_s,
                     mask=p_in[:, None] & k_in[None, :], other=0.0).to(c.dtype)
        acc = tl.dot(c, tl.trans(h0), input_precision=DOT_PRECISION) * tl.exp(atree_t)[:, None]
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)

    # Ancestors of this node block lie in columns [0, t0 + BLOCK_T).
    for s0 in range(0, tl.minimum(t0 + BLOCK_T, n), BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_in = offs_s < n
        dt_s = _processed_dt(dt_ptr, stride_dt_n, offs_s, n, dt_bias, dt_min, dt_max,
                             DT_SOFTPLUS, HAS_DT_LIMIT)
        atree_s = _tree_cumsum(mask_ptr, stride_mask_t, stride_mask_s, dt_ptr, stride_dt_n,
                               dt_bias, dt_min, dt_max, A, s0, n, DT_SOFTPLUS, HAS_DT_LIMIT,
                               BLOCK_S, BLOCK_S)
        b = tl.load(B_ptr + offs_s[:, None] * stride_B_n + offs_k[None, :] * stride_B_s,
                    mask=s_in[:, None] & k_in[None, :], other=0.0)
        cb = tl.dot(c, tl.trans(b), input_precision=DOT_PRECISION)
        anc = tl.load(mask_ptr + offs_t[:, None] * stride_mask_t + offs_s[None, :] * stride_mask_s,
                      mask=t_in[:, None] & s_in[None, :], other=0)
        # Mask before exp: for non-ancestors Atree[t] - Atree[s] can be large and positive.
        decay = tl.exp(tl.where(anc != 0, atree_t[:, None] - atree_s[None, :], float("-inf")))
        xs = tl.load(x_ptr + offs_s[:, None] * stride_x_n + offs_p[None, :] * stride_x_p,
                     mask=s_in[:, None] & p_in[None, :], other=0.0)
        m = (cb * decay * dt_s[None, :]).to(xs.dtype)
        acc += tl.dot(m, xs, input_precision=DOT_PRECISION)

    x_t = tl.load(x_ptr + offs_t[:, None] * stride_x_n + offs_p[None, :] * stride_x_p,
                  mask=t_in[:, None] & p_in[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        if D_HAS_HDIM:
            d = tl.load(D_ptr + pid_h * stride_D_h + offs_p, mask=p_in, other=0.0).to(tl.float32)
            acc += x_t * d[None, :]
        else:
            acc += x_t * tl.load(D_ptr + pid_h * stride_D_h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + pid_b * stride_z_b + pid_h * stride_z_h
                    + offs_t[:, None] * stride_z_n + offs_p[None, :] * stride_z_p,
                    mask=t_in[:, None] & p_in[None, :], other=0.0).to(tl.float32)
        acc *= z * tl.sigmoid(z)

    tl.store(y_ptr + pid_b * stride_y_b + pid_h * stride_y_h
             + offs_t[:, None] * stride_y_n + offs_p[None, :] * stride_y_p,
             acc.to(y_ptr.dtype.element_ty), mask=t_in[:, None] & p_in[None, :])
    tl.store(dt_out_ptr + pid_b * stride_dto_b + pid_h * stride_dto_h + offs_t * stride_dto_n,
             dt_t, mask=t_in & (pid_p == 0))


def _block_sizes(n: int, hdim: int, dstate: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_S, BLOCK_P, BLOCK_K). tl.dot needs every dimension >= 16.

    Node tiles stop at 64: a 64 x 64 fp32 tile is 32 registers a thread at 4 warps, and the
    (BLOCK_T, BLOCK_S) operand of the second dot stays small in shared memory even in fp32.
    Headdim blocks of 32 give 2 programs per head at headdim 64, to fill more SMs at batch 1.
    """
    block_n = min(64, triton.next_power_of_2(max(n, 16)))
    block_p = min(32, triton.next_power_of_2(max(hdim, 16)))
    block_k = triton.next_power_of_2(max(dstate, 16))
    return block_n, block_n, block_p, block_k


def _check_args(x, dt, A, B, C, mask, D, z, dt_bias, initial_states):
    check_ndim(_OP, "x", x, 4, "(batch, nodes, heads, headdim)")
    b, n, h, p = x.shape
    check_ndim(_OP, "B", B, 4, "(batch, nodes, groups, dstate)")
    g, s = B.shape[2], B.shape[3]
    check_shape(_OP, "dt", dt, (b, n, h), "(batch, nodes, heads)")
    check_shape(_OP, "A", A, (h,), "(heads,)")
    check_shape(_OP, "B", B, (b, n, g, s), "(batch, nodes, groups, dstate)")
    check_shape(_OP, "C", C, (b, n, g, s), "(batch, nodes, groups, dstate)")
    check_shape(_OP, "mask", mask, (b, n, n), "(batch, nodes, nodes)")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"{_OP}: D must have shape (heads,) = {(h,)} or (heads, headdim) = "
                         f"{(h, p)}, got {tuple(D.shape)}")
    if z is not None:
        check_shape(_OP, "z", z, (b, n, h, p), "(batch, nodes, heads, headdim)")
    if dt_bias is not None:
        check_shape(_OP, "dt_bias", dt_bias, (h,), "(heads,)")
    if initial_states is not None:
        check_shape(_OP, "initial_states", initial_states, (b, h, p, s),
                    "(batch, heads, headdim, dstate)")
    if n == 0:
        raise ValueError(f"{_OP}: the tree has no nodes")
    if g == 0 or h % g != 0:
        raise ValueError(f"{_OP}: heads ({h}) must be a multiple of groups ({g})")
    if mask.dtype != torch.bool:
        raise ValueError(f"{_OP}: mask must be a bool tensor, got {mask.dtype}")
    check_float(_OP, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                initial_states=initial_states)
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(
            f"{_OP}: B and C must have x's dtype {x.dtype}, got {B.dtype} and {C.dtype}")
    check_device(_OP, x.device, dt=dt, A=A, B=B, C=C, mask=mask, D=D, z=z, dt_bias=dt_bias,
                 initial_states=initial_states)


def _tree_scan_triton(x, dt, A, B, C, mask, D, z, dt_bias, dt_softplus, dt_limit, initial_states):
    b, n, h, p = x.shape
    g, s = B.shape[2], B.shape[3]
    y = torch.empty_like(x)
    dt_out = torch.empty(b, n, h, device=x.device, dtype=torch.float32)
    BLOCK_T, BLOCK_S, BLOCK_P, BLOCK_K = _block_sizes(n, p, s)
    A = A.contiguous()
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    D = D.contiguous() if D is not None else None
    mask_u8 = mask.view(torch.uint8)  # same bytes; Triton loads bool pointers less portably
    z_strides = z.stride() if z is not None else (0, 0, 0, 0)
    h0_strides = initial_states.stride() if initial_states is not None else (0, 0, 0, 0)
    has_limit = tuple(dt_limit) != NO_DT_LIMIT
    grid = (b, h, triton.cdiv(p, BLOCK_P) * triton.cdiv(n, BLOCK_T))
    _tree_scan_kernel[grid](
        x, dt, A, B, C, mask_u8, D, z, dt_bias, initial_states, y, dt_out,
        n, p, s, h // g, float(dt_limit[0]), float(dt_limit[1]),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *mask_u8.stride(),
        D.stride(0) if D is not None else 0,
        *z_strides, *h0_strides, *y.stride(), *dt_out.stride(),
        HAS_D=D is not None, D_HAS_HDIM=D is not None and D.dim() == 2, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, HAS_INITIAL=initial_states is not None,
        DT_SOFTPLUS=bool(dt_softplus), HAS_DT_LIMIT=has_limit,
        # fp32 callers get fp32 products (exactness against a step-by-step oracle), not tf32.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_T=BLOCK_T, BLOCK_S=BLOCK_S, BLOCK_P=BLOCK_P, BLOCK_K=BLOCK_K,
        num_warps=4, num_stages=2,
    )
    return y, dt_out


def _f32(t):
    return t if t.dtype == torch.float32 else t.float()


def _tree_scan_ref(x, dt, A, B, C, mask, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                   tables=None):
    # Heads are laid out as (groups g, heads per group r) so B and C broadcast over r instead of
    # being repeated; fp32 compute, casts only where the input is not fp32 already.
    b, n, h, p = x.shape
    g = B.shape[2]
    r = h // g
    mask_f, bias = tables if tables is not None else _scan_tables(mask)
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, n, h) fp32
    # A_tree in (b, h, n) order: computed as (dt A)^T @ L^T so that it is contiguous and every
    # tensor derived from it keeps a BLAS-friendly layout (a permuted one makes CPU bmm copy
    # matrix by matrix). Products are 3-D bmm: matmul's broadcasting dispatches several times
    # more ops per product.
    at = torch.bmm((dt * _f32(A)).transpose(1, 2), mask_f.transpose(1, 2)).view(b, g, r, n)
    # decay[t, s] = exp(A_tree[t] - A_tree[s]) on ancestors, 0 elsewhere (-inf added before exp)
    decay = (at[..., :, None] - at[..., None, :]).add_(bias[:, None]).exp_()  # (b, g, r, n, n)
    Cg = _f32(C).transpose(1, 2).reshape(b * g, n, -1)  # (b g, n, s)
    cb = torch.bmm(Cg, _f32(B).permute(0, 2, 3, 1).reshape(b * g, -1, n)).view(b, g, 1, n, n)
    m = decay.mul_(cb).mul_(dt.transpose(1, 2).view(b, g, r, 1, n))
    xg = _f32(x).view(b, n, g, r, p).permute(0, 2, 3, 1, 4)  # (b, g, r, n, p)
    y = torch.bmm(m.view(-1, n, n), xg.reshape(-1, n, p)).view(b, g, r, n, p)
    if initial_states is not None:  # + exp(A_tree[t]) C[t] . h0
        # one (n, s) @ (s, r * p) product per group: a broadcast batched matmul over r would
        # run as r separate products
        h0 = _f32(initial_states).view(b, g, r, p, -1).permute(0, 1, 4, 2, 3).reshape(b * g, -1, r * p)
        init = torch.bmm(Cg, h0).view(b, g, n, r, p).transpose(2, 3)  # (b, g, r, n, p)
        y.addcmul_(init, at.exp()[..., None])
    if D is not None:
        y.addcmul_(xg, _f32(D).view(g, r, 1, -1))
    y = y.permute(0, 3, 1, 2, 4).reshape(b, n, h, p)
    if z is not None:
        y = y * F.silu(_f32(z))
    return (y if y.dtype == x.dtype else y.to(x.dtype)), dt


def _scan_tables(mask):
    mask_f = mask.float()
    return mask_f, torch.zeros_like(mask_f).masked_fill_(~mask, float("-inf"))[:, None]


def tree_scan(x, dt, A, B, C, mask, *, D=None, z=None, dt_bias=None, dt_softplus=True,
              dt_limit=NO_DT_LIMIT, initial_states=None, impl="auto", tables=None):
    """SSD over a packed token tree from a committed state; writes no state.

    Args:
        x: (batch, nodes, heads, headdim) SSM input (after conv1d + SiLU).
        dt: (batch, nodes, heads) raw dt (before dt_bias and softplus).
        A: (heads,) negative decay rates.
        B, C: (batch, nodes, groups, dstate), x's dtype; head h uses group h // (heads / groups).
        mask: (batch, nodes, nodes) bool ancestor mask, ``mask[b, t, s]`` iff s is on the
            root-to-t path (t included); nodes packed topologically (parent index < child index).
        D: (heads,) or (heads, headdim) skip, or None.
        z: (batch, nodes, heads, headdim) gate, ``y *= silu(z)``, or None.
        dt_bias: (heads,) or None. dt_softplus, dt_limit: as mamba_ssm's chunked scan (the clamp
            applies only when dt_limit != (0, inf)).
        initial_states: (batch, heads, headdim, dstate) committed SSM state h0, or None (zero).
        impl: "auto" (Triton on CUDA tensors, the reference on CPU), "triton" or "ref".
        tables: ``TokenTree.scan_tables()`` (the mask as 0/1 and as 0/-inf), shared by every
            layer of a tree; derived from ``mask`` when None. Used by the reference only.
    Returns:
        y: (batch, nodes, heads, headdim) in x.dtype, and dt_out: (batch, nodes, heads) fp32
        processed dt (what ``ssm_replay`` consumes).
    """
    if debug_checks():
        _check_args(x, dt, A, B, C, mask, D, z, dt_bias, initial_states)
    if use_triton(impl, x):
        return _tree_scan_triton(x, dt, A, B, C, mask, D, z, dt_bias, dt_softplus, dt_limit,
                                 initial_states)
    return _tree_scan_ref(x, dt, A, B, C, mask, D, z, dt_bias, dt_softplus, dt_limit,
                          initial_states, tables)


def tree_scan_ref(x, dt, A, B, C, mask, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                  dt_limit=NO_DT_LIMIT, initial_states=None):
    """Plain-PyTorch TreeScan: same arguments and returns as ``tree_scan``.

    Computes in fp32 and materialises (batch, heads, nodes, nodes); the CPU path and test oracle.
    """
    _check_args(x, dt, A, B, C, mask, D, z, dt_bias, initial_states)
    return _tree_scan_ref(x, dt, A, B, C, mask, D, z, dt_bias, dt_softplus, dt_limit,
                          initial_states)
