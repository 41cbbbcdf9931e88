"""Chunked SSD over a linear sequence from an initial state (prefill).

On CUDA this is mamba_ssm's own ``mamba_chunk_scan_combined`` (the fused Triton kernels). On CPU it
is mamba_ssm's plain-PyTorch ``ssd_minimal_discrete``, padded to any length and extended with dt
processing, D and the z gate, so prefill and training run at PyTorch speed instead of in the Triton
interpreter. The reference caps chunks at 64: it materialises
(chunk x chunk) decay matrices per head, and on CPU 64 is faster than the GPU kernels' 256
(forward + backward of a 4-layer d=256 model at L=256: 1.6 s vs 2.4 s); the chunk size changes only
rounding.
"""
from __future__ import annotations

import torch.nn.functional as F

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.modules.ssd_minimal import ssd_minimal_discrete

from stree.kernels._common import NO_DT_LIMIT, process_dt


REF_MAX_CHUNK_SIZE = 64


def chunk_scan_ref(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                   dt_limit=NO_DT_LIMIT, initial_states=None, chunk_size: int = 64):
    """Plain-PyTorch chunked SSD (fp32 compute, differentiable): mamba_ssm's ``ssd_minimal_discrete``.

    Args:
        x: ``(b, l, h, p)``; dt: ``(b, l, h)`` raw; A: ``(h,)``; B, C: ``(b, l, g, s)``;
        D: ``(h,)`` or ``(h, p)``; z: ``(b, l, h, p)`` (output gated by ``silu(z)``);
        initial_states: ``(b, h, p, s)`` or None for zeros.
    Returns:
        y ``(b, l, h, p)`` in x.dtype and the final state ``(b, h, p, s)`` in fp32.

    Lengths that are not a multiple of the chunk are padded at the end with dt = 0 and x = 0: such
    steps neither decay nor feed the state, so outputs and the final state are unchanged.
    """
    b, l, h, p = x.shape
    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    chunk = min(chunk_size, l)
    pad = -l % chunk
    xf, Bf, Cf = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    # B/C groups -> heads like GQA (head i reads group i // (h // g)), as mamba_ssm does
    Bf, Cf = (t.repeat_interleave(h // t.shape[2], dim=2) for t in (Bf, Cf))
    init = None if initial_states is None else initial_states.float()[:, None]
    y, final = ssd_minimal_discrete(xf * dt[..., None], A.float() * dt, Bf, Cf, chunk,
                                    initial_states=init)
    y = y[:, :l]
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), final


def chunk_scan(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
               dt_limit=NO_DT_LIMIT, initial_states=None, chunk_size: int = 256,
               impl: str = "auto"):
    """Chunked SSD from an initial state; returns ``(y, final_state)``. See :func:`chunk_scan_ref`.

    ``impl="auto"`` runs mamba_ssm's fused kernels on CUDA tensors and the reference on CPU.
    """
    if impl == "ref" or (impl == "auto" and not x.is_cuda):
        return chunk_scan_ref(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                              dt_limit=dt_limit, initial_states=initial_states,
                              chunk_size=min(chunk_size, REF_MAX_CHUNK_SIZE))
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    y, final = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        dt_softplus=dt_softplus, dt_limit=tuple(dt_limit), return_final_states=True)
    return y, final.float()
