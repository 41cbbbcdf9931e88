"""What a tree forward and a draft level of a patched model run once their tables are built: the
model's layers on tensors only (static shapes for a fixed template and span, no host reads).
:mod:`stree.patch` builds the tables and runs these steps eagerly; :mod:`stree.capture` compiles
the same functions with ``torch.compile(fullgraph=True)``; both import them from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from stree.cache import NextState
from stree.layers import attention
from stree.walk import mixers, walk


def tree_step(model, tokens, layers: dict, tables: dict, impl: str):
    """Logits ``(b, n, vocab)`` of the tree ``tokens (b, n)`` and ``{layer: activations}``."""
    acts = {}
    attn = attention_tables(model, tables, layers)

    def run(idx, mixer, h):
        if idx in tables["kinds"]:
            out, acts[idx] = tables["kinds"][idx].tree_forward(mixer, h, layers[idx], tables["recurrent"][idx],
                                                               impl=impl, k=tables["consts"][idx])
        else:
            out, acts[idx] = attention.tree_forward(attention.view(mixer), h, layers[idx], attn)
        return out

    return walk(model, tokens, run), acts


def root_step(model, tokens, layers: dict, tables: dict):
    """Logits ``(b, 1, vocab)`` of a root-only tree ``tokens (b, 1)`` (a step that drafted
    nothing) and ``{layer: activations}``: per recurrent layer the :class:`NextState` after the
    root, computed by the recurrence from its committed state ``layers[idx]``, which stays as it
    is (the commit copies the new one in); attention K/V go to the scratch slot, which is the
    root's committed position."""
    acts = {}
    attn = attention_tables(model, tables, layers)

    def run(idx, mixer, h):
        if idx not in tables["kinds"]:
            out, acts[idx] = attention.tree_forward(attention.view(mixer), h, layers[idx], attn)
            return out
        state = layers[idx]
        out, conv, ssm = tables["kinds"][idx].node_step(mixer, h, state.conv_state, state.ssm_state,
                                                        tables["consts"][idx])
        acts[idx] = NextState(conv, ssm)
        return out

    return walk(model, tokens, run), acts


def level_step(model, tokens, layers: dict, states: dict, src, dst, tables: dict, lead=None):
    """Logits ``(b, w, vocab)`` of ``w`` level nodes per row (tokens ``(b, w)``), each run from
    the :class:`NodeStates` slot ``src (b * w,)`` of ``states`` (its parent's), its own state
    written to slot ``dst (b * w,)`` (flat indices); attention K/V go to the scratch.

    ``lead (b, c)`` int64 or None (a level of one node per row, attention-free models only):
    tokens run from ``src`` before the row's node, in the same pass, as a chain (-1: left
    padding, which leaves the state as it was)."""
    valid = None
    if lead is not None:
        tokens = torch.cat([lead.clamp(min=0), tokens], 1)
        valid = torch.cat([lead >= 0, torch.ones_like(lead[:, :1], dtype=torch.bool)], 1)
    b, w = tokens.shape
    attn = attention_tables(model, tables, layers)

    def run(idx, mixer, h):
        if idx not in tables["kinds"]:
            return attention.tree_forward(attention.view(mixer), h, layers[idx], attn)[0]
        ns = states[idx]
        out, conv, ssm = tables["kinds"][idx].node_step(mixer, h if lead is not None else h.reshape(b * w, 1, -1),
                                                        ns.conv.index_select(0, src),
                                                        ns.ssm.index_select(0, src), tables["consts"][idx], valid)
        ns.conv.index_copy_(0, dst, conv)
        ns.ssm.index_copy_(0, dst, ssm)
        return out.view(b, w, -1)

    logits = walk(model, tokens, run)
    return logits if lead is None else logits[:, -1:]


def levels_step(model, tokens, layers: dict, states: dict, inputs: list, spans: tuple, pick, lead=None,
                extra=None):
    """A tree drafted level by level: level ``d`` runs the nodes ``spans[d] = (start, end)`` of
    ``tokens (b, n)`` as :func:`level_step` does (``inputs[d] = (src, dst, tables)``), then
    ``pick(d, logits, tokens, extra)`` writes their children into the tokens the next level reads
    (``extra``: None, or tensors the choice reads or writes). ``lead (b, c)`` int64 (-1: left
    padding) or None: tokens run before the roots, in the roots' pass (:func:`level_step`).
    Returns the drafted tokens (a copy of ``tokens``, filled in)."""
    tokens = tokens.clone()
    for d, ((start, end), (src, dst, tables)) in enumerate(zip(spans, inputs)):
        logits = level_step(model, tokens[:, start:end], layers, states, src, dst, tables, lead if d == 0 else None)
        pick(d, logits, tokens, extra)
    return tokens


@dataclass(frozen=True)
class Steps:
    """The step functions a patched model runs: eager by default; ``stree.capture`` installs
    compiled ones, which need ``static`` shapes (attention over the cache's whole ``capacity``)."""
    tree: Callable = tree_step
    root: Callable = root_step
    level: Callable = level_step
    levels: Callable = levels_step
    static: bool = False


EAGER = Steps()


def attention_tables(model, tables: dict, layers: dict) -> dict:
    """:func:`attention.tree_tables` of a step (inside it, so that a compiled step fuses them)
    for its attention layers and their caches ``layers[idx]``."""
    idxs = [(idx, m) for idx, m in mixers(model) if idx not in tables["kinds"]]
    if not idxs:
        return {}
    return attention.tree_tables(adapters=[attention.view(m) for _, m in idxs],
                                 caches=[layers[idx] for idx, _ in idxs], **tables["tree"])
