"""The gated delta rule of a Gated DeltaNet layer's tree rows inside vLLM: each tree runs stree's
``tree_delta`` (the ancestor-masked UT transform) from the state slot the last step's accepted
tokens left, nothing written; at commit the state is advanced along the accepted path from the
kept ``k``, ``u`` and path-cumulative decay ``G`` (``delta_replay``) into slot ``a`` of the
request's slot table, the one vLLM reads next step. One state per request is read and one
written: no state per node or per draft position.

A decode row without drafts (one token, the root) runs the same rule as a one-node tree and is
committed at once: its token is already accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stree.kernels.replay import delta_replay, path_tables
from stree.kernels.tree_conv import tree_conv
from stree.hf.gated_delta import DeltaView, l2norm
from stree.kernels.tree_delta import tree_delta
from stree.layers.gated_delta import qkv
from stree.vllm.cpu_spec import conv_windows, start_slots
from stree.vllm.step import RecurrentRows, TreeGroup, TreeStep, template


@dataclass
class DeltaShape:
    """A vLLM Gated DeltaNet layer ``m`` (its ``A_log``, ``dt_bias``) and its sizes on this rank,
    seen as stree's transformers adapters see a layer, so that the split, normalisation and
    gates are theirs (:class:`stree.hf.gated_delta.DeltaView`, :func:`stree.layers.gated_delta.qkv`)."""

    m: object
    num_heads: int
    num_k_heads: int
    head_k_dim: int
    head_v_dim: int

    split_qkv = DeltaView.split_qkv
    decay = DeltaView.decay
    l2norm = staticmethod(l2norm)

    def split(self, conv: torch.Tensor):
        """``conv (..., conv_dim)`` -> ``q`` (normalised, scaled), ``k`` (normalised) ``(..., Hv,
        dk)`` fp32, one head per value head, and ``v (..., Hv, dv)``."""
        return qkv(self, {"groups": self.num_heads // self.num_k_heads, "scale": self.head_k_dim ** -0.5}, conv)

    def gates(self, a: torch.Tensor, b: torch.Tensor):
        """The per-head log-decay ``g`` and write strength ``beta = sigmoid(b)``, fp32."""
        return self.decay(a), b.float().sigmoid()


@dataclass
class DeltaKept:
    """One layer's tree group, kept for the commit: vLLM's ``(slots, Hv, dk, dv)`` state, each
    request's slot table, the state before the root ``h0 (b, Hv, dk, dv)`` fp32, and what
    ``tree_delta`` returned for the replay: ``k (b, n, Hv, dk)``, ``u (b, n, Hv, dv)``,
    ``G (b, n, Hv)``."""

    group: TreeGroup
    ssm_state: torch.Tensor
    slots: list[list[int]]
    h0: torch.Tensor
    k: torch.Tensor
    u: torch.Tensor
    G: torch.Tensor

    def commit(self, step: TreeStep) -> None:
        g = self.group
        paths = step.table(("paths", id(g), str(self.k.device)), lambda: g.paths().to(self.k.device))
        tables = step.table(("path tables", id(g), str(self.k.device)), lambda: path_tables(paths))
        state = self.h0.clone()
        delta_replay(state, self.k, self.u, self.G, paths, tables=tables)
        self.ssm_state[[slots[a] for slots, a in zip(self.slots, g.accepted())]] = state.to(self.ssm_state.dtype)


def tree_delta_rows(shape: DeltaShape, conv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    ssm_state: torch.Tensor, rows: RecurrentRows, step: TreeStep, out: torch.Tensor) -> None:
    """The rule over each tree of vLLM's decode rows, one call per tree shape: ``conv (tokens,
    conv_dim)`` the tree conv's output, ``a``, ``b`` ``(tokens, Hv)`` the gate projections,
    ``ssm_state (slots, Hv, dk, dv)``; writes the tree tokens' rows of ``out (tokens, Hv, dv)``
    and keeps what the commit replays."""
    for rg in rows.groups:
        grp = rg.group
        q, k, v = shape.split(grp.take(conv))
        g, beta = shape.gates(grp.take(a), grp.take(b))
        h0 = ssm_state[rg.start].float()
        o, u, G = tree_delta(q, k, v, g, beta, grp.tree(conv.device).mask, h0)
        grp.put(out, o.to(out.dtype))
        step.keep(DeltaKept(grp, ssm_state, rg.slots, h0, k, u, G))


def single_rows(shape: DeltaShape, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor,
                table: torch.Tensor, accepted: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                bias, ssm_state: torch.Tensor, out: torch.Tensor) -> None:
    """Decode rows of one token (no drafts): the conv and the rule from the window and state the
    last step left (column and slot ``num_accepted - 1``), committed at once into column 0 and
    slot ``table[:, 0]`` (what vLLM reads after a one-token step). ``x (tokens, conv_dim)``
    pre-conv inputs, ``tokens (r,)`` the rows' token indices, ``table (r, 1 + K)``,
    ``accepted (r,)``; writes those rows of ``out``."""
    width, r = weight.shape[1], len(tokens)
    slot = table[:, 0].long()
    window = conv_windows(conv_state, slot, accepted, width).to(x.dtype)  # (r, dim, width - 1)
    xs = x[tokens][:, None]  # (r, 1, dim): one-node trees
    tables = template((-1,), r, x.device).conv_scan_tables(width)
    conv = tree_conv(xs, F.pad(window, (1, 0)), weight, bias, tables["window"], activation="silu",
                     gather_index=tables["gather"])
    q, k, v = shape.split(conv)
    g, beta = shape.gates(a[tokens][:, None], b[tokens][:, None])
    h0 = ssm_state[start_slots(table, accepted)].float()
    o, u, G = tree_delta(q, k, v, g, beta, tables["mask"], h0)
    out[tokens] = o[:, 0].to(out.dtype)
    delta_replay(h0, k, u, G, torch.zeros(r, 1, dtype=torch.long, device=x.device))
    ssm_state[slot] = h0.to(ssm_state.dtype)
    conv_state[slot, :, :width - 1] = torch.cat([window[:, :, 1:], xs.transpose(1, 2)], dim=2).to(conv_state.dtype)
