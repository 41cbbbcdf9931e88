"""The documentation, tried as a newcomer would: what it shows must exist and run as shown.

* Every repository path a document cites exists (``bench/...``, ``docs/...``, ``models/...``,
  ``stree/...``, ``tests/...``, ``scripts/...``, globs and ``{a,b}`` alternatives expanded;
  Markdown links resolved from the citing file).
* Every link to a heading (``page.md#anchor``, ``#anchor``) names a heading of that page, by
  GitHub's rule for anchors.
* Every file in ``bench/results/`` is cited by name (not by a glob) in a page a user reads (the
  README, ``docs/*.md``, ``models/README.md``; a run's ``.json``, ``.csv`` and
  ``_per_prompt.csv.gz`` count as one), and there are at most :data:`MAX_RESULT_SETS` runs:
  superseded runs are deleted, history stays in git.
* Pages stay short enough to read: the README at most 250 lines, ``docs/vllm.md`` 300, every
  other page of ``docs/`` 400 (:data:`MAX_LINES`).
* Every command shown (lines of ``bash`` blocks, and inline code that starts with ``stree``,
  ``scripts/venv``, ``python`` or ``pytest``) runs with ``--help`` appended, exit status 0, and
  its help lists every ``--flag`` it is shown with (argparse stops at ``--help`` before it
  rejects an unknown flag, so the flags are checked against the help text). The README's first
  block runs literally through ``scripts/venv``; the others run in one interpreter, each through
  its own argument parser. A ``scripts/venv-vllm python SCRIPT ...`` line is checked the same way
  in the main environment (the benchmark scripts import vLLM only once they run); other
  ``scripts/venv-vllm`` commands need the vLLM environment and are left to ``tests/vllm/``.
  The values ``--help`` cannot check are parsed too: the methods of ``bench/e2e.py``,
  ``bench/vllm.py`` and ``bench/vllm_profile.py`` commands, the ``--tree`` of ``stree`` ones.
* The README's Python blocks run as shown, in order, in a fresh interpreter from the repository
  root, on the shipped pair. Their one placeholder, the path of a transformers checkpoint, is
  replaced by a tiny random ``Mamba2ForCausalLM`` saved here (:data:`PLACEHOLDERS`).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted({REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("models/*.md"),
               *REPO.glob("stree/**/*.md"), *REPO.glob("bench/**/*.md")})
RESULTS = REPO / "bench" / "results"
TOP_DIRS = ("bench", "docs", "models", "stree", "tests", "scripts")
# A path in running text or code: a top-level directory, then path characters (globs, braces).
PATH_RE = re.compile(r"(?<![\w/.~$-])((?:%s)/[\w.*{},/+-]*)" % "|".join(TOP_DIRS))
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE_RE = re.compile(r"`([^`\n]+)`")
COMMAND_START = ("stree ", "scripts/venv ", "scripts/venv-vllm ", "python ", "pytest", "lint-imports")
# README placeholder -> what the test puts there (filled by the fixture below).
PLACEHOLDERS = {"path/to/checkpoint": "hf_target", "path/to/draft": "hf_draft"}
# the pages a user reads: every result file is cited from one of them
USER_DOCS = sorted({REPO / "README.md", *REPO.glob("docs/*.md"), REPO / "models" / "README.md"})
MAX_RESULT_SETS = 25
# page -> most lines; every other page of docs/ gets the "docs" bound
MAX_LINES = {"README.md": 250, "docs/vllm.md": 300, "docs": 400}
HEADING_RE = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def read(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def rel(doc: Path) -> str:
    return str(doc.relative_to(REPO))


def expand_braces(pattern: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",")
            for p in expand_braces(pattern[:m.start()] + alt + pattern[m.end():])]


def resolve(base: Path, cited: str) -> list[Path]:
    """The existing paths ``cited`` names relative to ``base`` (glob and braces expanded)."""
    found = []
    for pattern in expand_braces(cited):
        if any(c in pattern for c in "*?["):
            found += [Path(p) for p in glob.glob(str(base / pattern))]
        elif (base / pattern).exists():
            found.append(base / pattern)
    return found


def citations(doc: Path) -> list[tuple[Path, str]]:
    """``(base, cited path)`` for every repository path and relative link in ``doc``."""
    text = read(doc)
    out = [(REPO, m.rstrip(".,;:")) for m in PATH_RE.findall(text)]
    for target in LINK_RE.findall(text):
        target = target.split("#")[0]
        if target and not re.match(r"[a-z]+:", target):
            out.append((doc.parent, target))
    return out


def test_docs_exist():
    names = {rel(d) for d in DOCS}
    assert {"README.md", "docs/benchmarks.md", "docs/drafters.md", "docs/models.md",
            "docs/development.md", "docs/ARCHITECTURE.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_cited_path_exists(doc):
    missing = sorted({cited for base, cited in citations(doc) if not resolve(base, cited)})
    assert not missing, f"{rel(doc)} cites paths that do not exist: {missing}"


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives ``doc``'s headings: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``; a repeated heading gets ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING_RE.findall(FENCE_RE.sub("", read(doc))):
        slug = re.sub(r"[^\w\- ]", "", re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", title).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_link_anchor_exists(doc):
    broken = []
    for target in LINK_RE.findall(read(doc)):
        path, _, anchor = target.partition("#")
        if not anchor or re.match(r"[a-z]+:", target):
            continue
        page = (doc.parent / path).resolve() if path else doc
        if page.suffix == ".md" and page.is_file() and anchor not in anchors(page):
            broken.append(target)
    assert not broken, f"{rel(doc)} links to headings that do not exist: {broken}"


def run_stem(name: str) -> str:
    return re.sub(r"(_per_prompt)?\.(csv\.gz|csv|json|txt|png)$", "", name)


def result_citations(docs) -> set[str]:
    """The runs of ``bench/results/`` that ``docs`` cite by file name (a glob cites none)."""
    return {run_stem(p.name) for doc in docs for base, c in citations(doc)
            if not any(ch in c for ch in "*?[{") for p in resolve(base, c)
            if p.is_file() and p.parent == RESULTS}


def uncited_results(docs) -> list[str]:
    cited = result_citations(docs)
    return sorted(p.name for p in RESULTS.iterdir() if run_stem(p.name) not in cited)


def test_every_result_file_is_cited():
    uncited = uncited_results(USER_DOCS)
    assert not uncited, ("bench/results/ holds files no page cites (cite them by name where the "
                         f"claim is made, or git rm them: history stays in git): {uncited}")


def test_uncited_result_file_fails(tmp_path, monkeypatch):
    """The check above fails on a result file no page names, and on one named only by a glob."""
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    for name in ("e2e_cited_X.json", "e2e_cited_X.csv", "e2e_cited_X_per_prompt.csv.gz",
                 "vllm_uncited_X.json", "vllm_uncited_X.csv"):
        (results / name).write_text("{}")
    doc = tmp_path / "page.md"
    doc.write_text("Rows: `bench/results/e2e_cited_X.json`; all runs: `bench/results/vllm_*`.\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "RESULTS", results)
    assert uncited_results([doc]) == ["vllm_uncited_X.csv", "vllm_uncited_X.json"]


def test_result_sets_are_few():
    runs = sorted({run_stem(p.name) for p in RESULTS.iterdir()})
    assert len(runs) <= MAX_RESULT_SETS, (
        f"bench/results/ holds {len(runs)} runs (at most {MAX_RESULT_SETS}): delete the superseded "
        f"ones with the change that supersedes them: {runs}")


@pytest.mark.parametrize("doc", [d for d in USER_DOCS if d.parent != REPO / "models"], ids=rel)
def test_pages_are_short(doc):
    name = rel(doc)
    bound = MAX_LINES.get(name, MAX_LINES["docs"])
    lines = len(read(doc).splitlines())
    assert lines <= bound, f"{name} has {lines} lines (at most {bound}): history belongs in git"


# ------------------------------------------------------------------------------ commands
def commands(doc: Path) -> list[list[str]]:
    """The commands ``doc`` shows, as argument lists (``...`` placeholders dropped)."""
    text = read(doc)
    lines = []
    for lang, body in FENCE_RE.findall(text):
        if lang in ("bash", "sh", "shell"):
            lines += body.replace("\\\n", " ").splitlines()
    prose = FENCE_RE.sub("", text)
    lines += [span for span in INLINE_RE.findall(prose) if span.startswith(COMMAND_START)]
    out = []
    for line in lines:
        args = [a for a in shlex.split(line, comments=True) if a != "..."]
        if args:
            out.append(args)
    return out


def first_block(doc: Path) -> list[str]:
    (lang, body), *_ = FENCE_RE.findall(read(doc))
    assert lang == "bash"
    return [line for line in body.splitlines() if line.strip()]


# Runs each command's own argument parser with --help, in one interpreter; prints JSON results.
_HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
results = []
for args in json.loads(sys.argv[1]):
    out, code = io.StringIO(), None
    path = list(sys.path)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if args[0] == "stree":
                from stree.cli import main
                code = main(args[1:] + ["--help"])
            elif args[0] == "pytest":
                import pytest
                code = int(pytest.main(args[1:] + ["--help"]))
            elif args[0] == "lint-imports":  # import-linter's click command
                from importlinter.cli import lint_imports_command
                code = lint_imports_command.main(args[1:] + ["--help"], standalone_mode=False)
            elif args[1] == "-m":  # python -m MODULE ARGS...
                sys.argv = [args[2]] + args[3:] + ["--help"]
                runpy.run_module(args[2], run_name="__main__", alter_sys=True)
            else:  # python SCRIPT ARGS...
                script = os.path.abspath(args[1])
                sys.path.insert(0, os.path.dirname(script))
                sys.argv = [script] + args[2:] + ["--help"]
                runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
    except BaseException as err:  # noqa: BLE001 - reported to the test
        code = f"{type(err).__name__}: {err}"
    sys.path[:] = path
    results.append({"args": args, "code": 0 if code is None else code, "output": out.getvalue()})
print(json.dumps(results))
"""


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # a new user's shell; stree picks CPU paths by itself
    # one thread, as tests/conftest.py sets: tiny matrices on a shared machine's second core only
    # wait for it (seen 100x slower)
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_commands_run_with_help():
    shown, first = [], set(first_block(REPO / "README.md"))
    for doc in DOCS:
        for args in commands(doc):
            if args[0] == "scripts/venv-vllm":
                if len(args) < 3 or args[1] != "python" or not args[2].endswith(".py"):
                    continue  # needs the separate vLLM environment (tests/vllm/ runs in it)
                args = args[1:]  # a script's parser runs here; vLLM is imported once it runs
            if args[0] == "scripts/venv":
                if " ".join(args) in first:
                    continue  # run literally below
                args = args[1:]
            assert args[0] in ("stree", "python", "pytest", "lint-imports"), (
                f"{rel(doc)} shows {' '.join(args)!r}: teach tests/test_docs.py to check it")
            if args[0] == "python" and args[1] != "-m":
                assert (REPO / args[1]).is_file(), f"{rel(doc)}: no script {args[1]}"
            if args not in shown:
                shown.append(args)
    proc = subprocess.run([sys.executable, "-c", _HELP_RUNNER, json.dumps(shown)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = []
    for r in json.loads(proc.stdout.splitlines()[-1]):
        flags = {a.split("=")[0] for a in r["args"] if a.startswith("--")}
        unknown = sorted(f for f in flags if f not in r["output"])
        if r["code"] != 0 or unknown:
            failures.append(f"{' '.join(r['args'])} --help: exit {r['code']}, flags not in its "
                            f"help: {unknown}\n{r['output'][-1500:]}")
    assert not failures, "\n\n".join(failures)


def _flag_values(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return []
    rest = args[args.index(flag) + 1:]
    return rest[:next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def _bench_module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_docs_bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_command_values_parse():
    """What ``--help`` cannot check: every method a benchmark command names and every tree a
    ``stree`` command names is one its parser takes (``bench/e2e.py``'s method specs with their
    drafter and verifier, ``bench/vllm.py``'s method names, ``stree``'s ``--tree`` specs)."""
    pytest.importorskip("torch")
    from stree.draft import parse_drafter
    from stree.verify.registry import VERIFIERS

    e2e, vllm_bench = _bench_module("e2e"), _bench_module("vllm")
    bad = []
    for doc in DOCS:
        for args in commands(doc):
            args = args[1:] if args[0] in ("scripts/venv", "scripts/venv-vllm") else args
            script = args[1] if len(args) > 1 and args[0] == "python" else None
            try:
                if script == "bench/e2e.py":
                    for spec in _flag_values(args, "--methods"):
                        method = e2e.Method.parse(spec)
                        if method.drafter:
                            parse_drafter(method.drafter)
                        assert method.verifier in (None, *VERIFIERS), f"verifier {method.verifier!r}"
                elif script in ("bench/vllm.py", "bench/vllm_profile.py"):
                    unknown = set(_flag_values(args, "--methods")) - set(vllm_bench.METHODS)
                    assert not unknown, f"methods {sorted(unknown)}"
                elif args[0] == "stree":
                    for spec in _flag_values(args, "--tree"):
                        parse_drafter(spec)
            except (AssertionError, ValueError) as err:
                bad.append(f"{rel(doc)}: {' '.join(args)}: {err}")
    assert not bad, "\n".join(bad)


def test_readme_first_block_runs_literally():
    """The two commands a newcomer types first, through ``scripts/venv`` itself."""
    lines = first_block(REPO / "README.md")
    assert lines[0] == "scripts/venv stree demo" and lines[1].startswith("scripts/venv pytest")
    for line in lines:
        proc = subprocess.run(shlex.split(line) + ["--help"], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{line} --help:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        assert "usage" in proc.stdout.lower()


# ------------------------------------------------------------------------------ snippets
def readme_python(vllm: bool = False) -> str:
    """The README's Python blocks: those that use vLLM (run by tests/vllm/test_readme.py in the vLLM
    environment) or the others."""
    blocks = [body for lang, body in FENCE_RE.findall(read(REPO / "README.md"))
              if lang == "python" and ("from vllm" in body) == vllm]
    assert blocks, "the README shows no Python"
    return "\n".join(blocks)


@pytest.fixture
def hf_checkpoints(tmp_path):
    """Two tiny transformers Mamba2 checkpoints whose vocabulary covers the shipped tokenizer's."""
    torch = pytest.importorskip("torch")
    from tests.hf_models import _mamba2

    dirs = {}
    for seed, name in enumerate(("hf_target", "hf_draft")):
        torch.manual_seed(seed)
        _mamba2(4096).save_pretrained(str(tmp_path / name))
        dirs[name] = str(tmp_path / name)
    return dirs


def test_readme_python_runs_as_shown(hf_checkpoints, tmp_path):
    code = readme_python()
    for placeholder, name in PLACEHOLDERS.items():
        assert placeholder in code, f"placeholder {placeholder!r} is gone: update PLACEHOLDERS"
        code = code.replace(f'"{placeholder}"', repr(hf_checkpoints[name]))
    assert "..." not in code and "path/to" not in code, "an unmapped placeholder in the README"
    script = tmp_path / "readme_snippets.py"
    script.write_text(code, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README snippets failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "tau" in proc.stdout  # out.stats.summary() printed
