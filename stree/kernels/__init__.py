"""Tree ops (Mamba2's SSM, the gated delta rule, the short conv): one op per file, each a Triton kernel, its launcher and a plain-PyTorch reference.

Every public op takes ``impl="auto" | "triton" | "ref"``: "auto" runs Triton on CUDA tensors and the
reference on CPU tensors. The math, with shapes, is in README.md beside this file.
"""
from stree.kernels.chunk_delta import chunk_delta
from stree.kernels.replay import conv_replay, delta_replay, ssm_replay, ssm_replay_ref
from stree.kernels.tree_conv import tree_conv, tree_conv_ref
from stree.kernels.tree_delta import tree_delta, tree_delta_ref
from stree.kernels.tree_scan import tree_scan, tree_scan_ref

__all__ = [
    "tree_scan", "tree_scan_ref", "tree_conv", "tree_conv_ref", "ssm_replay", "ssm_replay_ref",
    "conv_replay", "tree_delta", "tree_delta_ref", "delta_replay", "chunk_delta",
]
