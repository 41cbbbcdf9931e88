"""Smoke run of models/recipe.py: a corpus slice, tiny dims, a few steps, into tmp_path (< 30 s on CPU).

Checks the pipeline end to end, not model quality: both checkpoints load back through
``MambaInLlamaForCausalLM.from_pretrained`` in the public layout, the stored weights are fp16 and load
as fp32, the tokenizer sits beside each, and the card and metrics.json are written.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import recipe  # noqa: E402


def tiny_config() -> "recipe.RecipeConfig":
    shape = recipe.ModelShape
    cfg = recipe.RecipeConfig(
        seed=7, vocab_size=320, heldout_percent=20.0, max_files=16,
        target=shape(hidden_size=32, num_layers=2, attn_layers=(1,), num_heads=2, num_kv_heads=1,
                     intermediate_size=64),
        draft=shape(hidden_size=16, num_layers=1, attn_layers=(), num_heads=1, num_kv_heads=1,
                    intermediate_size=32),
        target_train=recipe.TrainSettings(budget_s=0.0, steps=3, batch_size=2, seq_len=32, log_every=1),
        draft_train=recipe.TrainSettings(budget_s=0.0, steps=3, batch_size=2, seq_len=32, log_every=1),
        eval_windows=4, threads=1)
    return cfg


def test_recipe_smoke(tmp_path):
    out = tmp_path / "stree-tiny"
    logs = []
    report = recipe.run(tiny_config(), out, command="smoke", log=logs.append)

    card = tmp_path / "README.md"
    assert card.exists()
    text = card.read_text()
    assert "top-1 agreement" in text and "smoke" in text
    assert json.loads((out / "metrics.json").read_text())["train"]["target"]["steps"] == 3

    for name in ("target", "draft"):
        d = out / name
        for f in ("config.json", "mamba_config.json", "model.safetensors", "tokenizer.json"):
            assert (d / f).exists(), f"{name}/{f} missing"
        from safetensors import safe_open
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
        model = recipe.load_checkpoint(d)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x = torch.randint(0, 320, (1, 8))
        logits = recipe._logits(model(x))
        assert logits.shape == (1, 8, 320) and torch.isfinite(logits).all()

    mamba_cfg = json.loads((out / "draft" / "mamba_config.json").read_text())
    assert mamba_cfg["attn_layers"] == [] and mamba_cfg["n_layer"] == 1
    assert json.loads((out / "target" / "mamba_config.json").read_text())["attn_layers"] == [1]

    e = report["eval"]
    assert 0.0 <= e["top1_agreement"] <= 1.0 and 0.0 <= e["sampling_acceptance"] <= 1.0
    assert e["target_loss"] > 0 and e["draft_loss"] > 0

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "draft" / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.decode(tok.encode("def f(x):\n    return x\n").ids) == "def f(x):\n    return x\n"


def test_schedule_and_split():
    s = recipe.TrainSettings(budget_s=1.0, lr=1.0, warmup=0.1, min_lr_ratio=0.1)
    assert recipe.lr_at(0.05, s) == pytest.approx(0.5)
    assert recipe.lr_at(0.1, s) == pytest.approx(1.0)
    assert recipe.lr_at(1.0, s) == pytest.approx(0.1)
    from models import data
    # the held-out split depends only on the relative path
    assert data.is_heldout("asyncio/futures.py", 5.0) == data.is_heldout("asyncio/futures.py", 5.0)
    picked = sum(data.is_heldout(f"m{i}.py", 5.0) for i in range(4000))
    assert 120 < picked < 280
