"""vLLM 0.32's CPU Mamba2 ops, completed for speculative decoding (why its output was lossy) and prefix caching.

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

Prefix caching of Mamba state (vLLM 0.32's "align" mode, its only one, the default with prefix
caching on: the state at block boundaries, by default only the boundary before each prompt's last
token) did not run on the CPU build; :func:`patch_cpu_prefix_caching` makes it run for Mamba2
models, with and without speculation:

- a prefill that crosses a boundary stores the state there from inside the forward, from per-chunk
  states (``return_intermediate_states``) that the CPU chunk scan does not return (``index 1 is out
  of bounds`` in ``conv_ssm_forward``), with a Triton-only kernel: :func:`chunk_states` (the scan
  one chunk of every sequence at a time) and :func:`store_checkpoint`;
- under speculation on hybrid models vLLM moves states between blocks with fused Triton kernels
  only (``'function' object is not subscriptable`` in ``run_fused_precopy``): the pre-step copy
  takes vLLM's scalar path (its host loop and CPU ``batch_memcpy``), the post-step copy of a
  boundary state into its block is :func:`align_postprocess`; attention-free models
  (``Mamba2ForCausalLM``), for which vLLM records neither accepted counts nor copies, get both.

stree's trees commit the state after the accepted path's last token only (the slot and conv offset
vLLM reads next), not after each path token as vLLM's kernels do, so a retention that also caches
boundaries inside decode steps (``prefix_cache_retention_interval`` other than 0) is refused with
stree verifying; a prompt's boundary state comes from the prefill, which stree does not touch.
Prefix caching stays off, with a warning, for Mamba models of other layer kinds (Gated DeltaNet,
Mamba-1), whose CPU paths these wrappers do not cover.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


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


def chunk_states(scan, x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx,
                 out, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False,
                 dt_limit=(0.0, float("inf")), return_intermediate_states=False, state_dtype=None):
    """vLLM's ``mamba_chunk_scan_combined_varlen`` (``scan``: its CPU build) with
    ``return_intermediate_states``: the state at the end of every chunk ``(nchunks, h, p, n)``,
    where the CPU op returns each sequence's final state only.

    Chunk ``c`` spans tokens ``cu_chunk_seqlens[c]:[c + 1]`` of sequence ``seq_idx[c]``. Round
    ``r`` runs the ``r``-th chunk of every sequence as one varlen call of the CPU op, from the
    states round ``r - 1`` left (fp32 in between), so a prefill of ``m`` chunks costs ``m`` calls
    over the same tokens; outputs and final states equal one call's up to rounding (4e-6 on a
    random case: tests/vllm/test_engine_prefix_cache.py). Without ``return_intermediate_states``:
    ``scan`` itself."""
    kwargs = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if not return_intermediate_states:
        return scan(x, dt, A, B, C, chunk_size, cu_seqlens, cu_chunk_seqlens, last_chunk_indices, seq_idx, out,
                    z=z, initial_states=initial_states, state_dtype=state_dtype, **kwargs)
    bounds, owner = cu_chunk_seqlens.tolist(), seq_idx.tolist()
    rounds: list[list[int]] = []
    seen: dict[int, int] = {}
    for c, s in enumerate(owner):
        r = seen.get(s, 0)
        seen[s] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(c)
    h, p, n = x.shape[1], x.shape[2], B.shape[2]
    batch = len(cu_seqlens) - 1
    state = (initial_states.float().clone() if initial_states is not None
             else torch.zeros(batch, h, p, n, dtype=torch.float32, device=x.device))
    states = torch.empty(len(owner), h, p, n, dtype=state_dtype or x.dtype, device=x.device)
    for chunks in rounds:
        spans = [torch.arange(bounds[c], bounds[c + 1], device=x.device) for c in chunks]
        tokens = torch.cat(spans)
        cu = torch.tensor([0] + [len(t) for t in spans], device=x.device).cumsum(0).to(cu_seqlens.dtype)
        rows = torch.arange(len(chunks), device=x.device, dtype=seq_idx.dtype)
        seqs = torch.tensor([owner[c] for c in chunks], device=x.device)
        part = torch.empty(len(tokens), *out.shape[1:], dtype=out.dtype, device=out.device)
        final = scan(x[tokens], dt[tokens], A, B[tokens], C[tokens], chunk_size, cu, cu, rows, rows, part,
                     z=z[tokens] if z is not None else None, initial_states=state[seqs],
                     state_dtype=torch.float32, **kwargs)
        out[tokens] = part
        state[seqs] = final
        states[torch.tensor(chunks, device=x.device)] = final.to(states.dtype)
    return states


def store_checkpoint(checkpoint, chunk_idx: torch.Tensor, x: torch.Tensor, conv_state: torch.Tensor,
                     chunk_states: torch.Tensor, ssm_state: torch.Tensor, query_start_loc: torch.Tensor, *,
                     state_len: int) -> None:
    """vLLM's ``store_prefill_checkpoint`` (a Triton kernel only) in PyTorch: for each prefill row
    with a checkpoint (offset > 0) inside its query, the conv window (the ``state_len`` inputs
    before the checkpoint; x: ``(dim, tokens)``, conv_state: ``(blocks, dim, width - 1 + K)``)
    and the SSM state at the end of its chunk ``chunk_idx[row]`` go to the row's checkpoint
    block ``checkpoint.state_indices[row]``."""
    offsets = checkpoint.checkpoint_offsets.tolist()
    blocks, chunks, starts = checkpoint.state_indices.tolist(), chunk_idx.tolist(), query_start_loc.tolist()
    for row, offset in enumerate(offsets):
        if offset <= 0:
            continue
        end = starts[row] + offset
        conv_state[blocks[row], :, :state_len] = x[:, end - state_len:end].to(conv_state.dtype)
        ssm_state[blocks[row]] = chunk_states[chunks[row]].to(ssm_state.dtype)


def align_moves(num_accepted: list[int], state_cols: list[int], running: list[int], block_size: int):
    """Where vLLM's "align" mode wants states copied after a speculative step (the decisions of
    its fused Triton postprocess, on host lists): request ``i``'s state table column ``t`` holds
    the state after ``running[i] + t`` tokens (``running``: computed tokens through the step's
    root), its running block is column ``state_cols[i]`` of its block table, and it accepted
    ``num_accepted[i] - 1`` drafts. Where the accepted tokens reach a block boundary
    ``k * block_size``, the state there (table column ``bias``) is copied to block ``k - 1``,
    which the prefix cache then holds. Returns ``(moves, accepted)``: ``(i, src column, dst
    column, bias)`` per copy, and the accepted counts for the next step (1 where the boundary
    block is the running one)."""
    moves, accepted = [], list(num_accepted)
    for i, (a, src, run) in enumerate(zip(num_accepted, state_cols, running)):
        aligned = (run + a - 1) // block_size * block_size
        if aligned < run:
            continue
        bias, dst = aligned - run, aligned // block_size - 1
        if src == dst:
            accepted[i] = 1
            if bias == 0:
                continue
        moves.append((i, src, dst, bias))
    return moves, accepted


def copy_block_states(kv_cache_config, forward_context, copy_funcs, block_tables: dict[int, torch.Tensor],
                      moves) -> None:
    """Copy Mamba states between block columns of each request's block table, as vLLM's align
    copies do (``_copy_mamba_state_block``): the conv window shifted left by ``bias`` tokens,
    ``conv[bt[src], bias:] -> conv[bt[dst], :width - bias]``, the temporal (SSM) state from the
    accepted column, ``ssm[bt[src + bias]] -> ssm[bt[dst]]``. block_tables: each Mamba group's
    ``(num_reqs, blocks)`` block table; moves: ``(row, src column, dst column, bias)``. Plain
    indexing on either conv layout (vLLM's scalar path copies raw pointers, which its "DS" layout
    refuses)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, is_conv_state_dim_first
    from vllm.v1.worker.mamba_utils import _get_mamba_spec_for_layer

    if not moves:
        return
    dim_first = is_conv_state_dim_first()
    for gid, table in block_tables.items():
        group = kv_cache_config.kv_cache_groups[gid]
        ids = [(int(table[r, src]), int(table[r, dst]), int(table[r, src + bias]), bias) for r, src, dst, bias in moves]
        for name in group.layer_names:
            funcs = copy_funcs[_get_mamba_spec_for_layer(group, name).mamba_type]
            for state, func in zip(forward_context[name].kv_cache, funcs):
                for src, dst, accepted, bias in ids:
                    if func is get_conv_copy_spec:
                        window = (state[src, :, bias:] if dim_first else state[src, bias:]).clone()
                        (state[dst, :, :window.shape[1]] if dim_first else state[dst, :window.shape[0]]).copy_(window)
                    elif dst != accepted:
                        state[dst].copy_(state[accepted])


