"""The Mamba2 scan of the tree rows inside vLLM: each tree runs stree's tree scan from the SSM
slot the last step's accepted tokens left (on the CPU in fp32, stree's C++ op), nothing written;
at commit the state is advanced along the accepted path from the kept activations
(``ssm_replay``) into slot ``a`` of the request's slot table, the one vLLM reads next step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stree.kernels import cpu_ops
from stree.kernels.replay import path_tables, ssm_replay
from stree.kernels.tree_scan import tree_scan
from stree.vllm.step import RecurrentRows, TreeGroup, TreeStep


@dataclass
class ScanKept:
    """One layer's tree group, kept for the commit: vLLM's ``(slots, heads, headdim, dstate)`` SSM
    state, each request's slot table, and the scan's inputs: ``h0 (b, heads, headdim, dstate)``
    fp32 state before the root, ``x (b, n, heads, headdim)``, ``dt (b, n, heads)`` fp32 processed,
    ``A (heads,)``, ``B (b, n, groups, dstate)``."""

    group: TreeGroup
    ssm_state: torch.Tensor
    slots: list[list[int]]
    h0: torch.Tensor
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor

    def committed_slots(self) -> list[int]:
        """Each request's slot for the committed state: slot ``a`` of its table, ``a`` accepted."""
        return [slots[a] for slots, a in zip(self.slots, self.group.accepted())]

    def commit(self, step: TreeStep) -> None:
        g = self.group
        if cpu_ops.usable(self.x, self.ssm_state):  # one C++ call
            cpu_ops.ops().tree_scan_commit(self.ssm_state, torch.tensor(self.committed_slots()), self.h0, self.x,
                                           self.dt, self.A, self.B, g.paths())
            return
        paths = step.table(("paths", id(g), str(self.x.device)), lambda: g.paths().to(self.x.device))
        tables = step.table(("path tables", id(g), str(self.x.device)), lambda: path_tables(paths))
        state = self.h0.clone()
        ssm_replay(state, self.x, self.dt, self.A, self.B, paths, tables=tables)
        self.ssm_state[self.committed_slots()] = state.to(self.ssm_state.dtype)


def tree_scan_rows(ssm_state, x, dt, A, B, C, D, dt_bias, rows: RecurrentRows, step: TreeStep, out) -> None:
    """Tree scan of the tree rows of vLLM's decode tokens, one call per tree shape: x and
    ``out`` (tokens, h, p), dt (tokens, h) before softplus and bias, A, D, dt_bias (h,), B, C
    (tokens, g, n); each tree starts from the SSM slot the last step's accepted tokens left.
    Writes the tree tokens' rows of ``out``; the state is not written, what the commit replays
    is kept: the tree rows of x and B as views where they lie back to back, so x and B must not
    change before the commit (the mixer passes the tree conv's own output, which nothing else
    writes)."""
    a_h = A.float()
    native = cpu_ops.usable(x, dt, B, C, ssm_state, out)
    for rg in rows.groups:
        g = rg.group
        if native:  # one C++ call: the same math, gathers and copies included
            h0, xs, dt_out, bs = cpu_ops.ops().tree_scan_rows(x, dt, B, C, ssm_state, rg.start, g.index,
                                                              g.parent_index, a_h, D, dt_bias, out)
            step.keep(ScanKept(g, ssm_state, rg.slots, h0, xs, dt_out, a_h, bs))
            continue
        h0 = ssm_state[rg.start].float()
        xs, bs = g.take(x), g.take(B)  # kept for the commit (see the docstring)
        tree = g.tree(x.device)
        y, dt_out = tree_scan(xs, g.take(dt), a_h, bs, g.take(C), tree.mask, D=D, dt_bias=dt_bias, dt_softplus=True,
                              initial_states=h0, tables=None if x.is_cuda else tree.scan_tables())
        g.put(out, y)
        step.keep(ScanKept(g, ssm_state, rg.slots, h0, xs, dt_out, a_h, bs))
