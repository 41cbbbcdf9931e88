"""Train stree-tiny: a small hybrid Mamba2+attention target and a 1-layer Mamba2 draft distilled from it
(or, with ``--pair gdn``, stree-gdn: a Qwen3.5-shaped Gated DeltaNet hybrid and a one-layer Gated
DeltaNet draft, transformers' ``Qwen3_5ForCausalLM`` saved with ``save_pretrained``).

Fully offline and seeded. The corpus is the Python standard library's source (``models/data.py``), the
tokenizer a byte-level BPE trained on its training split, the target a MambaInLlama-layout hybrid
(``stree.hybrid.MambaInLlamaForCausalLM``) trained with AdamW + cosine schedule. The trained target
then writes text of its own (continuations of training windows, greedy and sampled), and the draft,
the same class with one Mamba2 layer and no attention, is distilled from the target's logits
(forward KL, computed on the fly, plus a little cross-entropy) on a mixture of that text and the
corpus: a draft is asked to guess what the target says, so it learns on the target's text. Both
are saved in the public MambaInLlama layout (config.json + mamba_config.json + model.safetensors)
with the tokenizer beside each, evaluated after loading back (so the card's numbers are those of
the shipped weights), and described in a model card.

    python models/recipe.py --out models/stree-tiny                      # CPU: target, then draft
    python models/recipe.py --out models/stree-tiny --target-from models/stree-tiny/target  # draft only
    python models/recipe.py --out /tmp/trial/stree-tiny --budget-minutes 2  # calibration run
    python models/recipe.py --out /tmp/big --device cuda                 # same shapes, big batches, GPU
    python models/recipe.py --out models/stree-gdn --pair gdn --target-steps 800 --draft-steps 1600 \
        --continuations 2048                                             # the Gated DeltaNet pair

By default each phase runs a fixed number of steps (``--target-steps``, ``--draft-steps``; the
schedule follows the step count), so a run repeats exactly given the seed, whatever else the machine
is doing. ``--budget-minutes`` trains for wall-clock time instead (the schedule follows the elapsed
fraction of the budget, so the run ends on time, but its step counts depend on the machine's load);
the card records the steps each run took.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script: make `stree` and `models.data` importable
    sys.path.insert(0, str(_REPO))

from models import data  # noqa: E402

MAX_BYTES = 40e6  # both checkpoints together: the repository stays quick to clone and to copy to a GPU


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@dataclass
class ModelShape:
    """Sizes of one MambaInLlama hybrid. Mamba layers follow the distillation mapping (d_state = head_dim,
    nheads = num_heads, x/B groups = num_kv_heads); layers in ``attn_layers`` are Llama attention."""

    hidden_size: int
    num_layers: int
    attn_layers: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool = False  # untied, as MambaInLlama's public checkpoints are

    def to_config(self, vocab_size: int, eos_id: int, max_len: int):
        from stree.hybrid import MambaInLlamaConfig

        return MambaInLlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, attn_layers=tuple(self.attn_layers),
            tie_word_embeddings=self.tie_embeddings, max_position_embeddings=max_len,
            bos_token_id=eos_id, eos_token_id=eos_id)


    def describe(self) -> str:
        kind = f"attention layers {list(self.attn_layers)}" if self.attn_layers else "no attention (pure Mamba2)"
        return (f"MambaInLlama hybrid: {_n(self.num_layers, 'layer')}, d_model {self.hidden_size}, {kind}; "
                f"{_n(self.num_heads, 'head')} (d_state = head_dim = {self.hidden_size // self.num_heads}), "
                f"{self.num_kv_heads} KV / x-B group{'s' if self.num_kv_heads > 1 else ''}; SwiGLU MLP "
                f"{self.intermediate_size}; {'tied' if self.tie_embeddings else 'untied'} embeddings")


@dataclass
class GatedDeltaShape:
    """Sizes of one Qwen3.5-shaped hybrid (transformers' ``Qwen3_5ForCausalLM``): ``layer_types``
    of ``linear_attention`` (Gated DeltaNet: ``linear_key_heads`` q/k heads serving
    ``linear_value_heads`` value heads of ``linear_head_dim``) and ``full_attention`` (Qwen's gated
    attention: ``num_heads`` heads of ``head_dim``, ``num_kv_heads`` K/V heads, rotary on
    ``partial_rotary`` of each head)."""

    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    intermediate_size: int
    partial_rotary: float = 0.5
    tie_embeddings: bool = True

    def to_config(self, vocab_size: int, eos_id: int, max_len: int):
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=len(self.layer_types), layer_types=list(self.layer_types),
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
            linear_key_head_dim=self.linear_head_dim, linear_value_head_dim=self.linear_head_dim,
            linear_conv_kernel_dim=4, tie_word_embeddings=self.tie_embeddings, max_position_embeddings=max_len,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": self.partial_rotary},
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)

    def describe(self) -> str:
        gdn = sum(t == "linear_attention" for t in self.layer_types)
        attn = len(self.layer_types) - gdn
        return (f"Qwen3.5-shaped hybrid (`Qwen3_5ForCausalLM`): {_n(len(self.layer_types), 'layer')}, d_model "
                f"{self.hidden_size}: {gdn} Gated DeltaNet ({self.linear_key_heads} q/k heads for "
                f"{self.linear_value_heads} value heads of {self.linear_head_dim})"
                + (f", {attn} gated attention ({_n(self.num_heads, 'head')} of {self.head_dim}, "
                   f"{self.num_kv_heads} KV, rotary on {self.partial_rotary:.0%})" if attn else "")
                + f"; SwiGLU MLP {self.intermediate_size}; {'tied' if self.tie_embeddings else 'untied'} embeddings")


def gdn_shapes() -> tuple[GatedDeltaShape, GatedDeltaShape]:
    """The Gated DeltaNet pair (``--pair gdn``): a target of Qwen3.5's layer mix (three Gated
    DeltaNet layers to one gated attention layer) with heads of 64 (what vLLM 0.32's CPU GDN op
    takes), and a one-layer Gated DeltaNet draft; 15 MB in fp16 together."""
    target = GatedDeltaShape(hidden_size=256, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 2,
                             num_heads=4, num_kv_heads=2, head_dim=64, linear_key_heads=2, linear_value_heads=4,
                             linear_head_dim=64, intermediate_size=512)
    draft = GatedDeltaShape(hidden_size=192, layer_types=("linear_attention",), num_heads=4, num_kv_heads=2,
                            head_dim=64, linear_key_heads=2, linear_value_heads=4, linear_head_dim=64,
                            intermediate_size=512)
    return target, draft


@dataclass
class TrainSettings:
    """One training phase. ``steps`` None = run for ``budget_s`` seconds of wall clock."""

    budget_s: float
    steps: int | None = None
    # 2048 tokens a step: ~2000 steps in a free 17-minute CPU phase, still a few hundred when the
    # machine is shared (CPU tokens/s barely depends on the batch at this size).
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 3e-3  # tiny models, short runs: a high peak lr (warm-up and clipping keep it stable)
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: float = 0.03  # fraction of the run spent in linear warm-up
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 25


@dataclass
class ContinuationSettings:
    """Text the trained target writes itself, for the draft's distillation (sequence-level KD, as
    DistillSpec and EAGLE's regenerated data do): what a draft must predict at decoding time is the
    target's own text, which the corpus is not. ``sequences`` continuations of ``prompt_len``-token
    windows of the training stream, long enough to fill one draft batch row (``seq_len + 1``
    tokens in all), written by the target's own batched decoding; batches alternate between the
    ``temperatures``. ``mix`` is the fraction of every draft batch drawn from them (the rest is
    corpus text). ``sequences=0`` distills on the corpus alone."""

    sequences: int = 8192
    prompt_len: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    batch_size: int = 128
    mix: float = 0.75


@dataclass
class RecipeConfig:
    """Everything that determines a run (recorded in the card and metrics.json)."""

    seed: int = 1234
    vocab_size: int = 4096
    heldout_percent: float = 5.0
    max_files: int | None = None  # smoke tests: a spread-out slice of the corpus
    # The pair's cost ratio is what real pairs have (Mamba2-2.7B vs 130M, an 8B hybrid vs a 2-layer
    # draft: 20x and more): one 1-node call of this 16M-parameter, 8-layer target costs about 5x a call
    # of the draft in the decoding loop on 2 CPU cores (its 65 MB of fp32 weights make a decoding step
    # memory-bound, as on a GPU, and it has 8x the layers). d_state = head_dim = 64; GQA 3:1 (x/B
    # groups likewise).
    target: ModelShape | GatedDeltaShape = field(default_factory=lambda: ModelShape(
        hidden_size=384, num_layers=8, attn_layers=(1, 3, 5, 7), num_heads=6, num_kv_heads=2,
        intermediate_size=1024))
    # One wide Mamba2 layer, embeddings tied (the untied ones would not fit the 40 MB): on 2 CPU cores a
    # draft call costs what its small ops cost, so one layer of width 320 runs 15% faster in the
    # decoding loop than the two layers of width 192 shipped before (0.65 against 0.73-0.86 ms) and,
    # distilled the same way for 800 steps, agreed more with the target on its greedy text (0.58
    # against 0.53); width 384 cost more and agreed less on that text (model card).
    draft: ModelShape | GatedDeltaShape = field(default_factory=lambda: ModelShape(
        hidden_size=320, num_layers=1, attn_layers=(), num_heads=5, num_kv_heads=1,
        intermediate_size=896, tie_embeddings=True))
    # 2e-3: the 16M-parameter target is less stable than the small draft at 3e-3
    target_train: TrainSettings = field(default_factory=lambda: TrainSettings(budget_s=0.0, lr=2e-3))
    draft_train: TrainSettings = field(default_factory=lambda: TrainSettings(budget_s=0.0))
    continuations: ContinuationSettings = field(default_factory=ContinuationSettings)
    kd_ce_weight: float = 0.1  # draft loss = KL(target || draft) + kd_ce_weight * CE(data)
    kd_temperature: float = 1.0
    eval_windows: int = 128  # held-out windows of seq_len tokens used for evaluation
    save_dtype: str = "float16"  # storage dtype; loading casts back to fp32 (keeps both dirs < 40 MB)
    device: str = "cpu"
    threads: int = 2
    # A target checkpoint written by an earlier run (its metrics.json beside it): distil a new draft
    # for it instead of training a target; its training settings and statistics are carried over.
    target_from: str | None = None


# Default step counts. On the project's 2-core VMs (quiet) the target trained at ~1,300 tokens/s
# (79 min for 3,000 x 2,048 = 6.1M tokens, 1.9 epochs; the earlier, slower VM); on the later one
# the target wrote its 8,192 continuations in 13.5 min (~1,950 new tokens/s) and the draft's
# distillation, which runs the target forward too, took 28 min for 6.1M tokens (~3,600 tokens/s).
# The CUDA preset's batches are 8x bigger.
TARGET_STEPS = 3000
DRAFT_STEPS = 3000


def preset(device: str) -> RecipeConfig:
    """Default config for a device. The CPU preset: batches of 8 x 256 tokens (about 2 hours on 2 quiet
    cores with the default steps). The CUDA preset trains the same shapes with batches of 32 x 512."""
    cfg = RecipeConfig(device=device)
    if device.startswith("cuda"):
        cfg.target_train = TrainSettings(budget_s=0.0, batch_size=32, seq_len=512, lr=2e-3, log_every=100)
        cfg.draft_train = TrainSettings(budget_s=0.0, batch_size=32, seq_len=512, lr=3e-3, log_every=100)
        cfg.eval_windows = 256
    return cfg


# ------------------------------------------------------------------------------------------------
# Model construction
# ------------------------------------------------------------------------------------------------
def build_model(shape: ModelShape | GatedDeltaShape, vocab_size: int, eos_id: int, max_len: int, seed: int):
    """A freshly initialised hybrid (seeded, so target and draft inits do not depend on each other).
    A Gated DeltaNet hybrid keeps transformers' own init (its zero-centred norms, A_log and dt_bias
    ranges are the family's)."""
    config = shape.to_config(vocab_size, eos_id, max_len)
    torch.manual_seed(seed)
    if isinstance(shape, GatedDeltaShape):
        from transformers import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(config)
    from stree.hybrid import MambaInLlamaForCausalLM

    model = MambaInLlamaForCausalLM(config)
    init_weights(model, config, seed)
    return model


