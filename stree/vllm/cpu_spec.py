"""vLLM 0.32's CPU Mamba2 ops, completed for speculative decoding (why its output was lossy).

With speculation, vLLM verifies ``1 + K`` tokens per request and keeps, per request, ``1 + K``
SSM state slots (``state_indices[i, t]`` holds the state after token ``t``) and a sliding conv
state of ``width - 1 + K`` columns. The next step starts from what the accepted prefix left:
SSM state slot ``num_accepted_tokens - 1``, conv window at column offset
``num_accepted_tokens - 1``. The CUDA (Triton) kernels do this. The CPU replacements in 0.32 do
not: ``causal_conv1d_update_cpu`` drops ``num_accepted_tokens`` (it lands in ``**kwargs``) and
reads the window at offset 0, and the C++ ``selective_state_update_cpu`` does not start from
slot ``num_accepted_tokens - 1`` (measured: it starts from the last slot). So on CPU every step
after a partial acceptance continues from the wrong state, and greedy output with ``ngram``
speculation differs from the non-speculative output within a few tokens (reproduced on the
shipped pair).

:func:`patch_cpu_spec_ops` keeps vLLM's CPU functions for calls without speculation and routes
calls with it to :func:`spec_conv_update` / :func:`spec_state_update`, plain PyTorch that follows
the Triton kernels' contract, batched over the requests of a step (a loop over the ``1 + K``
tokens only: at batch 4 a per-request loop cost 2.6 ms of an 8 ms step on this CPU).

Sampled speculation (T > 0) was lossy for every model: the rejection sampler spreads each
request's temperature (and top-k, top-p) over its draft positions with ``expand_kernel``, whose
CPU replacement (``cpu_triton_utils._expand_kernel_impl``) hands the C++ op int64 *copies* of a
float output and input; the op writes into the copy, and the float output keeps whatever memory
``torch.empty`` gave it, so the target logits are divided by garbage before acceptance and the
recovered-token draws. :func:`expand_impl` replaces it (a chi-square test of the sampled output
against the exact distribution fails without it and passes with it).

Prefix caching of Mamba state on the CPU: :mod:`stree.vllm.cpu_prefix_cache`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _by_length(starts: list[int], valid: list[bool]) -> dict[int, list[int]]:
    """The rows ``i`` with ``valid[i]`` and a non-empty query, grouped by query length
    (``starts[i + 1] - starts[i]``): with speculation every decode row has ``1 + K`` tokens, so a
    step is one group and each op runs once per group, not once per request."""
    groups: dict[int, list[int]] = {}
    for i, ok in enumerate(valid):
        length = starts[i + 1] - starts[i]
        if ok and length > 0:
            groups.setdefault(length, []).append(i)
    return groups


def conv_windows(conv_state: torch.Tensor, slots: torch.Tensor, accepted: torch.Tensor, width: int) -> torch.Tensor:
    """``(g, dim, width - 1)`` the conv window each request's next token reads under speculation:
    the ``width - 1`` columns of its slot's conv state from column ``num_accepted - 1``
    (``slots``, ``accepted``: ``(g,)``). Shared with the tree rows (:mod:`stree.vllm.step`)."""
    slots = slots.to(conv_state.device).long()
    cols = (accepted.to(conv_state.device).long() - 1)[:, None] + torch.arange(width - 1, device=conv_state.device)
    return conv_state[slots].gather(2, cols[:, None, :].expand(-1, conv_state.shape[1], -1))


def start_slots(table: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """``(g,)`` the SSM state slot each request starts from under speculation:
    ``table[i, num_accepted - 1]`` of its ``(g, 1 + K)`` slot table. Shared with
    :mod:`stree.vllm.step`."""
    return table.long().gather(1, (accepted.to(table.device).long() - 1).clamp(min=0)[:, None])[:, 0]


def spec_conv_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None, conv_state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
                     query_start_loc: torch.Tensor, null_block_id: int) -> torch.Tensor:
    """The speculative branch of vLLM's ``causal_conv1d_update`` (varlen inputs), in place.

    x: (num_tokens, dim), each request's ``1 + K`` tokens at ``query_start_loc[i]:[i + 1]``;
    conv_state: (slots, dim, width - 1 + K); weight: (dim, width); conv_state_indices: (b, *)
    (column 0 is the request's slot; ``null_block_id`` marks padding rows); num_accepted_tokens:
    (b,). Returns silu(conv) per token (num_tokens, dim); each row's conv state becomes the last
    ``width - 2 + L`` inputs (its old window minus its first column, then its L tokens).
    """
    out = torch.empty_like(x)
    width = weight.shape[1]
    starts = query_start_loc.tolist()
    b = len(starts) - 1
    slots = conv_state_indices[:b, 0].long()
    valid = (slots != null_block_id).tolist()
    for length, rows in _by_length(starts, valid).items():
        r = torch.tensor(rows)
        slot = slots[r]
        window = conv_windows(conv_state, slot, num_accepted_tokens[r], width)
        tokens = query_start_loc[r].long()[:, None] + torch.arange(length)  # (g, L)
        full = torch.cat([window, x[tokens].transpose(1, 2).to(conv_state.dtype)], dim=2)  # (g, dim, width - 1 + L)
        # the depthwise conv as windows times weights: PyTorch's grouped conv1d costs 5x more here
        y = (full.unfold(2, width, 1) * weight[:, None, :].to(full.dtype)).sum(-1)  # (g, dim, L)
        if bias is not None:
            y = y + bias[:, None].to(y.dtype)
        y = F.silu(y) if activation in ("silu", "swish", True) else y
        out[tokens] = y.transpose(1, 2).to(x.dtype)
        conv_state[slot, :, :full.shape[2] - 1] = full[:, :, 1:]
    return out


def spec_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                      state_batch_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
                      cu_seqlens: torch.Tensor, out: torch.Tensor, null_block_id: int) -> torch.Tensor:
    """The speculative branch of vLLM's ``selective_state_update`` (varlen inputs), in place.

    state: (slots, h, p, n); x, dt, out: (num_tokens, h, p); A: (h, p, n); B, C: (num_tokens, g, n);
    D, dt_bias: (h, p); state_batch_indices: (b, 1 + K). Request ``i`` starts from slot
    ``state_batch_indices[i, num_accepted_tokens[i] - 1]`` and writes the state after its token
    ``t`` to ``state_batch_indices[i, t]``; ``out`` gets ``C . state + D * x`` per token.
    """
    starts = cu_seqlens.tolist()
    b = len(starts) - 1
    table = state_batch_indices[:b].long()
    heads_per_group = x.shape[1] // B.shape[1]
    for length, rows in _by_length(starts, (table[:, 0] != null_block_id).tolist()).items():
        r = torch.tensor(rows)
        slots = table[r]  # (g, 1 + K)
        s = state[start_slots(slots, num_accepted_tokens[r])].float()  # (g, h, p, n)
        bos = cu_seqlens[r].long()
        for t in range(length):
            k = bos + t
            delta = (dt[k] + dt_bias if dt_bias is not None else dt[k]).float()
            if dt_softplus:
                delta = F.softplus(delta)
            b_t, c_t = (v[k].float().repeat_interleave(heads_per_group, 1)[:, :, None, :] for v in (B, C))
            xk = x[k].float()
            s = s * torch.exp(delta[..., None] * A) + (delta * xk)[..., None] * b_t
            y = (s * c_t).sum(-1)
            out[k] = (y + D * xk if D is not None else y).to(out.dtype)
            state[slots[:, t]] = s.to(state.dtype)
    return out


def _host_plan(starts: torch.Tensor, first: torch.Tensor, num_accepted_tokens: torch.Tensor,
               null_block_id: int) -> list[int] | None:
    """For a speculative call: None if some request has drafts this step; else the rows whose
    window and state the last step's accepted drafts left past column / slot 0 (accepted > 1, a
    real slot). Host lists: the step's metadata are small CPU tensors, for which a few list
    operations cost less than a chain of tensor ops (both plans 36 -> 12 us a step at batch 4)."""
    starts = starts.tolist()
    if any(b - a != 1 for a, b in zip(starts, starts[1:])):
        return None
    accepted = num_accepted_tokens[:len(first)].tolist()
    return [i for i, (n, slot) in enumerate(zip(accepted, first.tolist())) if n > 1 and slot != null_block_id]


class _PerStep:
    """A value computed once per step from vLLM's per-step metadata tensors, not once per layer.

    vLLM hands every Mamba2 layer of a step the same metadata tensors (fresh slices of its
    buffers each step). The last key's tensors are kept alive, so a later step's tensors cannot
    be the same objects: an identity match means the same step."""

    def __init__(self, compute):
        self.compute, self.key, self.value = compute, (), None

    def __call__(self, *key):
        if len(key) != len(self.key) or any(a is not b for a, b in zip(key, self.key)):
            self.key, self.value = key, self.compute(*key)
        return self.value


def _conv_plan(query_start_loc, conv_state_indices, num_accepted_tokens, null_block_id):
    """For a speculative conv call: None if some request has drafts; else each request's slot and
    the rows whose window must first move to column 0 (``(slots, accepted)``, or None)."""
    move = _host_plan(query_start_loc, conv_state_indices[:, 0], num_accepted_tokens, null_block_id)
    if move is None:  # a step with drafts: nothing else to build
        return None
    slots = conv_state_indices[:, 0].contiguous()
    return slots, ((slots[move].long(), num_accepted_tokens[move]) if move else None)


def _state_plan(cu_seqlens, table, num_accepted_tokens, null_block_id):
    """For a speculative SSM-state call: None if some request has drafts; else each request's
    first slot (``(b, 1)``, dense: the C++ op reads it so) and the moves of the states left at
    slot ``num_accepted - 1`` to slot 0 (``(dst, src)``, or None)."""
    move = _host_plan(cu_seqlens, table[:, 0], num_accepted_tokens, null_block_id)
    if move is None:
        return None
    moves = None
    if move:
        rows = table[move].long()
        moves = (rows[:, 0], start_slots(rows, num_accepted_tokens[move]))
    return table[:, :1].contiguous(), moves


def patch_cpu_spec_ops() -> None:
    """Route vLLM's CPU Mamba2 decode ops through the functions above when speculating.

    A speculative call in which every request has one token (no drafts this step) goes back to
    vLLM's own C++ ops, 4x cheaper at batch 4: each request's window and state are first moved
    to column 0 (where the last step accepted drafts), which those ops read and write exactly
    as the speculative contract wants for one token (the conv op on a view of the window's
    ``width - 1`` columns)."""
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID

    original = mixer2.causal_conv1d_update
    if getattr(original, "_stree", False):
        return
    original_ssu = mixer2.selective_state_update
    conv_plan, state_plan = _PerStep(_conv_plan), _PerStep(_state_plan)

    def conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                    num_accepted_tokens=None, query_start_loc=None, null_block_id=NULL_BLOCK_ID, **kwargs):
        if num_accepted_tokens is None or query_start_loc is None:
            return original(x, conv_state, weight, bias, activation, conv_state_indices=conv_state_indices,
                            query_start_loc=query_start_loc, null_block_id=null_block_id, **kwargs)
        plan = conv_plan(query_start_loc, conv_state_indices, num_accepted_tokens, null_block_id)
        if plan is not None:
            width, (slots, moves) = weight.shape[1], plan
            if moves is not None:
                conv_state[moves[0], :, :width - 1] = conv_windows(conv_state, *moves, width)
            return original(x, conv_state[:, :, :width - 1], weight, bias, activation, conv_state_indices=slots,
                            query_start_loc=query_start_loc, null_block_id=null_block_id, **kwargs)
        return spec_conv_update(x, conv_state, weight, bias, activation, conv_state_indices,
                                num_accepted_tokens, query_start_loc, null_block_id)

    def state_update(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
                     dst_state_batch_indices=None, null_block_id=NULL_BLOCK_ID, out=None, num_accepted_tokens=None,
                     cu_seqlens=None, **kwargs):
        if num_accepted_tokens is None or cu_seqlens is None or out is None:
            return original_ssu(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                state_batch_indices=state_batch_indices,
                                dst_state_batch_indices=dst_state_batch_indices, null_block_id=null_block_id,
                                out=out, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, **kwargs)
        # vLLM passes the same (b, 1 + K) table as source and destination
        plan = state_plan(cu_seqlens, state_batch_indices, num_accepted_tokens, null_block_id)
        if plan is not None:
            first, moves = plan
            if moves is not None:
                state[moves[0]] = state[moves[1]]
            return original_ssu(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                                state_batch_indices=first, dst_state_batch_indices=first,
                                null_block_id=null_block_id, out=out, **kwargs)
        return spec_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, state_batch_indices,
                                 num_accepted_tokens, cu_seqlens, out, null_block_id)

    conv_update._stree = True
    mixer2.causal_conv1d_update = conv_update
    mixer2.selective_state_update = state_update


def expand_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
                replace_to, MAX_NUM_TOKENS=None) -> None:
    """``expand_kernel`` (rejection sampler): ``output[tokens of request r] = input_val[r]``, with
    ``replace_from`` values replaced by ``replace_to``; any dtype, in place."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    output[:int(counts.sum())] = values.repeat_interleave(counts).to(output.dtype)


def patch_cpu_expand() -> None:
    """Make vLLM's CPU platform register :func:`expand_impl` for ``expand_kernel`` (its kernel
    overrides are registered after general plugins load, from this module attribute)."""
    import vllm.utils.cpu_triton_utils as cpu_tl

    cpu_tl._expand_kernel_impl = expand_impl
