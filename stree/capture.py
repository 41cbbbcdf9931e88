"""Compiled decoding steps: ``torch.compile(fullgraph=True)`` of a patched model's tree forward
(the target's verify step), draft level and whole static draft.

The steps (``stree.steps.tree_step`` / ``level_step`` / ``levels_step``) read only tensors: every
table is built before them, and with ``static`` steps attention reads the whole ``max_seqlen`` key
span under the mask (per-row lengths stay on the device), so a template has fixed shapes and the
step has no host synchronisation. One graph is compiled per model and shape: the verify tree, each
level width of the draft, and a greedy static draft whole (its levels and the choice of children
between them: one call instead of one per level, 1.13 -> 0.82 ms for the shipped draft's
``caterpillar:2,2,2`` on the project's CPU). Trees whose size varies (suffix and merged trees)
reach the verify step padded to a few sizes (``tree_forward``'s ``pad_nodes``, set by
``stree.generate``), so they too run on a few graphs.

Inductor compiles with *freezing*: the weights are constants of the graph, so on a CPU its linear
layers run on weights packed once (what :func:`stree.prepack_linears` does for eager code, which
steps aside inside a compiled graph) and the rest of the step is fused around them. Which packed
kernel: for fp32 weights and static shapes inductor picks MKL's packed GEMM
(``mkl._mkl_linear``), which on the project's CPU ran 1.7x slower per call than oneDNN's inner
product on a reordered weight, the kernel stree's eager steps use, and made a compiled verify
step 1.3x slower than the eager one. Inside stree's compiled steps inductor therefore packs for
oneDNN wherever eager stree would (:class:`_OnednnLinears`), as it does itself for dynamic batch
sizes and ahead-of-time compilation. A compiled step sees the weights as they were when it was
compiled: load or change weights before the first compiled call (steps are kept on the model).
"""
from __future__ import annotations

import functools
import inspect
import types
import warnings
from contextlib import contextmanager

import torch

from stree.steps import Steps, level_step, levels_step, root_step, tree_step

BACKEND = "inductor"  # torch.compile's backend for the steps
# inductor config: weights as graph constants (see above), and linears reading one input
# concatenated into one (a gated MLP's gate and up projections: one call of two, 0.82 -> 0.76 ms
# for the draft above)
FREEZING = {"freezing": True, "cpp.enable_concat_linear": True}


def unavailable() -> str | None:
    """Why ``torch.compile`` cannot run here, or None."""
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    try:
        import torch._dynamo as dynamo
        if not dynamo.is_dynamo_supported():
            return "torch.compile is not supported on this Python / platform"
    except Exception as err:  # noqa: BLE001 - any import or probe failure means: not available
        return f"torch.compile is unavailable ({err})"
    return None


def compiled_steps(model) -> Steps:
    """The compiled :class:`stree.steps.Steps` of a patched ``model`` (built once per model)."""
    steps = getattr(model, "_stree_compiled", None)
    if steps is None:
        import torch._dynamo as dynamo
        # one graph per model and shape (verify tree, each draft level width): the shared step
        # functions must not fall back to eager after dynamo's default of 8
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
        steps = Steps(tree=Fallback(compile_step(tree_step), tree_step),
                      root=Fallback(compile_step(root_step), root_step),
                      level=Fallback(compile_step(level_step), level_step),
                      levels=Fallback(compile_step(levels_step), levels_step), static=True)
        model._stree_compiled = steps
    return steps


def compile_step(fn):
    """``fn`` compiled as every stree step is: one full graph per input shape, frozen weights.

    Freezing is inductor's global config, which dynamo reads while it traces (it turns the
    weights into graph attributes then), so it is set around every call, not passed as a
    compile option, and nothing else the user compiles sees it."""
    import torch._inductor.config as inductor_config

    # Dynamo guards every attribute of every module a step touches, each call: on a CPU that
    # was a fifth of a draft level (3.1 -> 2.5 ms a 4-level draft). The weights are frozen
    # into the graph and the modules never change under a compiled step (see above), so only
    # the guards on the step's tensors and tables are kept.
    skip_module_guards = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    options = {"guard_filter_fn": skip_module_guards} if skip_module_guards else None
    compiled = torch.compile(_own_code(fn), fullgraph=True, dynamic=False, backend=BACKEND, options=options)
    freezing = inductor_config.patch(FREEZING)  # reusable: it keeps a stack of prior values
    onednn = _onednn_linears()

    def frozen(*args):
        with freezing, onednn:
            return compiled(*args)

    return frozen


