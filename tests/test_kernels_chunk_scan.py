"""Chunked SSD from an initial state (prefill): the PyTorch reference vs the recurrence and vs
mamba_ssm's own fused kernels."""
import math

import pytest
import torch

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

from stree.kernels.chunk_scan import chunk_scan, chunk_scan_ref


def inputs(b=2, l=10, h=4, p=3, s=5, g=2, device="cpu", seed=0):
    g_ = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g_).to(device)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h), A=(-torch.rand(h, generator=g_) - 0.1).to(device),
                B=r(b, l, g, s), C=r(b, l, g, s), D=r(h), z=r(b, l, h, p), dt_bias=r(h),
                initial_states=r(b, h, p, s))


def recurrence(x, dt, A, B, C, D, z, dt_bias, initial_states, dt_limit=(0.0, math.inf)):
    """mamba_ssm's single-token reference applied token by token."""
    h, p, s = initial_states.shape[1:]
    state = initial_states.clone()
    dtp = torch.nn.functional.softplus(dt + dt_bias).clamp(*dt_limit)
    ys = [selective_state_update_ref(
        state, x[:, t], dtp[:, t, :, None].expand(-1, h, p), A[:, None, None].expand(h, p, s),
        B[:, t], C[:, t], D=D[:, None].expand(h, p), z=z[:, t]) for t in range(x.shape[1])]
    return torch.stack(ys, 1), state


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("chunk", [1, 3, 4, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.0, 0.3)], ids=["no-limit", "dt-limit"])
def test_reference_matches_recurrence(chunk, dt_limit):
    a = inputs()
    y, final = chunk_scan_ref(**a, dt_limit=dt_limit, chunk_size=chunk)
    y_ref, state = recurrence(**a, dt_limit=dt_limit)
    assert err(y, y_ref) < 1e-5, f"y max error {err(y, y_ref):.3g}"
    assert err(final, state) < 1e-5, f"final state max error {err(final, state):.3g}"


def test_reference_matches_mamba_chunk_scan_combined():
    a = inputs(l=37, p=8, s=16, seed=1)
    y, final = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 16, D=a["D"],
                                         z=a["z"], dt_bias=a["dt_bias"], dt_softplus=True,
                                         initial_states=a["initial_states"], return_final_states=True)
    y_ref, final_ref = chunk_scan_ref(**a, chunk_size=8)
    assert err(y, y_ref) < 1e-4, f"y max error {err(y, y_ref):.3g}"
    assert err(final, final_ref) < 1e-5, f"final state max error {err(final, final_ref):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_matches_reference(dtype):
    a = inputs(l=77, p=16, s=16, device="cuda")
    a = {k: (v.to(dtype) if k in ("x", "B", "C", "z") else v) for k, v in a.items()}
    y, final = chunk_scan(**a, chunk_size=32)
    y_ref, final_ref = chunk_scan_ref(**a)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert err(y, y_ref) < tol and err(final, final_ref) < tol
