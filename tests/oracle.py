"""The independent oracle: the unmodified model decoded one token at a time.

Mamba2 layers run mamba_ssm's own ``Mamba2.step`` on mamba_ssm's own cache layout; attention layers
run a plain causal attention written here (mamba_ssm's MHA decode needs flash-attn, and its SDPA
fallback aligns ``is_causal`` top-left when query and key lengths differ). Nothing here calls stree.
"""
from __future__ import annotations

import copy
import math

import torch

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.modules.mamba2 import Mamba2
from mamba_ssm.modules.mha import MHA


class SequentialDecoder:
    """Token-by-token decoding of a mamba_ssm ``MambaLMHeadModel`` for one sequence."""

    def __init__(self, model):
        self.model = model
        self.states = {}
        for i, blk in enumerate(model.backbone.layers):
            if isinstance(blk.mixer, Mamba2):
                self.states[i] = blk.mixer.allocate_inference_cache(1, 1)  # (conv_state, ssm_state)
            elif isinstance(blk.mixer, MHA):
                self.states[i] = ([], [])
            else:
                raise TypeError(type(blk.mixer))

    def fork(self) -> "SequentialDecoder":
        other = copy.copy(self)
        other.states = {i: tuple(s.clone() if torch.is_tensor(s) else list(s) for s in st)
                        for i, st in self.states.items()}
        return other

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token; return the next-token logits ``(vocab,)``."""
        bb = self.model.backbone
        dev = bb.embedding.weight.device
        h = bb.embedding(torch.tensor([[token]], device=dev))
        residual = None
        for i, blk in enumerate(bb.layers):
            h, residual = blk.norm(h, residual=residual, prenorm=True,
                                   residual_in_fp32=blk.residual_in_fp32)
            if isinstance(blk.mixer, Mamba2):
                conv, ssm = self.states[i]
                h, _, _ = blk.mixer.step(h, conv, ssm)
            else:
                h = self._attention(blk.mixer, h, *self.states[i])
            if blk.mlp is not None:
                h, residual = blk.norm2(h, residual=residual, prenorm=True,
                                        residual_in_fp32=blk.residual_in_fp32)
                h = blk.mlp(h)
        h = bb.norm_f(h, residual=residual, prenorm=False, residual_in_fp32=bb.residual_in_fp32)
        return self.model.lm_head(h)[0, -1].float()

    @staticmethod
    def _attention(m, h, ks, vs):
        qkv = m.in_proj(h)[0, 0]
        hq, hkv, d = m.num_heads, m.num_heads_kv, m.head_dim
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d])
        if m.rotary_emb_dim > 0:  # the MHA's own rotary module (flash-attn's, or tests/flash_rotary)
            kv = torch.stack([k.view(hkv, d), v.view(hkv, d)])[None, None]
            q, kv = m.rotary_emb(q.view(1, 1, hq, d), kv, seqlen_offset=len(ks))
            k = kv[0, 0, 0]
        ks.append(k.view(hkv, d))
        vs.append(v.view(hkv, d))
        K = torch.stack(ks, 1).repeat_interleave(hq // hkv, 0)  # (hq, t, d)
        V = torch.stack(vs, 1).repeat_interleave(hq // hkv, 0)
        scale = m.softmax_scale or 1.0 / math.sqrt(d)
        att = torch.softmax((K @ q.view(hq, d, 1)).squeeze(-1) * scale, dim=-1)  # (hq, t)
        out = (att.unsqueeze(-1) * V).sum(1).reshape(1, 1, hq * d)
        return m.out_proj(out)

    def feed(self, tokens) -> torch.Tensor:
        """Feed tokens in order; return the logits after each ``(len, vocab)``."""
        return torch.stack([self.step(int(t)) for t in tokens])


def node_logits(decoder: SequentialDecoder, tree, row: int = 0) -> torch.Tensor:
    """Oracle logits for every node of ``tree`` row ``row``: the root-to-node path fed token by
    token from a fork of ``decoder`` (which holds the committed state). ``(n, vocab)``."""
    out = []
    for i in range(tree.num_nodes):
        path = [int(j) for j in tree.paths[row, i] if j >= 0]
        dec = decoder.fork()
        out.append(dec.feed([int(tree.tokens[row, j]) for j in path])[-1])
    return torch.stack(out)
