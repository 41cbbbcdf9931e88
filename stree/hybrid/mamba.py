"""MambaInLlama's GQA-shaped Mamba2 mixer (plain PyTorch modules, mamba_ssm kernels/references for the math).

Differences from mamba_ssm's stock ``Mamba2``: ``nheads = ngroups = d_inner // d_state`` and
``headdim = d_state``; x and B are only ``d_xb`` wide (``d_xb // d_state`` groups, like GQA K/V heads)
and are repeated (repeat_interleave on the group axis) to ``nheads`` after the conv; C is ``d_inner``
wide. Parameter names follow the public checkpoints: ``in_proj.weight``, ``conv1d.{weight,bias}``,
``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj.weight``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stree._mamba import mamba_ssm  # noqa: F401  (must precede any mamba_ssm submodule import)
from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

from .cache import MambaLayerCache
from stree.kernels.chunk_scan import chunk_scan
from stree.layers.norm import gated_rms_norm

from .ssd import NO_DT_LIMIT, ssm_step

try:
    from causal_conv1d import causal_conv1d_update
except ImportError:
    causal_conv1d_update = None


class GatedRMSNorm(nn.Module):
    """``rmsnorm(y * silu(z))`` per group of ``group_size`` channels (mamba_ssm's ``RMSNormGated`` with
    ``norm_before_gate=False``): Triton kernel on CUDA, :func:`stree.layers.norm.gated_rms_norm` on CPU."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if y.is_cuda:
            return rmsnorm_fn(y, self.weight, None, z=z, eps=self.eps, group_size=self.group_size,
                              norm_before_gate=False)
        return gated_rms_norm(y, z, self.weight, None, self.eps, self.group_size)


