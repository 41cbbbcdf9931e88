"""Prefix caching of Mamba2 state inside vLLM on the CPU, with and without ``method: "stree"``.

A three-turn conversation (each turn's prompt is the last prompt, its output and the user's next
tokens) on a tiny random GraniteMoeHybrid target (Mamba2 layers beside attention; vLLM's block,
and so its cache granularity, is 128 tokens there) and on an attention-free ``Mamba2ForCausalLM``
(16 tokens), vLLM's "align" mode at its default retention (the state at each prompt's last block
boundary). Later turns hit the cache as often with stree's trees as without speculation (turn 2
the state after 128 tokens that turn 1's prefill stored, turn 3 after 256 from turn 2's), and the
greedy output equals the output with prefix caching off. One child process per target, its
engines one after another. A retention that caches inside decode steps is refused with stree's
trees. Without an engine: the CPU wrappers that make this run
(stree.vllm.cpu_prefix_cache): the prefill's per-chunk states, and the block copies of a speculative
step."""
import pytest
import torch

import stree  # noqa: F401  (before transformers: its torch paths)

from tests.vllm import engine
from tests.vllm.test_engine_families import _granite, _mamba2, _perturbed

FIRST = [3 + (i * 7) % 55 for i in range(140)]  # turn 1's prompt: 140 tokens
TURNS = [[5 + i % 50 for i in range(76)], [6, 7, 8, 9]]  # the user's tokens of turns 2 and 3
GREEDY = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
HITS = [0, 128, 256]  # turn 2's prompt: 264 tokens, turn 3's: 316


@pytest.mark.parametrize("build", [_granite, _mamba2], ids=["granitemoehybrid", "mamba2"])
def test_later_turns_hit_the_cache_with_stree(tmp_path, build):
    torch.manual_seed(0)
    build().save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    _perturbed(build(), scale=0.1).save_pretrained(tmp_path / "draft")  # some drafts accepted, not all
    base = {"model": str(tmp_path / "target"), "skip_tokenizer_init": True}
    stree_spec = {"method": "stree", "model": str(tmp_path / "draft"), "tree": "caterpillar:2,2,2"}
    configs = [(False, {}), (True, {"speculative_config": stree_spec})]
    if build is _granite:  # without speculation too (the same hits on Mamba2ForCausalLM, measured)
        configs.insert(1, (True, {}))
    runs = [{"engine": {**base, "enable_prefix_caching": caching, **extra}, "prompts": [FIRST], "turns": TURNS,
             "sampling": GREEDY} for caching, extra in configs]
    off, *plain, speculative = engine.result(engine.run({"runs": runs}))["runs"]
    assert off["cached"] == [0, 0, 0]
    assert speculative["cached"] == HITS  # as often as without speculation: vLLM's rule for the prompts
    assert speculative["tokens"] == off["tokens"]
    for out in plain:
        assert out["cached"] == HITS and out["tokens"] == off["tokens"]
    counts = speculative["spec"]
    assert 0 < counts["vllm:spec_decode_num_accepted_tokens"] < counts["vllm:spec_decode_num_draft_tokens"]
    assert counts["vllm:prefix_cache_hits"] == sum(HITS)



def test_retention_inside_decode_steps_refused_with_stree_trees(tmp_path):
    """A retention that also caches states at boundaries inside decode steps
    (``prefix_cache_retention_interval`` None: every block) is refused at start-up with stree's
    trees, whose commit writes the accepted path's last state only; a chain verified by vLLM
    (``"verifier": "sps"``, its ops write every state slot) runs."""
    torch.manual_seed(0)
    _mamba2().save_pretrained(tmp_path / "target")
    base = {"model": str(tmp_path / "target"), "skip_tokenizer_init": True, "enable_prefix_caching": True,
            "prefix_cache_retention_interval": None}
    spec = {"method": "stree", "model": str(tmp_path / "target")}
    proc = engine.run({"engine": {**base, "speculative_config": {**spec, "tree": "caterpillar:2,2,2"}},
                       "prompts": [FIRST], "sampling": GREEDY})
    assert proc.returncode != 0 and engine.MARK not in proc.stdout
    assert ("prefix_cache_retention_interval=None with speculative_config method 'stree' verifying trees"
            in proc.stderr)
    out = engine.result(engine.run({"engine": {**base, "speculative_config": {**spec, "tree": "chain:4",
                                                                               "verifier": "sps"}},
                                    "prompts": [FIRST], "sampling": {**GREEDY, "max_tokens": 8}}))
    assert len(out["tokens"][0]) == 8

