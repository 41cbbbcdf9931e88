"""Drafters: build a token tree with a (patched) draft model, layer by layer, or read one from the
context's suffix tries (no draft model), or both merged."""
from stree.draft.base import Drafter, pick_children
from stree.draft.beam import BeamTreeDrafter
from stree.draft.chain import ChainDrafter
from stree.draft.dynatree import DynaTree2Drafter, DynaTreeDrafter
from stree.draft.dyspec import DySpecDrafter
from stree.draft.merged import MergedDrafter
from stree.draft.parse import parse_drafter
from stree.draft.presets import STATIC_TREES
from stree.draft.static import StaticTreeDrafter
from stree.draft.suffix import ContextIndex, SuffixDrafter
from stree.draft.suffix_index import SpeculationConfig, SuffixCache

__all__ = ["Drafter", "StaticTreeDrafter", "ChainDrafter", "BeamTreeDrafter", "STATIC_TREES",
           "DySpecDrafter", "DynaTreeDrafter", "DynaTree2Drafter", "SuffixDrafter", "MergedDrafter",
           "ContextIndex", "SuffixCache", "SpeculationConfig", "parse_drafter", "pick_children"]
