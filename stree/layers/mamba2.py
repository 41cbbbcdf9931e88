"""Mamba2 mixers over a token tree (verification) and over a sequence (prefill), on explicit state.

Works for mamba_ssm's own ``Mamba2`` and for MambaInLlama's GQA-shaped Mamba2 (``stree.hybrid``),
through a small adapter that knows how each splits its projections. Everything per token (in_proj,
gated norm, out_proj) is the module's own; only the sequence mixing changes: the causal conv runs
along ancestor chains (``tree_conv``) and the SSM over the ancestor mask (``tree_scan``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.modules.mamba2 import Mamba2
from mamba_ssm.ops.triton.layernorm_gated import RMSNorm as RMSNormGated

from stree.cache import MambaActivations, MambaLayerCache
from stree.kernels import tree_conv, tree_scan
from stree.kernels._common import process_dt
from stree.kernels.chunk_scan import chunk_scan
from stree.layers.linear import linear
from stree.layers.norm import gated_rms_norm


class _Parts:
    """Uniform view of a Mamba2-type mixer: how to split projections and finish the output."""

    def __init__(self, m):
        self.m = m
        self.gqa = hasattr(m, "split_xbc")  # stree.hybrid's MambaInLlama layer
        act = getattr(m, "activation", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Mamba2 conv activation {act!r} is not supported (only silu)")

    # in_proj output -> (z, xBC, dt, (z0, x0) or None)
    def split(self, zxbcdt):
        m = self.m
        if self.gqa:
            z, xbc, dt = m.split_zxbcdt(zxbcdt)
            return z, xbc, dt, None
        d_mlp = (zxbcdt.shape[-1] - 2 * m.d_ssm - 2 * m.ngroups * m.d_state - m.nheads) // 2
        z0, x0, z, xbc, dt = torch.split(
            zxbcdt, [d_mlp, d_mlp, m.d_ssm, m.d_ssm + 2 * m.ngroups * m.d_state, m.nheads], dim=-1)
        return z, xbc, dt, ((z0, x0) if d_mlp > 0 else None)

    # conv output (..., c) -> x (..., h, p), B (..., g, s), C (..., g, s)
    def split_xbc(self, xbc):
        m = self.m
        if self.gqa:
            return m.split_xbc(xbc)
        x, B, C = torch.split(xbc, [m.d_ssm, m.ngroups * m.d_state, m.ngroups * m.d_state], dim=-1)
        return (x.unflatten(-1, (-1, m.headdim)), B.unflatten(-1, (m.ngroups, -1)),
                C.unflatten(-1, (m.ngroups, -1)))

    @property
    def D(self):
        m = self.m
        D = m.D
        return rearrange(D, "(h p) -> h p", p=m.headdim) if D.dim() == 1 and D.numel() != m.nheads else D

    def finish(self, y, z, mlp_in):
        """Gated norm (or silu gate already applied in the scan), optional MLP half, out_proj."""
        m = self.m
        y = rearrange(y, "b l h p -> b l (h p)")
        if getattr(m, "rmsnorm", True):
            y = _gated_norm(m.norm, y, z)
        if mlp_in is not None:
            z0, x0 = mlp_in
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return m.out_proj(y)

    @property
    def z_in_scan(self) -> bool:
        return not getattr(self.m, "rmsnorm", True)


def _gated_norm(norm, y, z):
    # mamba_ssm's gated RMSNorm is a Triton kernel; off-GPU the same math in a few torch ops
    if isinstance(norm, RMSNormGated) and not y.is_cuda:
        return gated_rms_norm(y, z, norm.weight, norm.bias, norm.eps, norm.group_size,
                              norm.norm_before_gate)
    return norm(y, z)


def constants(m) -> dict:
    """Per-module tensors that do not change between steps (``A = -exp(A_log)`` in fp32, D in the
    scan's layout, the conv weight as (c, w)), rebuilt only when a parameter is modified."""
    # (inference tensors keep no version counter: their storage is the key)
    key = tuple((t.data_ptr(), 0 if t.is_inference() else t._version)
                for t in (m.A_log, m.D, m.conv1d.weight, m.dt_bias))
    cached = getattr(m, "_stree_constants", None)
    if cached is None or cached[0] != key:
        parts = _Parts(m)
        cached = (key, dict(parts=parts, A=-torch.exp(m.A_log.detach().float()),
                            in_bias=_in_proj_bias(m),
                            D=parts.D.detach(), conv_weight=m.conv1d.weight.detach()[:, 0],
                            conv_bias=None if m.conv1d.bias is None else m.conv1d.bias.detach(),
                            dt_limit=tuple(m.dt_limit)))
        m._stree_constants = cached
    return cached[1]


def _in_proj_bias(m):
    """``in_proj``'s bias with ``dt_bias`` added in the dt slice (the last ``nheads`` outputs), so
    the projection adds it (one op less per layer); None where that would change the math (an
    fp32 dt from a lower-precision projection: dt + dt_bias must be summed in fp32; an ``in_proj``
    that is more than a Linear, e.g. Falcon-H1's multipliers)."""
    if not isinstance(m.in_proj, torch.nn.Linear):
        return None
    w = m.in_proj.weight
    if w.dtype != torch.float32 or m.dt_bias.dtype != torch.float32:
        return None
    bias = (torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if m.in_proj.bias is None
            else m.in_proj.bias.detach().clone())
    bias[-m.dt_bias.shape[0]:] += m.dt_bias.detach()
    return bias


def is_mamba2(module) -> bool:
    return isinstance(module, Mamba2) or hasattr(module, "split_xbc")


def allocate(m, batch_size: int, dtype=None) -> MambaLayerCache:
    """Zero committed state from the module's own allocator (mamba_ssm's layout and dtypes)."""
    if hasattr(m, "allocate_cache"):  # stree.hybrid
        return m.allocate_cache(batch_size, dtype=dtype)
    conv, ssm = m.allocate_inference_cache(batch_size, 1, dtype=dtype)
    return MambaLayerCache(conv, ssm)


def tree_forward(m, u, state: MambaLayerCache, tables: dict, impl: str = "auto", k: dict | None = None):
    """Mixer output for every tree node from the committed state, without writing it.

    Args:
        m: the Mamba2 module; u: ``(b, n, d_model)`` normalised hidden states of the tree nodes.
        tables: ``TokenTree.conv_scan_tables(width)`` of the tree (built before the
            layers run, so this function reads no Python-side cache).
        k: :func:`constants` of ``m`` (looked up when None).
    Returns:
        ``(out (b, n, d_model), MambaActivations)`` — the latter is what replay needs.
    """
    k = constants(m) if k is None else k
    parts = k["parts"]
    fold = k["in_bias"] is not None  # dt_bias added by the projection
    proj = linear(m.in_proj, u, k["in_bias"]) if fold else m.in_proj(u)
    z, xbc, dt, mlp_in = parts.split(proj)
    conv_out = tree_conv(xbc, state.conv_state, k["conv_weight"], k["conv_bias"],
                         tables["window"], activation="silu", impl=impl,
                         gather_index=tables["gather"])
    x, B, C = parts.split_xbc(conv_out)
    z_scan = rearrange(z, "b l (h p) -> b l h p", p=m.headdim) if parts.z_in_scan else None
    y, dt_proc = tree_scan(x, dt, k["A"], B, C, tables["mask"], D=k["D"], z=z_scan,
                           dt_bias=None if fold else m.dt_bias,
                           dt_softplus=True, dt_limit=k["dt_limit"],
                           initial_states=state.ssm_state, impl=impl, tables=tables["scan"])
    out = parts.finish(y, z, mlp_in)
    return out, MambaActivations(xbc=xbc, x=x, dt=dt_proc, B=B, A=k["A"])


def conv_width(m) -> int:
    """The taps of the module's causal conv: the key of its tree tables."""
    return m.conv1d.weight.shape[-1]


def prefill(m, u, state: MambaLayerCache):
    """Run ``u (b, l, d_model)`` through the mixer from the committed state and commit it."""
    parts = _Parts(m)
    z, xbc, dt, mlp_in = parts.split(m.in_proj(u))
    b, l, c = xbc.shape
    w = m.conv1d.weight.shape[-1]
    conv_state = state.conv_state
    ext = torch.cat([conv_state[:, :, 1:].to(xbc.dtype), xbc.transpose(1, 2)], dim=2)  # (b, c, w-1+l)
    conv_out = F.conv1d(ext, m.conv1d.weight, m.conv1d.bias, groups=c)  # (b, c, l)
    conv_state.copy_(torch.cat([conv_state.to(xbc.dtype), xbc.transpose(1, 2)], dim=2)[:, :, -w:])
    x, B, C = parts.split_xbc(F.silu(conv_out).transpose(1, 2))
    A = -torch.exp(m.A_log.float())
    z_scan = rearrange(z, "b l (h p) -> b l h p", p=m.headdim) if parts.z_in_scan else None
    y, final = chunk_scan(x, dt, A, B, C, D=parts.D, z=z_scan, dt_bias=m.dt_bias,
                          dt_softplus=True, dt_limit=tuple(m.dt_limit),
                          initial_states=state.ssm_state, chunk_size=getattr(m, "chunk_size", 256))
    state.ssm_state.copy_(final)
    return parts.finish(y, z, mlp_in)


def node_step(m, u, conv, ssm, k: dict | None = None, valid=None):
    """Tokens run one after another from a given state, the state not written: how a drafter runs
    each new node of a level from its parent's materialised state (the recurrence, no tree
    tables), after the tokens it is behind where a level starts with them.

    Args:
        m: the Mamba2 module; u: ``(N, L, d_model)`` normalised hidden states: a chain of ``L``
            tokens per row (a level's node: ``L = 1``), run in order.
        conv: ``(N, c, w)`` raw conv inputs before the chain; ssm: ``(N, h, p, s)`` state before it.
        k: :func:`constants` of ``m`` (looked up when None).
        valid: ``(N, L)`` bool or None (all valid): a row's False tokens leave its state as it
            was (left padding of a row with a shorter chain; their outputs are not meaningful).
    Returns:
        ``(out (N, L, d_model), conv (N, c, w), ssm (N, h, p, s))``: the mixer output of every
        token and the conv window and SSM state after the chain (new tensors, in the inputs'
        dtypes: rounded to them after every token, as separate steps would be).
    """
    k = constants(m) if k is None else k
    parts = k["parts"]
    fold = k["in_bias"] is not None  # dt_bias added by the projection
    proj = linear(m.in_proj, u, k["in_bias"]) if fold else m.in_proj(u)  # one weight read for the chain
    z, xbc, dt, mlp_in = parts.split(proj)
    ys = []
    for t in range(u.shape[1]):
        y, new_conv, new_ssm = _recurrence(m, k, conv, ssm, xbc[:, t:t + 1], dt[:, t], z[:, t], fold)
        if valid is None:
            conv, ssm = new_conv, new_ssm
        else:
            keep = valid[:, t]
            conv = torch.where(keep[:, None, None], new_conv, conv)
            ssm = torch.where(keep[:, None, None, None], new_ssm, ssm)
        ys.append(_to(y, u.dtype))
    out = parts.finish(torch.stack(ys, 1) if len(ys) > 1 else ys[0][:, None], z, mlp_in)
    return out, conv, ssm


def _recurrence(m, k: dict, conv, ssm, xbc, dt, z, fold: bool):
    """One token of :func:`node_step` from ``conv`` / ``ssm``: ``xbc (N, 1, c)``, ``dt (N, h)``,
    ``z (N, d_ssm)`` its projections. Returns its ``y (N, h, p)`` (fp32) and the states after it."""
    parts = k["parts"]
    new_conv = torch.cat([conv[:, :, 1:], _to(xbc.transpose(1, 2), conv.dtype)], dim=2)
    conv_out = (_to(new_conv, F32) * _to(k["conv_weight"], F32)).sum(-1)  # (N, c)
    if k["conv_bias"] is not None:
        conv_out += _to(k["conv_bias"], F32)
    x, B, C = (_to(t, F32) for t in parts.split_xbc(_to(F.silu(conv_out), xbc.dtype)))
    n, h, p = x.shape  # x (N, h, p), B and C (N, g, s)
    g = B.shape[1]
    dt = process_dt(dt.reshape(n, h), None if fold else m.dt_bias, True, k["dt_limit"])  # (N, h) fp32
    # h' = exp(dt A) h + (dt x) B^T, heads grouped (g, h / g) so B and C broadcast over a group
    dtx = (dt[..., None] * x).view(n, g, h // g, p, 1)
    new_ssm = torch.addcmul((dtx * B[:, :, None, None, :]).view(n, h, p, -1), _to(ssm, F32),
                            torch.exp(dt * k["A"])[..., None, None])
    y = torch.matmul(new_ssm.view(n, g, h // g * p, -1), C[..., None]).view(n, h, p)
    y = torch.addcmul(y, x, _to(k["D"], F32).view(h, -1))
    if parts.z_in_scan:
        y = y * F.silu(_to(z.reshape(n, h, p), F32))
    return y, new_conv, _to(new_ssm, ssm.dtype)


F32 = torch.float32


def _to(t, dtype):
    """``t`` in ``dtype``, without dispatching a cast when it already is."""
    return t if t.dtype == dtype else t.to(dtype)