def test_chunk_states_are_the_states_after_each_chunk():
    """:func:`chunk_states` over vLLM's CPU chunk scan: two sequences (one from an initial state)
    cut into chunks of uneven lengths; each chunk's state equals the scan of its sequence up to
    the chunk's end, and the outputs and final states equal one call without intermediate states
    (up to rounding: measured 4e-6)."""
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen as scan

    from stree.vllm.cpu_prefix_cache import chunk_states

    g = torch.Generator().manual_seed(0)
    h, p, n, groups = 4, 8, 16, 2
    lengths, cuts = [11, 7], [[0, 4, 8, 11], [0, 5, 7]]  # chunk boundaries within each sequence
    tokens = sum(lengths)
    x, dt = torch.randn(tokens, h, p, generator=g), torch.randn(tokens, h, generator=g)
    B, C = torch.randn(tokens, groups, n, generator=g), torch.randn(tokens, groups, n, generator=g)
    A, D, dt_bias = -torch.rand(h, generator=g), torch.randn(h, generator=g), torch.randn(h, generator=g)
    h0 = torch.randn(2, h, p, n, generator=g)
    h0[0] = 0
    cu = torch.tensor([0, 11, 18], dtype=torch.int32)
    bounds = [c for c in cuts[0][:-1]] + [11 + c for c in cuts[1][:-1]] + [18]
    owner = [0, 0, 0, 1, 1]
    args = dict(D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=h0)

    def run(x, dt, B, C, cu, init, intermediate=False, bounds=None, owner=None):
        out = torch.empty(len(x), h, p)
        chunks = torch.tensor(bounds or cu.tolist(), dtype=torch.int32)
        seq = torch.tensor(owner or list(range(len(cu) - 1)), dtype=torch.int32)
        last = torch.tensor([max(i for i, o in enumerate(seq.tolist()) if o == s) for s in range(len(cu) - 1)])
        states = chunk_states(scan, x, dt, A, B, C, 8, cu, chunks, last, seq, out,
                              **{**args, "initial_states": init}, return_intermediate_states=intermediate)
        return out, states

    out, states = run(x, dt, B, C, cu, h0, intermediate=True, bounds=bounds, owner=owner)
    want_out, want_final = run(x, dt, B, C, cu, h0)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(states[[2, 4]], want_final)
    for c, (s, end) in enumerate(zip(owner, bounds[1:])):  # the scan of the sequence's prefix
        start = cu[s].item()
        _, prefix = run(x[start:end], dt[start:end], B[start:end], C[start:end],
                        torch.tensor([0, end - start], dtype=torch.int32), h0[s:s + 1])
        torch.testing.assert_close(states[c], prefix[0])


def test_align_moves_copy_the_boundary_state_its_block_holds():
    """The decisions of vLLM's align postprocess (:func:`align_moves`), block size 16: a step
    whose accepted tokens reach a boundary copies the state at that boundary (table column
    ``boundary - running``) to the boundary's block; a step short of one copies nothing."""
    from stree.vllm.cpu_prefix_cache import align_moves

    # running: tokens through the step's root; state column t holds the state after running + t
    moves, accepted = align_moves(num_accepted=[4, 2, 4, 1], state_cols=[1, 1, 2, 0], running=[15, 14, 32, 16],
                                  block_size=16)
    assert moves == [(0, 1, 0, 1),  # after 15 + 3 tokens: the state after 16 (column 1) into block 0
                     (2, 2, 1, 0)]  # the root itself ends block 1: column 0
    assert accepted == [4, 2, 4, 1]  # the running block (column 0 of the table) moves in the next preprocess