@torch.no_grad()
def init_weights(model: torch.nn.Module, config, seed: int) -> None:
    """GPT-2/Llama-style init plus mamba_ssm's Mamba2 init, applied by parameter name so that training
    does not depend on whatever the model class does at construction (it is written for loading).

    * Linear / embedding: N(0, initializer_range); residual output projections (``out_proj``, ``o_proj``,
      ``down_proj``) scaled by 1/sqrt(2 * num_layers), as GPT-2 and mamba_ssm do, so the residual stream
      does not grow with depth.
    * Mamba2: ``A_log = log U[1, 16]``, ``dt_bias = softplus^-1(dt)`` with ``dt`` log-uniform in
      [1e-3, 1e-1] (floored at 1e-4), ``D = 1``; the depthwise conv keeps PyTorch's default init.
    * Norm weights 1.
    """
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    resid_std = std / math.sqrt(2 * config.num_hidden_layers)
    for name, p in model.named_parameters():
        module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""  # e.g. "out_proj"
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3))
                           + math.log(1e-3)).clamp(min=1e-4)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        elif name.endswith(".D"):
            p.fill_(1.0)
        elif "norm" in name and name.endswith("weight"):
            p.fill_(1.0)
        elif "conv1d" in name:
            continue  # PyTorch's default (kaiming-uniform) init, as mamba_ssm
        elif name.endswith("bias"):
            p.zero_()
        elif p.dim() == 2:
            s = resid_std if module in ("out_proj", "o_proj", "down_proj") else std
            p.copy_(torch.randn(p.shape, generator=gen) * s)


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(b, l, v)`` of ``model`` on ``x``, uncached: a MambaInLlama model returns them, a
    transformers model an output object (and no cache is built: transformers' cache of a model
    with no attention layer cannot tell its length)."""
    from stree.hybrid import MambaInLlamaForCausalLM

    if isinstance(model, MambaInLlamaForCausalLM):
        out = model(x)
        return out if isinstance(out, torch.Tensor) else out.logits
    return model(x, use_cache=False).logits


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def lr_at(progress: float, s: TrainSettings) -> float:
    """Linear warm-up then cosine decay to ``lr * min_lr_ratio``; ``progress`` in [0, 1]."""
    progress = min(max(progress, 0.0), 1.0)
    if s.warmup > 0 and progress < s.warmup:
        return s.lr * max(progress / s.warmup, 0.01)
    t = (progress - s.warmup) / max(1.0 - s.warmup, 1e-9)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_optimizer(model: torch.nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norms, biases, A_log, dt_bias, D) or embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=1e-8)


def train(model, loss_fn, batcher: data.Batcher, s: TrainSettings, device: str, name: str,
          log=print) -> dict:
    """Run one phase; ``loss_fn(model, x, y) -> (loss, ce)``. Returns steps, tokens, time, losses."""
    model.to(device).train()
    opt = make_optimizer(model, s)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else _null()
    t0 = time.perf_counter()
    step, tokens, ema, history = 0, 0, None, []
    while True:
        elapsed = time.perf_counter() - t0
        if s.steps is not None:
            if step >= s.steps:
                break
            progress = step / s.steps
        else:
            if elapsed >= s.budget_s:
                break
            progress = elapsed / s.budget_s
        lr = lr_at(progress, s)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batcher.next()
        x, y = x.to(device), y.to(device)
        with amp:
            loss, ce = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        ce_val = ce.item()
        ema = ce_val if ema is None else 0.95 * ema + 0.05 * ce_val
        if step % s.log_every == 0 or step == 1:
            el = time.perf_counter() - t0
            history.append({"step": step, "tokens": tokens, "seconds": round(el, 1), "train_ce_ema": round(ema, 4)})
            log(f"[{name}] step {step:5d}  loss {loss.item():.4f}  ce(ema) {ema:.4f}  lr {lr:.2e}  "
                f"{tokens / el:7.0f} tok/s  {el:6.0f}s")
    seconds = time.perf_counter() - t0
    model.eval()
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1), "final_train_ce_ema": ema,
            "history": history}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def ce_loss(model, x, y):
    """Next-token cross-entropy (the target's objective)."""
    logits = _logits(model, x).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return ce, ce.detach()


def kd_loss(target, ce_weight: float, temperature: float):
    """Draft objective: forward KL to the target's (temperature-scaled) distribution, plus ``ce_weight``
    times data cross-entropy. Forward KL (mass-covering) matches what speculative decoding rewards:
    acceptance is sum_x min(p, q), and argmax agreement for greedy."""

    def fn(model, x, y):
        with torch.no_grad():
            t_logits = _logits(target, x).float()
        d_logits = _logits(model, x).float()
        v = d_logits.shape[-1]
        t_logp = F.log_softmax(t_logits.reshape(-1, v) / temperature, dim=-1)
        d_logp = F.log_softmax(d_logits.reshape(-1, v) / temperature, dim=-1)
        kl = F.kl_div(d_logp, t_logp, log_target=True, reduction="batchmean") * temperature ** 2
        ce = F.cross_entropy(d_logits.reshape(-1, v), y.reshape(-1))
        return kl + ce_weight * ce, ce.detach()

    return fn


# ------------------------------------------------------------------------------------------------
# The target's own text
# ------------------------------------------------------------------------------------------------
def decoder(target):
    """A patched copy of ``target`` for :func:`continue_text` (the trained module stays as it was)."""
    import stree

    return stree.patch(copy.deepcopy(target).eval())


@torch.no_grad()
def continue_text(model, prompts: torch.Tensor, new_tokens: int, temperature: float,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompts (b, p)`` followed by the continuation of ``model`` (a :func:`decoder`) by its own
    batched decoding (``stree.generate(method="ar")``, no EOS stop): ``(b, p + new_tokens)`` int64."""
    import stree

    out = stree.generate(model, None, prompts, max_new_tokens=new_tokens, temperature=temperature,
                         method="ar", generator=generator)
    return out.sequences[:, :prompts.shape[1] + new_tokens]


def write_continuations(target, stream: torch.Tensor, s: ContinuationSettings, seq_len: int, seed: int,
                        device: str, log=print) -> tuple[torch.Tensor, dict]:
    """``(s.sequences, seq_len + 1)`` int32 rows for the draft's batches: ``s.prompt_len`` tokens of
    ``stream`` at seeded random offsets, continued by the target; batch ``i`` at temperature
    ``s.temperatures[i % len]``. Returns the rows and their statistics (tokens, time)."""
    new = seq_len + 1 - s.prompt_len
    if new < 1:
        raise ValueError(f"prompt_len {s.prompt_len} leaves no room in a row of {seq_len + 1} tokens")
    rows = torch.empty(s.sequences, seq_len + 1, dtype=torch.int32)
    model = decoder(target)
    starts = torch.Generator().manual_seed(seed)
    sampler = torch.Generator(device).manual_seed(seed)
    t0 = time.perf_counter()
    for i, lo in enumerate(range(0, s.sequences, s.batch_size)):
        b = min(s.batch_size, s.sequences - lo)
        offsets = torch.randint(0, stream.numel() - s.prompt_len, (b,), generator=starts)
        prompts = stream[offsets[:, None] + torch.arange(s.prompt_len)].long().to(device)
        temperature = s.temperatures[i % len(s.temperatures)]
        rows[lo:lo + b] = continue_text(model, prompts, new, temperature, sampler).cpu().to(torch.int32)
        el = time.perf_counter() - t0
        log(f"[continuations] {lo + b:5d}/{s.sequences}  T={temperature}  "
            f"{(lo + b) * new / el:6.0f} new tokens/s  {el:5.0f}s")
    seconds = time.perf_counter() - t0
    tokens = s.sequences * new
    return rows, {"sequences": s.sequences, "new_tokens": tokens, "seconds": round(seconds, 1),
                  "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


# ------------------------------------------------------------------------------------------------
# Evaluation, saving
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(target, draft, windows: torch.Tensor, device: str, batch_size: int = 8) -> dict:
    """Held-out metrics on ``windows (n, L+1)``:

    * ``*_loss`` / ``*_ppl``: mean next-token cross-entropy (nats/token) and its exp;
    * ``*_top1_acc``: argmax == next token;
    * ``top1_agreement``: argmax draft == argmax target (per-token acceptance of greedy speculation);
    * ``sampling_acceptance``: mean sum_x min(p_target, p_draft) at temperature 1 (per-token acceptance
      of speculative sampling, Leviathan et al.).
    """
    target.to(device).eval()
    draft.to(device).eval()
    sums = dict.fromkeys(("target_loss", "draft_loss", "target_top1_acc", "draft_top1_acc",
                          "top1_agreement", "sampling_acceptance"), 0.0)
    n = 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size].to(device)
        x, y = w[:, :-1], w[:, 1:]
        lt = _logits(target, x).float()
        ld = _logits(draft, x).float()
        v = lt.shape[-1]
        sums["target_loss"] += F.cross_entropy(lt.reshape(-1, v), y.reshape(-1), reduction="sum").item()
        sums["draft_loss"] += F.cross_entropy(ld.reshape(-1, v), y.reshape(-1), reduction="sum").item()
        at, ad = lt.argmax(-1), ld.argmax(-1)
        sums["target_top1_acc"] += (at == y).sum().item()
        sums["draft_top1_acc"] += (ad == y).sum().item()
        sums["top1_agreement"] += (at == ad).sum().item()
        sums["sampling_acceptance"] += torch.minimum(lt.softmax(-1), ld.softmax(-1)).sum(-1).sum().item()
        n += y.numel()
    out = {k: v / n for k, v in sums.items()}
    out["target_ppl"] = math.exp(out["target_loss"])
    out["draft_ppl"] = math.exp(out["draft_loss"])
    out["eval_tokens"] = n
    return out


@torch.no_grad()
def continuation_agreement(target, draft, windows: torch.Tensor, prompt_len: int, device: str) -> float:
    """Top-1 agreement on the target's own greedy text, which is what greedy speculation verifies: each
    held-out window's first ``prompt_len`` tokens continued greedily by the target to the window's
    length, then argmax draft == argmax target over the continuation (teacher-forced)."""
    seqs = continue_text(decoder(target), windows[:, :prompt_len].to(device), windows.shape[1] - prompt_len, 0.0)
    x = seqs[:, :-1]
    at = _logits(target, x).argmax(-1)[:, prompt_len - 1:]
    ad = _logits(draft, x).argmax(-1)[:, prompt_len - 1:]
    return (at == ad).float().mean().item()


def load_trained_target(cfg: RecipeConfig, tok):
    """The target of an earlier run, ``cfg.target_from`` (a directory this recipe wrote, its
    ``metrics.json`` one level up), in place of training one: its stored weights cast to fp32, and its
    training statistics with the command that trained it. ``cfg.target_train`` becomes the settings
    that trained it, so the card describes them. Refused unless its shape is ``cfg.target`` and its
    tokenizer is the one this run trained (same corpus, same vocabulary)."""
    from tokenizers import Tokenizer

    src = Path(cfg.target_from)
    metrics = src.parent / "metrics.json"
    for f in (src / "config.json", src / "tokenizer.json", metrics):
        if not f.exists():
            raise FileNotFoundError(f"--target-from {src}: {f} is missing (a target this recipe wrote is needed)")
    old = json.loads(metrics.read_text())
    if old["config"]["target"] != json.loads(json.dumps(dataclasses.asdict(cfg.target))):
        raise ValueError(f"--target-from {src}: its shape {old['config']['target']} is not this recipe's "
                         f"{dataclasses.asdict(cfg.target)}")
    if json.loads(Tokenizer.from_file(str(src / "tokenizer.json")).to_str()) != json.loads(tok.to_str()):
        raise ValueError(f"--target-from {src}: its tokenizer differs from the one trained on this corpus")
    settings = dict(old["config"]["target_train"], betas=tuple(old["config"]["target_train"]["betas"]))
    cfg.target_train = TrainSettings(**settings)
    # a target carried over more than once keeps the command that trained it
    trained_by = old["train"]["target"].get("trained_by", old["command"])
    return load_checkpoint(src), dict(old["train"]["target"], trained_by=trained_by)


def save_checkpoint(model, tok, directory: Path, dtype: str) -> int:
    """Save with the model's own ``save_pretrained`` (the MambaInLlama layout, or transformers') in ``dtype`` (weights only; the live model is untouched) with the
    tokenizer beside it. Returns the directory's size in bytes."""
    stored = copy.deepcopy(model).to("cpu", getattr(torch, dtype))
    stored.save_pretrained(str(directory))
    data.save_tokenizer(tok, directory)
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def load_checkpoint(directory: Path):
    """Load back and cast to fp32: the checkpoint is stored in fp16/bf16 to stay small; CPU runs in fp32."""
    import stree.hf
    from stree.hybrid import MambaInLlamaForCausalLM

    if stree.hf.is_checkpoint(str(directory)):  # a transformers layout (the Gated DeltaNet pair)
        return stree.hf.load(str(directory), dtype=torch.float32)
    return MambaInLlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def run(cfg: RecipeConfig, out_dir: str | os.PathLike, card_path: str | os.PathLike | None = None,
        command: str | None = None, log=print) -> dict:
    """Train, save, reload, evaluate and describe both models. Returns the report (also metrics.json)."""
    t_start = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = cfg.device

    corpus = data.load_corpus(heldout_percent=cfg.heldout_percent, max_files=cfg.max_files)
    tok = data.train_tokenizer(corpus.train_texts, cfg.vocab_size)
    eos = tok.token_to_id(data.EOS)
    train_stream = data.encode_stream(tok, corpus.train_texts)
    held_stream = data.encode_stream(tok, corpus.heldout_texts)
    seq_len = cfg.target_train.seq_len
    windows = data.eval_windows(held_stream, seq_len, cfg.eval_windows)
    log(f"corpus: {len(corpus.train_paths)} train files ({train_stream.numel()} tokens), "
        f"{len(corpus.heldout_paths)} held-out files ({held_stream.numel()} tokens); "
        f"vocab {tok.get_vocab_size()}; {time.perf_counter() - t_start:.1f}s")
    max_len = max(cfg.target_train.seq_len, cfg.draft_train.seq_len, 2048)

    if cfg.target_from is not None:
        target, t_stats = load_trained_target(cfg, tok)
    else:
        target = build_model(cfg.target, tok.get_vocab_size(), eos, max_len, cfg.seed)
        t_stats = train(target, ce_loss, data.Batcher(train_stream, cfg.target_train.batch_size, seq_len, cfg.seed),
                        cfg.target_train, device, "target", log)
    target.to(device)
    rows, c_stats = write_continuations(target, train_stream, cfg.continuations, cfg.draft_train.seq_len,
                                        cfg.seed + 2, device, log)
    batcher = data.MixedBatcher(
        data.Batcher(train_stream, cfg.draft_train.batch_size, cfg.draft_train.seq_len, cfg.seed + 1),
        rows, cfg.continuations.mix, cfg.seed + 3)
    draft = build_model(cfg.draft, tok.get_vocab_size(), eos, max_len, cfg.seed + 1)
    d_stats = train(draft, kd_loss(target, cfg.kd_ce_weight, cfg.kd_temperature), batcher,
                    cfg.draft_train, device, "draft", log)

    sizes = {}
    for name, model in (("target", target), ("draft", draft)):
        sizes[name] = save_checkpoint(model, tok, out / name, cfg.save_dtype)
    # Evaluate what was shipped: the stored (fp16/bf16) weights loaded back and cast to fp32.
    target_l, draft_l = load_checkpoint(out / "target"), load_checkpoint(out / "draft")
    storage_err = {name: _max_logit_diff(live, stored, windows[:1, :-1], device)
                   for name, live, stored in (("target", target, target_l), ("draft", draft, draft_l))}
    log(f"max |logit| change from {cfg.save_dtype} storage: " +
        ", ".join(f"{k} {v:.2e}" for k, v in storage_err.items()))
    metrics = evaluate(target_l, draft_l, windows, device)
    metrics["greedy_text_agreement"] = continuation_agreement(target_l, draft_l, windows,
                                                              cfg.continuations.prompt_len, device)
    log("eval: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))

    bytes_per_token = corpus.heldout_bytes / max(held_stream.numel(), 1)
    report = {
        "config": dataclasses.asdict(cfg),
        "command": command,
        "corpus": {"root": corpus.root, "train_files": len(corpus.train_paths),
                   "heldout_files": len(corpus.heldout_paths), "train_tokens": int(train_stream.numel()),
                   "heldout_tokens": int(held_stream.numel()), "train_bytes": corpus.train_bytes,
                   "heldout_bytes": corpus.heldout_bytes, "heldout_bytes_per_token": bytes_per_token,
                   "heldout_paths": corpus.heldout_paths},
        "params": {"target": count_params(target), "draft": count_params(draft)},
        "train": {"target": t_stats, "continuations": c_stats, "draft": d_stats},
        "eval": metrics,
        "bits_per_byte": {k: metrics[f"{k}_loss"] / math.log(2) / bytes_per_token for k in ("target", "draft")},
        "checkpoint_bytes": sizes,
        "storage_max_logit_diff": storage_err,
        "env": {"python": platform.python_version(), "torch": torch.__version__,
                "platform": platform.platform(), "device": _device_name(device), "threads": cfg.threads},
        "wall_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "metrics.json").write_text(json.dumps(report, indent=2) + "\n")
    card = Path(card_path) if card_path is not None else out.parent / "README.md"
    card.write_text(render_card(report, os.path.relpath(out, card.resolve().parent)))
    total = sum(sizes.values())
    log(f"saved {out} ({total / 1e6:.1f} MB in both dirs), card {card}, {report['wall_seconds']:.0f}s total")
    if total > MAX_BYTES:
        log(f"WARNING: checkpoints take {total / 1e6:.1f} MB, over the {MAX_BYTES / 1e6:.0f} MB the repository allows")
    return report


@torch.no_grad()
def _max_logit_diff(live, stored, x: torch.Tensor, device: str) -> float:
    """Largest logit change (one held-out window) between the trained fp32 model and its stored copy."""
    x = x.to(device)
    return (_logits(live.to(device).float(), x).float() - _logits(stored.to(device), x).float()).abs().max().item()


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


def _rerun_note(c: dict, tr: dict) -> str:
    steps = f"`--target-steps {tr['target']['steps']} --draft-steps {tr['draft']['steps']}`"
    if c["target_train"]["steps"] and c["draft_train"]["steps"]:
        return (f"Both phases ran a fixed number of steps ({steps}) on a step-based\nschedule: the same "
                "command and seed repeat this run, whatever else the machine is doing.")
    return ("Training for a wall-clock budget makes the step count (and the schedule's position at each\n"
            f"step) depend on the machine's load. {steps} reruns with this run's step\ncounts on a "
            "step-based schedule, which repeats exactly from run to run.")


def render_card(r: dict, rel: str) -> str:
    """The model card (Markdown) from a run report; ``rel`` is the output dir relative to the card."""
    c, e, cor, tr = r["config"], r["eval"], r["corpus"], r["train"]

    def shape(s):
        return (GatedDeltaShape(**s) if "layer_types" in s else ModelShape(**s)).describe()

    gdn = "layer_types" in c["target"]
    name = "stree-gdn" if gdn else "stree-tiny"
    layout = ("a transformers checkpoint written by `save_pretrained`: `config.json` (`Qwen3_5TextConfig`), "
              if gdn else "a public MambaInLlama checkpoint: `config.json` (Llama config), `mamba_config.json`\n"
              "(MambaInLlama `MambaConfig`), ")
    loader = ("`stree.hf.load(dir)` or `transformers.Qwen3_5ForCausalLM.from_pretrained(dir, dtype=torch.float32)`"
              if gdn else "`stree.hybrid.MambaInLlamaForCausalLM.from_pretrained(dir, dtype=torch.float32)`")

    def phase(t, s):
        mode = f"{s['steps']} steps" if s["steps"] else f"{s['budget_s'] / 60:.1f} min budget"
        return (f"{t['steps']} steps x {s['batch_size']} x {s['seq_len']} tokens = {t['tokens'] / 1e6:.2f}M tokens "
                f"({t['tokens'] / cor['train_tokens']:.2f} epochs) in {t['seconds'] / 60:.1f} min "
                f"({t['tokens_per_s']:.0f} tokens/s; {mode}); AdamW lr {s['lr']} betas {tuple(s['betas'])} "
                f"wd {s['weight_decay']}, warm-up {s['warmup']:.0%} then cosine to {s['min_lr_ratio']}x, "
                f"clip {s['grad_clip']}")

    mb = {k: v / 1e6 for k, v in r["checkpoint_bytes"].items()}
    cc, ct = c["continuations"], tr["continuations"]
    continuations = (
        f"{ct['sequences']:,} windows of {cc['prompt_len']} training tokens at random offsets, each continued "
        f"by the trained target's own decoding to {c['draft_train']['seq_len'] + 1} tokens (batches of "
        f"{cc['batch_size']}, alternately at temperature {' and '.join(map(str, cc['temperatures']))}): "
        f"{ct['new_tokens'] / 1e6:.2f}M new tokens in {ct['seconds'] / 60:.1f} min ({ct['tokens_per_s']:.0f} tokens/s)."
        if ct["sequences"] else "none (the draft is distilled on corpus text only).")
    target_origin = ("" if "trained_by" not in tr["target"] else
                     f"\n  Trained by an earlier run, `{tr['target']['trained_by']}` (its draft steps are that run's, "
                     f"since replaced); this run kept the target (`--target-from`) and distilled the draft below.")
    return f"""# {name}: a real target/draft pair for speculative decoding tests and benchmarks

Generated by `models/recipe.py` (do not edit by hand; rerun the recipe). Two small models trained here,
offline, on Python source code, so that speculative decoding has real (not random) acceptance:

| | target (`{rel}/target`) | draft (`{rel}/draft`) |
|---|---|---|
| architecture | {shape(c['target'])} | {shape(c['draft'])} |
| parameters | {r['params']['target']:,} | {r['params']['draft']:,} |
| checkpoint | {mb['target']:.1f} MB ({c['save_dtype']}) | {mb['draft']:.1f} MB ({c['save_dtype']}) |
| held-out loss (nats/token) | {e['target_loss']:.4f} | {e['draft_loss']:.4f} |
| held-out perplexity | {e['target_ppl']:.2f} | {e['draft_ppl']:.2f} |
| held-out bits/byte | {r['bits_per_byte']['target']:.3f} | {r['bits_per_byte']['draft']:.3f} |
| held-out top-1 accuracy | {e['target_top1_acc']:.4f} | {e['draft_top1_acc']:.4f} |

**Draft vs target on held-out text** ({e['eval_tokens']:,} positions, teacher-forced):
top-1 agreement (argmax draft == argmax target) **{e['top1_agreement']:.4f}**; expected per-token
acceptance of speculative sampling at temperature 1 (mean of sum_x min(p, q))
**{e['sampling_acceptance']:.4f}**. On the target's own greedy text (the first
{cc['prompt_len']} tokens of each held-out window continued greedily by the target to
{c['target_train']['seq_len'] + 1} tokens), which is what greedy speculation verifies, top-1
agreement (the per-token acceptance rate of greedy speculation) is **{e['greedy_text_agreement']:.4f}**.

## Layout and loading
Each directory is {layout}`model.safetensors` (stored in {c['save_dtype']} to keep the repository small)
plus `tokenizer.json` (+ `tokenizer_config.json` for `transformers.AutoTokenizer`). Load with
{loader} (the card's numbers are of the stored
weights loaded back and cast to fp32; storage changes the logits by at most
{max(r['storage_max_logit_diff'].values()):.1e} on a held-out window). Both models share one tokenizer: byte-level BPE, vocab
{c['vocab_size']}, `<|endoftext|>` = id 0 is EOS and BOS (training documents are `<|endoftext|>` + file
text, so prefix prompts with it), `<|pad|>` = id 1.

## Data
The Python {r['env']['python']} standard library's `*.py` files (`{cor['root']}`), sorted, without test
suites (`test`/`tests`/`idle_test` dirs, `test_*` files) or `site-packages`: {cor['train_files']} training
files ({cor['train_bytes'] / 1e6:.1f} MB, {cor['train_tokens']:,} tokens) and {cor['heldout_files']} held-out
files ({cor['heldout_bytes'] / 1e6:.2f} MB, {cor['heldout_tokens']:,} tokens) chosen by sha1 of the relative
path ({c['heldout_percent']}%; list in `metrics.json`). The same Python version gives the same corpus
on any machine. Evaluation uses {c['eval_windows']} non-overlapping held-out windows of
{c['target_train']['seq_len']} tokens spread over the held-out stream.

## Training
- Target: {phase(tr['target'], c['target_train'])}. Objective: next-token cross-entropy.{target_origin}
- Target-written text: {continuations}
- Draft: {phase(tr['draft'], c['draft_train'])}. Objective: KL(target || draft) at temperature
  {c['kd_temperature']} on target logits computed on the fly, + {c['kd_ce_weight']} x cross-entropy;
  {cc['mix']:.0%} of each batch is target-written text, the rest corpus windows.
- Seed {c['seed']}; {r['env']['device']}, {r['env']['threads']} threads; Python {r['env']['python']},
  torch {r['env']['torch']}; {r['wall_seconds'] / 60:.1f} min wall clock in all.
- Command: `{r['command']}`

{_rerun_note(c, tr)}

## Intended use
Tests and benchmarks of speculative (tree) decoding: a real target whose distribution a draft
approximates imperfectly. These are tiny models of Python code; they are not useful language models.
"""


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output dir; gets target/ and draft/ checkpoints")
    p.add_argument("--card", default=None, help="model card path (default: OUT/../README.md; with --pair gdn "
                                                "OUT/README.md)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda selects the bigger preset)")
    p.add_argument("--budget-minutes", type=float, default=None,
                   help="train for wall-clock time instead of steps (phases without explicit steps): "
                        "~62%% target, ~31%% draft, the rest data/eval/saving")
    p.add_argument("--target-steps", type=int, default=None,
                   help=f"target training steps (default {TARGET_STEPS}, unless --budget-minutes)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help=f"draft distillation steps (default {DRAFT_STEPS}, unless --budget-minutes)")
    p.add_argument("--target-from", default=None, metavar="DIR",
                   help="distil a new draft for the target an earlier run wrote to DIR (its metrics.json "
                        "one level up) instead of training a target")
    p.add_argument("--continuations", type=int, default=None, metavar="N",
                   help="target-written sequences for the draft's distillation (default "
                        f"{ContinuationSettings.sequences}; 0: corpus text only)")
    p.add_argument("--pair", choices=("mambainllama", "gdn"), default="mambainllama",
                   help="mambainllama: stree-tiny's shapes; gdn: a Qwen3.5-shaped Gated DeltaNet target and "
                        "a one-layer Gated DeltaNet draft (transformers' save_pretrained layout)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    p.add_argument("--max-files", type=int, default=None, help="corpus slice (smoke runs)")
    return p.parse_args(argv)


def config_from_args(args) -> RecipeConfig:
    cfg = preset(args.device)
    if args.pair == "gdn":
        cfg.target, cfg.draft = gdn_shapes()
    if args.budget_minutes is not None:
        budget = args.budget_minutes * 60
        cfg.target_train.budget_s = 0.62 * budget
        cfg.draft_train.budget_s = 0.31 * budget
        cfg.target_train.steps, cfg.draft_train.steps = args.target_steps, args.draft_steps
    else:
        cfg.target_train.steps = args.target_steps or TARGET_STEPS
        cfg.draft_train.steps = args.draft_steps or DRAFT_STEPS
    if args.seed is not None:
        cfg.seed = args.seed
    if args.threads is not None:
        cfg.threads = args.threads
    cfg.max_files = args.max_files
    cfg.target_from = args.target_from
    if args.continuations is not None:
        cfg.continuations.sequences = args.continuations
    return cfg


def main(argv=None):
    args = parse_args(argv)
    command = "python models/recipe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    card = args.card or (os.path.join(args.out, "README.md") if args.pair == "gdn" else None)  # beside it
    run(config_from_args(args), args.out, card, command=command)


if __name__ == "__main__":
    main()
