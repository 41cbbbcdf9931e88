"""Linear layers with prepacked weights on CPU: the small-batch GEMMs of decoding without the packing.

A decoding step multiplies a few rows (1 token, or a tree's 5-63 nodes) by every weight matrix.
PyTorch's CPU ``F.linear`` hands that to MKL: a GEMV for one row, and from two rows a GEMM whose
cost jumps (as we read the timings, it packs the weight on every call). On the project's 2-core
CPU a (1024, 384) projection costs 38 us for one row, 74 us for two and 83-115 us for 5-13, so a
5-node verify step cost about 1.35x a decoding step and the tree's extra nodes looked expensive.
oneDNN's inner product on a weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's CPU freezing uses) costs 27, 28 and 37-65 us for the same calls, and beats
``F.linear`` even for one row once the weight is large (the (4096, 384) LM head: 77 against
147 us); for small weights and one row its fixed ~15 us call overhead loses
(``bench/prepack.py``). :func:`prepack_linears` therefore gives every fp32 ``nn.Linear`` of a
model on the CPU a forward that takes the packed path when ``rows * weight.numel() >=
PACK_MIN_WORK`` and plain ``F.linear`` otherwise.

The crossover is measured where it matters, in each model's own one-token decoding step
(``bench/prepack.py --crossover-only``), not by calls in a loop: in a step every weight is read
from memory once, where a loop keeps it in cache (in a loop a (1024, 384) row costs 37 us
through ``F.linear`` and 32-41 us packed, 1-2 threads). With the one-row calls on the shipped
target's 0.39M-element projections (MLP, Mamba2 input and output) packed (``2**18``; ``2**19``
left them on ``F.linear``) its own step took 8.2 ms against 9.7 with 2 threads (median of 9
rounds; oneDNN spreads even one row over the threads, ``F.linear``'s one-row GEMV runs on one)
and 8.6 against 9.1 with 1. Lower crossovers also pack the draft's 0.04-0.1M-element weights,
which stay in cache and where oneDNN's fixed call overhead loses: its own step ran 25-55%
slower from ``2**16`` down.

It is a property of the model, not of stree's decoding: a model's own ``forward``/``step`` (the
autoregressive baseline) runs the same modules and gets the same kernels. The checkpoint, the
parameters and ``state_dict`` are untouched (the packed copy is a cache, rebuilt when the weight's
storage or version changes, e.g. after an optimiser step); with gradients enabled for the weight or
the input, under ``torch.compile`` and off the CPU the plain path runs. Results equal ``F.linear``
up to fp32 rounding (another summation order). The packed copy doubles the memory of the weights.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

# rows x weight elements from which the packed kernel is the faster one (see the module docstring)
PACK_MIN_WORK = 1 << 18
_NO_BIAS = object()


def prepack_available() -> bool:
    """Whether this PyTorch build has oneDNN's packed linear (x86-64 and most ARM builds)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prepack_linears(model: nn.Module) -> int:
    """Give every fp32 CPU ``nn.Linear`` of ``model`` the packed-weight forward; returns how many.

    In place and idempotent; a no-op (0) where :func:`prepack_available` is False. The weights are
    packed lazily, on a module's first inference call with enough rows.
    """
    if not prepack_available():
        return 0
    count = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is nn.Linear and w.dtype == torch.float32 and w.device.type == "cpu":
            if not is_prepacked(module):
                module.forward = types.MethodType(_packed_forward, module)
                module._stree_packed = PackedWeight()
            count += 1
    return count


def is_prepacked(module: nn.Module) -> bool:
    return "forward" in module.__dict__ and getattr(module.forward, "__func__", None) is _packed_forward


def linear(module: nn.Linear, x: torch.Tensor, bias=_NO_BIAS) -> torch.Tensor:
    """``F.linear(x, module.weight, bias)`` (the module's own bias by default) through the packed
    weight where :func:`prepack_linears` enabled it: for callers that swap in another bias."""
    bias = module.bias if bias is _NO_BIAS else bias
    if is_prepacked(module):
        return _packed(module, x, bias)
    return F.linear(x, module.weight, bias)


class PackedWeight:
    """The packed copy of a module's weight (an opaque oneDNN tensor) and the weight it was made
    from: a cache, so copies and pickles of the module start empty and pack their own."""

    __slots__ = ("key", "tensor")

    def __init__(self):
        self.key, self.tensor = None, None

    def __deepcopy__(self, memo):
        return PackedWeight()

    def __reduce__(self):
        return PackedWeight, ()


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _packed(self, x, self.bias)


def _packed(module: nn.Linear, x: torch.Tensor, bias) -> torch.Tensor:
    w = module.weight
    if (torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu"
            or torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
        return F.linear(x, w, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows * w.numel() < PACK_MIN_WORK:
        return F.linear(x, w, bias)
    # inference tensors keep no version counter: their storage is the key
    key = (w.data_ptr(), w.dtype, 0 if w.is_inference() else w._version)
    cached = module._stree_packed
    if cached.key != key:
        cached.key, cached.tensor = key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), cached.tensor, bias, "none", [], "")
    return y.view(*x.shape[:-1], w.shape[0])
