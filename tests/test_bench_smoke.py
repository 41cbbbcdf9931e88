"""Smoke runs of the benchmark scripts on tiny random models (CPU, seconds).

* ``bench/e2e.py`` on a tiny hybrid target and a noisy copy of it as draft, saved to tmp_path in the
  MambaInLlama layout with a byte-level BPE tokenizer trained on a few lines, over 2 prompts from a
  JSONL file: every method at T = 0 and 1, T = 0 outputs identical, result files tagged.
* ``bench/model_verify.py --tiny --device cpu``: both model sections, checked outputs, result files.
* ``bench/prepack.py`` on the same tiny pair: per-shape linear timings, both variants end to end
  and the crossover's decoding steps.
* ``bench/vllm.py``'s split of methods into engines (its runs need the vLLM environment).
* ``bench/cpu_ops.py``: every op and tree, the attention op checked against its eager baseline.
* ``bench/gdn_state.py``: its memory formula against what a Gated DeltaNet tree forward keeps.
* ``bench/multiturn.py`` on the tiny pair: code and chat conversations in every cache mode, cached
  tokens where a session or the prefix cache holds them, and a differing reply failing the run.
"""
import csv
import gzip
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

pytest.importorskip("tokenizers")
e2e = importlib.import_module("e2e")
model_verify = importlib.import_module("model_verify")
prepack = importlib.import_module("prepack")
cpu_ops_bench = importlib.import_module("cpu_ops")
replot = importlib.import_module("replot")
gdn_state = importlib.import_module("gdn_state")
multiturn = importlib.import_module("multiturn")

from models import data  # noqa: E402
from stree.hybrid import MambaInLlamaConfig, MambaInLlamaForCausalLM  # noqa: E402
from stree.layers.linear import prepack_available  # noqa: E402
from tests.test_generate_models import noisy_copy  # noqa: E402

PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print("]
LINES = PROMPTS + ["import os\nimport sys\n", "class Point:\n    def __init__(self, x, y):\n",
                   "    return [x * 2 for x in items if x]\n"]
META = ("device", "commit", "date")


def write_model_dir(root: Path) -> Path:
    """``root/models/{target,draft}``: a tiny hybrid and a noisy copy, tokenizer beside each."""
    tok = data.train_tokenizer(LINES, vocab_size=300)
    torch.manual_seed(3)
    cfg = MambaInLlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, attn_layers=(1,), d_state=16,
                             max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    target = MambaInLlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger than the init's weights: a peaked, tie-free target distribution
        for p in target.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    models = root / "models"
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.2, seed=4))):
        model.save_pretrained(str(models / name))
        data.save_tokenizer(tok, models / name)
    return models


