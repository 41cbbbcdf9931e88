"""Checks of user input at the API boundary (``stree.generate``, ``prefill``): token ids must be
integers, and ids that stand for tokens (stop ids, the pad id) must lie in the vocabulary. A
float tensor of ids would otherwise be truncated silently by ``.long()``, and a stop id outside
the vocabulary could never stop anything. A device named for loading must exist here: otherwise
the first failure would come from deep inside a checkpoint reader, worded as a broken file."""
from __future__ import annotations

import operator

import torch


def available_device(device) -> torch.device:
    """``device`` (a string or torch.device) as a ``torch.device`` that can hold tensors here;
    ValueError naming it when it is malformed, unavailable (``cuda`` without a GPU, an ordinal past
    the GPUs present) or ``meta`` (which holds no data)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"unknown device {device!r}: {' '.join(str(err).split())}") from None
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no data: load the models onto a real device")
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"device {str(dev)!r} is not available here ({first})") from None
    return dev


def token_ids(ids, device=None, name: str = "input_ids") -> torch.Tensor:
    """``ids`` (an integer tensor, array or nested list of ints) as an int64 tensor on ``device``.

    Raises:
        TypeError: floating-point, complex or bool values, or anything that is not a sequence of
            integers (strings, None, mixed lists).
    """
    if torch.is_tensor(ids):
        t = ids
    else:
        try:
            t = torch.as_tensor(ids)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} must be an integer tensor or a list of ints, got "
                            f"{type(ids).__name__}: {ids!r:.60}") from None
    if not torch.is_tensor(ids) and t.numel() == 0:
        t = t.long()  # an empty list becomes float32: it holds no non-integer value
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got a {t.dtype} "
                        f"{'tensor' if torch.is_tensor(ids) else type(ids).__name__}; convert with "
                        ".long() if the values are whole numbers")
    return t.to(device=device, dtype=torch.long) if device is not None else t.long()


def stop_ids(eos_token_id, vocab_size: int | None) -> set[int]:
    """The stop ids of ``eos_token_id`` (None, an int or an iterable of ints) as a set.

    Raises:
        TypeError: a value that is not an integer (a float, a bool, a string).
        ValueError: an id outside ``[0, vocab_size)``.
    """
    if eos_token_id is None:
        return set()
    if torch.is_tensor(eos_token_id):
        eos_token_id = eos_token_id.tolist()
    values = [eos_token_id] if _is_int(eos_token_id) or not _iterable(eos_token_id) else list(eos_token_id)
    return {token_id(v, vocab_size, "eos_token_id") for v in values}


def token_id(value, vocab_size: int | None, name: str) -> int:
    """One token id, checked: an integer (not a bool or float) in ``[0, vocab_size)``."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer token id, got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{name} {value} is outside the vocabulary: token ids must lie in {bound}")
    return value


def _is_int(value) -> bool:
    if isinstance(value, bool) or (torch.is_tensor(value) and value.dtype == torch.bool):
        return False
    try:
        operator.index(value)  # int, numpy integers, 0-d integer tensors
    except TypeError:
        return False
    return True


def _iterable(value) -> bool:
    return not isinstance(value, (str, bytes)) and hasattr(value, "__iter__")


def vocab_size(model) -> int | None:
    """Width of the model's logits: its LM head's rows, else a ``vocab_size`` attribute."""
    head = getattr(model, "lm_head", None)
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    v = getattr(model, "vocab_size", None)
    return None if v is None else int(v)
