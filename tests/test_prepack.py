"""stree.prepack_linears: CPU linear layers on prepacked weights give F.linear's results (fp32
tolerance) on every path, fall back where they must (gradients, small work, other dtypes), follow
weight updates, and leave a patched model's tree logits and greedy decoding as they were."""
import copy

import pytest
import torch
import torch.nn.functional as F

import stree
from stree.layers import linear as packed
from tests.test_model_hybrid import make_hybrid

pytestmark = pytest.mark.skipif(not packed.prepack_available(), reason="no oneDNN in this torch build")


@pytest.fixture
def always_pack(monkeypatch):
    """Every call takes the packed kernel (the tests' layers are below the work threshold)."""
    monkeypatch.setattr(packed, "PACK_MIN_WORK", 0)


def _linear(bias=True, out_f=48, in_f=40, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_f, out_f, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 40), (3, 5, 40), (2, 13, 40)])
def test_packed_forward_matches_f_linear(always_pack, bias, shape):
    lin = _linear(bias)
    assert stree.prepack_linears(lin) == 1 and packed.is_prepacked(lin)
    x = torch.randn(shape)
    with torch.no_grad():
        y = lin(x)
        y_strided = lin(torch.randn(shape[-1], *shape[:-1]).movedim(0, -1))  # non-contiguous input
    assert lin._stree_packed.tensor is not None  # the packed kernel ran
    assert y.shape == (*shape[:-1], 48) and y_strided.shape == y.shape
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_small_work_stays_on_f_linear():
    lin = _linear()
    stree.prepack_linears(lin)
    with torch.no_grad():
        y = lin(torch.ones(1, 40))
    assert lin._stree_packed.tensor is None  # 1 x 48 x 40 is far below PACK_MIN_WORK
    assert torch.equal(y, F.linear(torch.ones(1, 40), lin.weight, lin.bias))


@pytest.mark.parametrize("out_f, packs", [(1024, True), (384, False)])
def test_one_row_packs_from_the_crossover(out_f, packs):
    """One row on a (1024, 384) weight (0.39M elements, past PACK_MIN_WORK) takes the packed
    kernel; on a (384, 384) one (0.15M) F.linear."""
    lin = _linear(out_f=out_f, in_f=384)
    stree.prepack_linears(lin)
    x = torch.randn(1, 384)
    with torch.no_grad():
        y = lin(x)
    assert (lin._stree_packed.tensor is not None) == packs
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_gradients_take_the_plain_path(always_pack):
    lin, ref = _linear(), _linear()
    stree.prepack_linears(lin)
    x = torch.randn(4, 40)
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert lin._stree_packed.tensor is None
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


def test_weight_update_repacks(always_pack):
    lin = _linear()
    stree.prepack_linears(lin)
    x = torch.randn(6, 40)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(-2.0)  # in place (an optimiser step): same storage, new version
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight = torch.nn.Parameter(torch.randn(48, 40))  # replaced: new storage
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_swapped_bias_helper(always_pack):
    lin = _linear(bias=False)
    stree.prepack_linears(lin)
    x, b = torch.randn(5, 40), torch.randn(48)
    with torch.no_grad():
        torch.testing.assert_close(packed.linear(lin, x, b), F.linear(x, lin.weight, b), rtol=1e-5, atol=1e-5)
        assert torch.equal(packed.linear(_linear(), x, b), F.linear(x, _linear().weight, b))  # unpacked


def test_only_fp32_linears_change_and_state_dict_is_untouched():
    model = torch.nn.Sequential(_linear(), torch.nn.Linear(40, 40).to(torch.bfloat16), torch.nn.ReLU())
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert stree.prepack_linears(model) == 1
    assert stree.prepack_linears(model) == 1  # idempotent
    assert packed.is_prepacked(model[0]) and not packed.is_prepacked(model[1])
    assert model.state_dict().keys() == keys.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in keys.items())
    with torch.no_grad():
        model[0](torch.randn(2000, 40))  # packs model[0]
    copied = copy.deepcopy(model)  # the packed forward binds to the copy, which packs its own
    assert copied[0].forward.__self__ is copied[0] and copied[0]._stree_packed.tensor is None


def test_hybrid_tree_logits_and_greedy_unchanged(always_pack):
    """A prepacked hybrid's tree logits equal the plain model's, and greedy stree.generate emits the
    plain model's own greedy tokens (its step recurrence, unpacked)."""
    plain = stree.patch(make_hybrid([1], n_layer=3, seed=4))
    fast = copy.deepcopy(plain)
    assert stree.prepack_linears(fast) > 0
    prompt = torch.tensor([[3, 9, 14, 2, 7]])
    tree = stree.TokenTree(torch.tensor([5, 8, 1, 6, 2]), torch.tensor([-1, 0, 0, 1, 1]))
    with torch.no_grad():
        logits = []
        for m in (plain, fast):
            cache = m.allocate_tree_cache(1, 64)
            m.prefill(prompt, cache)
            logits.append(m.tree_forward(tree, cache))
    assert fast.lm_head._stree_packed.tensor is not None
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    draft = copy.deepcopy(fast)
    out = stree.generate(fast, draft, prompt, 24, drafter="static:fig4a")
    reference = plain.generate(prompt, 24)
    assert out.sequences[0, :out.lengths[0]].tolist() == reference[0].tolist()
