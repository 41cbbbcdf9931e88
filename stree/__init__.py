"""stree: speculative tree decoding for Mamba2 and hybrid Mamba2 + attention models."""
from stree.patch import patch
from stree.tree import TokenTree, parents_from_widths
from stree.cache import TreeCache

__all__ = ["patch", "TokenTree", "TreeCache", "parents_from_widths"]
__version__ = "0.1.0"
