"""stree.vllm.cpu_spec without an engine: vLLM's speculative Mamba2 decode ops on CPU (batched over
the requests of a step) against a per-request, per-token recurrence written here, on vLLM's
layouts: requests start from the state their accepted prefix left (conv window at column offset
``num_accepted - 1``, SSM slot ``num_accepted - 1``), write the state after each token to their
own slots, and padding rows (vLLM's null block) are left alone."""
import torch
import torch.nn.functional as F

from stree.vllm.cpu_spec import spec_conv_update, spec_state_update

NULL = 0  # vLLM's null block id: slot 0 is never a request's
DIM, WIDTH, K = 6, 4, 2
H, P, N, G = 4, 3, 5, 2


def _case(lengths, accepted, seed=0):
    """Requests with query ``lengths`` (0 or None: a padding row on the null block) and accepted
    counts; slots 1.. for conv and disjoint (1 + K)-slot runs for the SSM state."""
    g = torch.Generator().manual_seed(seed)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + (length or 0))
    rows = len(lengths)
    conv_slots = torch.tensor([NULL if not n else 1 + i for i, n in enumerate(lengths)])[:, None]
    ssm_slots = torch.tensor([[NULL] * (1 + K) if not n else [1 + i * (1 + K) + t for t in range(1 + K)]
                              for i, n in enumerate(lengths)])
    return dict(g=g, starts=starts, rows=rows, conv_slots=conv_slots, ssm_slots=ssm_slots,
                accepted=torch.tensor(accepted), tokens=starts[-1])


def _conv_reference(x, conv_state, weight, bias, c):
    out, state = torch.zeros_like(x), conv_state.clone()
    for i in range(c["rows"]):
        slot, bos, eos = int(c["conv_slots"][i, 0]), c["starts"][i], c["starts"][i + 1]
        if slot == NULL or eos == bos:
            continue
        a = int(c["accepted"][i])
        inputs = list(conv_state[slot, :, a - 1:a - 1 + WIDTH - 1].T) + list(x[bos:eos])  # oldest first
        for t in range(eos - bos):
            window = torch.stack(inputs[t:t + WIDTH])  # (WIDTH, DIM)
            out[bos + t] = F.silu((window.T * weight).sum(-1) + bias)
        kept = torch.stack(inputs[1:]).T  # the old window less its first column, then the tokens
        state[slot, :, :kept.shape[1]] = kept
    return out, state


def test_conv_update_equals_per_request_recurrence():
    for lengths, accepted in [([3, 3, None, 3], [1, 3, 1, 2]), ([3, 1, 2], [2, 1, 3])]:  # one group; mixed
        c = _case(lengths, accepted)
        g = c["g"]
        x = torch.randn(c["tokens"], DIM, generator=g)
        conv_state = torch.randn(1 + len(lengths), DIM, WIDTH - 1 + K, generator=g)
        weight, bias = torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g)
        want_out, want_state = _conv_reference(x, conv_state, weight, bias, c)
        got_state = conv_state.clone()
        out = spec_conv_update(x, got_state, weight, bias, "silu", c["conv_slots"], c["accepted"],
                               torch.tensor(c["starts"]), NULL)
        valid = torch.cat([torch.arange(c["starts"][i], c["starts"][i + 1]) for i in range(c["rows"])])
        torch.testing.assert_close(out[valid], want_out[valid])
        torch.testing.assert_close(got_state, want_state)


def _scan_reference(state, x, dt, A, B, C, D, dt_bias, c):
    out, state = torch.zeros_like(x), state.clone()
    for i in range(c["rows"]):
        bos, eos = c["starts"][i], c["starts"][i + 1]
        slots = c["ssm_slots"][i].tolist()
        if slots[0] == NULL or eos == bos:
            continue
        h = state[slots[max(int(c["accepted"][i]) - 1, 0)]].clone()
        for t in range(eos - bos):
            k = bos + t
            for head in range(H):
                grp = head // (H // G)
                delta = F.softplus(dt[k, head] + dt_bias[head])  # (P,)
                h[head] = h[head] * torch.exp(delta[:, None] * A[head]) + (delta * x[k, head])[:, None] * B[k, grp]
                out[k, head] = h[head] @ C[k, grp] + D[head] * x[k, head]
            state[slots[t]] = h
    return out, state


