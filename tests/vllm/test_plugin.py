"""stree's vLLM plugin without an engine: the version gate, the entry point, routing of MambaInLlama
checkpoints to stree's model class, and the load-time weight expansion (against stree's own mixer)."""
import importlib.metadata
import json
import shutil

import pytest
import torch

import vllm
import vllm.config.model as model_config

from stree.hybrid.mamba import Mamba2GQA
from stree.vllm import SUPPORTED_VLLM
from stree.vllm import plugin
from stree.vllm.mambainllama import expand_mamba_weight

from tests.vllm import engine

TARGET, DRAFT = "models/stree-tiny/target", "models/stree-tiny/draft"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_supported_version_passes(version):
    plugin.check_version(version)


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0", "0.32.1", "0.3.2"])
def test_other_versions_refused_naming_the_supported_one(version):
    with pytest.raises(plugin.UnsupportedVLLMVersion, match=f"supports vLLM {SUPPORTED_VLLM} only "
                                                          rf"\(found vLLM {version}\)"):
        plugin.check_version(version)


def test_installed_vllm_is_the_pinned_one():
    assert vllm.__version__.split("+")[0] == SUPPORTED_VLLM


def test_entry_point_registered():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [ep.value for ep in eps if ep.name == "stree"] == ["stree.vllm.plugin:register"]


def _config(directory):
    plugin.register()
    plugin.register()  # vLLM may load plugins twice in one process: nothing doubles
    return model_config.get_config(directory, False)


def test_mambainllama_checkpoints_routed_to_stree():
    target = _config(TARGET)
    assert target.architectures == [plugin.HYBRID_ARCH]
    assert target.stree_mamba["attn_layers"] == [1, 3, 5, 7]
    assert target.layers_block_type == ["mamba", "attention"] * 4
    assert _config(DRAFT).architectures == [plugin.MAMBA_ONLY_ARCH]
    assert model_config.get_config.__wrapped__.__name__ == "get_config"  # wrapped once, not twice
    assert not hasattr(model_config.get_config.__wrapped__, "__wrapped__")


def test_plain_llama_untouched(tmp_path):
    shutil.copy(f"{TARGET}/config.json", tmp_path / "config.json")  # no mamba_config.json
    config = _config(str(tmp_path))
    assert config.architectures == ["LlamaForCausalLM"] and not hasattr(config, "stree_mamba")


def test_mamba1_checkpoint_refused_at_config_time(tmp_path):
    shutil.copy(f"{TARGET}/config.json", tmp_path / "config.json")
    mamba = json.load(open(f"{TARGET}/mamba_config.json"))
    mamba["ssm_cfg"]["layer"] = "Mamba1"
    json.dump(mamba, open(tmp_path / "mamba_config.json", "w"))
    with pytest.raises(ValueError, match="Mamba-1"):
        _config(str(tmp_path))


