"""``speculative_config={"method": "stree", ...}``: stree's drafts inside vLLM.

vLLM's ``SpeculativeConfig`` accepts only its own method names, so the plugin reads stree's
spelling where vLLM's engine arguments turn the dict into a config (``create_speculative_config``)
and rewrites it to vLLM's custom-proposer method, pointing at
:class:`stree.vllm.proposer.StreeProposer`. The stree settings travel to vLLM's engine and worker
processes (started after this point, from this process) in the ``STREE_VLLM_DRAFT`` environment
variable. Everything is checked here, at start-up, before any engine process exists: the target
is of an architecture whose layers stree verifies over a tree (:data:`ARCHITECTURES`; its built
layers are checked again in the engine, :mod:`stree.vllm.targets`), the draft is of a kind stree
loads, loads and patches (Mamba-1 layers and other unsupported layers are refused by stree), its
vocabulary equals the target's, the tree spec parses.

What runs: any drafter spec stree parses (chains, static, caterpillar, beam, DySpec, DynaTree
trees) drafts trees that stree verifies inside the engine (:mod:`stree.vllm.step`; a chain is a
tree), except a chain under SpS on a GPU or with ``"verifier": "sps"`` named, which vLLM's own
rejection sampler verifies (:mod:`stree.vllm.proposer`). On the CPU stree's tree step costs less
than vLLM's speculative Mamba2 ops over the same chain (docs/vllm.md); on a GPU vLLM's kernels
and CUDA graphs keep the chains.
Suffix trees (``"tree": "suffix:16"``) need no ``"model"``: no draft model is loaded, each request
drafts from its own text and from the outputs of earlier requests (a cache bounded by
``"suffix_cache_requests"`` outputs and ``"suffix_cache_tokens"`` tokens; 0 requests: none);
merged with a draft's tree (``"caterpillar:2,2,2+suffix:16"``) they need one. A config without
a ``"tree"`` gets :func:`config_tree`'s default (on a CPU the merged tree, or the suffix tree
alone without a ``"model"``; on a GPU ``chain:4``).
``num_speculative_tokens`` is the drafter's largest tree less its root. ``"auto"`` is refused: it
picks its tree from timings of stree's own decoding loop. vLLM's own
``num_speculative_tokens_per_batch_size`` schedule (``[[first, last, K], ...]`` over the number of
requests a step runs) passes through: where it gives 0 the proposer drafts nothing (no draft work
at all, see :meth:`stree.vllm.proposer.StreeProposer.propose`), where it gives fewer than the
tree's tokens vLLM verifies the first ones in topological order (a subtree). On the CPU a config
without one gets :func:`alone_only` (drafting while a request runs alone). ``"suffix_sampled"``
says whether suffix trees draft for sampled requests (default: on a GPU yes; on the CPU no, since
their fixed tokens verified by sampling accept too little there to pay for a tree step: a suffix
tree then drafts nothing for them, a merged one only the draft's part). ``"draft_dtype"``
(``"float32"`` or ``"bfloat16"``) is the draft model's dtype: default bf16 on a CPU that
multiplies it natively, else fp32; drafts in any dtype are verified losslessly (the verifier
reads the probabilities the draft sampled from). Where the engine caches prefixes
(``enable_prefix_caching``) the draft model keeps its own :class:`~stree.PrefixCache` of draft
states at the ends of earlier requests (``"draft_prefix_cache_bytes"``, default 256 MiB; 0:
none), so that a request resuming a conversation does not prefill the draft over all of it
(:mod:`stree.vllm.proposer`). Exactness of the
Mamba layers under speculation on CPU comes from :mod:`stree.vllm.cpu_spec` and
:mod:`stree.vllm.accepted_counts`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

ENV = "STREE_VLLM_DRAFT"
# opt-in to stree's tree verification on a GPU (FlashAttention), written but never run
GPU_TREES = "STREE_VLLM_GPU_TREES"
PROPOSER = "stree.vllm.proposer.StreeProposer"
# vLLM's own dynamic speculation by batch size, passed through (see ``translate``)
SCHEDULE = "num_speculative_tokens_per_batch_size"
# whether suffix trees draft for sampled requests (see ``translate``)
SUFFIX_SAMPLED = "suffix_sampled"
# the draft model's dtype (see ``translate``)
DRAFT_DTYPE = "draft_dtype"
DRAFT_DTYPES = ("float32", "bfloat16")
# the bound of the draft's own prefix cache (see ``translate``)
DRAFT_PREFIX_CACHE = "draft_prefix_cache_bytes"
# keys of stree's dict; every other key is refused (no silent typos)
KEYS = {"method", "model", "tree", "verifier", "num_speculative_tokens", SCHEDULE, "suffix_cache_requests",
        "suffix_cache_tokens", SUFFIX_SAMPLED, DRAFT_DTYPE, DRAFT_PREFIX_CACHE}
# the targets (architectures as vLLM resolves them) whose vLLM classes are built from the layer
# kinds stree verifies over a tree, Mamba2 mixers and plain causal attention (stree.vllm.targets
# checks the built layers again), each tested inside vLLM (docs/vllm.md); every other one is refused
ARCHITECTURES = ("Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM",
                 "Zamba2ForCausalLM", "MambaInLlamaForCausalLM", "MambaInLlamaMambaOnlyForCausalLM",
                 "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")
# the layers of some refused families, named in the error
REFUSED_LAYERS = {"OlmoHybridForCausalLM": "Gated DeltaNet",
                  "KimiLinearForCausalLM": "Kimi Delta Attention", "JambaForCausalLM": "Mamba-1",
                  "MambaForCausalLM": "Mamba-1", "FalconMambaForCausalLM": "Mamba-1"}


class UnsupportedTarget(ValueError):
    """A target whose layers stree cannot verify over a tree inside vLLM."""


@dataclass(frozen=True)
class DraftSpec:
    """stree's speculative settings inside vLLM: the draft checkpoint directory (None for a suffix
    tree, which needs no draft model), the tree spec, the verifier of sampled requests (None: the
    lossless default for the draft, stree's rule), the bounds of the engine's cache of earlier
    outputs that suffix trees draft from (0 requests: no cache), whether suffix trees draft for
    sampled requests (else a suffix tree drafts nothing for them and a merged tree only the
    draft's part), the dtype the draft model runs in, whether chains under SpS go to vLLM's
    rejection sampler (else stree verifies them like trees), and the bound in bytes of the draft
    model's prefix cache where the engine caches prefixes (0: none)."""

    model: str | None
    tree: str
    verifier: str | None = None
    suffix_cache_requests: int = 1024
    suffix_cache_tokens: int = 1 << 18
    suffix_sampled: bool = True
    draft_dtype: str = "float32"
    vllm_sps: bool = True
    draft_prefix_cache_bytes: int = 1 << 28

    @property
    def stree_verifies(self) -> bool:
        """Whether stree verifies inside the engine (:mod:`stree.vllm.step`): every tree and
        chain, but a chain under SpS (no verifier, or ``"sps"``) where :attr:`vllm_sps` gives it
        to vLLM's own rejection sampler, which runs SpS (``translate``: on a GPU, or ``"sps"``
        named)."""
        return not is_chain(self.tree) or self.verifier not in (None, "sps") or not self.vllm_sps

    def pair(self, sampling):
        """stree's (drafter, verifier) for requests of ``sampling`` (greedy ones always verify
        greedily), or None where such requests draft nothing (sampled ones with a suffix tree alone
        and not :attr:`suffix_sampled`); ValueError for a verifier that is not lossless with the
        drafter."""
        from stree.draft import MergedDrafter, parse_drafter
        from stree.generation import resolve

        drafter = self.tree
        if not sampling.is_greedy and not self.suffix_sampled:
            parsed = parse_drafter(self.tree)
            if isinstance(parsed, MergedDrafter):
                drafter = parsed.base  # the draft's part
            elif parsed.reads_context:  # a suffix tree alone
                return None
        method = "chain" if is_chain(self.tree) else "tree"
        return resolve(method, drafter, None if sampling.is_greedy else self.verifier, sampling,
                       draft_model=self.model is not None)

    def suffix_cache(self):
        """A new :class:`~stree.SuffixCache` of this spec's bounds, or None (no cache, or a tree
        that reads no text)."""
        from stree.draft import parse_drafter
        from stree.draft.suffix_index import SuffixCache

        if self.suffix_cache_requests == 0 or not parse_drafter(self.tree).reads_context:
            return None
        return SuffixCache(self.suffix_cache_requests, self.suffix_cache_tokens)

    def to_env(self) -> None:
        os.environ[ENV] = json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> "DraftSpec":
        raw = os.environ.get(ENV)
        if raw is None:
            raise RuntimeError(f"{PROPOSER} runs only through speculative_config={{'method': 'stree', ...}} "
                               f"({ENV} is not set)")
        return cls(**json.loads(raw))


def config_tree(config: dict, cpu: bool) -> str:
    """The tree spec of stree's speculative dict: its ``"tree"``, or where it names none, on a
    CPU with a draft model the draft's ``caterpillar:2,2,2`` merged with a suffix tree that drafts
    alone where it scores 4 (the fastest measured there, docs/vllm.md), without one ``suffix:16``;
    on a GPU ``chain:4``, which vLLM's rejection sampler verifies (stree's tree path is unrun
    there)."""
    if config.get("tree") is not None:
        return str(config["tree"])
    if not cpu:
        return "chain:4"
    return "caterpillar:2,2,2+suffix:16:solo=4" if config.get("model") else "suffix:16"


def draft_size(tree: str) -> int:
    """The most draft tokens a spec proposes per step (its largest tree less the root), parsed by
    stree's own drafter parser; ValueError for an unknown spec or ``auto``. A suffix tree proposes
    fewer, or none, where its match is short."""
    from stree.draft import parse_drafter
    from stree.draft.auto import AutoDrafter

    drafter = parse_drafter(tree)  # ValueError for an unknown spec, naming the known ones
    if isinstance(drafter, AutoDrafter):
        raise ValueError(f"speculative_config['tree']={tree!r}: 'auto' chooses its tree from timings of "
                         "stree's own decoding loop and does not run inside vLLM; name a tree "
                         "(e.g. 'caterpillar:2,2,2,2') or a chain ('chain:4')")
    return drafter.num_nodes - 1


def needs_model(tree: str) -> bool:
    """Whether a spec drafts with a draft model (a suffix tree alone does not)."""
    from stree.draft import parse_drafter

    return parse_drafter(tree).uses_draft_model


def is_chain(tree: str) -> bool:
    """Whether a spec drafts chains (which vLLM's rejection sampler may verify) rather than trees."""
    from stree.draft import ChainDrafter, parse_drafter

    return isinstance(parse_drafter(tree), ChainDrafter)


def check_target(architecture: str) -> None:
    """Raise :class:`UnsupportedTarget` unless vLLM's class for the target (``architecture``, as
    vLLM resolved it) is one of :data:`ARCHITECTURES`: its error names the architecture (and the
    layers of known families) and what is supported."""
    if architecture in ARCHITECTURES:
        return
    layers = f" (its {REFUSED_LAYERS[architecture]} layers)" if architecture in REFUSED_LAYERS else ""
    raise UnsupportedTarget(
        f"speculative_config method 'stree': stree cannot verify trees on a {architecture} target inside "
        f"vLLM{layers}. Supported targets, whose layers are Mamba2 mixers, Qwen's Gated DeltaNet layers (on the CPU) "
        f"and plain causal attention: "
        f"{', '.join(ARCHITECTURES)}; run this target without method 'stree'")


def check_draft(directory: str) -> None:
    """ValueError unless ``directory`` holds a checkpoint of a kind stree drafts with (what
    :func:`stree.checkpoints.load_model` loads): a transformers class of :data:`stree.hf.SUPPORTED`,
    a MambaInLlama hybrid (``mamba_config.json`` beside ``config.json``) or a mamba-ssm model
    (``d_model`` and ``n_layer`` in its ``config.json``)."""
    from stree import hf
    from stree.checkpoints import check_model_dir, model_config

    check_model_dir(directory)
    if hf.is_checkpoint(directory) or os.path.isfile(os.path.join(directory, "mamba_config.json")):
        return
    config = model_config(directory)
    if "d_model" in config and "n_layer" in config:
        return
    archs = config.get("architectures") or []
    llama = (" (a MambaInLlama hybrid keeps its Mamba layers' settings in a mamba_config.json beside its "
             "Llama-style config.json: it is missing)" if config.get("model_type") == "llama" else "")
    raise ValueError(f"speculative_config['model']={directory!r}: stree cannot draft with this checkpoint "
                     f"(architectures={archs}, model_type={config.get('model_type')!r}){llama}. stree drafts "
                     f"with transformers' {', '.join(hf.SUPPORTED)}, MambaInLlama hybrids (config.json with "
                     "mamba_config.json) and mamba-ssm checkpoints")


def load_draft(directory: str, dtype: str = "float32"):
    """The patched draft model (CPU, in ``dtype``) from a checkpoint directory stree can load."""
    import torch

    from stree.checkpoints import load_model

    return load_model(directory, torch.device("cpu"), getattr(torch, dtype)).eval()


def default_draft_dtype() -> str:
    """``"bfloat16"`` where this CPU multiplies bf16 natively (oneDNN's test: AVX-512 BF16 or
    AMX), else ``"float32"``. A draft level reads all the draft's weights for a row or two, so
    it costs about what streaming them does: half the bytes, a cheaper level (docs/vllm.md)."""
    import torch

    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return "bfloat16" if supported is not None and supported() else "float32"


def translate(config: dict, target_vocab_size: int) -> dict:
    """stree's speculative dict -> vLLM's custom-proposer dict (and the environment variable).

    Raises ValueError (unknown key, missing draft, tree spec, a draft of a kind stree does not
    load, vocabulary mismatch, trees on a GPU without ``STREE_VLLM_GPU_TREES=1``) or the
    draft loader's error, all before any engine process starts (the target is checked before,
    by :func:`check_target`).
    """
    from vllm.platforms import current_platform

    from stree.inputs import vocab_size
    from stree.sampling import SamplingConfig

    unknown = sorted(set(config) - KEYS)
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {unknown} for method 'stree' (known: {sorted(KEYS)})")
    verifier = config.get("verifier")
    tree = config_tree(config, current_platform.is_cpu())
    k = draft_size(tree)
    if needs_model(tree) and not config.get("model"):
        raise ValueError(f"speculative_config: tree {tree!r} needs 'model', the draft checkpoint "
                         "directory (a suffix tree, 'suffix:16', needs none)")
    if not needs_model(tree) and config.get("model"):
        raise ValueError(f"speculative_config: tree {tree!r} runs no draft model: leave 'model' out, or "
                         f"merge the draft's tree with it ('caterpillar:2,2,2+{tree}')")
    bounds = {}
    for key in ("suffix_cache_requests", "suffix_cache_tokens"):
        value = config.get(key, getattr(DraftSpec, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key.endswith("requests") else 1):
            raise ValueError(f"speculative_config: {key} must be an int >= "
                             f"{0 if key.endswith('requests') else 1}, got {value!r}")
        bounds[key] = value
    suffix_sampled = config.get(SUFFIX_SAMPLED)
    if suffix_sampled is None:  # the CPU default: see docs/vllm.md
        suffix_sampled = not current_platform.is_cpu()
    elif not isinstance(suffix_sampled, bool):
        raise ValueError(f"speculative_config: {SUFFIX_SAMPLED} must be true or false, got {suffix_sampled!r}")
    prefix_bytes = config.get(DRAFT_PREFIX_CACHE, DraftSpec.draft_prefix_cache_bytes)
    if isinstance(prefix_bytes, bool) or not isinstance(prefix_bytes, int) or prefix_bytes < 0:
        raise ValueError(f"speculative_config: {DRAFT_PREFIX_CACHE} must be an int >= 0, got {prefix_bytes!r}")
    draft_dtype = config.get(DRAFT_DTYPE)
    if draft_dtype is None:  # the CPU default: see docs/vllm.md
        draft_dtype = default_draft_dtype() if current_platform.is_cpu() else "float32"
    elif draft_dtype not in DRAFT_DTYPES:
        raise ValueError(f"speculative_config: {DRAFT_DTYPE} must be one of {DRAFT_DTYPES}, got {draft_dtype!r}")
    # chains under SpS: vLLM's rejection sampler on a GPU or where named, else stree (module docstring)
    vllm_sps = verifier == "sps" or not current_platform.is_cpu()
    spec = DraftSpec(model=str(config["model"]) if config.get("model") else None, tree=tree,
                     verifier=None if verifier is None else str(verifier), suffix_sampled=suffix_sampled,
                     draft_dtype=draft_dtype, vllm_sps=vllm_sps, draft_prefix_cache_bytes=prefix_bytes,
                     **bounds)
    try:  # the verifier is checked against the whole tree, whether or not sampled requests draft it
        replace(spec, suffix_sampled=True).pair(SamplingConfig(temperature=1.0))
    except ValueError as err:
        raise ValueError(f"speculative_config['verifier']={spec.verifier!r} with tree {spec.tree!r}: {err}") from None
    if spec.stree_verifies:
        if not current_platform.is_cpu() and os.environ.get(GPU_TREES) != "1":
            raise ValueError(f"speculative_config tree={spec.tree!r}, verifier={spec.verifier!r}: stree verifies "
                             f"inside vLLM with vLLM's CPU attention backend only so far (its FlashAttention "
                             f"backend is written but has never run on a GPU: {GPU_TREES}=1 tries it, under "
                             "vLLM's piecewise CUDA graphs); use a chain ('chain:4') with vLLM's SpS here")
    if config.get("num_speculative_tokens") not in (None, k):
        raise ValueError(f"speculative_config: num_speculative_tokens={config['num_speculative_tokens']} "
                         f"disagrees with tree {spec.tree!r} ({k} draft tokens); leave it out")
    if spec.model is not None:
        check_draft(spec.model)
    draft_vocab = target_vocab_size if spec.model is None else vocab_size(load_draft(spec.model, spec.draft_dtype))
    if draft_vocab != target_vocab_size:
        raise ValueError(f"speculative_config: the draft's vocabulary ({draft_vocab} tokens, {spec.model}) "
                         f"differs from the target's ({target_vocab_size}): draft and target must share "
                         "one tokenizer")
    out = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}
    schedule = config.get(SCHEDULE)
    if schedule is None and current_platform.is_cpu():
        schedule = alone_only(k)
    if schedule is not None:
        # vLLM checks a schedule only when its scheduler starts (inside the engine process)
        from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

        try:
            out[SCHEDULE] = validate_and_normalize_dynamic_sd_schedule(schedule)
        except ValueError as err:
            raise ValueError(f"speculative_config['{SCHEDULE}']: {err}") from None
    spec.to_env()
    return out


def alone_only(k: int) -> list[tuple[int, int, int]]:
    """The CPU default schedule: ``k`` draft tokens while a request runs alone, none beside others
    (vLLM carries the last range's 0 up to its largest batch). On this CPU vLLM's batching pays
    more than speculation as soon as two requests share a step (docs/vllm.md)."""
    return [(1, 1, k), (2, 2, 0)]


def patch_engine_args() -> None:
    """Teach ``EngineArgs.create_speculative_config`` the ``"stree"`` method (see module docstring)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_stree", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        config = self.speculative_config
        if isinstance(config, dict) and config.get("method") == "stree":
            check_target(target_model_config.architecture)
            self.speculative_config = translate({k.replace("-", "_"): v for k, v in config.items()},
                                                target_model_config.get_vocab_size())
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._stree = True
    EngineArgs.create_speculative_config = create_speculative_config