def test_state_update_equals_per_request_recurrence():
    for lengths, accepted in [([3, None, 3, 3], [2, 1, 1, 3]), ([1, 3, 2], [3, 2, 1])]:
        c = _case(lengths, accepted, seed=1)
        g = c["g"]
        T = c["tokens"]
        state = torch.randn(1 + len(lengths) * (1 + K), H, P, N, generator=g)
        x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, P, generator=g)
        A = -torch.rand(H, 1, 1, generator=g).expand(H, P, N)  # vLLM's per-head-dim expanded A
        B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
        D, dt_bias = torch.randn(H, 1, generator=g).expand(H, P), torch.randn(H, 1, generator=g).expand(H, P)
        want_out, want_state = _scan_reference(state, x, dt, A, B, C, D, dt_bias, c)
        got_state, out = state.clone(), torch.zeros_like(x)
        spec_state_update(got_state, x, dt, A, B, C, D, dt_bias, True, c["ssm_slots"], c["accepted"],
                          torch.tensor(c["starts"]), out, NULL)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(got_state, want_state)


def test_one_token_calls_take_vllms_own_ops_from_the_accepted_state(monkeypatch):
    """A speculative call where every request has one token (no drafts this step) runs vLLM's own
    C++ ops after moving each request's window and state to column 0: the same tokens and states
    as the per-request recurrence, after an acceptance of 1, 2 or 3 tokens."""
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    from vllm.config.mamba import MambaConfig
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    import stree.vllm.cpu_spec as cpu_spec

    cpu_spec.patch_cpu_spec_ops()
    # what vLLM's CPU worker selects at start-up (the C++ kernel)
    monkeypatch.setattr(ssu_dispatch, "_mamba_ssu_backend", ssu_dispatch.CPUSSUBackend(MambaConfig()))

    def unexpected(*args, **kwargs):
        raise AssertionError("a one-token call took the speculative path")

    monkeypatch.setattr(cpu_spec, "spec_conv_update", unexpected)
    monkeypatch.setattr(cpu_spec, "spec_state_update", unexpected)
    lengths, accepted = [1, 1, 1, 1], [1, 3, 1, 2]
    c = _case(lengths, accepted, seed=2)
    g, T = c["g"], c["tokens"]
    starts = torch.tensor(c["starts"], dtype=torch.int32)
    x = torch.randn(T, DIM, generator=g)
    conv_state = torch.randn(1 + len(lengths), WIDTH - 1 + K, DIM, generator=g).transpose(1, 2)  # vLLM's layout
    weight, bias = torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g)
    want_out, want_state = _conv_reference(x, conv_state, weight, bias, c)
    got = conv_state.clone()
    wide = c["conv_slots"].int().repeat(1, 1 + K)  # a (b, 1 + K) table: its first column is strided
    out = mixer2.causal_conv1d_update(x, got, weight, bias, "silu", conv_state_indices=wide,
                                      num_accepted_tokens=c["accepted"].int(), query_start_loc=starts,
                                      null_block_id=NULL)
    torch.testing.assert_close(out, want_out)
    slots = c["conv_slots"][:, 0]
    # the window the next step reads, columns 0 .. WIDTH - 2 (vLLM's op leaves the columns after it)
    torch.testing.assert_close(got[slots, :, :WIDTH - 1], want_state[slots, :, :WIDTH - 1])

    state = torch.randn(1 + len(lengths) * (1 + K), H, P, N, generator=g)
    xs, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, 1, generator=g).expand(T, H, P)  # dt per head
    A = -torch.rand(H, 1, 1, generator=g).expand(H, P, N)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    D, dt_bias = torch.randn(H, 1, generator=g).expand(H, P), torch.randn(H, 1, generator=g).expand(H, P)
    want_out, want_state = _scan_reference(state, xs, dt, A, B, C, D, dt_bias, c)
    got, out = state.clone(), torch.zeros_like(xs)
    mixer2.selective_state_update(got, xs, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True,
                                  state_batch_indices=c["ssm_slots"].int(), dst_state_batch_indices=c["ssm_slots"].int(),
                                  null_block_id=NULL, out=out, num_accepted_tokens=c["accepted"].int(), cu_seqlens=starts)
    torch.testing.assert_close(out, want_out)
    first = c["ssm_slots"][:, 0]  # each request's state after its one token
    torch.testing.assert_close(got[first], want_state[first])