@pytest.mark.parametrize("d_xb", [32, 64, 128])
def test_expanded_weights_are_stree_mixer_exactly(d_xb):
    """The loaded vLLM mixer is a stock Mamba2 (x/B not repeated): stree's own mixer with
    ``d_xb = d_inner`` holding the expanded weights gives the GQA-shaped mixer's output."""
    torch.manual_seed(0)
    d_model, d_inner, d_state = 48, 128, 32
    gqa = Mamba2GQA(d_model, d_inner, d_xb, d_state)
    stock = Mamba2GQA(d_model, d_inner, d_inner, d_state)
    with torch.no_grad():
        for p in gqa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    sizes = {"d_inner": d_inner, "d_xb": d_xb, "d_state": d_state, "nheads": d_inner // d_state}
    prefix = "model.layers.0.mamba."
    expanded = dict(expand_mamba_weight(prefix + k, v, sizes) for k, v in gqa.state_dict().items())
    local = {k[len(prefix):]: v for k, v in expanded.items()}
    local["A_log"] = local.pop("A")  # vLLM's A holds -exp(A_log) (its loader applies it)
    stock.load_state_dict(local)
    x = torch.randn(2, 9, d_model)
    torch.testing.assert_close(stock(x), gqa(x), rtol=1e-5, atol=1e-5)


def _refused_at_start(code: str) -> str:
    """Run ``code`` (which builds an LLM) in a child; it must fail before any engine process starts."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0
    assert "EngineCore" not in proc.stderr + proc.stdout  # nothing half-started
    return proc.stderr


def test_other_vllm_version_refused_at_start_up():
    err = _refused_at_start("import vllm; vllm.__version__ = '0.31.0'\n"
                            f"from vllm import LLM; LLM(model={TARGET!r}, **{engine.ENGINE_DEFAULTS!r})")
    assert f"stree's vLLM plugin supports vLLM {SUPPORTED_VLLM} only (found vLLM 0.31.0)" in err


BAD_SPECS = {
    "caterpillar:x": {"method": "stree", "model": DRAFT, "tree": "caterpillar:x"},
    "does not run inside vLLM": {"method": "stree", "model": DRAFT, "tree": "auto"},
    "disagrees": {"method": "stree", "model": DRAFT, "tree": "chain:4", "num_speculative_tokens": 3},
    "unknown keys": {"method": "stree", "model": DRAFT, "trees": "chain:4"},
    "needs a sampled chain": {"method": "stree", "model": DRAFT, "tree": "caterpillar:2,2", "verifier": "asps"},
    "unknown verifier 'bogus'": {"method": "stree", "model": DRAFT, "verifier": "bogus"},
    "must start at 1": {"method": "stree", "model": DRAFT, "num_speculative_tokens_per_batch_size": [[2, 4, 0]]},
    "needs 'model'": {"method": "stree", "tree": "chain:4"},
    "not found": {"method": "stree", "model": "/nonexistent/draft"},
}


@pytest.fixture(scope="module")
def bad_specs(tmp_path_factory):
    """Each of :data:`BAD_SPECS` and a draft of another vocabulary (``"vocabulary"``) as the shipped
    target's speculative_config, and a MambaInLlama checkpoint with Mamba-1 layers (``"mamba1"``),
    built one after another in one child: ``{key: traceback}``."""
    from tests.vllm import drafts

    root = tmp_path_factory.mktemp("refused")
    small = drafts.unrelated(1000, str(root / "small"))
    (root / "mamba1").mkdir()
    shutil.copy(f"{TARGET}/config.json", root / "mamba1" / "config.json")
    mamba = json.load(open(f"{TARGET}/mamba_config.json"))
    mamba["ssm_cfg"]["layer"] = "Mamba1"
    json.dump(mamba, open(root / "mamba1" / "mamba_config.json", "w"))
    engines = {key: {"model": TARGET, "speculative_config": spec} for key, spec in BAD_SPECS.items()}
    engines["vocabulary"] = {"model": TARGET, "speculative_config": {"method": "stree", "model": small}}
    engines["mamba1"] = {"model": str(root / "mamba1")}
    return dict(zip(engines, engine.refusals(list(engines.values()))))


def _refused_before_the_engine(err: str | None) -> str:
    assert err is not None, "the engine started"
    assert "EngineCore" not in err  # refused while vLLM built its config: nothing half-started
    return err


@pytest.mark.parametrize("message", list(BAD_SPECS))
def test_bad_stree_speculative_config_refused_at_start_up(bad_specs, message):
    assert message in _refused_before_the_engine(bad_specs[message])


def test_draft_vocabulary_mismatch_refused_at_start_up(bad_specs):
    err = _refused_before_the_engine(bad_specs["vocabulary"])
    assert "draft's vocabulary (1000 tokens" in err and "target's (4096)" in err


def test_mamba1_refused_at_start_up(bad_specs):
    assert "Mamba-1 layers are not" in _refused_before_the_engine(bad_specs["mamba1"])


def test_trees_on_a_gpu_need_the_opt_in_not_eager_mode(monkeypatch):
    """stree's tree verification on vLLM's FlashAttention backend has never run on a GPU: there,
    a tree (or a stree-verified chain) is refused unless ``STREE_VLLM_GPU_TREES=1`` asks for it;
    then it starts without ``enforce_eager``: the tree backend declares no CUDA-graph support, so
    vLLM captures the model piecewise, attention and the Mamba2 mixer eager between the pieces.
    vLLM-verified chains pass."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.platforms import current_platform

    from stree.vllm.attention import flash_backend
    from stree.vllm.speculative import ENV, GPU_TREES, translate

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setenv(ENV, "")  # translate() writes it
    monkeypatch.delenv(GPU_TREES, raising=False)
    tree = {"method": "stree", "model": DRAFT, "tree": "caterpillar:2,2"}
    with pytest.raises(ValueError, match=f"CPU attention backend only so far .*{GPU_TREES}=1"):
        translate(tree, 4096)
    assert translate({"method": "stree", "model": DRAFT, "tree": "chain:4"}, 4096)["method"] == "custom_class"
    monkeypatch.setenv(GPU_TREES, "1")
    assert translate(tree, 4096)["num_speculative_tokens"] == 4
    builder = flash_backend().get_builder_cls()
    assert builder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


def test_cpu_default_schedule_drafts_only_while_a_request_runs_alone(monkeypatch):
    """Without a schedule of the user's, the CPU gets stree's default (drafting while a request
    runs alone, none beside others: vLLM's batching pays more there); a user's schedule passes
    through unchanged, and a GPU gets none (vLLM drafts at every batch size)."""
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    from stree.vllm.speculative import ENV, SCHEDULE, translate

    monkeypatch.setenv(ENV, "")  # translate() writes it
    out = translate({"method": "stree", "tree": "suffix:16"}, 4096)
    assert build_dynamic_sd_schedule_lookup(out[SCHEDULE], 8, 15)[1:] == [15, 0, 0, 0, 0, 0, 0, 0]
    mine = [[1, 2, 6], [3, 4, 2]]
    out = translate({"method": "stree", "model": DRAFT, "tree": "caterpillar:2,2,2", SCHEDULE: mine}, 4096)
    assert build_dynamic_sd_schedule_lookup(out[SCHEDULE], 4, 6)[1:] == [6, 6, 2, 2]
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert SCHEDULE not in translate({"method": "stree", "model": DRAFT, "tree": "chain:4"}, 4096)


def test_cpu_default_chains_are_verified_by_stree(monkeypatch):
    """On a CPU a chain under SpS (no verifier named) is verified by stree inside the engine, its
    tree step costing less there than vLLM's speculative Mamba2 ops; ``"verifier": "sps"`` keeps
    vLLM's rejection sampler, and so does a GPU by default (its kernels and CUDA graphs); ASpS is
    stree's everywhere. Trees are stree's everywhere."""
    from vllm.platforms import current_platform

    from stree.vllm.speculative import ENV, GPU_TREES, DraftSpec, translate

    monkeypatch.setenv(ENV, "")
    monkeypatch.setenv(GPU_TREES, "1")
    chain = {"method": "stree", "model": DRAFT, "tree": "chain:4"}

    def verifies(config):
        translate(config, 4096)
        return DraftSpec.from_env().stree_verifies

    assert verifies(chain)
    assert not verifies({**chain, "verifier": "sps"})
    assert verifies({**chain, "verifier": "asps"})
    assert verifies({**chain, "tree": "caterpillar:2,2"})
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not verifies(chain)
    assert not verifies({**chain, "verifier": "sps"})
    assert verifies({**chain, "verifier": "asps"})


def test_default_tree_is_the_fastest_measured_on_a_cpu(monkeypatch):
    """A config without ``"tree"``: on a CPU the draft's caterpillar merged with a suffix tree
    that drafts alone where it scores 4, or without a ``"model"`` the suffix tree alone; on a GPU
    ``chain:4`` (vLLM's rejection sampler; stree's tree path is opt-in there). A named tree is
    kept."""
    from vllm.platforms import current_platform

    from stree.vllm.speculative import ENV, DraftSpec, draft_size, translate

    monkeypatch.setenv(ENV, "")
    with_draft, without = {"method": "stree", "model": DRAFT}, {"method": "stree"}
    for config, tree in [(with_draft, "caterpillar:2,2,2+suffix:16:solo=4"), (without, "suffix:16"),
                         ({**with_draft, "tree": "chain:3"}, "chain:3")]:
        out = translate(config, 4096)
        assert DraftSpec.from_env().tree == tree
        assert out["num_speculative_tokens"] == draft_size(tree)  # vLLM's K follows the default too
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    translate(with_draft, 4096)
    assert DraftSpec.from_env().tree == "chain:4"


def test_cpu_default_suffix_trees_draft_for_greedy_requests_only(monkeypatch):
    """Without ``suffix_sampled`` the CPU's suffix trees draft for greedy requests only (a sampled
    one's fixed tokens accept too little there to pay for a tree step); a GPU's for all; the
    user's setting passes through, and anything but a bool is refused."""
    from vllm.platforms import current_platform

    from stree.vllm.speculative import ENV, GPU_TREES, SUFFIX_SAMPLED, DraftSpec, translate

    monkeypatch.setenv(ENV, "")
    monkeypatch.setenv(GPU_TREES, "1")
    suffix = {"method": "stree", "tree": "suffix:16"}
    translate(suffix, 4096)
    assert DraftSpec.from_env().suffix_sampled is False
    translate({**suffix, SUFFIX_SAMPLED: True}, 4096)
    assert DraftSpec.from_env().suffix_sampled is True
    with pytest.raises(ValueError, match=f"{SUFFIX_SAMPLED} must be true or false"):
        translate({**suffix, SUFFIX_SAMPLED: "yes"}, 4096)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    translate(suffix, 4096)
    assert DraftSpec.from_env().suffix_sampled is True


def test_draft_dtype_defaults_to_bf16_on_a_cpu_that_multiplies_it(monkeypatch):
    """Without ``draft_dtype`` the CPU's draft runs in bf16 where oneDNN multiplies bf16 natively,
    else fp32 (a GPU's: fp32); the user's setting passes through to the proposer's model, and an
    unknown dtype is refused."""
    import torch
    from vllm.platforms import current_platform

    from stree.vllm.speculative import DRAFT_DTYPE, ENV, DraftSpec, load_draft, translate

    monkeypatch.setenv(ENV, "")
    chain = {"method": "stree", "model": "models/stree-tiny/draft", "tree": "chain:4"}
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    translate(chain, 4096)
    assert DraftSpec.from_env().draft_dtype == ("bfloat16" if native else "float32")
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: not native)
    translate(chain, 4096)
    assert DraftSpec.from_env().draft_dtype == ("float32" if native else "bfloat16")
    for dtype in ("float32", "bfloat16"):
        translate({**chain, DRAFT_DTYPE: dtype}, 4096)
        spec = DraftSpec.from_env()
        assert spec.draft_dtype == dtype
        assert next(load_draft(spec.model, spec.draft_dtype).parameters()).dtype == getattr(torch, dtype)
    with pytest.raises(ValueError, match=f"{DRAFT_DTYPE} must be one of"):
        translate({**chain, DRAFT_DTYPE: "float16"}, 4096)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    translate(chain, 4096)
    assert DraftSpec.from_env().draft_dtype == "float32"


