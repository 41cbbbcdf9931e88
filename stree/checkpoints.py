"""Local checkpoints, tokenizers and prompts, as the command-line programs, the benchmarks and the
vLLM plugin load them (never from a hub):

* a ``config.json`` naming a transformers Mamba2-family class (``architectures``): loaded with
  transformers' own ``from_pretrained`` (``stree.hf``), its tokenizer with ``AutoTokenizer``;
* a directory with ``mamba_config.json``: a MambaInLlama hybrid (``stree.hybrid``);
* otherwise mamba_ssm's ``MambaLMHeadModel`` layout: ``config.json`` + ``pytorch_model.bin``
  (or ``model.safetensors``), built and loaded the way mamba_ssm's ``from_pretrained`` does,
  without the hub.

The tokenizer is a ``tokenizer.json`` (Hugging Face ``tokenizers``), a file or the directory
holding it. Prompts get the model's BOS in front; stop ids come from the model's configs.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager

import torch

from stree.errors import describe_error
from stree.inputs import available_device
from stree.jsonfile import read_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# End-of-text tokens of the tokenizers the supported model families ship with.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>")


def encode_prompt(tokenizer, text: str, bos_token_id: int | None) -> list[int]:
    """Token ids of ``text`` with the model's BOS in front (once: a tokenizer whose template
    already adds it is left alone). The CLI, the demo and the benchmarks encode prompts here."""
    ids = tokenizer.encode(text).ids
    if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
        ids = [int(bos_token_id)] + ids
    if not ids:
        raise ValueError(f"the prompt {text!r} encodes to no tokens")
    return ids


def load_role(role: str, directory: str, device, dtype, model_type: str = "auto", prepack: bool = True):
    """:func:`load_model`, with any failure reported as ``"<role> model <dir>: <why>"``."""
    with reported_as(role, directory):
        return load_model(directory, device, dtype, model_type, prepack)


@contextmanager
def reported_as(role: str, directory: str):
    """Any failure inside the block as a :class:`ModelLoadError` ``"<role> model <dir>: <why>"``."""
    try:
        yield
    except Exception as err:
        raise ModelLoadError(f"{role} model {directory}: {describe_error(err)}") from err


class ModelLoadError(ValueError):
    """A model directory could not be turned into a patched model."""


def load_model(directory: str, device, dtype, model_type: str = "auto", prepack: bool = True):
    """A patched model from a local checkpoint directory (see the module docstring); on the CPU in
    fp32 its linear layers get prepacked weights (``stree.prepack_linears``) unless ``prepack`` is
    False: the model's own decoding and stree's run the same kernels."""
    model = _load_patched(directory, available_device(device), dtype, model_type)
    if prepack:
        from stree.layers.linear import prepack_linears

        prepack_linears(model)
    return model


def check_model_dir(directory: str) -> None:
    """FileNotFoundError unless ``directory`` exists and holds a ``config.json`` (naming the model
    directories inside it, if it holds some: the pair's folder instead of one of its models)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    if not os.path.exists(os.path.join(directory, "config.json")):
        subdirs = sorted(d for d in os.listdir(directory)
                         if os.path.exists(os.path.join(directory, d, "config.json")))
        hint = f" (it holds model directories {', '.join(subdirs)}: pass one of them)" if subdirs else ""
        raise FileNotFoundError(f"no config.json in {directory}: not a model checkpoint directory{hint}")


def _load_patched(directory: str, device, dtype, model_type: str):
    from stree import hf
    from stree.patch import patch

    check_model_dir(directory)
    if model_type == "transformers" or (model_type == "auto" and hf.is_checkpoint(directory)):
        return patch(hf.load(directory, dtype=dtype, device=device))
    hybrid = os.path.exists(os.path.join(directory, "mamba_config.json"))
    if model_type == "hybrid" and not hybrid:
        raise ValueError(f"{directory} has no mamba_config.json: not a MambaInLlama hybrid checkpoint")
    if model_type == "hybrid" or (model_type == "auto" and hybrid):
        from stree.hybrid import MambaInLlamaForCausalLM

        model = MambaInLlamaForCausalLM.from_pretrained(directory, dtype=dtype, device=device)
    else:
        model = _load_mamba_lm(directory, device, dtype)
    return patch(model.eval())


def _load_mamba_lm(directory: str, device, dtype):
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    from stree.hybrid.checkpoint import check_state_dict, read_weights

    raw = model_config(directory)
    missing = [k for k in ("d_model", "n_layer") if k not in raw]
    if missing:  # MambaConfig's defaults would build (and allocate) a 2.8B-parameter model
        llama = raw.get("model_type") == "llama" or "LlamaForCausalLM" in (raw.get("architectures") or [])
        why = (" (a Llama-style config.json: a MambaInLlama hybrid keeps its Mamba layers' settings in a "
               "mamba_config.json beside it, which is missing)" if llama else "")
        raise ValueError(f"{directory}/config.json is not a mamba-ssm config: it lacks "
                         f"{', '.join(missing)}{why}")
    known = {f.name for f in dataclasses.fields(MambaConfig)}
    model = MambaLMHeadModel(MambaConfig(**{k: v for k, v in raw.items() if k in known}),
                             device=device, dtype=dtype)
    bin_path = os.path.join(directory, "pytorch_model.bin")
    st_path = os.path.join(directory, "model.safetensors")
    if os.path.exists(bin_path):
        state = read_weights(bin_path)
    elif os.path.exists(st_path):
        state = read_weights(st_path)
    else:
        raise FileNotFoundError(f"{directory}: neither pytorch_model.bin nor model.safetensors found")
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    check_state_dict({k: v.shape for k, v in model.state_dict().items()}, state, optional=tied)
    model.load_state_dict(state, strict=not tied)
    return model


def model_config(directory: str) -> dict:
    """The parsed ``config.json`` of a model directory ({} if there is none)."""
    return read_json(os.path.join(directory, "config.json"))



def load_tokenizer(path: str):
    """``tokenizers.Tokenizer`` from a tokenizer.json file or a directory holding one (a transformers
    checkpoint directory: through ``AutoTokenizer``)."""
    from tokenizers import Tokenizer

    from stree import hf

    if os.path.isdir(path) and hf.is_checkpoint(path):
        return hf.load_tokenizer(path)

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no tokenizer.json at {path}; pass --tokenizer FILE_OR_DIR")
    try:
        return Tokenizer.from_file(file)
    except Exception as err:
        raise ValueError(f"{file} is not a readable tokenizer.json ({type(err).__name__}: "
                         f"{' '.join(str(err).split())})") from err


def default_eos(model_dir: str, tokenizer) -> list[int]:
    """Stop ids: every ``eos_token_id`` of ``config.json`` and ``generation_config.json`` (an id or
    a list; chat models end a turn with an id their config lists second, e.g. Llama-3.1's
    ``<|eot_id|>``), else the tokenizer's end-of-text tokens; [] if none is known."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        eos = read_json(os.path.join(model_dir, name)).get("eos_token_id")
        for t in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(t) not in ids:
                ids.append(int(t))
    if ids:
        return ids
    return [tokenizer.token_to_id(t) for t in EOS_TOKENS if tokenizer.token_to_id(t) is not None]