def align_postprocess(input_batch, kv_cache_config, forward_context, copy_funcs, group_ids, block_size: int,
                      num_accepted: list[int], state_cols: list[int], running: list[int]) -> list[int]:
    """vLLM's align-mode postprocess of a speculative step, on CPU (its fused Triton kernel does
    not run there): the copies of :func:`align_moves` (:func:`copy_block_states` on the input
    batch's host block tables); returns the accepted counts the next step's preprocess reads."""
    moves, accepted = align_moves(num_accepted, state_cols, running, block_size)
    tables = {gid: input_batch.block_table[gid].get_numpy_array() for gid in group_ids}
    copy_block_states(kv_cache_config, forward_context, copy_funcs, tables, moves)
    return accepted


# vLLM's Mamba2 families whose align-mode prefix caching the wrappers below make run on the CPU
# build (stree.vllm.speculative.ARCHITECTURES less the Gated DeltaNet ones: their CPU ops are others)
MAMBA2_ARCHITECTURES = ("Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
                        "FalconH1ForCausalLM", "Zamba2ForCausalLM", "MambaInLlamaForCausalLM",
                        "MambaInLlamaMambaOnlyForCausalLM")


def _host(buffer, n: int) -> list[int]:
    return buffer.np[:n].tolist()


def patch_cpu_prefix_caching() -> None:
    """Make vLLM's "align" prefix caching of Mamba2 state run on the CPU build (see the module
    docstring): the prefill's per-chunk states and checkpoint store, the pre-step copy on vLLM's
    scalar path, the post-step copies of a speculative step (hybrid and attention-free models) in
    PyTorch. Prefix caching stays off, with a warning, for Mamba models of other layer kinds
    (Gated DeltaNet, Mamba-1, ...), whose CPU paths this does not cover."""
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    from vllm.model_executor.models.config import MambaModelConfig
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    scan = mixer2.mamba_chunk_scan_combined_varlen
    if getattr(scan, "_stree", False):
        return

    def scan_with_states(*args, **kwargs):
        return chunk_states(scan, *args, **kwargs)

    scan_with_states._stree = True
    mixer2.mamba_chunk_scan_combined_varlen = scan_with_states
    mixer2.store_prefill_checkpoint = store_checkpoint

    preprocess = mamba_utils.preprocess_mamba

    def preprocess_scalar(*args, align_ctx=None, **kwargs):
        # vLLM's own decisions and copies (its host loop and batch_memcpy, which the CPU build
        # has), never the fused Triton pre-copy
        return preprocess(*args, align_ctx=None, **kwargs)

    def postprocess(*, bufs, num_reqs, num_accepted_tokens_gpu, num_accepted_tokens_cpu_tensor, input_batch,
                    kv_cache_config, forward_context, mamba_state_copy_funcs) -> None:
        # what stage_postprocess_inputs_to_gpu staged for the fused kernel, read on the host
        ctx, copy = bufs.postprocess_align, bufs.preprocess
        computed, scheduled, drafts = (_host(b, num_reqs) for b in (ctx.num_computed_tokens_buf,
                                                                    ctx.num_scheduled_tokens_buf,
                                                                    ctx.num_draft_tokens_buf))
        accepted = align_postprocess(input_batch, kv_cache_config, forward_context, mamba_state_copy_funcs,
                                     copy.mamba_group_ids, copy.mamba_spec.block_size,
                                     num_accepted_tokens_gpu[:num_reqs].tolist(),
                                     _host(ctx.mamba_state_idx_buf, num_reqs),
                                     [c + s - d for c, s, d in zip(computed, scheduled, drafts)])
        num_accepted_tokens_cpu_tensor[:num_reqs] = torch.tensor(accepted, dtype=num_accepted_tokens_cpu_tensor.dtype)

    mamba_utils.preprocess_mamba = preprocess_scalar
    mamba_utils.postprocess_mamba_align_gpu = postprocess

    update = GPUModelRunner._update_states_after_model_execute

    def update_attention_free(self, output_token_ids, scheduler_output):
        # vLLM records accepted counts (and runs the align postprocess) for hybrids only; an
        # attention-free model (Mamba2ForCausalLM) in align mode gets both here
        if not (self.speculative_config and not self.model_config.is_hybrid
                and self.cache_config.mamba_cache_mode == "align"):
            return update(self, output_token_ids, scheduler_output)
        n = output_token_ids.size(0)
        counts = (output_token_ids != -1).sum(dim=1)
        rids = self.input_batch.req_ids[:n]
        spec = scheduler_output.scheduled_spec_decode_tokens
        running = [self.requests[r].num_computed_tokens + scheduler_output.num_scheduled_tokens[r]
                   - len(spec.get(r, ())) for r in rids]
        copy = self._get_mamba_bufs().preprocess
        accepted = align_postprocess(self.input_batch, self.kv_cache_config,
                                     self.compilation_config.static_forward_context,
                                     self._get_mamba_state_copy_funcs(), copy.mamba_group_ids,
                                     copy.mamba_spec.block_size, counts.tolist(),
                                     [self.mamba_state_idx[r] for r in rids], running)
        self.num_accepted_tokens.gpu[:n] = counts
        self.input_batch.num_accepted_tokens_cpu_tensor[:n] = torch.tensor(accepted)
        self.num_accepted_tokens_event.record()
        return None

    update_attention_free._stree_align = True
    GPUModelRunner._update_states_after_model_execute = update_attention_free

    verify = MambaModelConfig.verify_and_update_config.__func__

    def verify_and_update_config(cls, vllm_config) -> None:
        cache, arch = vllm_config.cache_config, vllm_config.model_config.architecture
        if cache.enable_prefix_caching and arch not in MAMBA2_ARCHITECTURES:
            logger.warning("stree: prefix caching turned off for %s: on the CPU stree makes vLLM's Mamba "
                           "prefix caching run for Mamba2 models only (see stree/vllm/cpu_spec.py)", arch)
            cache.enable_prefix_caching = False
        if cache.enable_prefix_caching and cache.prefix_cache_retention_interval != 0 and _stree_verifies(vllm_config):
            raise ValueError(
                f"prefix_cache_retention_interval={cache.prefix_cache_retention_interval!r} with speculative_config "
                "method 'stree' verifying trees: such an engine caches Mamba states at block boundaries that a "
                "step's accepted path crosses, and stree's commit writes the state after the path's last "
                "token only; leave prefix_cache_retention_interval at vLLM's default 0 (states at prompt "
                "boundaries, which stree runs exactly) or turn prefix caching off")
        verify(cls, vllm_config)

    MambaModelConfig.verify_and_update_config = classmethod(verify_and_update_config)


def _stree_verifies(vllm_config) -> bool:
    """Whether ``vllm_config`` speculates with stree's proposer and stree verifies its trees in the
    engine (not a chain left to vLLM's rejection sampler, which writes every state slot)."""
    from stree.vllm.speculative import PROPOSER, DraftSpec

    spec = vllm_config.speculative_config
    if spec is None or spec.method != "custom_class" or spec.model != PROPOSER:
        return False
    return DraftSpec.from_env().stree_verifies


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
