"""Helpers shared by the kernel launchers: implementation dispatch and argument checks."""
from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F

IMPLS = ("auto", "triton", "ref")

# Argument checks of the ops and of trusted internal calls (paths from a verifier) cost host time
# on every layer of every step and a correct caller never trips them: they run only when
# ``STREE_DEBUG=1`` or inside ``checks(True)``. User input is validated at the API boundary.
_CHECKS = [os.environ.get("STREE_DEBUG", "0") not in ("", "0")]


def debug_checks() -> bool:
    """True when internal argument checks are on (``STREE_DEBUG=1`` or :func:`checks`)."""
    return _CHECKS[0]


@contextmanager
def checks(enabled: bool = True):
    """Turn internal argument checks on (or off) for the block."""
    before = _CHECKS[0]
    _CHECKS[0] = enabled
    try:
        yield
    finally:
        _CHECKS[0] = before


def use_triton(impl: str, like: torch.Tensor) -> bool:
    """True when the Triton kernel should run: ``impl="triton"``, or ``"auto"`` on a CUDA tensor."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl == "triton" or (impl == "auto" and like.is_cuda)


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple, dims: str) -> None:
    """Raise ValueError unless ``t.shape == shape`` (``dims`` names the axes in the message)."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{op}: {name} must have shape {dims} = {tuple(shape)}, got {tuple(t.shape)}")


def check_ndim(op: str, name: str, t: torch.Tensor, ndim: int, dims: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {dims}, got shape {tuple(t.shape)}")


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def check_index(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")


def check_device(op: str, device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


NO_DT_LIMIT = (0.0, math.inf)


def process_dt(dt: torch.Tensor, dt_bias=None, dt_softplus: bool = True,
               dt_limit=NO_DT_LIMIT) -> torch.Tensor:
    """mamba_ssm's chunked-path dt transform, in fp32: bias, softplus, then clamp to dt_limit
    (only when it is not the default ``(0, inf)``, as mamba_ssm's kernels do)."""
    if dt.dtype != torch.float32:  # casts only where they do something
        dt = dt.float()
    if dt_bias is not None:
        dt = dt + (dt_bias if dt_bias.dtype == torch.float32 else dt_bias.float())
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt
