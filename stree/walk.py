"""The layers of the models stree runs, by family: which are the sequence mixers (``mixers``) and
how to run the model with each mixer replaced by a function of the caller's (``walk``). Every
tree forward, draft level and prefill of a patched model goes through ``walk``.

Families: mamba_ssm's ``MambaLMHeadModel``; a model that names its own (``stree_mixers`` /
``stree_walk``: ``stree.hybrid``); transformers' Mamba2 family (:mod:`stree.hf`).
"""
from __future__ import annotations

from stree._mamba import mamba_ssm  # noqa: F401
from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
from mamba_ssm.ops.triton.layer_norm import layer_norm_ref, rms_norm_ref, layer_norm_fn, RMSNorm

from stree import hf


def mixers(model):
    """``[(layer_idx, mixer_module)]`` of a supported model."""
    if isinstance(model, MambaLMHeadModel):
        return [(i, blk.mixer) for i, blk in enumerate(model.backbone.layers)]
    if hasattr(model, "stree_mixers"):
        return list(model.stree_mixers())
    family = hf.family(model)  # transformers' Mamba2 family; raises for classes not supported yet
    if family is not None:
        return family.stree_mixers()
    raise TypeError(f"stree.patch supports mamba_ssm MambaLMHeadModel, stree.hybrid models and "
                    f"transformers' {', '.join(hf.SUPPORTED)}, not {type(model).__name__}")


def walk(model, input_ids, run_mixer, head: bool = True):
    """Run the model's layers with each sequence mixer replaced by ``run_mixer(idx, mixer, h)``:
    the logits ``(b, l, v)`` fp32, or with ``head=False`` None (the layers run for what the
    mixer calls keep, the head does not)."""
    if isinstance(model, MambaLMHeadModel):
        return _walk_mamba_lm(model, input_ids, run_mixer, head)
    if hasattr(model, "stree_walk"):
        return model.stree_walk(input_ids, run_mixer, head)
    return hf.family(model).stree_walk(input_ids, run_mixer, head)


def _walk_mamba_lm(model, input_ids, run_mixer, head: bool):
    """mamba_ssm's MixerModel/Block forward (Add -> Norm -> Mixer [-> Add -> Norm -> MLP])."""
    bb = model.backbone
    h = bb.embedding(input_ids)
    residual = None
    for i, blk in enumerate(bb.layers):
        h, residual = _add_norm(h, residual, blk.norm, blk.residual_in_fp32)
        h = run_mixer(i, blk.mixer, h)
        if blk.mlp is not None:
            h, residual = _add_norm(h, residual, blk.norm2, blk.residual_in_fp32)
            h = blk.mlp(h)
    if not head:
        return None
    h, _ = _add_norm(h, residual, bb.norm_f, bb.residual_in_fp32 if hasattr(bb, "residual_in_fp32") else False)
    return model.lm_head(h).float()


def _add_norm(h, residual, norm, residual_in_fp32):
    """``residual += h; h = norm(residual)`` with mamba_ssm's fused kernel on CUDA, its PyTorch
    reference elsewhere."""
    is_rms = isinstance(norm, RMSNorm)
    if h.is_cuda:
        return layer_norm_fn(h, norm.weight, norm.bias, residual=residual, prenorm=True,
                             residual_in_fp32=residual_in_fp32, eps=norm.eps, is_rms_norm=is_rms)
    ref = rms_norm_ref if is_rms else layer_norm_ref
    out, res = ref(h, norm.weight, norm.bias, residual=residual, eps=norm.eps, prenorm=True, upcast=True)
    if residual_in_fp32:
        res = res.float()
    return out.to(h.dtype), res