class Mamba2GQA(nn.Module):
    """GQA-shaped Mamba2 mixer of MambaInLlama.

    Sizes: ``nheads = d_inner // d_state``, ``headdim = d_state``, ``ngroups = nheads`` (B/C groups
    after the repeat), ``conv_dim = d_inner + 2 * d_xb``; ``in_proj`` output is
    ``[z (d_inner), x (d_xb), B (d_xb), C (d_inner), dt (nheads)]``.
    """

    def __init__(self, d_model: int, d_inner: int, d_xb: int, d_state: int, d_conv: int = 4,
                 dt_limit=NO_DT_LIMIT, chunk_size: int = 256, layer_idx: int | None = None,
                 dt_range=(0.001, 0.1), dt_init_floor=1e-4, A_init_range=(1.0, 16.0)):
        super().__init__()
        self.d_model, self.d_inner, self.d_xb, self.d_state, self.d_conv = d_model, d_inner, d_xb, d_state, d_conv
        self.nheads = d_inner // d_state
        self.headdim = d_state
        self.ngroups = self.nheads
        self.xb_groups = d_xb // d_state
        self.repeat_group = self.nheads // self.xb_groups
        self.conv_dim = d_inner + 2 * d_xb
        self.dt_limit = tuple(dt_limit)
        self.chunk_size = chunk_size
        self.layer_idx = layer_idx

        self.in_proj = nn.Linear(d_model, 2 * d_inner + 2 * d_xb + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim,
                                padding=d_conv - 1, bias=True)
        # Initialisation as in mamba_ssm's Mamba2: dt log-uniform in dt_range (stored as
        # softplus^-1), A uniform in A_init_range (stored as log), D = 1.
        dt = torch.exp(torch.rand(self.nheads) * (math.log(dt_range[1]) - math.log(dt_range[0]))
                       + math.log(dt_range[0])).clamp(min=dt_init_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nheads).uniform_(*A_init_range)))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = GatedRMSNorm(d_inner, group_size=d_inner // self.ngroups, eps=1e-5)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True

    # -- pieces the tree code reuses ------------------------------------------------------------
    def split_zxbcdt(self, zxbcdt: torch.Tensor):
        """``(..., 2*d_inner + 2*d_xb + nheads)`` -> ``z (..., d_inner), xBC (..., conv_dim), dt (..., nheads)``."""
        return torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.nheads], dim=-1)

    def split_xbc(self, xBC: torch.Tensor):
        """Post-conv ``xBC (..., conv_dim)`` -> ``x (..., h, p)``, ``B (..., h, s)``, ``C (..., h, s)``.

        x and B are repeated from ``d_xb // d_state`` groups to ``nheads`` (head i reads group
        ``i // repeat_group``, like GQA K/V).
        """
        x, B, C = torch.split(xBC, [self.d_xb, self.d_xb, self.d_inner], dim=-1)
        x, B = (t.unflatten(-1, (self.xb_groups, self.d_state)) for t in (x, B))
        if self.repeat_group > 1:
            x, B = (t.repeat_interleave(self.repeat_group, dim=-2) for t in (x, B))
        return x, B, C.unflatten(-1, (self.nheads, self.d_state))

    @property
    def A(self) -> torch.Tensor:
        """(nheads,) fp32, negative."""
        return -torch.exp(self.A_log.float())

    def allocate_cache(self, batch_size: int, *, dtype=None, device=None) -> MambaLayerCache:
        return MambaLayerCache.zeros(batch_size, self.conv_dim, self.d_conv, self.nheads, self.headdim,
                                     self.d_state, dtype=dtype or self.conv1d.weight.dtype,
                                     device=device or self.conv1d.weight.device,
                                     state_dtype=torch.float32)

    # -- sequence and token paths ---------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, cache: MambaLayerCache | None = None) -> torch.Tensor:
        """hidden_states: (b, l, d_model) -> (b, l, d_model).

        Without ``cache`` the sequence starts from zero state (differentiable). With ``cache`` it
        continues from the cached conv/SSM state, which is then advanced in place to after the last token.
        """
        b, l, _ = hidden_states.shape
        z, xBC, dt = self.split_zxbcdt(self.in_proj(hidden_states))
        xBC = xBC.transpose(1, 2)  # (b, c, l)
        weight = self.conv1d.weight  # (c, 1, w)
        if cache is None:
            xBC = F.conv1d(xBC, weight, self.conv1d.bias, padding=self.d_conv - 1, groups=self.conv_dim)[..., :l]
        else:
            ext = torch.cat([cache.conv_state[..., 1:].to(xBC.dtype), xBC], dim=-1)  # (b, c, w - 1 + l)
            cache.conv_state.copy_(ext[..., -self.d_conv:])
            xBC = F.conv1d(ext, weight, self.conv1d.bias, groups=self.conv_dim)
        x, B, C = self.split_xbc(F.silu(xBC.transpose(1, 2)))
        y, final = chunk_scan(x, dt, self.A, B, C, D=self.D, dt_bias=self.dt_bias, chunk_size=self.chunk_size,
                              dt_limit=self.dt_limit, initial_states=None if cache is None else cache.ssm_state)
        if cache is not None:
            cache.ssm_state.copy_(final)
        return self.out_proj(self.norm(y.flatten(-2), z))

    def step(self, hidden_states: torch.Tensor, cache: MambaLayerCache) -> torch.Tensor:
        """One token by the recurrence: hidden_states (b, 1, d_model) -> (b, 1, d_model); cache advanced."""
        z, xBC, dt = self.split_zxbcdt(self.in_proj(hidden_states[:, 0]))
        xBC = self._conv_step(xBC, cache.conv_state)
        x, B, C = self.split_xbc(xBC)
        y = ssm_step(cache.ssm_state, x, dt, self.A, B, C, self.D, self.dt_bias, dt_limit=self.dt_limit)
        return self.out_proj(self.norm(y.flatten(-2), z))[:, None]

    def _conv_step(self, xBC: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
        """xBC (b, c) raw -> silu(conv) (b, c); shifts conv_state (b, c, w) left and appends xBC."""
        weight = self.conv1d.weight[:, 0]  # (c, w)
        if xBC.is_cuda and causal_conv1d_update is not None:
            return causal_conv1d_update(xBC, conv_state, weight, self.conv1d.bias, "silu")
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = xBC
        out = (conv_state * weight).sum(-1) + self.conv1d.bias
        return F.silu(out).to(xBC.dtype)
