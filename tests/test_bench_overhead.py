"""Smoke run of ``bench/overhead.py --tiny`` (tiny random models, CPU, seconds): every call of a step
is profiled, every layer type reports its op counts, and the result files carry device/commit/date."""
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

overhead = importlib.import_module("overhead")


def test_overhead_tiny(tmp_path):
    assert overhead.main(["--tiny", "--repeats", "1", "--step-tokens", "8", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("overhead_tiny_*.json")
    rows = json.loads(path.read_text())
    assert all(r["device"] and r["commit"] and r["date"] for r in rows)
    calls = {(r["model"], r["call"]) for r in rows}
    for n in (1, 13, 63):
        assert ("target", f"tree_forward_{n}") in calls and ("draft", f"tree_forward_{n}") in calls
    assert ("target", "verify_fig4a") in calls and ("pair", "generate_step") in calls
    types = {t for r in rows for t in r["per_layer"]}
    assert {"Mamba2", "Mamba2GQA", "MHA", "LlamaAttention"} <= types
    assert all(v["ops"] > 0 and v["dispatches"] >= v["ops"] for r in rows for v in r["per_layer"].values())
    assert all(r["wall_ms"] > 0 for r in rows if "wall_ms" in r)
    step = next(r for r in rows if r["call"] == "generate_step")
    assert step["host_syncs"] == pytest.approx(sum(step["sync_sites"].values()))


def test_overhead_gpu_path_counts_kernel_launches(tmp_path):
    """--gpu-path: the mixers take their CUDA branches (Triton kernels, interpreted), each launch
    counted once and its interpreter work left out of the ops."""
    assert overhead.main(["--tiny", "--gpu-path", "--step-tokens", "8", "--out", str(tmp_path)]) == 0
    rows = json.loads(next(tmp_path.glob("overhead_tiny_*.json")).read_text())
    cpu = {(r["model"], r["call"]): r for r in rows}
    for model in ("target", "mamba2-tiny-layers"):
        row = cpu[(model, "tree_forward_13")]
        mamba = next(v for t, v in row["per_layer"].items() if t.startswith("Mamba2"))
        # TreeConv and TreeScan (and the gated RMSNorm, which conftest swaps for its reference)
        assert mamba["launches"] >= 2
        assert 0 < mamba["ops"] < 60
        commit = next(v for t, v in cpu[(model, "commit_5")]["per_layer"].items()
                      if t.startswith("Mamba"))
        assert commit["launches"] == 1  # SSM replay
    assert all(r["gpu_path"] for r in rows)


def test_compute_ops_count_a_reshape_that_copies():
    """A view op that has to copy (``reshape`` of a transposed tensor) launches a kernel; one that
    stays a view does not."""
    def f():
        with torch.profiler.record_function(overhead.SCOPE + "x"):
            a = torch.ones(4, 6).t()  # ones: compute; t: view
            a.reshape(-1)  # copies: compute
            a.t().reshape(-1)  # t and reshape stay views
    _, scopes, _ = overhead.profile_call(f, cuda=False)
    assert scopes["x"]["ops"] == 5
    assert scopes["x"]["compute"] == 2
