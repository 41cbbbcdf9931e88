"""Configuration of a MambaInLlama-style hybrid model.

A public MambaInLlama checkpoint carries two JSON files: ``config.json`` (the HF Llama config of the
model it was distilled from) and ``mamba_config.json`` (MambaInLlama's ``MambaConfig.__dict__``). Both
describe overlapping facts (width, depth, vocab, MLP size, norm eps); :class:`MambaInLlamaConfig` is the
single flat view of them and checks that they agree.

The Mamba layers are MambaInLlama's GQA-shaped Mamba2: ``nheads = ngroups = d_inner // d_state``,
``headdim = d_state``, and x/B have ``d_xb // d_state`` groups repeated to ``nheads`` like GQA K/V.
The distillation recipe maps attention onto it as ``d_state = head_dim``, ``ngroups = num_attention_heads``,
``d_inner = num_attention_heads * head_dim``, ``d_xb = num_key_value_heads * head_dim``; those are the
defaults when the Mamba sizes are not given.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from stree.jsonfile import read_json

CONFIG_NAME = "config.json"
MAMBA_CONFIG_NAME = "mamba_config.json"

ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

# config.json keys that this class models; every other key is carried through `extra_llama_config`.
_LLAMA_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
    "bos_token_id", "eos_token_id", "initializer_range", "pretraining_tp", "attention_dropout",
)
# ssm_cfg keys that only matter for initialisation (or that MambaInLlama's Mamba2 overrides): accepted
# and dropped. Keys that would change the computation to something not implemented here are rejected.
_SSM_CFG_IGNORED = ("dt_min", "dt_max", "dt_init_floor", "A_init_range", "conv_init", "headdim",
                    "use_mem_eff_path", "layer")
_SSM_CFG_REQUIRED_VALUE = {"repeat_kv_before_conv": False, "D_has_hdim": False, "rmsnorm": True,
                           "norm_before_gate": False, "bias": False, "conv_bias": True}

# Options only mamba_ssm's Mamba-1 layer has (its low-rank dt projection and init).
_MAMBA1_ONLY_KEYS = {"dt_rank", "dt_init", "dt_scale", "use_fast_path"}

DEFAULT_DT_LIMIT = (0.0, math.inf)


@dataclass
class MambaInLlamaConfig:
    """Sizes and options of a MambaInLlama hybrid (Llama attention + GQA-shaped Mamba2 layers).

    Layer ``i`` is a Llama attention layer if ``i in attn_layers``, else a Mamba2 layer; every layer has
    the Llama pre-norm residual structure with a SwiGLU MLP.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: = num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attn_layers: tuple[int, ...] = ()
    # Mamba layer sizes; None: derived from the attention shape as the distillation recipe does.
    d_inner: int | None = None
    d_xb: int | None = None
    d_state: int | None = None
    d_conv: int = 4
    dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT
    chunk_size: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF Llama rope_scaling: None, {"rope_type": "linear"|"llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra_llama_config: dict[str, Any] = field(default_factory=dict)  # carried through save/load

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            _require(self.hidden_size % self.num_attention_heads == 0, "head_dim",
                     f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                     f"{self.num_attention_heads}; give head_dim explicitly")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.d_state is None:
            self.d_state = self.head_dim
        if self.d_inner is None:
            self.d_inner = self.num_attention_heads * self.head_dim
        if self.d_xb is None:
            self.d_xb = self.num_key_value_heads * self.head_dim
        self.attn_layers = tuple(int(i) for i in self.attn_layers)
        self.dt_limit = (float(self.dt_limit[0]), float(self.dt_limit[1]))
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)
        # What HF tooling needs to read config.json as a Llama config, unless the checkpoint says otherwise.
        self.extra_llama_config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                   **self.extra_llama_config}
        self.validate()

    # ----------------------------------------------------------------------------------------------
    @property
    def nheads(self) -> int:
        """Mamba heads (= ngroups of MambaInLlama's Mamba2)."""
        return self.d_inner // self.d_state

    @property
    def conv_dim(self) -> int:
        """Channels of the Mamba depthwise conv (x, B, C)."""
        return self.d_inner + 2 * self.d_xb

    def is_attention_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.attn_layers

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field if the sizes are inconsistent."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "d_inner", "d_xb",
                     "d_state", "d_conv", "chunk_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, name, f"must be a positive int, got {value!r}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"{self.num_key_value_heads} does not divide num_attention_heads {self.num_attention_heads}")
        _require(self.d_inner % self.d_state == 0, "d_inner",
                 f"{self.d_inner} is not a multiple of d_state {self.d_state}")
        _require(self.d_xb % self.d_state == 0, "d_xb", f"{self.d_xb} is not a multiple of d_state {self.d_state}")
        _require(self.nheads % (self.d_xb // self.d_state) == 0, "d_xb",
                 f"the {self.d_xb // self.d_state} x/B groups (d_xb / d_state) do not divide the "
                 f"{self.nheads} heads (d_inner / d_state)")
        bad = [i for i in self.attn_layers if not 0 <= i < self.num_hidden_layers]
        _require(not bad, "attn_layers", f"indices {bad} outside [0, num_hidden_layers={self.num_hidden_layers})")
        _require(len(set(self.attn_layers)) == len(self.attn_layers), "attn_layers",
                 f"duplicate indices in {list(self.attn_layers)}")
        lo, hi = self.dt_limit
        _require(0.0 <= lo < hi, "dt_limit", f"must satisfy 0 <= low < high, got {self.dt_limit}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_json_dicts(cls, llama: dict, mamba: dict) -> "MambaInLlamaConfig":
        """Build from the parsed ``config.json`` (``llama``) and ``mamba_config.json`` (``mamba``)."""
        for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                              ("pretraining_tp", 1)):
            if key in llama and llama[key] != expected:
                raise ValueError(f"config.json: {key}={llama[key]!r} is not supported (expected {expected!r})")
        if mamba.get("hidden_act", "silu") != "silu":
            raise ValueError(f"mamba_config.json: hidden_act={mamba['hidden_act']!r} is not supported (expected 'silu')")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in llama:
                raise ValueError(f"config.json: missing required field {key!r}")
        # Fields stated in both files must agree (mamba_config.json's vocab_size may be null).
        for llama_key, mamba_key in (("hidden_size", "d_model"), ("intermediate_size", "intermediate_size"),
                                     ("num_hidden_layers", "n_layer"), ("vocab_size", "vocab_size"),
                                     ("rms_norm_eps", "rms_norm_eps")):
            if mamba.get(mamba_key) is not None and llama_key in llama and mamba[mamba_key] != llama[llama_key]:
                raise ValueError(f"mamba_config.json: {mamba_key}={mamba[mamba_key]!r} disagrees with "
                                 f"config.json: {llama_key}={llama[llama_key]!r}")

        ssm_cfg = dict(mamba.get("ssm_cfg") or {})
        mamba1 = sorted(set(ssm_cfg) & _MAMBA1_ONLY_KEYS)
        if ssm_cfg.get("layer", "Mamba2") != "Mamba2" or mamba1:
            what = f"ssm_cfg.layer={ssm_cfg['layer']!r}" if "layer" in ssm_cfg else f"ssm_cfg fields {mamba1}"
            raise ValueError(f"mamba_config.json: {what} describes Mamba-1 layers: Mamba-1 layers are not "
                             "supported (stree runs MambaInLlama's Mamba2 layers)")
        for key, required in _SSM_CFG_REQUIRED_VALUE.items():
            if key in ssm_cfg and ssm_cfg.pop(key) != required:
                raise ValueError(f"mamba_config.json: ssm_cfg.{key} must be {required!r} (other values are not supported)")
        for key in _SSM_CFG_IGNORED:
            ssm_cfg.pop(key, None)
        expand = ssm_cfg.pop("expand", 2)
        d_inner = mamba.get("d_inner")
        if d_inner is None:
            d_inner = expand * llama["hidden_size"]
        d_state = ssm_cfg.pop("d_state", 128)
        ngroups = ssm_cfg.pop("ngroups", 1)
        if ngroups * d_state != d_inner:
            raise ValueError(f"mamba_config.json: ssm_cfg.ngroups ({ngroups}) * ssm_cfg.d_state ({d_state}) "
                             f"must equal d_inner ({d_inner})")
        d_ssm = ssm_cfg.pop("d_ssm", None)
        if d_ssm is not None and d_ssm != d_inner:
            raise ValueError(f"mamba_config.json: ssm_cfg.d_ssm={d_ssm} must equal d_inner ({d_inner})")
        d_conv = ssm_cfg.pop("d_conv", 4)
        dt_limit = tuple(ssm_cfg.pop("dt_limit", DEFAULT_DT_LIMIT))
        chunk_size = ssm_cfg.pop("chunk_size", 256)
        if ssm_cfg:
            raise ValueError(f"mamba_config.json: unsupported ssm_cfg fields {sorted(ssm_cfg)}")
        if "d_xb" not in mamba:
            raise ValueError("mamba_config.json: missing required field 'd_xb'")

        rope_theta = llama.get("rope_theta", 10000.0)
        rope_scaling = llama.get("rope_scaling")
        if llama.get("rope_parameters") is not None:  # transformers >= 5 folds theta and scaling together
            params = dict(llama["rope_parameters"])
            rope_theta = params.pop("rope_theta", rope_theta)
            rope_scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else None

        return cls(
            vocab_size=llama["vocab_size"],
            hidden_size=llama["hidden_size"],
            intermediate_size=llama["intermediate_size"],
            num_hidden_layers=llama["num_hidden_layers"],
            num_attention_heads=llama["num_attention_heads"],
            num_key_value_heads=llama.get("num_key_value_heads"),
            head_dim=llama.get("head_dim"),
            attn_layers=tuple(mamba.get("attn_layers") or ()),
            d_inner=d_inner,
            d_xb=mamba["d_xb"],
            d_state=d_state,
            d_conv=d_conv,
            dt_limit=dt_limit,
            chunk_size=chunk_size,
            rms_norm_eps=llama.get("rms_norm_eps", mamba.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=llama.get("max_position_embeddings", 2048),
            tie_word_embeddings=llama.get("tie_word_embeddings", False),
            initializer_range=llama.get("initializer_range", 0.02),
            bos_token_id=llama.get("bos_token_id"),
            eos_token_id=llama.get("eos_token_id"),
            extra_llama_config={k: v for k, v in llama.items() if k not in _LLAMA_KEYS},
        )

    def to_json_dicts(self) -> tuple[dict, dict]:
        """Return ``(config.json dict, mamba_config.json dict)`` in the public MambaInLlama layout."""
        llama = {
            **self.extra_llama_config,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        ssm_cfg = {"d_state": self.d_state, "ngroups": self.nheads, "d_conv": self.d_conv}
        if self.d_inner % self.hidden_size == 0:
            ssm_cfg["expand"] = self.d_inner // self.hidden_size
        if self.dt_limit != DEFAULT_DT_LIMIT:  # JSON has no infinity; omit the default
            ssm_cfg["dt_limit"] = list(self.dt_limit)
        if self.chunk_size != 256:
            ssm_cfg["chunk_size"] = self.chunk_size
        mamba = {
            "d_model": self.hidden_size,
            "ssm_cfg": ssm_cfg,
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "d_inner": self.d_inner,
            "d_xb": self.d_xb,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "n_layer": self.num_hidden_layers,
            "attn_layers": list(self.attn_layers),
        }
        return llama, mamba

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "MambaInLlamaConfig":
        """Read ``config.json`` and ``mamba_config.json`` from ``directory``."""
        return cls.from_json_dicts(_read_json(directory, CONFIG_NAME), _read_json(directory, MAMBA_CONFIG_NAME))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``mamba_config.json`` into ``directory`` (created if needed)."""
        os.makedirs(directory, exist_ok=True)
        for name, data in zip((CONFIG_NAME, MAMBA_CONFIG_NAME), self.to_json_dicts()):
            with open(os.path.join(directory, name), "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"MambaInLlamaConfig.{name}: {message}")


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """Check an HF ``rope_scaling`` dict; return None for plain RoPE, else a copy with ``rope_type``."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("type", None)  # older HF configs spell it "type"
    rope_type = scaling.setdefault("rope_type", rope_type or "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"MambaInLlamaConfig.rope_scaling: rope_type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in scaling]
    if missing:
        raise ValueError(f"MambaInLlamaConfig.rope_scaling: rope_type {rope_type!r} needs {missing}")
    if rope_type == "default":
        return None
    if not scaling["factor"] > 0:
        raise ValueError(f"MambaInLlamaConfig.rope_scaling: factor must be positive, got {scaling['factor']}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("MambaInLlamaConfig.rope_scaling: llama3 needs high_freq_factor > low_freq_factor")
    return scaling


def _read_json(directory, name: str) -> dict:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory not found: {directory}")
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{name} not found in {directory} (a MambaInLlama checkpoint needs "
                                f"{CONFIG_NAME} and {MAMBA_CONFIG_NAME})")
    return read_json(path)
