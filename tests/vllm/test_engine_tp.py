"""Tensor parallelism: stree's trees at ``tensor_parallel_size=2`` give the TP=1 greedy output (vLLM's
own decoding without speculation) token for token:

- a ``Mamba2ForCausalLM`` target with ``n_groups=1`` (vLLM replicates the group on both ranks) and
  ``static:fig4a`` drafted by a perturbed copy; beside the greedy requests two sampled ones
  without a seed of their own (before the fix rank 1's proposer drew another tree than the
  scheduled one, rank 0's, raised, and the engine hung until vLLM's RPC timeout);
- a ``Mamba2ForCausalLM`` target with ``n_groups=2`` (a group per rank) and ``suffix:16``, no
  draft model;
- a ``GraniteMoeHybridForCausalLM`` target (Mamba2 layers, attention with its KV heads sharded,
  MoE) and ``caterpillar:2,2,2+suffix:16``: a draft model's tree and a suffix tree, merged;
- a ``Qwen3_5ForCausalLM`` target (Gated DeltaNet layers, bf16: vLLM's CPU GDN op runs nothing
  else; one key head and two value heads a rank) and ``caterpillar:2,2+suffix:16`` drafted by a
  perturbed copy (both kinds of tree rows): equal to TP=1 up to bf16 near-ties. Every request that
  differs must stay near-greedy for the fp32 model from its first difference on (tests/vllm/gdn.py's
  check, whose control in tests/vllm/test_engine_gdn.py fails on a wrong state); how many differ
  is not bounded, since bf16 all-reduces round with the CPU: none on this one, three of five on
  CI's (vLLM's own decoding at TP=2 differs from its TP=1 output too);
- a MambaInLlama target at TP=2: refused by stree's model class with its reason.

Five greedy requests of 16 to 32 tokens, four at a time, the last drafting from the engine's cache
of earlier outputs in the suffix trees' cases.

On this CPU vLLM runs TP=2 over gloo, one worker process per rank, each on one core
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every engine but the refused one runs in one child process,
one after another (tests/vllm/engine.py's ``"runs"``): vLLM is imported once, and a TP=2 engine
costs its two workers' start. Mamba heads, groups, attention, KV and GDN heads all divide by 2; the
attention heads are 32 or 64 wide (vLLM's CPU attention needs head_dim >= 32), the Mamba heads 16
or 32, the GDN heads 64 (vLLM's CPU GDN op needs them).
"""
import os

import pytest
import torch

import stree  # noqa: F401  (before transformers: its torch paths)

from tests.vllm import engine, gdn
from tests.vllm.test_engine_families import VOCAB, _granite, _perturbed

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="TP=2 binds one core per rank")

BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# four at a time (max_num_seqs=4): the fifth, a copy of the first, starts when a slot frees (the
# first is the shortest) and its suffix trees draft from the first's output, in the engine's cache
PROMPTS = [[5, 17, 33, 40, 5, 17, 33, 40, 5, 17], [7, 8, 9, 7, 8, 9, 7, 8], list(range(3, 40)), [30, 31],
           [5, 17, 33, 40, 5, 17, 33, 40, 5, 17]]
GREEDY = [{"temperature": 0.0, "max_tokens": n, "ignore_eos": True} for n in (16, 32, 32, 32, 32)]
SAMPLED = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}  # no seed: the proposer's generator draws
SAMPLED_PROMPTS = [[11, 12, 13, 11, 12, 13], [40, 41, 42, 43]]
# case: (target, its speculative_config, with sampled requests beside the greedy ones)
CASES = {
    "mamba2-groups1-static": ("mamba2_g1", {"tree": "static:fig4a", "model": "mamba2_g1_draft"}, True),
    "mamba2-groups2-suffix": ("mamba2_g2", {"tree": "suffix:16"}, False),
    "granite-merged": ("granite", {"tree": "caterpillar:2,2,2+suffix:16", "model": "granite_draft"}, False),
    "qwen3_5-merged": ("qwen3_5", {"tree": "caterpillar:2,2+suffix:16", "model": "qwen3_5_draft"}, False),
}
BF16 = {"qwen3_5"}  # targets vLLM runs in bf16 only on the CPU


