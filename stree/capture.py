"""Compiled decoding steps: ``torch.compile(fullgraph=True)`` of a patched model's tree forward
(the target's verify step) and draft level, for a fixed tree template.

The steps (``stree.patch.tree_step`` / ``level_step``) read only tensors: every table is built
before them, and with ``static`` steps attention reads the whole ``max_seqlen`` key span under
the mask (per-row lengths stay on the device), so a template has fixed shapes and the step has no
host synchronisation. One graph is compiled per model and shape: the verify tree, and each
level width of the draft.

Inductor compiles with *freezing*: the weights are constants of the graph, so on a CPU its linear
layers run on weights packed once for MKL (what :func:`stree.prepack_linears` does for eager
code, which steps aside inside a compiled graph) and the rest of the step is fused around them.
A compiled step therefore sees the weights as they were when it was compiled: load or change
weights before the first compiled call (steps are kept on the model).
"""
from __future__ import annotations

import types
import warnings
from contextlib import contextmanager

import torch

from stree.patch import Steps, level_step, tree_step

BACKEND = "inductor"  # torch.compile's backend for the steps
FREEZING = {"freezing": True}  # inductor config: weights as graph constants (see above)


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
    """The compiled :class:`stree.patch.Steps` of a patched ``model`` (built once per model)."""
    steps = getattr(model, "_stree_compiled", None)
    if steps is None:
        import torch._dynamo as dynamo
        # one graph per model and shape (verify tree, each draft level width): the shared step
        # functions must not fall back to eager after dynamo's default of 8
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
        steps = Steps(tree=Fallback(compile_step(tree_step), tree_step),
                      level=Fallback(compile_step(level_step), level_step), static=True)
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

    def frozen(*args):
        with freezing:
            return compiled(*args)

    return frozen


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
