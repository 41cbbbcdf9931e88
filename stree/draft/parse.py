"""``parse_drafter``: a drafter from the spec string of the API and CLI, ``"auto"`` included.

The spec strings are :mod:`stree.draft.presets`'s; ``"auto"`` (:mod:`stree.draft.auto`) picks among
candidates that module parses, so the string that names it is read here, above both.
"""
from __future__ import annotations

from stree.draft.auto import AutoDrafter, default_candidates
from stree.draft.base import Drafter
from stree.draft.presets import parse_tree
from stree.draft.suffix import ContextIndex
from stree.draft.suffix_index import SuffixCache


def parse_drafter(spec: str | Drafter, device=None, *, suffix_cache: SuffixCache | None = None,
                  draft_model: bool = True, index: ContextIndex | None = None) -> Drafter:
    """A drafter from a spec string (:mod:`stree.draft.presets`, or ``"auto"``); a Drafter is
    returned as is. ``device``: where it will run (``"auto"``'s candidates depend on it);
    ``suffix_cache``: the earlier outputs its suffix trees also read; ``draft_model``: whether a
    draft model is given (without one ``"auto"`` picks among suffix trees); ``index``: the
    per-request suffix index to share (one is made per call otherwise)."""
    if isinstance(spec, Drafter):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"drafter must be a spec string or a Drafter, got {type(spec).__name__}")
    if spec.strip() == "auto":
        return AutoDrafter(default_candidates(device, draft_model),
                           index=index or ContextIndex(suffix_cache))
    return parse_tree(spec, suffix_cache=suffix_cache, index=index)
