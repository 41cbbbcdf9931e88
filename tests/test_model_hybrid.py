"""Tree forward and commit for the MambaInLlama hybrid, against its own token-by-token decoding
(``step``: Mamba layers by the recurrence, attention by plain causal attention over its cache)."""
import copy
import random

import pytest
import torch

import stree
from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM
from stree.tree import TokenTree

VOCAB = 53


def make_hybrid(attn_layers, n_layer=4, seed=0, rope_scaling=None):
    torch.manual_seed(seed)
    cfg = MambaInLlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                             attn_layers=tuple(attn_layers), d_state=16, rope_scaling=rope_scaling,
                             max_position_embeddings=512)  # its context limit: > every test's length
    model = MambaInLlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the init so every path matters
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


class StepOracle:
    """The hybrid decoded token by token through its own ``step``; forkable."""

    def __init__(self, model, max_seqlen=128):
        self.model = model
        self.cache = model.allocate_inference_cache(1, max_seqlen)

    def fork(self):
        other = copy.copy(self)
        other.cache = copy.deepcopy(self.cache)
        return other

    @torch.no_grad()
    def feed(self, tokens):
        return torch.stack([self.model.step(torch.tensor([[int(t)]]), self.cache)[0, -1].float()
                            for t in tokens])

    def node_logits(self, tree, row=0):
        out = []
        for i in range(tree.num_nodes):
            path = [int(j) for j in tree.paths[row, i] if j >= 0]
            out.append(self.fork().feed([int(tree.tokens[row, j]) for j in path])[-1])
        return torch.stack(out)


def close(a, b, what, atol=2e-4):
    err = (a - b).abs().max().item()
    assert err <= atol, f"{what}: max abs error {err:.3g}"


def check_states(model, cache, oracle, row=0):
    ref = oracle.cache
    t = ref.seqlen
    assert cache.seqlens[row] == t
    for i, st in cache.layers.items():
        r = ref.layers[i]
        if hasattr(st, "ssm_state"):
            close(st.ssm_state[row], r.ssm_state[0], f"layer {i} ssm_state")
            close(st.conv_state[row], r.conv_state[0], f"layer {i} conv_state")
        else:
            close(st.k[row, :, :t], r.k[0, :, :t], f"layer {i} K")
            close(st.v[row, :, :t], r.v[0, :, :t], f"layer {i} V")


