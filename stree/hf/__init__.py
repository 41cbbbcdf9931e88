"""Hugging Face transformers' hybrid families for ``stree.patch`` (Mamba2 and gated delta rule
layers beside attention): one small module per family.

``family(model)`` gives the :class:`~stree.hf.common.Family` adapter of a supported transformers
model (built once, kept on the model), or ``None`` (``stree.patch`` then refuses the model by name).
``load(directory)`` loads a ``save_pretrained`` directory through transformers' own
``from_pretrained`` (local files only).
"""
from __future__ import annotations

import importlib
import os

from stree.hf import kernels
from stree.inputs import available_device
from stree.jsonfile import read_json

kernels.install()

# class name -> (module, adapter class)
SUPPORTED = {
    "Mamba2ForCausalLM": ("stree.hf.mamba2", "Mamba2Family"),
    "BambaForCausalLM": ("stree.hf.bamba", "BambaFamily"),
    "GraniteMoeHybridForCausalLM": ("stree.hf.granitemoehybrid", "GraniteMoeHybridFamily"),
    "NemotronHForCausalLM": ("stree.hf.nemotron_h", "NemotronHFamily"),
    "FalconH1ForCausalLM": ("stree.hf.falcon_h1", "FalconH1Family"),
    "Zamba2ForCausalLM": ("stree.hf.zamba2", "Zamba2Family"),
    "Qwen3_5ForCausalLM": ("stree.hf.qwen3_5", "Qwen3_5Family"),
    "Qwen3_5MoeForCausalLM": ("stree.hf.qwen3_5", "Qwen3_5Family"),
    "Qwen3NextForCausalLM": ("stree.hf.qwen3_next", "Qwen3NextFamily"),
    "OlmoHybridForCausalLM": ("stree.hf.olmo_hybrid", "OlmoHybridFamily"),
    "KimiLinearForCausalLM": ("stree.hf.kimi_linear", "KimiLinearFamily"),
}
_ATTR = "_stree_family"


def _transformers_class(model):
    """The first transformers class in the model's MRO (``stree.patch`` subclasses it), or None."""
    return next((c for c in type(model).__mro__ if c.__module__.startswith("transformers.")), None)


def family(model):
    """The family adapter of ``model``, or ``None`` if it is no transformers model of a supported family."""
    cached = model.__dict__.get(_ATTR)
    if cached is not None:
        return cached
    cls = _transformers_class(model)
    if cls is None or cls.__name__ not in SUPPORTED:
        return None
    kernels.use_torch_paths_on_cpu(importlib.import_module(cls.__module__))
    mod, adapter = SUPPORTED[cls.__name__]
    fam = getattr(importlib.import_module(mod), adapter)(model)
    model.__dict__[_ATTR] = fam
    return fam


def is_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a transformers checkpoint of a supported class."""
    cfg = _read_config(directory)
    return cfg is not None and any(a in SUPPORTED for a in cfg.get("architectures") or ())


def load(directory: str, dtype=None, device="cpu"):
    """A transformers model from a local ``save_pretrained`` directory (never downloads), in eval
    mode and not patched. Raises ``ValueError`` for a directory of another kind."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    device = available_device(device)  # as every loader: an absent device is named, not a broken file
    cfg = _read_config(directory)
    archs = (cfg or {}).get("architectures") or []
    if not any(a in SUPPORTED for a in archs):
        raise ValueError(f"{directory}: config.json names no supported transformers class "
                         f"(architectures={archs}); supported: {', '.join(SUPPORTED)}")
    import transformers

    from safetensors import SafetensorError

    from stree.hybrid.checkpoint import CheckpointError

    cls = getattr(transformers, next(a for a in archs if a in SUPPORTED))
    try:
        model = cls.from_pretrained(directory, local_files_only=True, dtype=dtype)
    except SafetensorError as err:
        raise CheckpointError(f"cannot read the weights in {directory}: a safetensors file is truncated or "
                              f"corrupt ({' '.join(str(err).split())})") from err
    return model.to(device).eval()


def load_tokenizer(directory: str):
    """The checkpoint's tokenizer via ``AutoTokenizer`` (local files only), as a ``tokenizers``
    ``Tokenizer`` (the interface the CLI uses)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True).backend_tokenizer


def _read_config(directory: str) -> dict | None:
    return read_json(os.path.join(directory, "config.json")) or None

