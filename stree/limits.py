"""How long one ``generate`` call may run: the model's context limit against the request.

A request is ``prompt + max_new_tokens`` tokens plus one tree of scratch (the drafter's
``num_nodes``, which attention layers write after the committed tokens). Memory is no limit: the
caches grow with the real length (``stree.cache.StatePool.reserve``), so ``max_new_tokens=10**9``
means "until EOS". What bounds a run is:

* the model's context limit (:func:`context_limit`: ``max_position_embeddings`` of a model with
  attention layers). A longer request is **capped**: ``max_new_tokens`` shrinks to what fits and
  a :class:`ContextLimitWarning` names the numbers, the way a large ``max_new_tokens`` is a
  request to stop at EOS. A prompt that leaves no room is refused (``ValueError``).
* an explicit ``max_seqlen`` of the caller: a request past it is **refused** (``ValueError``
  naming the numbers; the caller chose both values, so one of them is a mistake).

Both checks run before anything is allocated. Models without a context limit (pure Mamba2: their
state has a fixed size) run while memory lasts. See ``docs/limits.md``.
"""
from __future__ import annotations

import warnings


class ContextLimitWarning(UserWarning):
    """``max_new_tokens`` was capped at the model's context limit."""


def context_limit(model) -> int | None:
    """The most positions ``model`` supports: its config's ``max_position_embeddings`` when it has
    attention layers (positions past it were never trained, and rotary tables may end there);
    None for attention-free models (pure Mamba2) and models whose config names no limit."""
    if model is None or not _has_attention(model):
        return None
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def cap_new_tokens(prompt_len: int, max_new_tokens: int, scratch: int,
                   limits: dict[str, int | None]) -> int:
    """``max_new_tokens``, capped so that ``prompt_len + max_new_tokens + scratch`` fits every
    model's context limit (``limits``: role -> limit or None); a :class:`ContextLimitWarning`
    when it is capped.

    Raises:
        ValueError: the prompt and one tree of scratch alone exceed a limit.
    """
    known = {role: n for role, n in limits.items() if n is not None}
    if not known:
        return max_new_tokens
    role, limit = min(known.items(), key=lambda kv: kv[1])
    need = prompt_len + max_new_tokens + scratch
    if need <= limit:
        return max_new_tokens
    room = limit - prompt_len - scratch
    if room < 1:
        raise ValueError(f"prompt length {prompt_len} + tree size {scratch} leaves no room for new "
                         f"tokens within the {role}'s context limit of {limit} positions "
                         "(max_position_embeddings); shorten the prompt or draft a smaller tree")
    warnings.warn(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} + tree size "
                  f"{scratch} = {need} exceeds the {role}'s context limit of {limit} positions "
                  f"(max_position_embeddings): generating at most {room} new tokens",
                  ContextLimitWarning, stacklevel=3)
    return room


def _has_attention(model) -> bool:
    from stree.layers import recurrent
    from stree.walk import mixers

    try:
        layers = mixers(model)
    except TypeError:  # a model stree cannot walk (method "ar" on its own code): trust its config
        return True
    return any(recurrent.kind(m) is None for _, m in layers)
