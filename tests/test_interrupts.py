"""Ctrl-C: ``stree generate`` (streaming to a pipe or to a terminal) and ``stree demo``, sent
SIGINT once their output has started, end with the text so far flushed (its line ended), one
``interrupted`` line on stderr, exit status 130 and no traceback."""
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, "models", "stree-tiny")
GENERATE = ["generate", "--target", os.path.join(PAIR, "target"), "--draft",
            os.path.join(PAIR, "draft"), "--prompt", "def f(x):", "--max-new-tokens", "1500",
            "--eos-token-id", "-1"]
STARTED_WITHIN_S = 60  # imports and model loading on a busy 2-core machine


def interrupt(argv, started: bytes, *, tty: bool = False):
    """Run ``python -m stree.cli argv``, send SIGINT once stdout holds ``started`` (and a little
    more), and return (exit status, stdout bytes, stderr text)."""
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    env.pop("STREE_DEBUG", None)
    if tty:
        reader, writer = pty.openpty()
    else:
        reader, writer = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "stree.cli", *argv], stdout=writer,
                            stderr=subprocess.PIPE, env=env, cwd=REPO)
    os.close(writer)
    out, deadline, sent = b"", time.monotonic() + STARTED_WITHIN_S, None
    try:
        while True:
            ready, _, _ = select.select([reader], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(reader, 4096)
                except OSError:  # a pty's reader fails with EIO once the child closed it
                    chunk = b""
                if not chunk:
                    break
                out += chunk
            if sent is None and started in out and len(out) > out.index(started) + len(started) + 8:
                proc.send_signal(signal.SIGINT)
                sent = time.monotonic()
            if sent is None and time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"no output within {STARTED_WITHIN_S} s: {out!r}")
        err = proc.stderr.read().decode()
        proc.wait(timeout=30)
    finally:
        os.close(reader)
        if proc.poll() is None:
            proc.kill()
    assert sent is not None, f"the command ended before it was interrupted: {out!r} {err}"
    return proc.returncode, out, err


def assert_clean_interrupt(rc, out, err):
    assert rc == 130, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "interrupted", err
    assert out.endswith(b"\n"), out[-80:]  # the text so far, its line ended


@pytest.mark.parametrize("progress", [True, False], ids=["progress-bar", "no-progress"])
def test_generate_to_a_pipe(progress):
    rc, out, err = interrupt(GENERATE + ([] if progress else ["--no-progress"]), b"\n")
    assert_clean_interrupt(rc, out, err)
    if not progress:
        assert err == "interrupted\n"  # the one line, nothing else
    assert "\r" not in err.splitlines()[-1]  # the bar was cleared before the message


def test_generate_to_a_terminal():
    rc, out, err = interrupt(GENERATE, b"\n", tty=True)
    assert_clean_interrupt(rc, out.replace(b"\r\n", b"\n"), err)
    assert err == "interrupted\n"  # no bar on a terminal: the streamed text is the progress


def test_demo():
    rc, out, err = interrupt(["demo", "--prompts", "1", "--max-new-tokens", "1000"], b"prompt ====")
    assert_clean_interrupt(rc, out, err)
    assert b"target:" in out and err == "interrupted\n"
