"""Keep transformers' Mamba2-family models on their PyTorch paths for CPU tensors.

transformers binds each mixer helper (``mamba2_chunk_scan``, ``causal_conv1d_fn``, ...) once, when
its modeling module is first imported: to mamba_ssm / causal_conv1d if those import, else to its own
PyTorch reference. ``import stree`` makes mamba_ssm importable on CPU-only installs (``stree/_mamba``),
and mamba_ssm's Triton kernels cannot run on CPU tensors, so a modeling module imported after stree
would fail on CPU. We rebind each such helper in the modeling module's namespace to a dispatcher:
the bound kernel for CUDA tensors, transformers' own PyTorch reference (``__wrapped__``) otherwise.
This is applied to modules already imported when stree is imported and, through an import hook,
to ones imported later, so the import order does not matter. Nothing else in transformers changes.
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys

import torch

MODULES = (
    "transformers.models.mamba2.modeling_mamba2",
    "transformers.models.bamba.modeling_bamba",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "transformers.models.nemotron_h.modeling_nemotron_h",
    "transformers.models.falcon_h1.modeling_falcon_h1",
    "transformers.models.zamba2.modeling_zamba2",
)


def _closure(fn) -> dict:
    cells = fn.__closure__ or ()
    return {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, cells)}


def _on_cuda(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):
        if torch.is_tensor(a):
            return a.is_cuda
    return False


def _by_device(bound, reference):
    sig = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())

    @functools.wraps(reference)
    def dispatch(*args, **kwargs):
        if _on_cuda(args, kwargs):
            return bound(*args, **kwargs)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in sig}
        return reference(*args, **kwargs)

    dispatch.__stree_dispatch__ = True
    return dispatch


def use_torch_paths_on_cpu(module) -> None:
    """Rebind ``module``'s kernel-bound helpers to dispatch on device (idempotent)."""
    for name, fn in list(vars(module).items()):
        if not callable(fn) or getattr(fn, "__stree_dispatch__", False) or not hasattr(fn, "__wrapped__"):
            continue
        cl = _closure(fn) if inspect.isfunction(fn) else {}
        if cl.get("is_new_implementation") and "torch_function" in cl:
            setattr(module, name, _by_device(fn, cl["torch_function"]))


class _Hook(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds nothing itself; wraps the real loader of the family modules to rebind after exec."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _Wrapped(spec.loader)
                return spec
        return None


class _Wrapped(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        use_torch_paths_on_cpu(module)


def install() -> None:
    """Fix already-imported family modules and hook later imports (idempotent)."""
    for name in MODULES:
        if name in sys.modules:
            use_torch_paths_on_cpu(sys.modules[name])
    if not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
