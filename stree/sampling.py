"""Target-side sampling: logits -> probabilities, and drawing from (unnormalised) probabilities.

The transform matches mamba_ssm's ``sample`` and Hugging Face's warpers
(``TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper``): divide by the temperature,
keep the ``top_k`` largest logits (ties with the k-th are kept), then drop the smallest tokens
whose cumulative probability is ``<= 1 - top_p``. Top-k commutes with the temperature (both are
monotone), so the order of those two does not matter.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How the *target* distribution is shaped. ``temperature == 0`` means greedy decoding.

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. ``top_k == 1`` is greedy too (as in
    mamba_ssm's ``sample``), whatever the temperature.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name, kind in (("temperature", numbers.Real), ("top_k", numbers.Integral), ("top_p", numbers.Real)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{name} must be {'an int' if kind is numbers.Integral else 'a number'}, "
                                f"got {value!r}")
        if not 0.0 <= self.temperature < math.inf:  # also catches NaN
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        # mamba_ssm treats top_p=0 as "off" and HF as "keep one token"; refuse rather than guess.
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 disables it), got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        """True when the target distribution is a point mass on the argmax."""
        return self.temperature == 0.0 or self.top_k == 1


_FP32_TINY = torch.finfo(torch.float32).tiny


def target_probs(logits: Tensor, sampling: SamplingConfig, temperature: Tensor | None = None) -> Tensor:
    """Probabilities the target samples from.

    logits: (..., v) any float dtype. Returns (..., v) float32 summing to 1 along the last dim.
    Greedy configs give a one-hot argmax (first index on ties, like ``torch.argmax``).
    ``temperature``: a 0-d tensor used in place of ``sampling.temperature`` (of a sampled config),
    so that a compiled step takes it as an input and one graph serves every temperature.
    """
    logits = logits.float()
    if sampling.is_greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted so the largest logit is 0 before the division: the same distribution, and a tiny
    # temperature sends the others to -inf (the greedy limit) instead of overflowing to inf - inf;
    # a temperature below fp32's smallest normal number (0 in fp32: 0 / 0) divides as that number,
    # which is already that limit for any two logits fp32 can tell apart
    scale = max(sampling.temperature, _FP32_TINY) if temperature is None else temperature.clamp_min(_FP32_TINY)
    logits = (logits - logits.amax(-1, keepdim=True)) / scale
    v = logits.shape[-1]
    if 0 < sampling.top_k < v:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # The largest token always survives: its cumulative sum is 1 > 1 - top_p.
        drop_sorted = cum <= 1.0 - sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(logits: Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None = None) -> Tensor:
    """One draw per row from ``target_probs(logits, sampling)``: ``(..., v)`` -> ``(...)`` int64.
    At greedy sampling the argmax itself (no one-hot, no random draw)."""
    if sampling.is_greedy:
        return logits.argmax(-1)
    return sample_from(target_probs(logits, sampling), generator)


def sample_from(weights: Tensor, generator: torch.Generator | None = None, u: Tensor | None = None) -> Tensor:
    """One draw per row from non-negative, maybe unnormalised ``weights`` (..., v) -> (...) int64.
    ``u``: the draw's uniforms ``(..., 1)`` float64, drawn beforehand (:func:`uniforms`), else drawn here.

    Inverse CDF: one uniform per row against the running sum of the weights, in float64 (a
    100k-token vocabulary keeps its smallest weights). Exact up to rounding, needs no
    normalisation, and never raises (an all-zero row returns 0; callers mask such rows), so a
    batched walk has no host sync here. Zero-weight tokens are never drawn: the draw is the first
    token whose running sum exceeds ``u * total < total``. (One uniform per row instead of an
    exponential race over the vocabulary: the race's ``v`` random draws per row were half the
    cost of a sampled verify step on a CPU.)
    """
    cdf = weights.double().cumsum(-1)
    total = cdf[..., -1:]
    if u is None:
        u = uniforms(total.shape, cdf.device, generator)
    # u * total can round up to total: stay strictly below it
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return torch.where(total.squeeze(-1) > 0, idx, 0)


def uniforms(shape, device, generator: torch.Generator | None = None) -> Tensor:
    """The uniforms :func:`sample_from` draws for weights of shape ``shape[:-1] + (v,)``."""
    return torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
