"""Beam-search tree drafter (STree Section 5.1): N beam steps of M beams, every kept token stays.

Standard beam search with the draft model; each step's M winners become a new tree layer hanging
from the beams they extend. A beam that wins no continuation later is dropped from the search but
its tokens stay in the tree as a shorter branch, so the tree always has ``1 + N * M`` nodes, M per
layer (the paper: "keep all the tokens generated at each step of beam search, even if the beam is
later discarded").

Choices the paper leaves open: score = sum of the draft's log-probabilities along the path (no
length normalisation: every beam of a step has the same length), at the draft's own temperature 1
whatever the target's sampling config; candidates per beam = its top M tokens (enough, since at
most M of them can win). Layers are sorted best score first. Children are chosen, not sampled, so
the mode is "deterministic" (greedy or naive verification).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stree.draft.base import Drafter, forward_level
from stree.draft_types import Draft
from stree.sampling import SamplingConfig, target_probs
from stree.tree import TokenTree


@dataclass(frozen=True)
class BeamTreeDrafter(Drafter):
    """Beam-search tree of ``steps`` layers (N) with ``beams`` nodes each (M)."""

    steps: int
    beams: int
    mode: str = "deterministic"

    def __post_init__(self):
        if int(self.steps) < 1 or int(self.beams) < 1:
            raise ValueError(f"beam drafter needs steps >= 1 and beams >= 1, got {self.steps}x{self.beams}")
        if self.mode != "deterministic":
            raise ValueError("beam-search trees are chosen, not sampled: mode must be 'deterministic'")

    @property
    def name(self) -> str:
        return f"beam:{self.steps}x{self.beams}"

    @property
    def num_nodes(self) -> int:
        return 1 + self.steps * self.beams

    @property
    def depth(self) -> int:
        return self.steps

    @property
    def num_forwarded(self) -> int:
        return 1 + (self.steps - 1) * self.beams

    @property
    def max_leaves(self) -> int:
        # the last layer, plus at most M - 1 dropped beams per earlier layer (one beam survives)
        return self.beams + (self.steps - 1) * (self.beams - 1)

    def draft(self, model, cache, roots: Tensor, sampling: SamplingConfig,
              generator: torch.Generator | None = None) -> Draft:
        M, device = self.beams, roots.device
        b, n = roots.shape[0], self.num_nodes
        tokens = torch.zeros(b, n, dtype=torch.long, device=device)
        tokens[:, 0] = roots
        parents = torch.full((b, n), -1, dtype=torch.long, device=device)
        scores = torch.zeros(b, 1, device=device)  # (b, beams alive): the root alone at first
        q = None
        for step in range(self.steps):
            start, end = (0, 1) if step == 0 else (1 + (step - 1) * M, 1 + step * M)
            tree = TokenTree(tokens[:, :end], parents[:, :end])
            logits = forward_level(model, cache, tree, start, end, n)       # (b, beams, v)
            if not sampling.is_greedy:  # at greedy no verifier reads q: no (b, n, v) buffer
                if q is None:
                    q = torch.zeros(b, n, logits.shape[-1], dtype=torch.float32, device=device)
                q[:, start:end] = target_probs(logits, sampling)
            top = logits.float().log_softmax(-1).topk(M, dim=-1)            # (b, beams, M)
            cand = (scores.unsqueeze(-1) + top.values).flatten(1)           # (b, beams * M)
            best = cand.topk(M, dim=-1)                                     # sorted, best first
            tokens[:, end:end + M] = top.indices.flatten(1).gather(1, best.indices)
            parents[:, end:end + M] = start + best.indices // M
            scores = best.values
        return Draft(TokenTree(tokens, parents), q, self.mode)