def read_rows(out: Path, pattern: str) -> list[dict]:
    (path,) = out.glob(pattern)
    if path.name.endswith(".csv.gz"):  # written without a JSON twin
        with gzip.open(path, "rt", newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = json.loads(path.read_text())
        assert (path.with_suffix(".csv")).exists()
    assert rows and all(r[f] for r in rows for f in META)
    return rows


def test_e2e_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("STREE_CACHE", str(tmp_path / "cache"))  # auto's measured costs
    models = write_model_dir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "results"
    methods = ["ar", "ar-tree", "chain:4", "chain:4@asps", "tree:static:fig4a", "tree:beam:4x3",
               "tree:dyspec:8", "tree:dynatree2:8", "tree:auto"]
    rc = e2e.main(["--models", str(models), "--prompts", str(prompts), "--limit", "2",
                   "--max-new-tokens", "12", "--temperatures", "0", "1", "--methods", *methods,
                   "--device", "cpu", "--out", str(out)])
    assert rc == 0
    summary = read_rows(out, "e2e_*[0-9].json")
    assert [(r["method"], r["temperature"]) for r in summary] == [
        (m, t) for t in (0.0, 1.0) for m in methods]
    assert all(r["t0_identical"] for r in summary if r["temperature"] == 0)
    assert all(r["prompts"] == 2 and r["steps"] > 0 and r["tau"] >= 1 for r in summary)
    assert all(r["tau"] == 1 for r in summary if r["method"] == "ar")
    assert {r["verifier"] for r in read_rows(out, "e2e_*_per_prompt.csv.gz")
            if r["method"] == "chain:4@asps"} == {"asps"}
    per_prompt = read_rows(out, "e2e_*_per_prompt.csv.gz")
    assert len(per_prompt) == 2 * len(methods) * 2
    if importlib.util.find_spec("matplotlib") is not None:
        (png,) = out.glob("e2e_*.png")
        png.unlink()  # replot.py draws it again from the saved rows
        assert replot.main([str(next(out.glob("e2e_*[0-9].json")))]) == 0 and png.exists()


def test_e2e_runs_several_prompt_sets_into_one_result_set(tmp_path):
    """``--prompts A B``: the models load once, each set runs in turn, one result set holds the rows
    of both, each tagged with its prompt set."""
    models = write_model_dir(tmp_path)
    sets = []
    for name, lines in (("first", PROMPTS), ("second", PROMPTS[::-1])):
        sets.append(tmp_path / f"{name}.jsonl")
        sets[-1].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    out = tmp_path / "results"
    assert e2e.main(["--models", str(models), "--prompts", *map(str, sets), "--limit", "2",
                     "--max-new-tokens", "6", "--temperatures", "0", "--methods", "ar", "chain:2",
                     "--device", "cpu", "--out", str(out)]) == 0
    (stem,) = {p.name.split("_AMD")[0].split("_cpu")[0] for p in out.glob("e2e_*[0-9].json")}
    rows = read_rows(out, "e2e_*[0-9].json")
    assert [(r["prompt_set"].rsplit("/", 1)[-1], r["method"]) for r in rows] == [
        (f"{n}.jsonl", m) for n in ("first", "second") for m in ("ar", "chain:2")]
    assert stem.startswith("e2e_first+second")


def test_e2e_batches_prompts_cut_to_one_length(tmp_path):
    """``--batch 2``: one request of both prompts, cut to the shorter (the model's own decoding
    batches one length), every method's greedy rows identical; a batch that does not divide the
    prompts is refused before anything runs."""
    models = write_model_dir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "results"
    methods = ["ar", "ar-tree", "chain:2", "tree:auto", "nodraft:auto"]
    assert e2e.main(["--models", str(models), "--prompts", str(prompts), "--limit", "2", "--batch", "2",
                     "--max-new-tokens", "8", "--temperatures", "0", "1", "--methods", *methods,
                     "--device", "cpu", "--out", str(out)]) == 0
    rows = read_rows(out, "e2e_*[0-9].json")
    assert all(r["batch"] == 2 and r["prompts"] == 2 and r["new_tokens"] > 8 for r in rows)
    assert all(r["t0_identical"] for r in rows if r["temperature"] == 0)
    per_request = read_rows(out, "e2e_*_per_prompt.csv.gz")
    assert len(per_request) == len(methods) * 2
    assert len({r["prompt_tokens"] for r in per_request}) == 1
    with pytest.raises(SystemExit, match="does not divide"):
        e2e.main(["--models", str(models), "--prompts", str(prompts), "--limit", "2", "--batch", "3",
                  "--methods", "ar", "--device", "cpu", "--out", str(out)])

@pytest.mark.skipif(not prepack_available(), reason="no oneDNN packed linear in this torch build")
def test_prepack_smoke(tmp_path):
    models = write_model_dir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "results"
    assert prepack.main(["--models", str(models), "--prompts", str(prompts), "--limit", "2",
                         "--max-new-tokens", "8", "--rounds", "1", "--out", str(out)]) == 0
    rows = read_rows(out, "prepack_*.json")
    crossover = [(r["model"], r["threads"], r["crossover"]) for r in rows if r["kind"] == "crossover"]
    assert len(crossover) == 20 and all(r["step_ms"] > 0 for r in rows if r["kind"] == "crossover")
    linear = [r for r in rows if r["kind"] == "linear"]
    assert linear and all(r["f_linear_us"] > 0 and r["packed_us"] > 0 for r in linear)
    e2e_rows = [(r["variant"], r["method"]) for r in rows if r["kind"] == "e2e"]
    assert e2e_rows == [(v, m) for v in ("plain", "prepacked") for m, _, _ in prepack.METHODS]
    assert all(r["identical_texts"] and r["prompts"] == 2 for r in rows if r["kind"] == "e2e")


def test_cpu_ops_smoke(tmp_path):
    out = tmp_path / "results"  # the ops must build here (as tests/test_cpu_ops.py requires)
    assert cpu_ops_bench.main(["--calls", "3", "--out", str(out)]) == 0  # asserts the same math inside
    rows = read_rows(out, "cpu_ops_*.json")
    ops = sorted({(r["op"], r["tree"], r["context"]) for r in rows})
    assert len(ops) == len(rows) == 2 * (2 + len(cpu_ops_bench.CONTEXTS))
    assert all(r["us"] > 0 for r in rows) and all(r["eager_us"] > 0 for r in rows if r["op"] == "tree_attention_rows")


def test_method_specs():
    assert e2e.Method.parse("chain:4@asps") == e2e.Method("chain:4@asps", "chain", "chain:4", "asps")
    assert e2e.Method.parse("tree:dynatree:6x2:16") == e2e.Method("tree:dynatree:6x2:16", "tree",
                                                                  "dynatree:6x2:16")
    assert e2e.Method.parse("tree:static:2,2+compile") == e2e.Method(
        "tree:static:2,2+compile", "tree", "static:2,2", compile=True)
    assert e2e.Method.parse("ar+compile") == e2e.Method("ar+compile", "ar", None, compile=True)
    for bad in ("ar@greedy", "tree", "chain@sps", "foo:1", "tree:dyspec:8+compile"):
        with pytest.raises(ValueError):
            e2e.Method.parse(bad)
    cfg = e2e.parse_args(["--models", "m", "--methods", "ar", "tree:static:2,2", "tree:dyspec:8",
                          "--compile"])
    assert [m.label for m in cfg.methods] == ["ar", "tree:static:2,2", "tree:dyspec:8",
                                              "ar+compile", "tree:static:2,2+compile"]


def _vllm_bench():
    """bench/vllm.py, loaded by path (its name would shadow the vllm package)."""
    spec = importlib.util.spec_from_file_location("bench_vllm", REPO / "bench" / "vllm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_vllm_bench_gives_cache_readers_an_engine_per_cell():
    # methods that draft from earlier requests' outputs must not read an earlier cell's outputs of
    # the same prompts
    bench = _vllm_bench()
    readers = {m for m, config in bench.METHODS.items() if bench._reads_outputs(config)}
    assert readers == {"stree-suffix", "stree-suffix-every", "stree-merged", "stree-merged-solo2",
                       "stree-merged-solo4", "vllm-suffix"}
    from stree.prompts import load_prompts

    # the warm-up request's output seeds the engine's cache: its text is in no prompt set
    assert not any(bench.WARM_UP in prompt for name in ("humaneval", "mtbench") for prompt in load_prompts(name))


def test_vllm_bench_summarizes_rounds_by_median():
    bench = _vllm_bench()
    rows = [dict(prompts="humaneval", method=m, temperature=t, batch=1, round=r, speedup=s, tau=tau, exact=e)
            for m, t, r, s, tau, e in [("tree", 0.0, 0, 1.2, 2.5, True), ("tree", 0.0, 1, 0.9, 2.7, True),
                                       ("tree", 0.0, 2, 1.4, 2.6, False), ("tree", 1.0, 0, 0.8, 2.0, None),
                                       ("tree", 1.0, 1, 1.0, 2.2, None)]]
    cells = {(s["method"], s["temperature"]): s for s in bench.summarize(rows)}
    greedy, sampled = cells[("tree", 0.0)], cells[("tree", 1.0)]
    spread = (greedy["speedup_median"], greedy["speedup_min"], greedy["speedup_max"])
    assert greedy["rounds"] == 3 and spread == (1.2, 0.9, 1.4)
    assert greedy["tau_median"] == 2.6 and greedy["exact"] is False  # one inexact round makes the cell inexact
    assert (sampled["speedup_median"], sampled["exact"]) == (0.9, None)
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_first_mismatch_names_prompt_method_and_position():
    assert e2e.first_mismatch({"ar": [[1, 2, 3]], "tree": [[1, 2, 3]]}) is None
    msg = e2e.first_mismatch({"ar": [[1, 2], [4, 5, 6]], "tree": [[1, 2], [4, 7, 6]]})
    assert "prompt 1" in msg and "'tree'" in msg and "new token 1" in msg


def test_model_verify_tiny(tmp_path):
    assert model_verify.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = read_rows(tmp_path, "model_verify_tiny_*[0-9].json")
    checked = [r for r in rows if r["checked_against"]]
    assert {r["method"] for r in checked} == {"tree", "decode_tree_1", "unrolled_chunked",
                                              "unrolled_chain"}
    assert all(r["rel_err"] <= 1e-3 and r["argmax_agree"] == 1.0 for r in checked)
    targets = read_rows(tmp_path, "model_verify_tiny_*_targets.json")
    assert {r["issue"] for r in targets} >= {"2", "3"}


def test_gdn_state_formula_is_what_a_tree_forward_keeps(capsys):
    """bench/gdn_state.py: the bytes a real Gated DeltaNet tree forward keeps and its committed
    state equal the formula the docs' table is computed with; one slot plus activations stays
    under a state per node at every shape and size."""
    assert gdn_state.main([]) == 0
    assert "Qwen3.5-397B-A17B" in capsys.readouterr().out
    for s in gdn_state.SHAPES:
        for n in gdn_state.NODES:
            d = gdn_state.designs(s, n)
            assert d["stree"] < d["chain slots"] < d["state per node"]


MULTITURN = ["--sets", "code", "chat", "--conversations", "2", "--turns", "3", "--system-tokens", "40",
             "--turn-tokens", "20", "--max-new-tokens", "6", "--device", "cpu"]


def test_multiturn_smoke(tmp_path):
    """bench/multiturn.py on the tiny pair (a 256-position context): every method in every cache
    mode, identical replies, what each mode reuses, result files tagged."""
    models = write_model_dir(tmp_path)
    out = tmp_path / "results"
    methods = ["ar", "ar-tree", "tree:caterpillar:2,2,2+suffix:16"]
    assert multiturn.main(["--models", str(models), *MULTITURN, "--methods", *methods, "--pin-system",
                           "--out", str(out)]) == 0
    configs = [("ar", "none")] + [(m, mode) for mode in ("none", "session", "prefix") for m in methods[1:]]
    summary = read_rows(out, "multiturn_code+chat_*[0-9].json")
    assert [(r["method"], r["mode"], r["turn"]) for r in summary if r["turn"] == "all"] == [
        (m, mode, "all") for m, mode in configs]
    assert all(r["identical"] and r["ttft_s"] > 0 for r in summary)
    assert all((r["ttft_vs_fresh"] is not None) == (r["mode"] != "none") for r in summary if r["turn"] == "all")
    turns = read_rows(out, "multiturn_*_per_prompt.csv.gz")
    assert len(turns) == 2 * 2 * 3 * len(configs)
    for r in turns:
        cached, prompt, turn = int(r["cached_tokens"]), int(r["prompt_tokens"]), int(r["turn"])
        assert int(r["prefilled_tokens"]) == prompt - cached and float(r["ttft_s"]) > 0
        # a hit is timed beside a fresh prefill of what it prefilled; a miss has nothing to compare
        assert (r["fresh_ttft_s"] not in ("", None)) == (cached > 0)
        if r["mode"] == "none":
            assert cached == 0
        elif turn > 1:  # the conversation so far, but the reply's last token or few
            assert cached >= prompt - int(r["input_tokens"]) - 8
        elif r["mode"] == "prefix":  # the pinned system prompt
            assert cached == 41
        else:  # a session's first turn: nothing held yet
            assert cached == 0


def test_multiturn_fails_on_a_differing_reply(tmp_path, monkeypatch, capsys):
    models = write_model_dir(tmp_path)
    turn = multiturn.Runner.turn

    def wrong(self, *args):
        reply, m = turn(self, *args)
        return (reply[:-1] + [reply[-1] + 1] if self.mode == "prefix" else reply), m

    monkeypatch.setattr(multiturn.Runner, "turn", wrong)
    out = tmp_path / "results"
    assert multiturn.main(["--models", str(models), *MULTITURN, "--methods", "ar-tree", "--modes", "none",
                           "prefix", "--out", str(out)]) == 1
    assert "FAILED" in capsys.readouterr().out and not out.exists()
