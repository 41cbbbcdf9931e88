"""Verifiers by name (``get_verifier``) and the lossless default for a sampling setting and draft
mode (``default_verifier``): above every verifier module, which none of them imports."""
from __future__ import annotations

from stree.draft_types import DRAFT_MODES
from stree.sampling import SamplingConfig
from stree.verify.asps import ASpSVerifier
from stree.verify.base import Verifier
from stree.verify.block import BlockVerifier
from stree.verify.chain_aware import ChainAwareVerifier
from stree.verify.greedy import GreedyVerifier
from stree.verify.mss import MSSVerifier
from stree.verify.naive import NaiveVerifier
from stree.verify.sps import SpSVerifier
from stree.verify.traversal import TraversalVerifier

VERIFIERS = {cls.name: cls for cls in (GreedyVerifier, MSSVerifier, NaiveVerifier, SpSVerifier,
                                       ASpSVerifier, ChainAwareVerifier, BlockVerifier,
                                       TraversalVerifier)}


def get_verifier(name_or_obj) -> Verifier:
    """A verifier by name ("greedy", "mss", "naive", "sps", "asps", "mss+asps", "block",
    "traversal"); an object with verify/check as is."""
    if isinstance(name_or_obj, str):
        if name_or_obj not in VERIFIERS:
            raise ValueError(
                f"unknown verifier {name_or_obj!r}; expected one of {sorted(VERIFIERS)}")
        return VERIFIERS[name_or_obj]()
    if all(callable(getattr(name_or_obj, m, None)) for m in ("verify", "check")):
        return name_or_obj
    raise TypeError(f"expected a verifier name or an object with verify() and check(), "
                    f"got {type(name_or_obj).__name__}")


def default_verifier(sampling: SamplingConfig, draft_mode: str) -> Verifier:
    """The lossless verifier with the best acceptance for this (sampling, draft mode) pair."""
    if draft_mode not in DRAFT_MODES:
        raise ValueError(f"unknown draft mode {draft_mode!r}; expected one of {DRAFT_MODES}")
    if sampling.is_greedy:
        name = "greedy"
    elif draft_mode == "deterministic":
        name = "naive"   # the only lossless sampling rule for chosen (not sampled) children
    elif draft_mode == "chain":
        name = "sps"
    else:
        name = "mss"
    return get_verifier(name)
