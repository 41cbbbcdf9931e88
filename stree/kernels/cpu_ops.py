"""stree's C++ CPU ops (``csrc/tree_rows.cpp``, ``csrc/tree_attention.cpp``,
``csrc/tree_delta.cpp``, ``csrc/replay.cpp``), built on first use with torch's C++ extension
loader and cached per source, flags, CPU, Python environment and torch version under
``$STREE_CACHE`` (default ``~/.cache/stree``).

Serving engines run a decode step as a few fused ops per layer; stree's eager tree rows are a
dozen small PyTorch ops per layer and tree shape, each paying the interpreter and dispatcher. These
ops do a Mamba2 layer's tree conv, tree scan and their commits, gathers and copies included, and an
attention layer's tree rows over the engine's paged KV cache, one call each; and the gated delta
rule over a tree (stree's own Gated DeltaNet and KDA verify: ``tree_delta``'s CPU path), and the
commits of stree's own loop (``conv_replay``, ``ssm_replay``, ``delta_replay``). Each has
an eager reference with the same math (:func:`stree.kernels.tree_conv.tree_conv`,
:func:`stree.kernels.tree_scan.tree_scan`, :mod:`stree.kernels.replay`,
:func:`stree.vllm.attention_rows.tree_attention`'s gathered path,
:func:`stree.kernels.tree_delta.tree_delta_ref`), which is what runs where the ops cannot: no
compiler (a warning, once), ``STREE_CPU_OPS=0``, or anything but fp32 CPU tensors.
"""
from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("tree_rows.cpp", "tree_attention.cpp",
                                                                   "tree_delta.cpp", "replay.cpp")]
# -march=native: built on the machine that runs it; -ffast-math: vectorized exp and sums (the
# results are compared with the eager references at fp32 tolerances, as the Triton kernels are)
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_module = None
_failed: str | None = None


def _cpu_flags() -> bytes:
    """The CPU's instruction-set flags (``-march=native`` builds for them): part of the cache key,
    so a cache shared by different machines never hands one another's build."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _build_dir() -> Path:
    # the environment's prefix too: torch's loader writes that environment's include paths into
    # the build file, so two environments sharing a directory rebuilt it on every switch (a
    # minute each), and a build killed halfway left its lock to hang the other's next load
    key = (b"".join(source.read_bytes() for source in _SOURCES) + " ".join(_FLAGS).encode() + _cpu_flags()
           + sys.prefix.encode())
    digest = hashlib.sha256(key).hexdigest()[:12]
    root = Path(os.environ.get("STREE_CACHE", Path.home() / ".cache" / "stree"))
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-{digest}"
    return root / "cpu_ops" / tag.replace("+", "_")


def ops():
    """The compiled module, or None where it cannot be had (see the module docstring)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    if os.environ.get("STREE_CPU_OPS", "1") == "0":
        _failed = "STREE_CPU_OPS=0"
        return None
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        _module = load(name="stree_cpu_ops", sources=[str(source) for source in _SOURCES], build_directory=str(build),
                       extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, ...: the eager path still gives the same results
        _failed = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"stree: C++ CPU ops unavailable, tree rows run eagerly ({_failed})", stacklevel=2)
    return _module


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the ops take these tensors (fp32, CPU) and are available (asked about a dozen
    times per layer and step inside a serving engine: a plain loop, no generator)."""
    if ops() is None:
        return False
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True
