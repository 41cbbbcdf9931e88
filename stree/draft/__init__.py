"""Drafters: build a token tree with a (patched) draft model, layer by layer."""
from stree.draft.base import Drafter, pick_children
from stree.draft.beam import BeamTreeDrafter
from stree.draft.chain import ChainDrafter
from stree.draft.dynatree import DynaTree2Drafter, DynaTreeDrafter
from stree.draft.dyspec import DySpecDrafter
from stree.draft.presets import STATIC_TREES, parse_drafter
from stree.draft.static import StaticTreeDrafter

__all__ = ["Drafter", "StaticTreeDrafter", "ChainDrafter", "BeamTreeDrafter", "STATIC_TREES",
           "DySpecDrafter", "DynaTreeDrafter", "DynaTree2Drafter", "parse_drafter", "pick_children"]
