"""One token of the Mamba2 recurrence for the hybrid's own decoding (``selective_state_update``).

Unlike mamba_ssm's ``Mamba2.step`` this honours ``dt_limit``, so token-by-token decoding matches the
chunked forward (``stree.kernels.chunk_scan``) for checkpoints that set it. CUDA tensors go to
mamba_ssm's Triton kernel, CPU tensors to its ``selective_state_update_ref``.
"""
from __future__ import annotations

from stree._mamba import mamba_ssm  # noqa: F401  (must precede any mamba_ssm submodule import)
from mamba_ssm.ops.triton.selective_state_update import selective_state_update, selective_state_update_ref

from stree.kernels._common import NO_DT_LIMIT, process_dt


def ssm_step(state, x, dt, A, B, C, D, dt_bias, *, dt_limit=NO_DT_LIMIT, impl="auto"):
    """One token of the recurrence; updates ``state`` in place and returns ``y (b, h, p)`` in x.dtype.

    state: (b, h, p, s); x: (b, h, p); dt: (b, h) raw; A: (h,) fp32; B, C: (b, g, s); D, dt_bias: (h,).
    """
    if impl == "auto":
        impl = "triton" if x.is_cuda else "ref"
    update = {"triton": selective_state_update, "ref": selective_state_update_ref}.get(impl)
    if update is None:
        raise ValueError(f"impl must be 'auto', 'triton' or 'ref', got {impl!r}")
    h, p, s = state.shape[1:]
    # Stride-0 expansions over headdim/d_state: the Triton kernel then takes its scalar-per-head path.
    # dt arrives processed (softplus, dt_limit), so the kernel gets a zero dt_bias (it cannot take None).
    dt = process_dt(dt, dt_bias, True, dt_limit)[..., None].expand(-1, h, p)
    A = A.float()[:, None, None].expand(h, p, s)
    D = D[:, None].expand(h, p)
    zero_bias = dt.new_zeros(h)[:, None].expand(h, p)
    return update(state, x, dt, A, B, C, D=D, dt_bias=zero_bias, dt_softplus=False)
