"""Import mamba_ssm on machines where it was built without its CUDA extensions.

mamba_ssm's package ``__init__`` imports the Mamba-1 CUDA extension ``selective_scan_cuda``
unguarded, so a pure-Python (CPU or ``MAMBA_SKIP_CUDA_BUILD``) install cannot even be imported.
Mamba2 does not need that extension. We register a placeholder module that raises a clear error
if Mamba-1's kernel is ever called, and touch nothing else (no torch monkeypatching).
"""
from __future__ import annotations

import importlib
import sys
import types


class _MissingExtension(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(
            "mamba_ssm was installed without its CUDA extension 'selective_scan_cuda'; Mamba-1 "
            "layers cannot run here (Mamba2 and attention layers can)."
        )


def import_mamba_ssm():
    """Return the ``mamba_ssm`` module, importable without its CUDA extensions."""
    if "mamba_ssm" in sys.modules:
        return sys.modules["mamba_ssm"]
    try:
        return importlib.import_module("mamba_ssm")
    except ImportError as err:
        if "selective_scan_cuda" not in str(err):
            raise
    sys.modules.setdefault("selective_scan_cuda", _MissingExtension("selective_scan_cuda"))
    for name in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
        del sys.modules[name]
    return importlib.import_module("mamba_ssm")


mamba_ssm = import_mamba_ssm()
