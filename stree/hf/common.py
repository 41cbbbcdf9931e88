"""What the transformers Mamba2 family has in common, seen through stree's layer interfaces.

Every family's Mamba2 mixer (``Mamba2Mixer``, ``BambaMixer``, ``GraniteMoeHybridMambaLayer``,
``NemotronHMamba2Mixer``, ``FalconH1Mixer``, ``Zamba2MambaMixer``) keeps the same parameters and
projection layout (``in_proj -> [gate, xBC, dt]``, depthwise ``conv1d``, ``A_log``, ``dt_bias``,
``D`` per head, a grouped gated RMSNorm, ``out_proj``). :class:`Mamba2View` exposes them through the
GQA-adapter interface of ``stree/layers/mamba2.py``; :class:`AttentionView` exposes a family's
attention (GQA, rotary or not) through the adapter interface of ``stree/layers/attention.py``.
A family module then only says which layers exist and how its decoder layers are wired
(:class:`Family`).
"""
from __future__ import annotations

import torch

from stree.cache import MambaLayerCache
from stree.layers.norm import gated_rms_norm


class Mamba2View:
    """A transformers Mamba2 mixer as a GQA-shaped Mamba2 adapter (``split_zxbcdt``/``split_xbc``).

    Per-token pieces (projections, the gated norm, ``out_proj``) are the module's own; stree only
    replaces the conv and the scan.
    """

    def __init__(self, m, layer_name: str):
        act = getattr(m, "activation", "silu")
        if act not in ("silu", "swish"):
            raise TypeError(f"{layer_name}: conv activation {act!r} is not supported (only silu)")
        self.m = m
        self.in_proj, self.conv1d, self.out_proj = m.in_proj, m.conv1d, m.out_proj
        self.A_log, self.dt_bias, self.D = m.A_log, m.dt_bias, m.D
        self.nheads, self.headdim = m.num_heads, m.head_dim
        self.ngroups, self.d_state = m.n_groups, m.ssm_state_size
        self.d_inner, self.conv_dim, self.d_conv = m.intermediate_size, m.conv_dim, m.conv_kernel_size
        self.chunk_size = m.chunk_size
        # an ungrouped gated norm of transformers < 5.20 with several groups (see ``norm``)
        self.regroup_norm = (self.ngroups > 1 and not hasattr(m.norm, "group_size")
                             and not hasattr(m.norm, "n_groups"))
        limit = tuple(float(v) for v in m.time_step_limit)
        self.dt_limit = limit
        self.activation = "silu"
        if self.D.numel() != self.nheads:
            raise TypeError(f"{layer_name}: D of shape {tuple(self.D.shape)} (expected one per head)")
        if self.d_inner != self.nheads * self.headdim:
            raise TypeError(f"{layer_name}: intermediate size {self.d_inner} != heads x head_dim "
                            f"{self.nheads} x {self.headdim}")

    def split_zxbcdt(self, zxbcdt: torch.Tensor):
        """``in_proj`` output -> ``gate (..., d_inner)``, ``xBC (..., conv_dim)``, ``dt (..., h)``."""
        return torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.nheads], dim=-1)

    def split_xbc(self, xbc: torch.Tensor):
        """Post-conv ``xBC`` -> ``x (..., h, p)``, ``B (..., g, s)``, ``C (..., g, s)``."""
        gs = self.ngroups * self.d_state
        x, B, C = torch.split(xbc, [self.d_inner, gs, gs], dim=-1)
        return (x.unflatten(-1, (self.nheads, self.headdim)), B.unflatten(-1, (self.ngroups, self.d_state)),
                C.unflatten(-1, (self.ngroups, self.d_state)))

    def norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The module's own gated RMSNorm (``y * silu(z)``, then per-group RMS).

        transformers before 5.20 (the releases vLLM 0.32 pins) built Mamba2's and
        GraniteMoeHybrid's norm without groups: one RMS over all ``d_inner`` channels whatever
        ``n_groups``. Later releases, mamba-ssm and vLLM take it per group of ``d_inner / n_groups``
        channels, which is what checkpoints were trained with; stree computes that for such a
        module when it has more than one group (a draft then matches a vLLM target)."""
        norm = self.m.norm
        if self.regroup_norm:
            return gated_rms_norm(y, z, norm.weight, None, norm.variance_epsilon, self.d_inner // self.ngroups)
        return norm(y, z)

    def allocate_cache(self, batch_size: int, *, dtype=None, device=None) -> MambaLayerCache:
        w = self.conv1d.weight
        return MambaLayerCache.zeros(batch_size, self.conv_dim, self.d_conv, self.nheads, self.headdim,
                                     self.d_state, dtype=dtype or w.dtype, device=device or w.device,
                                     state_dtype=torch.float32)


class AttentionView:
    """A transformers attention module (``q/k/v/o_proj``, GQA, optional rotary) as stree's
    attention adapter. ``rotary`` is the model's rotary embedding module (or None: no positions)
    and ``apply_rope`` the family's own ``apply_rotary_pos_emb``."""

    def __init__(self, m, layer_name: str, rotary=None, apply_rope=None, scale: float | None = None):
        cfg = m.config
        self.m = m
        self.num_heads = cfg.num_attention_heads
        self.num_key_value_heads = cfg.num_key_value_heads
        self.head_dim = m.head_dim
        self.scale = scale if scale is not None else m.scaling
        self.rotary, self.apply_rope = rotary, apply_rope
        if self.num_heads % self.num_key_value_heads:
            raise TypeError(f"{layer_name}: {self.num_heads} query heads are not a multiple of "
                            f"{self.num_key_value_heads} KV heads")
        if getattr(cfg, "sliding_window", None):
            raise TypeError(f"{layer_name}: sliding-window attention is not supported over trees")

    def parameters(self):
        return self.m.parameters()

    def project_qkv(self, h: torch.Tensor):
        """``h (b, l, d)`` -> ``q (b, l, hq, hd)``, ``k, v (b, l, hkv, hd)`` before rotary."""
        m = self.m
        return (m.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim)),
                m.k_proj(h).unflatten(-1, (self.num_key_value_heads, self.head_dim)),
                m.v_proj(h).unflatten(-1, (self.num_key_value_heads, self.head_dim)))

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate to ``positions (b, l)`` with the model's own rotary module and rule."""
        if self.rotary is None:
            return q, k
        cos, sin = self.rotary(q, position_ids=positions)
        return self.apply_rope(q, k, cos, sin, unsqueeze_dim=2)

    def o_proj(self, out: torch.Tensor) -> torch.Tensor:
        return self.m.o_proj(out)