class _OnednnLinears:
    """While inductor compiles inside the block, it packs a frozen fp32 CPU linear for
    oneDNN (``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``, the eager packed path)
    instead of MKL when ``rows * weight elements >= stree.layers.linear.PACK_MIN_WORK``, the rule
    eager stree packs by; smaller ones keep inductor's choice. Inductor decides this in two
    methods of its CPU device op (``torch._inductor.fx_passes.mkldnn_fusion``), which are
    swapped for the block only, so nothing else compiled in the process is affected; where they
    do not exist (another torch, no oneDNN) the block changes nothing. Built once: entering and
    leaving are two attribute swaps, on every call of a compiled step."""

    def __init__(self):
        self.op = None
        try:
            from torch._inductor.fx_passes import mkldnn_fusion
            op = type(mkldnn_fusion._get_mkldnn_device_op("cpu"))
            pack_weight, pack = op.pack_linear_weight, op.pack_linear
            reorder = torch.ops.mkldnn._reorder_linear_weight
        except (ImportError, AttributeError, RuntimeError):
            return
        # the wrappers below pass inductor's arguments through by position: another torch whose
        # methods take others keeps its own choice
        if (list(inspect.signature(pack_weight).parameters) != ["self", "graph", "is_lp_weight",
                                                                 "transpose_weight_node", "batch_size"]
                or list(inspect.signature(pack).parameters) != ["self", "graph", "is_lp_weight", "batch_size",
                                                                 "input", "packed_weight_node", "bias"]):
            return
        from stree.layers.linear import PACK_MIN_WORK

        def pack_linear_weight(self, graph, is_lp_weight, transpose_weight_node, batch_size):
            node = transpose_weight_node.args[0]  # the permute's input: the frozen weight
            onednn = isinstance(batch_size, int) and batch_size * node.meta["val"].numel() >= PACK_MIN_WORK
            if not (is_lp_weight or onednn):
                return pack_weight(self, graph, False, transpose_weight_node, batch_size)
            # One packed copy per weight, placed right after the weight (before every use):
            # inductor packs each linear call's weight anew, so a weight used by several calls
            # in one graph (a draft's levels) would be packed, held and streamed once per call
            # (a 4-level fp32 chain draft: 1.4 -> 2.0 ms). Packed for the rows of its first
            # call (oneDNN's packed weight serves any number of rows): a draft whose roots'
            # pass runs a lead (more rows than its other levels) would otherwise stream its
            # weights in two layouts, cold after the target's forward (shipped bf16 draft,
            # caches flushed between drafts: 1.18-1.20 -> 1.08-1.16 ms a draft with a lead)
            packed = getattr(graph, "_stree_packed", None)
            if packed is None:
                packed = graph._stree_packed = {}
            if node not in packed:
                with graph.inserting_after(node):
                    permute = graph.create_node("call_function", torch.ops.aten.permute.default, (node, (1, 0)))
                with graph.inserting_after(permute):
                    packed[node] = pack_weight(self, graph, True, permute, batch_size)
            return packed[node]

        def pack_linear(self, graph, is_lp_weight, batch_size, input, packed_weight_node, bias):
            onednn = packed_weight_node.target in (reorder, reorder.default)
            return pack(self, graph, is_lp_weight or onednn, batch_size, input, packed_weight_node, bias)

        self.op, self.theirs, self.ours = op, (pack_weight, pack), (pack_linear_weight, pack_linear)

    def __enter__(self):
        if self.op is not None:
            self.op.pack_linear_weight, self.op.pack_linear = self.ours

    def __exit__(self, *exc):
        if self.op is not None:
            self.op.pack_linear_weight, self.op.pack_linear = self.theirs
        return False


@functools.cache
def _onednn_linears() -> _OnednnLinears:
    """The one :class:`_OnednnLinears` (built on first use, when inductor is first needed)."""
    return _OnednnLinears()


def _own_code(fn):
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs on the code object,
    so without this every model compiling one step function would share one cache, and with the
    module guards skipped a model's call could run another's graph, weights and all."""
    func = getattr(fn, "__func__", fn)  # a bound method (a model's own step): rebind the copy
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    return types.MethodType(own, fn.__self__) if func is not fn else own


@contextmanager
def compiled(*models):
    """Run the patched ``models`` (None entries skipped) with compiled steps inside the block.

    Where ``torch.compile`` is unavailable, warns (RuntimeWarning, with the reason) and runs
    them eagerly."""
    models = [m for m in models if m is not None]
    reason = unavailable()
    if reason is not None:
        warnings.warn(f"compile=True: {reason}; running eagerly", RuntimeWarning, stacklevel=3)
        yield
        return
    before = [getattr(m, "_stree_steps", None) for m in models]
    for m in models:
        m._stree_steps = compiled_steps(m)
    try:
        yield
    finally:
        for m, b in zip(models, before):
            m._stree_steps = b


class Fallback:
    """A compiled step that runs ``eager`` (same static shapes) from the first time its backend
    fails to compile (e.g. no C++ compiler for the CPU backend), after one RuntimeWarning."""

    def __init__(self, compiled_fn, eager):
        self.fn, self.eager = compiled_fn, eager

    def __call__(self, *args):
        try:
            return self.fn(*args)
        except torch._dynamo.exc.BackendCompilerFailed as err:
            warnings.warn(f"torch.compile's backend failed ({err}); running this step eagerly",
                          RuntimeWarning, stacklevel=2)
            self.fn = self.eager
            return self.fn(*args)
