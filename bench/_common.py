"""Helpers shared by the benchmark scripts: run metadata, timing, result files.

Every result row carries ``device``, ``commit`` and ``date`` (:data:`META_FIELDS`); :func:`write_rows`
refuses rows without them, so no result file can lose track of where and when it was measured.
"""
from __future__ import annotations

import csv
import datetime
import gzip
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
META_FIELDS = ("device", "commit", "date")


# ---- metadata ----------------------------------------------------------------------------

def device_name(device) -> str:
    """The GPU's name for a CUDA device, else the CPU's model name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    """Short hash of HEAD, with ``-dirty`` when the work tree has changes; ``unknown`` outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, text=True,
                               capture_output=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"
    return commit + ("-dirty" if dirty else "")


def utc_date() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def metadata(device) -> dict:
    """The fields every row starts with: device, commit, date and the torch version."""
    return dict(device=device_name(device), commit=git_commit(), date=utc_date(),
                torch=torch.__version__)


# ---- result files ------------------------------------------------------------------------

def result_stem(out_dir, name: str, meta: dict) -> Path:
    """``out_dir/{name}_{device}_{YYYYMMDDTHHMMSS}`` (no suffix)."""
    stamp = meta["date"].replace(":", "").replace("-", "")[:15]
    device = "".join(c if c.isalnum() or c in "-." else "_" for c in meta["device"])
    return Path(out_dir) / f"{name}_{device}_{stamp}"


def write_rows(rows: list[dict], stem, json_too: bool = True) -> list[Path]:
    """Write ``rows`` to ``{stem}.csv`` and (``json_too``) ``{stem}.json``; returns the paths.

    The CSV has the union of the rows' keys as columns (first-seen order); dict and list values
    are stored there as JSON text, in the JSON file as themselves. Long row sets (one per prompt)
    go to a gzipped CSV only, ``{stem}.csv.gz``: they repeat the metadata on every row, which
    compresses about 20x.
    """
    if not rows:
        raise ValueError("no rows to write")
    missing = [f for f in META_FIELDS if any(f not in r for r in rows)]
    if missing:
        raise ValueError(f"every result row needs {META_FIELDS}; missing {missing}")
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    csv_path = stem.with_name(stem.name + (".csv" if json_too else ".csv.gz"))
    json_path = stem.with_name(stem.name + ".json")
    opener = open if json_too else gzip.open
    with opener(csv_path, "wt", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()}
                         for r in rows)
    if not json_too:
        return [csv_path]
    json_path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return [csv_path, json_path]


# ---- CPU smoke runs ----------------------------------------------------------------------

def cpu_workarounds() -> None:
    """Apply the test suite's CPU workarounds (Triton interpreter, mamba_ssm's PyTorch references
    for its own Triton ops, no-op ``torch.cuda.device(None)``) so mamba_ssm's unmodified decode
    path runs on CPU tensors. Only for tiny smoke checks: it also pins torch to one thread."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import tests.conftest  # noqa: F401


# ---- timing ------------------------------------------------------------------------------

def host_sync(fn) -> str | None:
    """Run ``fn`` once with CUDA sync debugging on: None if it never waits for the device (so it can
    be captured in a CUDA graph), else the error naming the synchronising call."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as err:
        return str(err).split("\n")[0]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return None


def best_us(fn, calls: int = 200, repeats: int = 5, warmup: int = 20) -> float:
    """Microseconds per call of a host-side ``fn``: the best of ``repeats`` timed runs of
    ``calls`` calls each, after ``warmup`` calls (at most ``calls``)."""
    for _ in range(min(warmup, calls)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def time_fn(fn, device, warmup: int, repeats: int, inner: int, graphs: bool):
    """Median seconds per call of ``fn`` and whether a CUDA graph was replayed.

    CPU: wall clock around ``inner`` calls. CUDA: warmup on a side stream (Triton compiles and
    autotunes there), then CUDA events around ``inner`` calls, or graph replays when ``graphs``
    and ``fn`` has no host synchronisation (checked first: a capture that hits one can leave the
    device unusable).
    """
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
        return statistics.median(samples), False
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 3)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run = fn
    if graphs:
        reason = host_sync(fn)
        if reason is not None:
            print(f"  (not captured in a CUDA graph, timing eagerly: host sync: {reason})")
            graphs = False
    if graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except Exception as err:  # report eager timing and say why
            print(f"  (CUDA graph capture failed, timing eagerly: {type(err).__name__}: {err})")
            graphs = False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(samples), graphs
