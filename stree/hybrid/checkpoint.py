"""Weight files of a MambaInLlama checkpoint directory (local only; nothing is ever downloaded).

Read, in this order of preference: ``model.safetensors``; sharded ``model-0000i-of-0000n.safetensors``
listed by ``model.safetensors.index.json``; ``pytorch_model.bin``. Written: ``model.safetensors``, or
shards plus index when ``max_shard_bytes`` is given.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from stree.inputs import available_device

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
BIN_NAME = "pytorch_model.bin"


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match the model (missing/unexpected key, wrong shape)."""


def load_state_dict(directory: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read every tensor of the checkpoint in ``directory`` onto ``device``."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    device = str(available_device(device))
    single = os.path.join(directory, SAFETENSORS_NAME)
    if os.path.isfile(single):
        return read_weights(single, device)
    index_path = os.path.join(directory, SAFETENSORS_INDEX_NAME)
    if os.path.isfile(index_path):
        return _load_sharded(directory, index_path, device)
    bin_path = os.path.join(directory, BIN_NAME)
    if os.path.isfile(bin_path):
        return read_weights(bin_path, device)
    raise FileNotFoundError(f"no weights in {directory}: expected {SAFETENSORS_NAME}, "
                            f"{SAFETENSORS_INDEX_NAME} (+ shards) or {BIN_NAME}")


def read_weights(path: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one ``.safetensors`` or ``torch.save`` file; CheckpointError naming the file
    when it cannot be read (truncated or corrupt)."""
    try:
        if path.endswith(".safetensors"):
            return load_file(path, device=str(device))
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as err:  # safetensors, pickle and zip errors have no common base class
        raise CheckpointError(f"cannot read {path}: the file is truncated or corrupt "
                              f"({type(err).__name__}: {' '.join(str(err).split())})") from err


def refuse_mamba1(state_dict: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError if the weights hold Mamba-1 layers (``x_proj`` / ``dt_proj``, or an
    ``A_log`` of shape (d_inner, d_state)), which stree does not support."""
    for key, value in state_dict.items():
        name = key.rsplit(".", 2)
        if (len(name) == 3 and name[1] in ("x_proj", "dt_proj")) or (key.endswith("A_log") and value.dim() == 2):
            raise CheckpointError(f"{key!r} of shape {tuple(value.shape)} is a Mamba-1 layer weight: "
                                  "Mamba-1 layers are not supported (stree runs MambaInLlama's "
                                  "Mamba2 layers)")


def _load_sharded(directory, index_path, device) -> dict[str, torch.Tensor]:
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    state_dict = {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(directory, shard)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard {shard} listed in {SAFETENSORS_INDEX_NAME} not found in {directory}")
        state_dict.update(read_weights(path, device))
    absent = [key for key in weight_map if key not in state_dict]
    if absent:
        raise CheckpointError(f"{SAFETENSORS_INDEX_NAME} lists {absent[0]!r} in {weight_map[absent[0]]}, "
                              f"but that shard does not contain it ({len(absent)} such keys)")
    return state_dict


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous on the CPU in a storage of its own: safetensors refuses tensors that share
    one (the attention's q/k/v weights are row views of its fused ``qkv_proj``)."""
    t = t.detach().contiguous().cpu()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_state_dict(state_dict: dict[str, torch.Tensor], directory: str | os.PathLike,
                    max_shard_bytes: int | None = None) -> None:
    """Write ``state_dict`` as safetensors (sharded with an index when it exceeds ``max_shard_bytes``)."""
    os.makedirs(directory, exist_ok=True)
    tensors = {k: _own_storage(v) for k, v in state_dict.items()}
    metadata = {"format": "pt"}
    shards, current, size = [], {}, 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, SAFETENSORS_NAME), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, name), metadata=metadata)
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, SAFETENSORS_INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def check_state_dict(expected: dict[str, torch.Size], state_dict: dict[str, torch.Tensor],
                     optional: set[str] = frozenset()) -> None:
    """Raise :class:`CheckpointError` naming the first missing key, unexpected key or shape mismatch.

    expected: parameter name -> shape the model needs; names in ``optional`` may be absent.
    """
    missing = [k for k in expected if k not in state_dict and k not in optional]
    if missing:
        raise CheckpointError(f"missing key {missing[0]!r} in checkpoint ({len(missing)} missing: "
                              f"{_preview(missing)})")
    unexpected = [k for k in state_dict if k not in expected]
    if unexpected:
        raise CheckpointError(f"unexpected key {unexpected[0]!r} in checkpoint ({len(unexpected)} unexpected: "
                              f"{_preview(unexpected)})")
    for key, shape in expected.items():
        if key in state_dict and tuple(state_dict[key].shape) != tuple(shape):
            raise CheckpointError(f"shape mismatch for {key!r}: checkpoint has {tuple(state_dict[key].shape)}, "
                                  f"model expects {tuple(shape)}")


def _preview(keys: list[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (", ..." if len(keys) > n else "")