LAYOUTS = {"0pct-attn": (), "25pct-attn": (2,), "50pct-attn": (1, 3), "100pct-attn": (0, 1, 2, 3)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_tree_logits_and_commit_match_step_decoding(layout):
    rng = random.Random(3)
    model = stree.patch(make_hybrid(LAYOUTS[layout]))
    cache = model.allocate_tree_cache(1, 128)
    oracle = StepOracle(model)
    prompt = [rng.randrange(VOCAB) for _ in range(5)]
    close(model.prefill(torch.tensor([prompt]), cache)[0], oracle.feed(prompt), "prefill logits")
    check_states(model, cache, oracle)
    for rnd, n in enumerate([11, 6, 16]):
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tree = TokenTree(torch.tensor([rng.randrange(VOCAB) for _ in range(n)]), parents)
        close(model.tree_forward(tree, cache)[0], oracle.node_logits(tree), f"round {rnd} logits")
        leaf = max(range(n), key=lambda i: int(tree.depth[0, i]))
        path = [int(j) for j in tree.paths[0, leaf] if j >= 0]
        cache.commit(torch.tensor([path]))
        oracle.feed([int(tree.tokens[0, j]) for j in path])
        check_states(model, cache, oracle)


def test_positions_follow_depth_not_packing_order():
    """Nodes at equal depth but far apart in the packing must get the same rotary position: a
    star's leaves equal a 2-token decode of each leaf, whatever its packed index."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    model = stree.patch(make_hybrid((1, 3), seed=4, rope_scaling=rope))
    cache = model.allocate_tree_cache(1, 64)
    oracle = StepOracle(model)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    assert model.prefill(torch.tensor([prompt]), cache, logits=False) is None  # commits only
    oracle.feed(prompt)
    tree = TokenTree(torch.tensor([7] + list(range(10, 22))), [-1] + [0] * 12)
    close(model.tree_forward(tree, cache)[0], oracle.node_logits(tree), "star leaves")


def test_batch_of_two_with_ragged_prompts():
    rng = random.Random(5)
    model = stree.patch(make_hybrid((1,), seed=5))
    cache = model.allocate_tree_cache(2, 64)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (2, 9)]
    prefill = model.prefill([torch.tensor(p) for p in prompts], cache)
    oracles = [StepOracle(model) for _ in prompts]
    for r, (o, p) in enumerate(zip(oracles, prompts)):  # each row's logits, then NaN padding
        close(prefill[r, :len(p)], o.feed(p), f"row {r} prefill logits")
        assert prefill[r, len(p):].isnan().all()
    for _ in range(2):
        parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 2, 0, 4]])
        tree = TokenTree(torch.randint(0, VOCAB, (2, 6)), parents)
        logits = model.tree_forward(tree, cache)
        paths = [[0, 1, 3, 4], [0, 4]]
        for r in range(2):
            close(logits[r], oracles[r].node_logits(tree, row=r), f"row {r} logits")
        cache.commit(torch.tensor([paths[0], paths[1] + [-1, -1]]))
        for r in range(2):
            oracles[r].feed([int(tree.tokens[r, j]) for j in paths[r]])
            check_states(model, cache, oracles[r], row=r)


SLOTS = [3, 0]  # the pooled rows' slots: not contiguous, so the cache gathers and scatters them


@pytest.mark.parametrize("pooled", [False, True], ids=["rows", "pool-slots"])
def test_root_only_trees_step_and_commit_per_row(pooled):
    """A step that drafted nothing (a root-only tree: the recurrence from the committed state, the
    commit copies the state after the root in) between tree steps, on a batch of two where one row
    commits nothing some steps (a finished row), through plain rows and non-contiguous pool slots."""
    rng = random.Random(7)
    model = stree.patch(make_hybrid((1,), seed=7))
    pool = model.allocate_state_pool(5, 64) if pooled else None
    cache = pool.cache(SLOTS) if pooled else model.allocate_tree_cache(2, 64)
    prompts = [[rng.randrange(VOCAB) for _ in range(k)] for k in (3, 8)]
    model.prefill([torch.tensor(p) for p in prompts], cache, logits=False)
    oracles = [StepOracle(model) for _ in prompts]
    for o, p in zip(oracles, prompts):
        o.feed(p)
    for rnd, (n, accept) in enumerate([(1, [1, 1]), (1, [1, 0]), (4, [2, 3]), (1, [0, 1]), (1, [1, 1])]):
        parents = torch.tensor([[-1, 0, 1, 0][:n]] * 2)
        tree = TokenTree(torch.randint(0, VOCAB, (2, n)), parents)
        logits = model.tree_forward(tree, cache)
        for r in range(2):
            close(logits[r], oracles[r].node_logits(tree, row=r), f"round {rnd} row {r} logits")
        paths = [[0, 1, 2][:a] + [-1] * (max(accept) - a) for a in accept]
        cache.commit(torch.tensor(paths), counts=accept)
        for r in range(2):
            if accept[r]:
                oracles[r].feed([int(tree.tokens[r, j]) for j in paths[r] if j >= 0])
            # row r alone (for the pool, its slot's own view): the state it left behind
            check_states(model, pool.cache([SLOTS[r]], seqlens=[cache.seqlens[r]]) if pooled else cache.row(r),
                         oracles[r], row=0)


def test_patched_hybrid_generate_is_unchanged():
    model = make_hybrid((1,), seed=6)
    ids = torch.tensor([[1, 2, 3]])
    before = model.generate(ids, max_new_tokens=6)
    stree.patch(model)
    assert torch.equal(model.generate(ids, max_new_tokens=6), before)
