"""Run one vLLM engine in a child process and print its outputs as JSON (tests call :func:`run`).

vLLM starts worker processes of its own, so an engine is built under ``__main__`` of a fresh
interpreter rather than inside pytest's process. The child gets a clean environment: the test
suite's ``TRITON_INTERPRET=1`` is not for vLLM.

The engine runs in that one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the
model beside the caller), which starts in 13 s on the project's CPU against 30 s for vLLM's default
three processes (caller, engine core, worker; each imports vLLM and loads the plugin), the same
model runner, proposer and plugin code either way. A spec with ``"processes": True`` gets the
default layout; tests/vllm/test_engine_compiled.py, tests/vllm/test_readme.py and
tests/vllm/test_serve.py run stree in it. With ``tensor_parallel_size`` > 1 vLLM's multiprocessing
executor starts one worker process per rank in either layout (tests/vllm/test_engine_tp.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

# Small enough for a 2-core, 24 GB machine running other work: vLLM's CPU backend otherwise
# reserves 92% of memory at start-up.
ENGINE_DEFAULTS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4, seed=0,
                       gpu_memory_utilization=0.2, kv_cache_memory_bytes=256 << 20, disable_log_stats=False)

MARK = "STREE-RESULT "  # vLLM logs to stdout too


def run(spec: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the engine ``spec`` describes: ``{"engine": {...LLM kwargs}, "prompts": [[ids] or text],
    "sampling": {...SamplingParams kwargs}}``, in one process unless ``"processes": True`` (see the
    module docstring), with ``spec["env"]`` (if any) added to the child's environment; the result
    is the stdout line after :data:`MARK`. ``"sampling"`` may be a list, one per prompt.
    ``"turns": [[ids], ...]`` makes it a conversation from the first prompt (:func:`_converse`).
    ``{"runs": [spec, ...], "env": {...}}`` runs several engines one after another in the one child
    (vLLM imported once: after the first, an engine starts in seconds), the result
    ``{"runs": [result, ...]}``; ``{"refusals": [{...LLM kwargs}, ...]}`` builds engines that must
    fail to start, the result each one's traceback (None where one started: :func:`refusals`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not spec.get("processes"):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(spec.get("env", {}))
    return subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    return json.loads(lines[-1][len(MARK):])


def every_step(engine: dict) -> dict:
    """``engine`` with stree drafting at every batch size, and its suffix trees for sampled
    requests too, where its speculative config does not say: the CPU defaults draft only while a
    request runs alone and only for greedy requests from suffix trees, and the engine tests are
    about batches of trees under every sampling setting (the defaults themselves:
    tests/vllm/test_plugin.py)."""
    from stree.vllm.speculative import SCHEDULE, SUFFIX_SAMPLED, config_tree, draft_size

    spec = engine.get("speculative_config")
    if not spec or spec.get("method") != "stree":
        return engine
    k = draft_size(config_tree(spec, cpu=True))
    return {**engine, "speculative_config": {SCHEDULE: [[1, 1 << 10, k]], SUFFIX_SAMPLED: True, **spec}}


def refusals(engines: list[dict], env: dict | None = None) -> list[str | None]:
    """Build an engine of each of ``engines`` (LLM kwargs over :data:`ENGINE_DEFAULTS`), one after
    another in one child; each must fail before its engine core starts. Returns each one's
    traceback (None where an engine started)."""
    return result(run({"refusals": engines, "env": env or {}}))


def _main(spec: dict) -> None:
    from vllm import LLM

    if "refusals" in spec:
        print(MARK + json.dumps([_refusal(kwargs) for kwargs in spec["refusals"]]), flush=True)
        return
    if "runs" not in spec:
        llm = LLM(**every_step({**ENGINE_DEFAULTS, **spec["engine"]}))
        print(MARK + json.dumps(_generate(llm, spec)), flush=True)
        return
    results = []
    for run in spec["runs"]:  # one engine after another, each shut down before the next starts
        llm = LLM(**every_step({**ENGINE_DEFAULTS, **run["engine"]}))
        results.append(_generate(llm, run))
        _close(llm)
    print(MARK + json.dumps({"runs": results}), flush=True)


def _refusal(kwargs: dict) -> str | None:
    import traceback

    from vllm import LLM

    try:
        llm = LLM(**{**ENGINE_DEFAULTS, **kwargs})
    except Exception:  # noqa: BLE001  (the test reads which, from the traceback)
        return traceback.format_exc()
    _close(llm)
    return None


def _generate(llm, spec: dict) -> dict:
    from vllm import SamplingParams

    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in spec["prompts"]]
    lengths = spec.get("max_tokens")  # per-request max_tokens, overriding the shared sampling's
    if isinstance(spec["sampling"], list):  # one per prompt
        params = [SamplingParams(**sampling) for sampling in spec["sampling"]]
    else:
        params = ([SamplingParams(**{**spec["sampling"], "max_tokens": n}) for n in lengths] if lengths
                  else SamplingParams(**spec["sampling"]))
    if "abort" in spec:
        return _with_abort(llm, prompts, params, **spec["abort"])
    if "turns" in spec:
        return _converse(llm, spec["prompts"][0], params, spec["turns"])
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "texts": [o.outputs[0].text for o in outs],
            "spec": _counters(llm)}


def _counters(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name.startswith(("vllm:spec_decode_num", "vllm:num_preemptions", "vllm:prefix_cache"))
            and hasattr(m, "value")}


def _converse(llm, prompt: list[int], params, turns: list[list[int]]) -> dict:
    """A conversation, one request at a time: each of ``turns`` (the user's next token ids) is
    appended to the last prompt and its output to make the next prompt. Returns each turn's output
    tokens and ``num_cached_tokens`` (the prompt tokens vLLM's prefix cache supplied)."""
    tokens, cached = [], []
    for user in [None, *turns]:
        if user is not None:
            prompt = prompt + tokens[-1] + user
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    return {"tokens": tokens, "cached": cached, "spec": _counters(llm)}


def _close(llm) -> None:
    """Shut ``llm``'s engine (and its workers) down and tear vLLM's distributed state down, so that
    the next engine starts in this process as in a fresh one."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
    cleanup_dist_env_and_memory()


def _with_abort(llm, prompts, params, requests: list[int], after_steps: int, late: list) -> dict:
    """Step the engine by hand: abort ``requests`` (prompt indices) after ``after_steps`` engine
    steps, then add the ``late`` prompts, which take the aborted requests' places. Returns the
    finished requests' tokens by id (prompt index, or ``late<j>``)."""
    engine_ = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine_.add_request(str(i), prompt, params)
    finished, steps = {}, 0
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == after_steps:
            engine_.abort_request([str(i) for i in requests])
            for j, prompt in enumerate(late):
                engine_.add_request(f"late{j}", {"prompt_token_ids": prompt}, params)
    return {"finished": finished}


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