class Family:
    """One transformers model family: its layers as stree mixers and its decoder wiring.

    Subclasses build ``self.mixers`` (``{layer index: view}``) in ``__init__`` and implement
    :meth:`hidden` (embeddings -> final normalised hidden states with each mixer call replaced).
    """

    def __init__(self, model):
        self.model = model
        self.mixers: dict = {}

    def stree_mixers(self):
        return [(i, self.mixers[i]) for i in sorted(self.mixers)]  # sorts ints: torch.compile traces it

    def hidden(self, input_ids: torch.Tensor, run_mixer) -> torch.Tensor:
        raise NotImplementedError

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits, as the model's own ``forward`` computes them."""
        lm = self.model.lm_head
        return lm(h.to(lm.weight.dtype)).float()

    def stree_walk(self, input_ids: torch.Tensor, run_mixer, head: bool = True) -> torch.Tensor | None:
        """Logits ``(b, l, v)`` fp32 with every mixer call replaced by ``run_mixer(idx, view, h)``;
        None with ``head=False`` (the head is not run)."""
        h = self.hidden(input_ids, lambda i, h: run_mixer(i, self.mixers[i], h))
        return self.logits(h) if head else None


def layer_name(model, idx: int, kind: str) -> str:
    return f"{type(model).__name__} layer {idx} ({kind})"
