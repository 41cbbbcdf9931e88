"""The command line as a newcomer meets it: every bad input to ``stree generate`` / ``stree demo``
ends with one ``error: ...`` line on stderr and exit status 1 (``--debug``: the traceback), stop
ids and BOS come from the model directory, and the streamer decodes incrementally."""
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import stree.checkpoints as checkpoints
import stree.cli as cli
from tests.fakes import FakeLM, greedy_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, "models", "stree-tiny")
TARGET, DRAFT = os.path.join(PAIR, "target"), os.path.join(PAIR, "draft")


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error(capsys, argv, pattern):
    rc, _, err = run(capsys, *argv)
    lines = err.splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err


def gen(*extra, target=TARGET, draft=DRAFT, prompt="def f(x):"):
    args = ["generate", "--target", target, "--prompt", prompt, "--max-new-tokens", "4", "--no-progress"]
    return args + (["--draft", draft] if draft else []) + list(extra)


def model_dirs(tmp_path, *names):
    """Model directories as the CLI checks them before loading (a config.json each), for tests
    that replace the loader."""
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")


def copy_model(tmp_path, src=TARGET, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------- bad input: generate
@pytest.mark.parametrize("extra,pattern", [
    (["--temperature", "-1"], "temperature must be finite and >= 0"),
    (["--temperature", "nan"], "temperature must be finite and >= 0"),
    (["--temperature", "inf"], "temperature must be finite and >= 0"),
    (["--seed", str(2**70)], "--seed must fit in 64 bits"),
    (["--device", "bogus"], "unknown device 'bogus'"),
    (["--device", "meta"], "device 'meta' holds no data"),
    (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--top-k", "-2"], "top_k must be >= 0"),
    (["--tree", "static:fig9"], "unknown"),
    (["--tree", "beam:4"], "unknown|beam"),
    (["--tree", "beam:4x3", "--verifier", "mss", "--temperature", "1"], "MSS is not lossless"),
    (["--tree", "static:fig4a", "--verifier", "greedy", "--temperature", "1"], "greedy verifier"),
    (["--method", "chain", "--tree", "static:A"], "chain drafter"),
    (["--max-new-tokens", "-3"], "max-new-tokens must be >= 0"),
    (["--tree", "dyspec:8", "--compile"], "compile=True needs fixed draft shapes"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_generation_options(capsys, extra, pattern):
    assert_error(capsys, gen(*extra), pattern)


def test_missing_draft_and_options_ar_does_not_use(capsys):
    assert_error(capsys, gen(draft=None), "--draft DIR is required for --method tree")
    assert_error(capsys, gen("--method", "ar", "--tree", "fig4a", draft=None), "drafts and verifies nothing")


def test_empty_prompt(capsys, tmp_path):
    assert_error(capsys, gen(prompt=""), "prompt is empty")
    empty = tmp_path / "p.txt"
    empty.write_text("")
    args = [a for a in gen() if a not in ("--prompt", "def f(x):")] + ["--prompt-file", str(empty)]
    assert_error(capsys, args, "prompt is empty")
    assert_error(capsys, args[:-1] + [str(tmp_path / "missing.txt")], "--prompt-file .*missing.txt: No such file")
    assert_error(capsys, args[:-1] + [str(tmp_path)], "--prompt-file .*: Is a directory")
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"def f():\xff\xfe")
    assert_error(capsys, args[:-1] + [str(binary)], "--prompt-file .*b.txt: not UTF-8 text")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_named_not_blamed_on_the_checkpoint(capsys):
    """A GPU asked for on a machine without one: the device is the error, before any model loads
    (not a 'truncated or corrupt' checkpoint from the weight reader)."""
    assert_error(capsys, gen("--device", "cuda"), "device 'cuda' is not available here")
    assert_error(capsys, ["demo", "--device", "cuda", "--max-new-tokens", "2"], "device 'cuda' is not available here")
    from stree.hybrid import MambaInLlamaForCausalLM

    with pytest.raises(ValueError, match="device 'cuda' is not available here"):
        MambaInLlamaForCausalLM.from_pretrained(TARGET, device="cuda")
    import stree.hf

    with pytest.raises(ValueError, match="device 'cuda' is not available here"):
        stree.hf.load(TARGET, device="cuda")


def test_missing_and_wrong_model_directories(capsys, tmp_path):
    """Model directories are checked before the tokenizer is read from one of them."""
    assert_error(capsys, gen(target=str(tmp_path / "nope"), draft=None, *["--method", "ar"]),
                 "target model .*nope: model directory not found")
    assert_error(capsys, gen(target=PAIR), "target model .*no config.json .*pass one of them")
    assert_error(capsys, gen(draft=str(tmp_path / "nope")), "draft model .*nope: model directory not found")
    assert_error(capsys, gen("--tokenizer", TARGET, target=str(tmp_path / "nope")),
                 "target model .*nope: model directory not found")
    assert_error(capsys, gen("--tokenizer", TARGET, target=PAIR),
                 "no config.json .*pass one of them")
    assert_error(capsys, gen("--tokenizer", TARGET, target=str(tmp_path)), "no config.json")


def test_corrupt_or_truncated_checkpoint(capsys, tmp_path):
    m = copy_model(tmp_path)
    weights = m / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_error(capsys, gen(target=str(m)), "target model .*truncated or corrupt")
    m2 = copy_model(tmp_path, name="m2")
    (m2 / "config.json").write_text("{ not json")
    assert_error(capsys, gen(target=str(m2)), "config.json is not valid JSON")
    m3 = copy_model(tmp_path, src=DRAFT, name="m3")
    state = load_file(m3 / "model.safetensors")
    state.pop(next(k for k in state if k.endswith("A_log")))
    save_file(state, m3 / "model.safetensors")
    assert_error(capsys, gen(draft=str(m3)), "draft model .*missing key .*A_log")
    m4 = copy_model(tmp_path, name="m4")
    (m4 / "tokenizer.json").write_text("[]")
    assert_error(capsys, gen(target=str(m4)), "not a readable tokenizer.json")


def test_config_without_mamba_settings_is_refused_before_building_a_model(capsys, tmp_path, monkeypatch):
    """A hybrid directory that lost its mamba_config.json (or --model-type mamba on a Llama-style
    config.json) once fell through to mamba-ssm's config defaults and allocated a 2.8B-parameter
    model (about 11 GB) before failing on missing keys: refused from the config, naming the file."""
    import mamba_ssm.models.mixer_seq_simple as mixer_seq_simple

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(mixer_seq_simple, "MambaLMHeadModel", no_model)
    m = copy_model(tmp_path, src=DRAFT)
    (m / "mamba_config.json").unlink()
    assert_error(capsys, gen(draft=str(m)), "draft model .*config.json is not a mamba-ssm config: it lacks "
                                              "d_model, n_layer .*mamba_config.json .*missing")
    assert_error(capsys, gen("--model-type", "mamba", "--method", "ar", draft=None),
                 "target model .*config.json is not a mamba-ssm config")


def test_mamba1_hybrid_checkpoint_is_refused_as_mamba1(capsys, tmp_path):
    by_config = copy_model(tmp_path, src=DRAFT, name="cfg")
    cfg = json.loads((by_config / "mamba_config.json").read_text())
    cfg["ssm_cfg"] = {**cfg.get("ssm_cfg", {}), "layer": "Mamba1"}
    (by_config / "mamba_config.json").write_text(json.dumps(cfg))
    assert_error(capsys, gen(draft=str(by_config)), "Mamba-1 layers are not supported")
    # Mamba-1 weights under a config without a layer name: A_log (d_inner, d_state), x_proj, dt_proj
    by_weights = copy_model(tmp_path, src=DRAFT, name="w")
    cfg = json.loads((by_weights / "mamba_config.json").read_text())
    cfg["ssm_cfg"] = {"d_state": 16, "expand": 1}
    (by_weights / "mamba_config.json").write_text(json.dumps(cfg))
    state = load_file(by_weights / "model.safetensors")
    for key in [k for k in state if ".mamba." in k and "layers.0." in k]:
        del state[key]
    d = cfg["d_model"]
    state.update({"model.layers.0.mamba.A_log": torch.zeros(d, 16),
                  "model.layers.0.mamba.x_proj.weight": torch.zeros(44, d),
                  "model.layers.0.mamba.dt_proj.weight": torch.zeros(d, 12)})
    save_file(state, by_weights / "model.safetensors")
    assert_error(capsys, gen(draft=str(by_weights)), "Mamba-1 layers are not supported")


def test_unpatchable_model(capsys, tmp_path):
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    cfg = MambaConfig(d_model=32, n_layer=1, vocab_size=4096, ssm_cfg={"layer": "Mamba1"})
    model = MambaLMHeadModel(cfg)
    d = tmp_path / "mamba1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.__dict__))
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    assert_error(capsys, gen("--tokenizer", TARGET, "--method", "ar", target=str(d), draft=None),
                 "target model .*layer 0: Mamba is not supported by stree")


def test_vocabulary_mismatch(capsys, tmp_path, monkeypatch):
    models = {"T": FakeLM(vocab_size=23), "D": FakeLM(vocab_size=25)}
    monkeypatch.setattr(checkpoints, "load_model", lambda d, *_: models[os.path.basename(d)])
    model_dirs(tmp_path, *models)
    assert_error(capsys, gen("--tokenizer", TARGET, target=str(tmp_path / "T"), draft=str(tmp_path / "D")),
                 "vocabulary mismatch")


# ----------------------------------------------------------------------------- bad input: demo
def test_demo_errors(capsys, tmp_path):
    assert_error(capsys, ["demo", "--models", str(tmp_path)], "needs a directory holding target/ and draft/")
    assert_error(capsys, ["demo", "--prompt", ""], "prompt is empty")
    assert_error(capsys, ["demo", "--max-new-tokens", "0"], "max-new-tokens must be >= 1")
    assert_error(capsys, ["demo", "--prompts", "0"], "prompts must be >= 1")
    shutil.copytree(PAIR, tmp_path / "pair")
    (tmp_path / "pair" / "draft" / "model.safetensors").write_bytes(b"\0" * 16)
    assert_error(capsys, ["demo", "--models", str(tmp_path / "pair")], "draft model .*truncated or corrupt")


def test_demo_runs_every_method_on_several_prompts(capsys):
    """The main job, shortened: two HumanEval prompts, 12 tokens each, every text identical."""
    rc, out, err = run(capsys, "demo", "--prompts", "2", "--max-new-tokens", "12", "--repeats", "1")
    assert rc == 0, err
    assert "2 prompt(s)" in out and "identical per prompt (lossless at temperature 0): YES" in out
    rows = [line for line in out.splitlines() if line.startswith(("autoregressive", "chain SD", "STree"))]
    assert len(rows) == 5 and all(line.split()[-7] == "24" for line in rows)  # 2 x 12 tokens each
    assert any("suffix:16, no draft" in line for line in rows) and any("auto" in line for line in rows)


def test_entry_point_prints_one_line_and_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO}
    base = [sys.executable, "-m", "stree.cli", "generate", "--target", str(tmp_path / "nope"),
            "--tokenizer", TARGET, "--method", "ar", "--prompt", "x"]
    quiet = subprocess.run(base, capture_output=True, text=True, env=env, cwd=REPO)
    assert quiet.returncode == 1 and quiet.stdout == ""
    assert quiet.stderr.splitlines() == [f"error: target model {tmp_path / 'nope'}: model directory "
                                         f"not found: {tmp_path / 'nope'}"]
    loud = subprocess.run(base + ["--debug"], capture_output=True, text=True, env=env, cwd=REPO)
    assert loud.returncode == 1 and "Traceback" in loud.stderr and "FileNotFoundError" in loud.stderr


# --------------------------------------------------------------------------- stop ids and BOS
def test_default_stop_ids_are_every_eos_id(tmp_path):
    tok = checkpoints.load_tokenizer(TARGET)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [128001, 128008]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert checkpoints.default_eos(str(tmp_path), tok) == [128001, 128008, 128009]
    os.remove(tmp_path / "generation_config.json")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert checkpoints.default_eos(str(tmp_path), tok) == [7]
    os.remove(tmp_path / "config.json")  # nothing in the configs: the tokenizer's end-of-text
    assert checkpoints.default_eos(str(tmp_path), tok) == [tok.token_to_id("<|endoftext|>")]


def _word_tokenizer(path, v):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(v)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return tok


@pytest.mark.parametrize("progress", [False, True])
def test_cli_streams_text_and_prints_stats(tmp_path, monkeypatch, capsys, progress):
    target, draft = FakeLM(vocab_size=23), FakeLM(vocab_size=23, noise=1.5)
    tok = _word_tokenizer(tmp_path, 23)
    models = {"T": target, "D": draft}
    monkeypatch.setattr(checkpoints, "load_model", lambda d, *_: models[os.path.basename(d)])
    model_dirs(tmp_path, *models)
    args = ["generate", "--target", str(tmp_path / "T"), "--draft", str(tmp_path / "D"),
            "--prompt", "w1 w2 w3", "--max-new-tokens", "20", "--tree", "beam:3x2",
            "--tokenizer", str(tmp_path), "--eos-token-id", "-1"] + ([] if progress else ["--no-progress"])
    rc, out, err = run(capsys, *args)
    assert rc == 0
    assert out.strip() == tok.decode(greedy_reference(target, [1, 2, 3], 20))
    assert "tau" in err and "beam:3x2" in err


@pytest.mark.parametrize("method", ["ar", "tree"])
def test_cli_prepends_bos_and_stops_at_any_of_several_ids(tmp_path, monkeypatch, capsys, method):
    target, v = FakeLM(vocab_size=23), 23
    tok = _word_tokenizer(tmp_path, v)
    monkeypatch.setattr(checkpoints, "load_model", lambda d, *_: target)
    model_dirs(tmp_path, "T", "D")
    (tmp_path / "T" / "config.json").write_text(json.dumps({"bos_token_id": 5}))
    ref = greedy_reference(target, [5, 1, 2, 3], 30)  # BOS first, as in the demo
    stops = [ref[7], ref[12]]
    first = min(j for j, t in enumerate(ref) if t in stops)
    args = ["generate", "--target", str(tmp_path / "T"), "--draft", str(tmp_path / "D"), "--method", method,
            "--prompt", "w1 w2 w3", "--max-new-tokens", "30", "--tokenizer", str(tmp_path),
            "--no-progress", "--eos-token-id", *map(str, stops)]
    if method == "ar":
        args.remove("--draft"), args.remove(str(tmp_path / "D"))
    rc, out, err = run(capsys, *args)
    assert rc == 0, err
    assert out.strip() == tok.decode(ref[:first + 1])


def test_encode_prompt_adds_bos_once():
    tok = checkpoints.load_tokenizer(TARGET)
    ids = tok.encode("def f(x):").ids
    assert checkpoints.encode_prompt(tok, "def f(x):", 0) == [0] + ids
    assert checkpoints.encode_prompt(tok, "<|endoftext|>def f(x):", 0) == [0] + ids  # already there
    assert checkpoints.encode_prompt(tok, "def f(x):", None) == ids


# --------------------------------------------------------------------------------- streaming
class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


class _CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids):
        self.lengths.append(len(ids))
        return self.tok.decode(ids)


def test_streamer_is_incremental_and_exact_for_split_characters():
    tok = checkpoints.load_tokenizer(TARGET)
    text = "héllo wörld → 🙂 naïve café ✓ 日本語\n" * 8
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "no token splits a character: weak test"
    counting, out = _CountingTokenizer(tok), _Stream(tty=False)
    s = cli.TextStreamer(counting, len(ids), progress=False, out=out)
    s.put(torch.tensor([0]))  # the prompt
    for i in ids:
        s.put(torch.tensor([i]))
        assert "\ufffd" not in out.getvalue()
    s.end()
    assert out.getvalue() == tok.decode(ids) + "\n"
    assert max(counting.lengths) <= 8 < len(ids)  # a window, never the whole output


@pytest.mark.parametrize("stdout_tty", [True, False])
def test_no_progress_bar_between_lines_on_a_terminal(stdout_tty):
    tok = checkpoints.load_tokenizer(TARGET)
    ids = tok.encode("line one\nline two\nline three\n").ids
    out, err = _Stream(stdout_tty), _Stream(True)
    s = cli.TextStreamer(tok, len(ids), progress=True, out=out, err=err)
    s.put(torch.tensor([0]))
    for i in ids:
        s.put(torch.tensor([i]))
    s.end()
    assert out.getvalue() == tok.decode(ids) + "\n"  # the text alone, nothing drawn into it
    assert (err.getvalue() == "") == stdout_tty  # a bar on stderr only when stdout is redirected


def test_compile_flag_reaches_generate(tmp_path, monkeypatch, capsys):
    generation = sys.modules["stree.generation"]  # the module (stree.generate is the function)
    target = FakeLM(vocab_size=23)
    _word_tokenizer(tmp_path, 23)
    monkeypatch.setattr(checkpoints, "load_model", lambda d, *_: target)
    seen = {}
    real = generation.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **{**kwargs, "compile": False})  # a FakeLM has no steps to compile

    monkeypatch.setattr(generation, "generate", spy)
    model_dirs(tmp_path, "T", "D")
    rc, _, err = run(capsys, "generate", "--target", str(tmp_path / "T"), "--draft", str(tmp_path / "D"),
                     "--prompt", "w1 w2", "--max-new-tokens", "5", "--tokenizer", str(tmp_path),
                     "--tree", "static:2,2", "--no-progress", "--compile")
    assert rc == 0, err
    assert seen["compile"] is True


@pytest.mark.parametrize("flag", [[], ["--no-prepack"]])
def test_prepack_is_the_default_and_no_prepack_reaches_the_loader(tmp_path, monkeypatch, capsys, flag):
    target, seen = FakeLM(vocab_size=23), []
    _word_tokenizer(tmp_path, 23)
    monkeypatch.setattr(checkpoints, "load_model",
                        lambda d, device, dtype, kind, prepack: seen.append(prepack) or target)
    model_dirs(tmp_path, "T", "D")
    rc, _, err = run(capsys, "generate", "--target", str(tmp_path / "T"), "--draft", str(tmp_path / "D"),
                     "--prompt", "w1 w2", "--max-new-tokens", "5", "--tokenizer", str(tmp_path),
                     "--no-progress", *flag)
    assert rc == 0, err
    assert seen == [not flag, not flag]  # target and draft


@pytest.mark.parametrize("flag", [[], ["--compile"]])
def test_demo_compile_reaches_every_generate_call(monkeypatch, capsys, flag):
    """``--compile`` compiles every row, the baseline too (what compiling does is tested in
    tests/test_capture.py), and leaves out ``auto``'s row, which does not compile over suffix
    trees; here the calls are recorded and run eagerly."""
    import stree.generation

    real, seen = stree.generation.generate, []

    def generate(*args, compile=False, **kwargs):
        seen.append((kwargs["method"], compile))
        return real(*args, **kwargs)

    monkeypatch.setattr(stree.generation, "generate", generate)
    rc, out, err = run(capsys, "demo", "--prompts", "1", "--max-new-tokens", "4", "--repeats", "1", *flag)
    assert rc == 0, err
    assert sorted(set(seen)) == [(m, bool(flag)) for m in ("ar", "chain", "tree")]
    assert len(seen) == (8 if flag else 10)  # a warm-up and a timed run per row
    assert ("every method compiled" if flag else "eager") in out


@pytest.mark.parametrize("flag", [[], ["--no-prepack"]])
def test_demo_no_prepack_reaches_the_loader(monkeypatch, capsys, flag):
    seen = []

    def load_model(d, device, dtype, kind, prepack):
        seen.append(prepack)
        raise ValueError("stop here")  # the flag is all this test needs

    monkeypatch.setattr(checkpoints, "load_model", load_model)
    rc, _, err = run(capsys, "demo", "--prompts", "1", *flag)
    assert rc == 1 and "stop here" in err
    assert seen == [not flag]
