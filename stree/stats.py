"""Acceptance and timing statistics of one ``stree.generate`` call.

Counting rule, the same for every method (autoregressive, chain, tree, unrolled): the first new
token of each row comes from the prefill logits (as in mamba_ssm's ``generate``); every later token
comes from a target ``tree_forward`` call ("target call"). One row in one target call is a *step*;
``accept_hist[k]`` counts steps that emitted ``k`` tokens (accepted drafted tokens + the target's
correction/bonus, after EOS / ``max_new_tokens`` truncation). ``tau = sum(k * hist[k]) / steps``,
so autoregressive decoding has ``tau == 1`` exactly and, for batch size 1, ``steps == target_calls``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """Attributes:
        method, drafter, verifier: what ran.
        batch_size: rows; new_tokens: generated tokens over all rows (prefill token included).
        target_calls: target ``tree_forward`` calls after prefill (a batched call counts once).
        draft_calls: draft ``tree_forward`` calls after prefill (drafting and chain re-forwards).
        steps: (row, target call) pairs in which the row was still generating.
        accept_hist: ``{tokens emitted in one step: steps}``; sums to ``steps``.
        prefill_s: target + draft prefill and the first token.
        draft_s: all draft-model work after prefill (drafting, draft commit / re-forward).
        verify_s: target ``tree_forward`` + the verifier.
        replay_s: target ``commit`` (activation replay, KV compaction).
        total_s: wall time of the whole call.
    """

    method: str
    drafter: str = ""
    verifier: str = ""
    batch_size: int = 0
    new_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    steps: int = 0
    accept_hist: dict[int, int] = field(default_factory=dict)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    replay_s: float = 0.0
    total_s: float = 0.0

    def merge(self, other: "GenerationStats") -> None:
        """Add another call's counts and times to these (aggregating a benchmark's prompts)."""
        for name in ("new_tokens", "target_calls", "draft_calls", "steps", "prefill_s", "draft_s",
                     "verify_s", "replay_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, c in other.accept_hist.items():
            self.accept_hist[k] = self.accept_hist.get(k, 0) + c

    def record_step(self, emitted: int) -> None:
        """One row emitted ``emitted`` tokens in one target call."""
        self.steps += 1
        self.accept_hist[emitted] = self.accept_hist.get(emitted, 0) + 1

    @property
    def tau(self) -> float:
        """Tokens per target call per row (mean acceptance length, bonus included); NaN if no step."""
        if not self.steps:
            return float("nan")
        return sum(k * c for k, c in self.accept_hist.items()) / self.steps

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def summary(self) -> str:
        hist = " ".join(f"{k}:{self.accept_hist[k]}" for k in sorted(self.accept_hist))
        tau = f"{self.tau:.3f}" if self.steps else "-"
        return (f"method={self.method} drafter={self.drafter or '-'} verifier={self.verifier or '-'}\n"
                f"new tokens {self.new_tokens} (batch {self.batch_size}) in {self.total_s:.3f} s = "
                f"{self.tokens_per_s:.2f} tok/s\n"
                f"tau {tau} tokens/target call over {self.target_calls} target calls, "
                f"{self.draft_calls} draft calls; accepted-length histogram {hist or '-'}\n"
                f"time: prefill {self.prefill_s:.3f} s, draft {self.draft_s:.3f} s, "
                f"verify {self.verify_s:.3f} s, replay {self.replay_s:.3f} s")


@contextmanager
def timed(stats: GenerationStats, attr: str, device: torch.device):
    """Add the wall time of the block to ``stats.<attr>``; syncs CUDA so the split is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        setattr(stats, attr, getattr(stats, attr) + time.perf_counter() - start)
