"""The README's vLLM snippet runs as shown, in the vLLM environment (tests/test_docs.py runs the
README's other snippets in the main one)."""
import os
import subprocess
import sys

from tests.test_docs import REPO, readme_python


def test_readme_vllm_snippet_runs_as_shown(tmp_path):
    code = readme_python(vllm=True)
    assert "speculative_config" in code
    script = tmp_path / "readme_vllm.py"
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip()  # the generated text was printed
