"""Measured cost of one ``tree_forward`` against the number of tree nodes, cached on disk.

STree's runtime model (Eq. 7 / 8): one call over ``n`` nodes costs ``t(n) = a n^2 + b n + c``
(``a = 0`` for pure SSMs; attention makes hybrids quadratic). :func:`forward_cost` times a model's
``tree_forward`` over chains of a few sizes after a short prefill and fits that polynomial (least
squares; refit linear when the quadratic term comes out negative). Results are cached per model
(class, parameter count, shapes), device and dtype in ``$STREE_CACHE/costs.json`` (default
``~/.cache/stree``), so a model is measured once.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from stree.tree import TokenTree

SIZES = (1, 2, 4, 8, 16, 32, 64)
PREFIX = 32


@dataclass(frozen=True)
class ForwardCost:
    """``t(n) = a n^2 + b n + c`` seconds for one ``tree_forward`` over ``n`` nodes (of one row)."""

    a: float
    b: float
    c: float

    def __call__(self, n: int, rows: int = 1) -> float:
        """Seconds for ``rows`` rows of ``n`` nodes each: the per-node terms once per row (the
        linear layers see ``rows * n`` tokens, each row's attention its own nodes), the fixed
        term once."""
        return rows * (self.a * n * n + self.b * n) + self.c

    @classmethod
    def fit(cls, sizes, seconds) -> "ForwardCost":
        """Least-squares quadratic through (size, seconds); linear if its ``a`` is negative;
        coefficients clamped at 0 (a cost never falls with more nodes)."""
        n = torch.tensor(sizes, dtype=torch.float64)
        t = torch.tensor(seconds, dtype=torch.float64)
        for deg in (2, 1):
            X = torch.stack([n ** k for k in range(deg, -1, -1)], 1)
            coef = torch.linalg.lstsq(X, t[:, None]).solution[:, 0].tolist()
            if deg == 1 or coef[0] >= 0:
                break
        a, b, c = ([0.0] * (3 - len(coef)) + coef)
        return cls(max(a, 0.0), max(b, 0.0), max(c, 0.0))


def cache_path() -> Path:
    root = os.environ.get("STREE_CACHE") or os.path.join(Path.home(), ".cache", "stree")
    return Path(root) / "costs.json"


def model_key(model) -> str:
    """Identifies a model's cost: class, parameter count and shapes' hash, device, dtype."""
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    device = params[0].device if params else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shapes = hash(tuple(tuple(p.shape) for p in params)) & 0xFFFFFFFF
    dtype = params[0].dtype if params else None
    count = sum(p.numel() for p in params)
    return f"{type(model).__name__}:{count}:{shapes:08x}:{name}:{dtype}"


def forward_cost(model, *, sizes=SIZES, reps: int = 3, use_cache: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> ForwardCost:
    """The fitted ``tree_forward`` cost of a patched ``model`` (measured once, then cached).

    Each size is timed ``reps`` times (best kept) after one warm-up call, on a batch of one row
    whose committed prefix has ``PREFIX`` tokens; the committed state is never changed.
    """
    key = model_key(model)
    path = cache_path()
    table = json.loads(path.read_text()) if use_cache and path.exists() else {}
    if key in table:
        return ForwardCost(**table[key])
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    device = params[0].device if params else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = []
    with torch.inference_mode():
        cache = model.allocate_tree_cache(1, PREFIX + max(sizes) + 1)
        model.prefill(torch.zeros(1, PREFIX, dtype=torch.long, device=device), cache, logits=False)
        for n in sizes:
            tree = TokenTree.chain(torch.zeros(1, n, dtype=torch.long, device=device))
            model.tree_forward(tree, cache)  # warm-up (kernels, allocator)
            times = []
            for _ in range(reps):
                sync()
                start = clock()
                model.tree_forward(tree, cache)
                sync()
                times.append(clock() - start)
            best.append(min(times))
    cost = ForwardCost.fit(sizes, best)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        table = json.loads(path.read_text()) if path.exists() else {}
        table[key] = dict(a=cost.a, b=cost.b, c=cost.c)
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
    return cost
