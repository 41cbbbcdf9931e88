"""Chunked SSD over a linear sequence from an initial state (prefill).

On CUDA this is mamba_ssm's own ``mamba_chunk_scan_combined`` (the fused Triton kernels). On CPU it
is the plain-PyTorch chunked SSD below: the same algorithm as mamba_ssm's ``ssd_minimal_discrete``,
written for any length and with an initial state, so prefill and training run at PyTorch speed
instead of in the Triton interpreter.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import repeat


def process_dt(dt: torch.Tensor, dt_bias=None, dt_softplus: bool = True,
               dt_limit=(0.0, math.inf)) -> torch.Tensor:
    """mamba_ssm's chunked-path dt transform, in fp32: bias, softplus, then clamp to dt_limit."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, math.inf):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def chunk_scan_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                   dt_limit=(0.0, math.inf), initial_states=None, chunk_size: int = 64):
    """Plain-PyTorch chunked SSD (fp32 compute).

    Args:
        x: ``(b, l, h, p)``; dt: ``(b, l, h)`` raw; A: ``(h,)``; B, C: ``(b, l, g, s)``;
        D: ``(h,)`` or ``(h, p)``; z: ``(b, l, h, p)`` (output gated by ``silu(z)``);
        initial_states: ``(b, h, p, s)`` or None for zeros.
    Returns:
        y ``(b, l, h, p)`` in x.dtype and the final state ``(b, h, p, s)`` in fp32.
    """
    b, l, h, p = x.shape
    g, s = B.shape[2], B.shape[3]
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    xf = x.float()
    Bh = repeat(B.float(), "b l g s -> b l (g r) s", r=h // g)
    Ch = repeat(C.float(), "b l g s -> b l (g r) s", r=h // g)
    state = (initial_states.float().clone() if initial_states is not None
             else x.new_zeros(b, h, p, s, dtype=torch.float32))
    ys = []
    for start in range(0, l, chunk_size):
        sl = slice(start, min(start + chunk_size, l))
        d, xs, Bs, Cs = dt[:, sl], xf[:, sl], Bh[:, sl], Ch[:, sl]
        cs = torch.cumsum(d * A.float(), dim=1)  # (b, c, h) log-decay from chunk start
        c = cs.shape[1]
        causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        # mask before exp: future-minus-past differences are positive and could overflow
        seg = (cs[:, :, None, :] - cs[:, None, :, :]).masked_fill(~causal[None, :, :, None], -math.inf)
        M = torch.einsum("bthn,bshn->btsh", Cs, Bs) * seg.exp() * d[:, None, :, :]
        y = torch.einsum("btsh,bshp->bthp", M, xs)
        y = y + torch.einsum("bthn,bhpn->bthp", Cs, state) * cs.exp()[..., None]
        to_end = (cs[:, -1:, :] - cs).exp() * d  # (b, c, h)
        state = state * cs[:, -1].exp()[..., None, None] + torch.einsum(
            "bsh,bshp,bshn->bhpn", to_end, xs, Bs)
        ys.append(y)
    y = torch.cat(ys, dim=1)
    if D is not None:
        Df = D.float()
        y = y + xf * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), state


def chunk_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
               dt_limit=(0.0, math.inf), initial_states=None, chunk_size: int = 256,
               impl: str = "auto"):
    """Chunked SSD from an initial state; returns ``(y, final_state)``. See :func:`chunk_scan_ref`.

    ``impl="auto"`` runs mamba_ssm's fused kernels on CUDA tensors and the reference on CPU.
    """
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return chunk_scan_ref(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, initial_states=initial_states,
                              chunk_size=min(chunk_size, 64))
    from stree._mamba import mamba_ssm  # noqa: F401  (import guard for CPU-built wheels)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    y, final = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=True)
    return y, final
