"""Next-token choice for plain autoregressive generation (greedy, temperature, top-k, top-p)."""
from __future__ import annotations

import torch


def sample_next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (b, v) -> tokens (b,) int64. ``temperature == 0`` is greedy (argmax); ``top_k == 0`` and
    ``top_p == 1`` disable those filters. The top-p nucleus always keeps the most likely token."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already cover top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
