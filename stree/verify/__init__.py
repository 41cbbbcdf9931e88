"""Verifiers for speculative tree decoding: greedy, mss (SpecInfer / DySpec), naive, sps, asps,
mss+asps (per draft: asps for sampled chains, mss otherwise), block (block verification of a
sampled chain), traversal (Traversal Verification of a sampled tree)."""
from stree.verify.asps import ASpSVerifier
from stree.verify.chain_aware import ChainAwareVerifier
from stree.verify.base import Verdict, Verifier
from stree.verify.block import BlockVerifier
from stree.verify.greedy import GreedyVerifier
from stree.verify.mss import MSSVerifier
from stree.verify.naive import NaiveVerifier
from stree.verify.registry import default_verifier, get_verifier
from stree.verify.sps import SpSVerifier
from stree.verify.traversal import TraversalVerifier

__all__ = [
    "Verdict", "Verifier", "default_verifier", "get_verifier", "GreedyVerifier", "MSSVerifier",
    "NaiveVerifier", "SpSVerifier", "ASpSVerifier", "ChainAwareVerifier", "BlockVerifier",
    "TraversalVerifier",
]
