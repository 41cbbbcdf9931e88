"""Targets and drafts whose layers stree cannot verify over a tree are refused at start-up with one
error naming them and what is supported, never run: a Jamba target (Mamba-1 layers), whose tree
steps would otherwise go through vLLM's own Mamba-1 speculation over the flattened tree; a draft of a kind stree does not load; a target of
a supported architecture whose attention layers have a sliding window (refused once vLLM has
built it)."""
import json
import shutil

from stree.vllm.speculative import ARCHITECTURES

from tests.vllm import drafts, engine

PROMPTS = [[5, 17, 33, 40, 5, 17, 33, 40, 5, 17], [7, 8, 9, 7, 8, 9, 7, 8]]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
SUPPORTED = (f"Supported targets, whose layers are Mamba2 mixers, Qwen's Gated DeltaNet layers (on the CPU) and plain "
             f"causal attention: {', '.join(ARCHITECTURES)}")


def _refused_before_any_engine(engine_args: dict) -> str:
    """Run an engine in vLLM's default processes; it must stop before the engine core starts
    (nothing generated, no engine process). Returns its stderr."""
    proc = engine.run({"engine": engine_args, "prompts": PROMPTS, "sampling": GREEDY, "processes": True})
    assert proc.returncode != 0
    assert engine.MARK not in proc.stdout
    assert "EngineCore" not in proc.stderr + proc.stdout
    return proc.stderr


def test_mamba1_target_refused_before_any_engine(tmp_path):
    """A Jamba target (its config: the refusal comes before any weight loads)."""
    target = drafts.mamba1_hybrid(tmp_path / "jamba")
    base = {"model": target, "skip_tokenizer_init": True}
    for spec in ({"method": "stree", "tree": "suffix:16"}, {"method": "stree", "tree": "chain:4"}):
        err = _refused_before_any_engine({**base, "speculative_config": spec})
        assert ("UnsupportedTarget: speculative_config method 'stree': stree cannot verify trees on a "
                "JambaForCausalLM target inside vLLM (its Mamba-1 layers). " + SUPPORTED) in err


def test_draft_of_a_kind_stree_does_not_load_refused_before_any_engine(tmp_path):
    """A Jamba draft (Mamba-1 layers): named, with the kinds stree drafts with, where before the
    fix stree's loader said "config.json is not a mamba-ssm config"."""
    draft = drafts.mamba1_hybrid(tmp_path / "jamba")
    err = _refused_before_any_engine({"model": "models/stree-tiny/target", "speculative_config": {
        "method": "stree", "model": draft, "tree": "caterpillar:2,2"}})
    assert (f"speculative_config['model']={draft!r}: stree cannot draft with this checkpoint "
            "(architectures=['JambaForCausalLM'], model_type='jamba'). stree drafts with transformers'") in err
    assert "not a mamba-ssm config" not in err


def test_sliding_window_attention_refused_when_built(tmp_path):
    """A supported architecture whose config gives its attention a sliding window (stree's tree
    attention has none): refused by the layer check on the model vLLM built, before a step runs
    (before the fix: at the first tree step, mid-generation)."""
    target = tmp_path / "sliding"
    shutil.copytree("models/stree-tiny/target", target)
    config = json.loads((target / "config.json").read_text())
    config.update(layer_types=["sliding_attention"] * config["num_hidden_layers"], sliding_window=8)
    (target / "config.json").write_text(json.dumps(config))
    proc = engine.run({"engine": {"model": str(target), "speculative_config": {"method": "stree", "tree": "suffix:16"}},
                       "prompts": PROMPTS, "sampling": GREEDY})
    assert proc.returncode != 0 and engine.MARK not in proc.stdout
    assert ("UnsupportedTarget: speculative_config method 'stree': stree cannot verify trees on this "
            "MambaInLlamaForCausalLM target inside vLLM: it has attention with a sliding window (8) "
            "(model.layers.1.self_attn.attn and 3 more). stree verifies Mamba2 layers") in proc.stderr
