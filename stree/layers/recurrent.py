"""The recurrent layer kinds: a short conv and a state per sequence, advanced by replay at commit.

Each kind is a module with the same functions (``constants``, ``conv_width``, ``allocate``,
``prefill``, ``tree_forward``, ``node_step``): :mod:`stree.layers.mamba2` (Mamba2) and
:mod:`stree.layers.gated_delta` (Gated DeltaNet, KDA). Every other sequence mixer is attention.
"""
from __future__ import annotations

from stree.layers import gated_delta, mamba2


def kind(mixer):
    """The layer module that runs ``mixer``, or None for an attention layer."""
    if mamba2.is_mamba2(mixer):
        return mamba2
    if gated_delta.is_gated_delta(mixer):
        return gated_delta
    return None