def _mamba2(n_groups: int):
    from transformers import Mamba2Config, Mamba2ForCausalLM
    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=n_groups, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each target and a perturbed copy of it as its draft (some draft tokens accepted, some not)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tp")
    dirs = {}
    for name, build in (("mamba2_g1", lambda: _mamba2(1)), ("mamba2_g2", lambda: _mamba2(2)), ("granite", _granite)):
        torch.manual_seed(0)
        build().save_pretrained(root / name)
        torch.manual_seed(0)
        _perturbed(build(), scale=0.1).save_pretrained(root / f"{name}_draft")
        dirs[name], dirs[f"{name}_draft"] = str(root / name), str(root / f"{name}_draft")
    dirs["qwen3_5"] = gdn.qwen3_5(root / "qwen3_5")
    draft = _perturbed(AutoModelForCausalLM.from_pretrained(dirs["qwen3_5"], dtype=torch.float32), scale=0.1)
    draft.to(torch.bfloat16).save_pretrained(root / "qwen3_5_draft")
    dirs["qwen3_5_draft"] = str(root / "qwen3_5_draft")
    return dirs


def _engine(directories: dict, target: str, **kwargs) -> dict:
    dtype = {"dtype": "bfloat16"} if target in BF16 else {}
    return {"model": directories[target], "skip_tokenizer_init": True, **dtype, **kwargs}


@pytest.fixture(scope="module")
def runs(checkpoints):
    """Every case's TP=1 reference and TP=2 engine, run in one child: ``{case: (reference, tp2)}``."""
    targets = sorted({target for target, _, _ in CASES.values()})
    specs = [{"engine": _engine(checkpoints, t), "prompts": PROMPTS, "sampling": GREEDY} for t in targets]
    for target, spec, sampled in CASES.values():
        spec = {"method": "stree", **spec}
        if "model" in spec:
            spec["model"] = checkpoints[spec["model"]]
        extra = SAMPLED_PROMPTS if sampled else []
        specs.append({"engine": _engine(checkpoints, target, tensor_parallel_size=2, speculative_config=spec),
                      "prompts": PROMPTS + extra, "sampling": GREEDY + [SAMPLED] * len(extra)})
    out = engine.result(engine.run({"runs": specs, "env": BIND}, timeout=1200))["runs"]
    reference = dict(zip(targets, out))
    return {case: (reference[target], tp2) for (case, (target, _, _)), tp2 in zip(CASES.items(), out[len(targets):])}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_equals_tp1_greedy(checkpoints, runs, case):
    """The greedy requests' tokens at TP=2 equal vLLM's own at TP=1 (bf16 targets: up to fp32
    near-ties, each differing request near-greedy throughout), with drafts accepted (paths committed
    on every rank's shard);
    the sampled ones run to their end."""
    reference, tp2 = runs[case]
    target = CASES[case][0]
    if target in BF16:
        gdn.near_tie_differences(checkpoints[target], PROMPTS, reference["tokens"], tp2["tokens"][:len(PROMPTS)])
    else:
        assert tp2["tokens"][:len(PROMPTS)] == reference["tokens"]
    counts = tp2["spec"]
    assert counts["vllm:spec_decode_num_drafts"] > 0  # it speculated
    assert counts["vllm:spec_decode_num_accepted_tokens"] > 0  # and committed accepted paths under TP
    if CASES[case][2]:
        assert [len(t) for t in tp2["tokens"][len(PROMPTS):]] == [SAMPLED["max_tokens"]] * len(SAMPLED_PROMPTS)


def test_mambainllama_target_refused_at_tp2():
    """stree's MambaInLlama model runs at TP=1 only (its x/B groups would have to be repeated per
    shard): at TP=2 each rank's model refuses with that reason, in the workers' log, and the engine
    stops before generating anything."""
    proc = engine.run({"engine": {"model": "models/stree-tiny/target", "tensor_parallel_size": 2,
                                  "speculative_config": {"method": "stree", "tree": "suffix:16"}},
                       "prompts": PROMPTS[:1], "sampling": GREEDY[:1], "env": BIND})
    assert proc.returncode != 0 and engine.MARK not in proc.stdout
    log = proc.stdout + proc.stderr  # vLLM logs to stdout, the caller's traceback goes to stderr
    assert "ValueError: MambaInLlama in vLLM runs with tensor_parallel_size=1 only" in log
    assert "WorkerProc initialization failed" in proc.stderr