def test_draft_prefix_cache_bound_passes_through_and_bad_values_are_refused(monkeypatch):
    from stree.vllm.speculative import DRAFT_PREFIX_CACHE, ENV, DraftSpec, translate

    monkeypatch.setenv(ENV, "")
    chain = {"method": "stree", "model": "models/stree-tiny/draft", "tree": "chain:4"}
    translate(chain, 4096)
    assert DraftSpec.from_env().draft_prefix_cache_bytes == DraftSpec.draft_prefix_cache_bytes > 0
    translate({**chain, DRAFT_PREFIX_CACHE: 0}, 4096)
    assert DraftSpec.from_env().draft_prefix_cache_bytes == 0
    for bad in (-1, True, "1G"):
        with pytest.raises(ValueError, match=f"{DRAFT_PREFIX_CACHE} must be an int >= 0"):
            translate({**chain, DRAFT_PREFIX_CACHE: bad}, 4096)


def test_the_layers_are_registered_in_vllms_registries():
    """The plugin puts its tree attention backend and Mamba2 mixer where vLLM looks them up (its
    backend registry, its out-of-tree layer registry), not in wrappers around vLLM's functions;
    the runner is V1 (vLLM 0.32 keeps Model Runner V2 off for a custom proposer)."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from stree.vllm import plugin
    from stree.vllm.attention import TreeCPUAttentionBackend
    from stree.vllm.mixer import TreeMambaMixer2

    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is TreeCPUAttentionBackend
    mixer = MambaMixer2.__new__(MambaMixer2)
    assert type(mixer) is TreeMambaMixer2


@pytest.mark.parametrize("architecture, layers", [("OlmoHybridForCausalLM", " (its Gated DeltaNet layers)"),
                                                  ("KimiLinearForCausalLM", " (its Kimi Delta Attention layers)"),
                                                  ("JambaForCausalLM", " (its Mamba-1 layers)"),
                                                  ("LlamaForCausalLM", ""), ("TransformersForCausalLM", "")])
def test_targets_of_other_architectures_refused(architecture, layers):
    """Only the architectures whose vLLM classes are built from Mamba2 mixers, Qwen's Gated
    DeltaNet layers and plain causal attention pass; any other (OLMo Hybrid's Gated DeltaNet, KDA,
    an unknown one, vLLM's Transformers fallback) is refused, naming it, its layers where the family is known, and what is
    supported."""
    from stree.vllm.speculative import ARCHITECTURES, UnsupportedTarget, check_target

    for supported in ARCHITECTURES:
        check_target(supported)
    with pytest.raises(UnsupportedTarget) as err:
        check_target(architecture)
    assert str(err.value) == (f"speculative_config method 'stree': stree cannot verify trees on a {architecture} "
                              f"target inside vLLM{layers}. Supported targets, whose layers are Mamba2 mixers, Qwen's "
                              f"Gated DeltaNet layers (on the CPU) and plain causal attention: {', '.join(ARCHITECTURES)}; "
                              "run this target without method 'stree'")


def _bare(cls):
    """An instance of ``cls`` that ``__init__`` never ran on (the layer check reads classes and a
    few attributes), as vLLM's pluggable-layer registry picks its class."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    return layer


def _attention(impl_cls, sliding_window=-1, kv_sharing=None):
    from vllm.model_executor.layers.attention.attention import Attention

    layer = _bare(Attention)
    layer.attn_type, layer.kv_sharing_target_layer_name = "decoder", kv_sharing
    layer.impl = impl_cls.__new__(impl_cls)
    layer.impl.alibi_slopes, layer.impl.sliding_window, layer.impl.sinks, layer.impl.kv_cache_dtype = (
        None, sliding_window, None, "auto")
    return layer


def test_layer_check_allows_mamba2_and_plain_attention_only():
    """The layers of the built target: vLLM's Mamba2 mixer and Qwen Gated DeltaNet layer (stree's)
    and plain decoder attention on stree's tree backend pass; OLMo Hybrid's Gated DeltaNet layer, a
    sliding window, KV sharing, vLLM's
    own attention backend where stree verifies, M-RoPE are refused, each kind named with its
    first layer."""
    from vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn import OlmoHybridGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from stree.vllm.attention import TreeCPUAttentionImpl
    from stree.vllm.speculative import UnsupportedTarget
    from stree.vllm.targets import check_layers

    plugin.register()
    supported = torch.nn.ModuleList([_bare(MambaMixer2), _bare(QwenGatedDeltaNetAttention),
                                     _attention(TreeCPUAttentionImpl)])
    check_layers(supported, stree_verifies=True, uses_mrope=False)
    check_layers(torch.nn.ModuleList([_attention(CPUAttentionBackendImpl)]), stree_verifies=False, uses_mrope=False)
    mixed = torch.nn.ModuleList([*supported, _bare(OlmoHybridGatedDeltaNetAttention),
                                 _bare(OlmoHybridGatedDeltaNetAttention),
                                 _attention(TreeCPUAttentionImpl, sliding_window=8),
                                 _attention(TreeCPUAttentionImpl, kv_sharing="0"), _attention(CPUAttentionBackendImpl)])
    with pytest.raises(UnsupportedTarget) as err:
        check_layers(mixed, stree_verifies=True, uses_mrope=True)
    assert str(err.value) == (
        "speculative_config method 'stree': stree cannot verify trees on this ModuleList target inside vLLM: it "
        "has OlmoHybridGatedDeltaNetAttention layers (3 and 1 more); attention with a sliding window (8) (5); "
        "attention sharing another layer's KV cache (6); attention on a backend without tree rows "
        "(CPUAttentionBackendImpl) (7); multimodal rotary positions (M-RoPE). stree verifies Mamba2 layers (vLLM's "
        "MambaMixer2), on the CPU Qwen's Gated DeltaNet layers (QwenGatedDeltaNetAttention), and plain causal "
        "decoder attention (vLLM's Attention: no ALiBi, sliding window, sinks, KV sharing or quantised KV cache) "
        "only; run this target without method 'stree'")
    with pytest.raises(UnsupportedTarget, match=r"M-RoPE\)\. stree verifies"):
        check_layers(supported, stree_verifies=True, uses_mrope=True)


def test_drafts_stree_cannot_load_refused_by_kind(monkeypatch, tmp_path):
    """A draft checkpoint of a kind stree does not draft with (a Jamba: Mamba-1 layers) is refused
    naming its architecture and the kinds stree loads, before anything loads; a Llama config is
    told about the missing mamba_config.json."""
    from stree import hf
    from stree.vllm.speculative import ENV, translate

    from tests.vllm.drafts import mamba1_hybrid

    monkeypatch.setenv(ENV, "")
    kinds = (f"stree drafts with transformers' {', '.join(hf.SUPPORTED)}, MambaInLlama hybrids (config.json with "
             "mamba_config.json) and mamba-ssm checkpoints")
    jamba = mamba1_hybrid(tmp_path / "jamba")
    with pytest.raises(ValueError) as err:
        translate({"method": "stree", "model": jamba, "tree": "chain:4"}, 61)
    assert str(err.value) == (f"speculative_config['model']={jamba!r}: stree cannot draft with this checkpoint "
                              f"(architectures=['JambaForCausalLM'], model_type='jamba'). {kinds}")
    llama = tmp_path / "llama"
    llama.mkdir()
    shutil.copy(f"{TARGET}/config.json", llama / "config.json")  # no mamba_config.json
    with pytest.raises(ValueError, match=r"model_type='llama'\) \(a MambaInLlama hybrid keeps its Mamba layers' "
                                         r"settings in a mamba_config.json beside its Llama-style config.json: it "
                                         r"is missing\)\. stree drafts with"):
        translate({"method": "stree", "model": str(llama), "tree": "chain:4"}, 4096)
    translate({"method": "stree", "model": DRAFT, "tree": "chain:4"}, 4096)  # MambaInLlama passes
