"""vLLM 0.32's prefix caching of Mamba state on the CPU build. Its "align" mode (its only one, the
default with prefix caching on: the state at block boundaries, by default only the boundary before
each prompt's last token) did not run there; :func:`patch_cpu_prefix_caching` makes it run for
Mamba2 models, with and without speculation:

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

logger = logging.getLogger(__name__)


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
                           "prefix caching run for Mamba2 models only (see stree/vllm/cpu_prefix_cache.py)", arch)
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
