"""stree's vLLM proposer without an engine: it compiles the draft's levels when vLLM compiles its
model (``enforce_eager=False``) and the tree has a static template, and the compiled levels draft
what the eager ones do."""
from types import SimpleNamespace

import pytest
import torch

from stree.vllm.proposer import StreeProposer
from stree.vllm.speculative import ENV, DraftSpec, draft_size

DRAFT = "models/stree-tiny/draft"


def _proposer(monkeypatch, tree: str, enforce_eager: bool) -> StreeProposer:
    monkeypatch.setenv(ENV, "")
    DraftSpec(DRAFT, tree).to_env()
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=draft_size(tree)),
                             model_config=SimpleNamespace(enforce_eager=enforce_eager, max_model_len=256),
                             scheduler_config=SimpleNamespace(max_num_seqs=2))
    return StreeProposer(config)


def _drafts(proposer: StreeProposer, steps: int = 3) -> list[list[int]]:
    """Draft ``steps`` times for one request, each step committing the first draft token."""
    history, out = [0, 5, 17, 33, 80, 100], []
    proposer.bind(["r"])
    for _ in range(steps):
        tokens = proposer.propose([[history[-1]]], [len(history)], torch.tensor([history]))[0]
        out.append(tokens)
        history = history + tokens[:1]
    return out


@pytest.mark.parametrize("tree, compiles", [("caterpillar:2,2,2", True), ("chain:4", True), ("dyspec:6", False)])
def test_draft_levels_compiled_with_vllm_compile(monkeypatch, tree, compiles):
    eager, compiled = _proposer(monkeypatch, tree, True), _proposer(monkeypatch, tree, False)
    assert not eager.compiled and compiled.compiled == compiles  # dynamic trees: no static template
    if compiles:
        assert _drafts(compiled) == _drafts(eager)
        assert getattr(compiled.model, "_stree_compiled", None) is not None  # its compiled steps ran
