"""The short conv of a recurrent layer's tree rows inside vLLM (Mamba2's and Gated DeltaNet's):
each node convolves the inputs along its own ancestor chain, starting from the committed window
vLLM's speculative conv state holds at column ``num_accepted - 1``; nothing is written, and at
commit the accepted path's last ``width - 1`` inputs become the window vLLM reads next step."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stree.kernels import cpu_ops
from stree.kernels.replay import conv_replay, conv_replay_index
from stree.kernels.tree_conv import tree_conv
from stree.vllm.cpu_spec import conv_windows
from stree.vllm.step import RecurrentRows, TreeGroup, TreeStep


@dataclass
class ConvKept:
    """One layer's tree group, kept for the commit: vLLM's ``(slots, dim, width - 1 + K)`` conv
    state (written at commit), each request's conv slot, the ``(b, dim, width - 1)`` committed
    window the tree conv started from and the ``(b, n, dim)`` nodes' pre-conv inputs."""

    group: TreeGroup
    conv_state: torch.Tensor
    slots: list[int]
    window: torch.Tensor
    xbc: torch.Tensor

    def commit(self, step: TreeStep) -> None:
        g, accepted = self.group, step.table(("accepted", id(self.group)), lambda: torch.tensor(self.group.accepted()))
        if cpu_ops.usable(self.xbc, self.conv_state):  # one C++ call
            cpu_ops.ops().tree_conv_commit(self.conv_state, torch.tensor(self.slots), accepted,
                                           self.window.transpose(1, 2).contiguous(), self.xbc, g.paths())
            return
        paths = g.paths().to(self.xbc.device)
        window, w = self.window.clone(), self.window.shape[-1]
        index = step.table(("conv replay", id(g), w), lambda: conv_replay_index(paths, w))  # shared by the layers
        conv_replay(window, self.xbc, paths, index=index)
        for r, (slot, a) in enumerate(zip(self.slots, accepted.tolist())):
            self.conv_state[slot, :, a:a + w] = window[r]


def tree_conv_rows(x, conv_state, weight, bias, activation, rows: RecurrentRows, step: TreeStep) -> torch.Tensor:
    """Tree conv of the tree rows of vLLM's decode tokens, one call per tree shape.

    x: (tokens, dim) pre-conv inputs; conv_state: vLLM's (slots, dim, width - 1 + K), read from
    each tree's window at column ``num_accepted - 1``, not written; weight (dim, width). Returns
    (tokens, dim), the tree tokens' rows written; the inputs the commit replays are kept."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    act = "silu" if activation in ("silu", "swish", True) else None
    native = cpu_ops.usable(x, conv_state, weight, *([] if bias is None else [bias]))
    for rg in rows.groups:
        g = rg.group
        if native:  # one C++ call: the same math, gathers and copies included
            window0 = g.tree(x.device).conv_window(width)[0]
            xbc, window = cpu_ops.ops().tree_conv_rows(x, conv_state, *rg.slot_column, g.index, window0, weight,
                                                       torch.empty(0) if bias is None else bias, act is not None, out)
            step.keep(ConvKept(g, conv_state, [t[0] for t in rg.slots], window.transpose(1, 2), xbc))
            continue
        window = conv_windows(conv_state, rg.table[:, 0], rg.accepted, width)
        committed = F.pad(window, (1, 0))  # mamba layout: width columns, the first unused
        tables = g.tree(x.device).conv_scan_tables(width)  # cached on the template
        xbc = g.take(x).clone()  # kept for the commit: x is vLLM's buffer
        g.put(out, tree_conv(xbc, committed.to(x.dtype), weight, bias, tables["window"], activation=act,
                             gather_index=tables["gather"]))
        step.keep(ConvKept(g, conv_state, [t[0] for t in rg.slots], window, xbc))
    return out
