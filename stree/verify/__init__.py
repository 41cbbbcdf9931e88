"""Verifiers for speculative tree decoding: greedy, mss (SpecInfer / DySpec), naive, sps."""
from stree.verify.base import (
    DRAFT_MODES,
    Draft,
    Verdict,
    Verifier,
    default_verifier,
    get_verifier,
)
from stree.verify.greedy import GreedyVerifier
from stree.verify.mss import MSSVerifier
from stree.verify.naive import NaiveVerifier
from stree.verify.sampling import SamplingConfig, sample_from, target_probs
from stree.verify.sps import SpSVerifier

__all__ = [
    "DRAFT_MODES", "Draft", "Verdict", "Verifier", "SamplingConfig", "default_verifier",
    "get_verifier", "target_probs", "sample_from", "GreedyVerifier", "MSSVerifier",
    "NaiveVerifier", "SpSVerifier",
]
