"""The chunked gated delta rule over a sequence from an initial state: prefill (and training).

The sequence is cut into chunks of ``chunk`` tokens. Within a chunk, with ``G`` the cumulative
log-decay (per head, or per key channel for KDA), the UT transform of every chunk at once:

    A[i, j] = beta_i <k_i e^{G_i - G_j}, k_j>   (j < i),     T = (I + A)^{-1}
    U = T (beta v),   W = T (beta e^{G} k)

then chunk by chunk from the state ``S`` the chunks before it left (the only sequential part):

    u = U - W S,      o = (e^{G} q) S + tril(<q_i e^{G_i - G_j}, k_j>) u,
    S <- e^{G_last} S + sum_j e^{G_last - G_j} k_j u_j^T

which is ``tree_delta`` with the chain's mask and ``delta_replay`` of the whole chain, with the
transform of all chunks batched into one triangular solve. Plain PyTorch (any device), fp32,
differentiable (``models/recipe.py`` trains the Gated DeltaNet pair through it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def chunk_delta(q, k, v, g, beta, initial_state, chunk: int = CHUNK):
    """The gated delta rule over ``l`` tokens from ``initial_state``.

    Args:
        q, k: ``(b, l, h, dk)`` (normalised, q scaled: as ``tree_delta`` takes them); v:
            ``(b, l, h, dv)``; g: ``(b, l, h)`` or ``(b, l, h, dk)`` fp32 log-decay; beta ``(b, l, h)``.
        initial_state: ``(b, h, dk, dv)``.
    Returns:
        ``o (b, l, h, dv)`` in v's dtype and the final state ``(b, h, dk, dv)`` fp32.
    """
    f32, dtype = torch.float32, v.dtype
    b, l, h, dk = q.shape
    dv = v.shape[-1]
    chunk = min(chunk, l)  # a short prompt is one chunk of its own length, not padded to 64
    pad = (-l) % chunk
    n = (l + pad) // chunk
    per_channel = g.dim() == 4

    def chunks(t):  # (b, l, h, ...) -> (b, h, n, chunk, ...); padding: zero inputs, no decay
        t = t.to(f32).transpose(1, 2)
        if pad:
            t = F.pad(t, (0, 0) * (t.dim() - 3) + (0, pad))
        return t.reshape(b, h, n, chunk, *t.shape[3:])

    q, k, v, beta = chunks(q), chunks(k), chunks(v), chunks(beta)
    G = chunks(g).cumsum(3)  # (b, h, n, c[, dk])
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = causal.logical_and(~torch.eye(chunk, dtype=torch.bool, device=q.device))
    if per_channel:
        decay = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[..., None], float("-inf")).exp()
        kk = torch.einsum("bhnic,bhnijc,bhnjc->bhnij", k, decay, k)
        qk = torch.einsum("bhnic,bhnijc,bhnjc->bhnij", q, decay, k)
        eG = G.exp()
        ke, qe = k * eG, q * eG
        last = G[..., -1, :]  # (b, h, n, dk)
        k_to_end = k * (last[..., None, :] - G).exp()
        end_decay = last.exp()[..., None]  # (b, h, n, dk, 1)
    else:
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        kk = (k @ k.transpose(-1, -2)) * decay
        qk = (q @ k.transpose(-1, -2)) * decay
        eG = G.exp()[..., None]
        ke, qe = k * eG, q * eG
        last = G[..., -1]  # (b, h, n)
        k_to_end = k * (last[..., None] - G).exp()[..., None]
        end_decay = last.exp()[..., None, None]
    a = kk.masked_fill(~strict, 0.0) * beta[..., None]
    eye = torch.eye(chunk, dtype=f32, device=q.device)
    T_rhs = torch.cat([beta[..., None] * v, beta[..., None] * ke], dim=-1)  # (b, h, n, c, dv + dk)
    UW = torch.linalg.solve_triangular(a + eye, T_rhs, upper=False, unitriangular=True)
    U, W = UW[..., :dv], UW[..., dv:]
    P = qk.masked_fill(~causal, 0.0)
    S = initial_state.to(f32)
    outs = []
    for c in range(n):
        u = U[:, :, c] - W[:, :, c] @ S
        outs.append(qe[:, :, c] @ S + P[:, :, c] @ u)
        S = end_decay[:, :, c] * S + k_to_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, 2).reshape(b, h, n * chunk, dv)[:, :, :l].transpose(1, 2)
    return o.to(dtype), S
