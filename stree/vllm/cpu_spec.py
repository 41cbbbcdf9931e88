"""vLLM 0.32's CPU Mamba2 decode ops, completed for speculative decoding (why its output was lossy).

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
calls with it to :func:`spec_conv_update` / :func:`spec_state_update`, plain PyTorch loops that
follow the Triton kernels' contract.

Sampled speculation (T > 0) was lossy for every model: the rejection sampler spreads each
request's temperature (and top-k, top-p) over its draft positions with ``expand_kernel``, whose
CPU replacement (``cpu_triton_utils._expand_kernel_impl``) hands the C++ op int64 *copies* of a
float output and input; the op writes into the copy, and the float output keeps whatever memory
``torch.empty`` gave it, so the target logits are divided by garbage before acceptance and the
recovered-token draws. :func:`expand_impl` replaces it (a chi-square test of the sampled output
against the exact distribution fails without it and passes with it).

Prefix caching of Mamba state ("align" mode, vLLM's default when prefix caching is on) does not
work on the CPU build: under speculation it moves the accepted state between blocks with fused
Triton kernels only (``'function' object is not subscriptable`` in ``run_fused_precopy`` on the
first speculative step), and even without speculation a prompt longer than a few blocks fails in
the prefill (the CPU chunk scan returns final states only, where "align" mode indexes per-chunk
checkpoints: ``index 1 is out of bounds`` in ``conv_ssm_forward``). :func:`patch_cpu_prefix_caching`
turns prefix caching off, with a warning, for Mamba models on CPU.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


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
    slots = conv_state_indices[:, 0].tolist()
    accepted = num_accepted_tokens.tolist()
    for i, slot in enumerate(slots[:len(starts) - 1]):
        bos, eos = starts[i], starts[i + 1]
        if slot == null_block_id or eos == bos:
            continue
        offset = accepted[i] - 1
        window = conv_state[slot, :, offset:offset + width - 1]
        full = torch.cat([window, x[bos:eos].T.to(conv_state.dtype)], dim=-1)  # (dim, width - 1 + L)
        y = F.conv1d(full[None], weight[:, None, :].to(full.dtype), bias, groups=full.shape[0])[0]
        out[bos:eos] = (F.silu(y) if activation in ("silu", "swish", True) else y).T.to(x.dtype)
        conv_state[slot, :, :full.shape[1] - 1] = full[:, 1:]
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
    rows = state_batch_indices.tolist()
    accepted = num_accepted_tokens.tolist()
    heads_per_group = x.shape[1] // B.shape[1]
    for i in range(len(starts) - 1):
        bos, eos = starts[i], starts[i + 1]
        if eos == bos or rows[i][0] == null_block_id:
            continue
        s = state[rows[i][max(accepted[i] - 1, 0)]].float()
        for t in range(eos - bos):
            k = bos + t
            delta = (dt[k] + dt_bias if dt_bias is not None else dt[k]).float()
            if dt_softplus:
                delta = F.softplus(delta)
            b_t, c_t = (v[k].float().repeat_interleave(heads_per_group, 0)[:, None, :] for v in (B, C))
            s = s * torch.exp(delta[..., None] * A) + (delta * x[k].float())[..., None] * b_t
            y = (s * c_t).sum(-1)
            out[k] = (y + D * x[k] if D is not None else y).to(out.dtype)
            state[rows[i][t]] = s.to(state.dtype)
    return out


def patch_cpu_spec_ops() -> None:
    """Route vLLM's CPU Mamba2 decode ops through the functions above when speculating."""
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import NULL_BLOCK_ID

    original = mixer2.causal_conv1d_update
    if getattr(original, "_stree", False):
        return
    original_ssu = mixer2.selective_state_update

    def conv_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None,
                    num_accepted_tokens=None, query_start_loc=None, null_block_id=NULL_BLOCK_ID, **kwargs):
        if num_accepted_tokens is None or query_start_loc is None:
            return original(x, conv_state, weight, bias, activation, conv_state_indices=conv_state_indices,
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
        return spec_state_update(state, x, dt, A, B, C, D, dt_bias, dt_softplus, state_batch_indices,
                                 num_accepted_tokens, cu_seqlens, out, null_block_id)

    conv_update._stree = True
    mixer2.causal_conv1d_update = conv_update
    mixer2.selective_state_update = state_update


def patch_cpu_prefix_caching() -> None:
    """Turn prefix caching off for Mamba models on CPU (see the module docstring)."""
    from vllm.model_executor.models.config import MambaModelConfig

    original = MambaModelConfig.verify_and_update_config.__func__
    if getattr(original, "_stree", False):
        return

    def verify_and_update_config(cls, vllm_config) -> None:
        cache = vllm_config.cache_config
        if cache.enable_prefix_caching:
            logger.warning("stree: prefix caching turned off: vLLM's CPU build cannot cache Mamba state "
                           "by prefix (see stree/vllm/cpu_spec.py)")
            cache.enable_prefix_caching = False
        original(cls, vllm_config)

    verify_and_update_config._stree = True
    MambaModelConfig.verify_and_update_config = classmethod(verify_and_update_config)


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
