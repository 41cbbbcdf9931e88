"""The Gated DeltaNet tree rows inside vLLM without an engine (stree.vllm.delta_rows): node outputs
against the gated delta rule run token by token along each root-to-node path (written here), the
commit against the same rule along the accepted path, in vLLM's state layouts; one-token rows run
and committed at once. The requests of tests/vllm/test_trees.py: two trees of one shape and a
chain."""
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from stree.vllm.conv_rows import tree_conv_rows
from stree.vllm.delta_rows import DeltaShape, single_rows, tree_delta_rows
from tests.vllm.test_trees import PARENTS, REQUESTS, STARTS, TOKENS, _accept, _path, _step

HK, HV, DK, DV, WIDTH = 2, 4, 8, 6, 4
DIM = 2 * HK * DK + HV * DV


def _layer(seed: int = 0):
    torch.manual_seed(seed)
    return dict(weight=torch.randn(DIM, WIDTH) * 0.5, bias=None, A_log=torch.randn(HV) * 0.5,
                dt_bias=torch.randn(HV) * 0.5)


def _shape(layer) -> DeltaShape:
    return DeltaShape(SimpleNamespace(A_log=layer["A_log"], dt_bias=layer["dt_bias"]), HV, HK, DK, DV)


def _rule(layer, window, S0, x, a, b, tokens):
    """The conv and the rule token by token from ``window (dim, width - 1)`` and ``S0 (HV, DK,
    DV)`` over ``tokens``, in float64: ``(outputs (len, HV, DV), final state)``."""
    f64 = torch.float64
    w, S, seq, outs = layer["weight"].to(f64), S0.to(f64).clone(), window.to(f64), []
    for i in tokens:
        seq = torch.cat([seq, x[i].to(f64)[:, None]], dim=1)
        conv = F.silu((seq[:, -WIDTH:] * w).sum(-1))
        q, k, v = conv.split([HK * DK, HK * DK, HV * DV])
        q, k = (F.normalize(t.view(HK, DK), dim=-1, eps=1e-12).repeat_interleave(HV // HK, 0) for t in (q, k))
        q, v = q * DK ** -0.5, v.view(HV, DV)
        g = -layer["A_log"].to(f64).exp() * F.softplus(a[i].to(f64) + layer["dt_bias"].to(f64))
        beta = b[i].to(f64).sigmoid()
        S = S * g.exp()[:, None, None]
        u = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
        S = S + k[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q))
    return torch.stack(outs), S


def test_tree_rows_equal_each_path_as_a_sequence_and_commit_one_slot():
    layer, k = _layer(), len(PARENTS) - 1
    conv_state, state = torch.randn(5, DIM, WIDTH - 1 + k), torch.randn(30, HV, DK, DV) * 0.3
    before_conv, before = conv_state.clone(), state.clone()
    x, a, b = torch.randn(TOKENS, DIM), torch.randn(TOKENS, HV), torch.randn(TOKENS, HV)
    conv_slots, accepted = [1, 4, 2], [2, 1, 3]
    slots = [[c] + list(range(s, s + k)) for c, s in zip(conv_slots, (10, 0, 20))]
    step = _step()
    rows = step.recurrent_rows(torch.tensor(STARTS + [TOKENS]), torch.tensor(slots), torch.tensor(accepted), -1)
    conv = tree_conv_rows(x, conv_state, layer["weight"], None, "silu", rows, step)
    out = torch.full((TOKENS, HV, DV), float("nan"))
    tree_delta_rows(_shape(layer), conv, a, b, state, rows, step, out)
    assert torch.equal(state, before) and torch.equal(conv_state, before_conv)  # nothing written
    for (parents, _), start, own, c, acc in zip(REQUESTS, STARTS, slots, conv_slots, accepted):
        window, S0 = before_conv[c, :, acc - 1:acc - 1 + WIDTH - 1], before[own[acc - 1]]
        for node in range(len(parents)):
            want = _rule(layer, window, S0, x, a, b, [start + i for i in _path(parents, node)])[0][-1]
            torch.testing.assert_close(out[start + node].double(), want, rtol=1e-4, atol=1e-4)
    _accept(step)
    step.commit()
    for (parents, path), start, own, c, acc in zip(REQUESTS, STARTS, slots, conv_slots, accepted):
        window, S0 = before_conv[c, :, acc - 1:acc - 1 + WIDTH - 1], before[own[acc - 1]]
        want = _rule(layer, window, S0, x, a, b, [start + i for i in path])[1]
        n = len(path) - 1  # vLLM reads slot and conv column num_accepted - 1 = n next step
        torch.testing.assert_close(state[own[n]].double(), want, rtol=1e-4, atol=1e-4)
        others = [s for j, s in enumerate(own) if j != n and s not in own[:j]]
        assert torch.equal(state[others], before[others])  # one slot written per request
        seq = torch.cat([window, x[start:start + len(parents)][path].T], dim=1)[:, -(WIDTH - 1):]
        torch.testing.assert_close(conv_state[c, :, n:n + WIDTH - 1], seq)


def test_one_token_rows_run_and_commit_at_once():
    layer, k = _layer(1), 3
    conv_state, state = torch.randn(4, DIM, WIDTH - 1 + k), torch.randn(12, HV, DK, DV) * 0.3
    before_conv, before = conv_state.clone(), state.clone()
    x, a, b = torch.randn(5, DIM), torch.randn(5, HV), torch.randn(5, HV)
    tokens, table, accepted = torch.tensor([1, 3]), torch.tensor([[2, 5, 6, 7], [0, 8, 9, 10]]), torch.tensor([3, 1])
    out = torch.full((5, HV, DV), float("nan"))
    single_rows(_shape(layer), x, a, b, tokens, table, accepted, conv_state, layer["weight"], None, state, out)
    for t, row, acc in zip(tokens.tolist(), table.tolist(), accepted.tolist()):
        window = before_conv[row[0], :, acc - 1:acc - 1 + WIDTH - 1]
        o, S = _rule(layer, window, before[row[acc - 1]], x, a, b, [t])
        torch.testing.assert_close(out[t].double(), o[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(state[row[0]].double(), S, rtol=1e-4, atol=1e-4)  # slot 0: one token accepted
        torch.testing.assert_close(conv_state[row[0], :, :WIDTH - 1], torch.cat([window, x[t][:, None]], 1)[:, 1:])
    assert torch.isnan(out[[0, 2, 4]]).all()  # other rows untouched
