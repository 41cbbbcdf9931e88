"""stree.generate on real (tiny, random) patched models: greedy output of every method equals the
unmodified target's greedy decoding token for token, for a batch of two prompts of different
lengths, with a pure-Mamba2 draft and target (mamba_ssm) and a hybrid target (stree.hybrid)."""
import copy
import itertools

import pytest
import torch

import stree
from stree.costmodel import ForwardCost
from stree.draft.auto import AutoDrafter
from tests.oracle import SequentialDecoder
from tests.test_model_hybrid import make_hybrid
from tests.test_model_mamba2 import make_model

N_NEW = 256
PROMPTS = [torch.tensor([5, 17, 3, 40, 8, 22, 9]), torch.tensor([31, 2])]


def noisy_copy(model, scale, seed):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().nan_to_num(0.02))
    return draft


@pytest.fixture(scope="module")
def mamba_pair():
    target = make_model(seed=21, n_layer=2)
    draft = noisy_copy(target, 0.3, seed=1)
    return stree.patch(target), stree.patch(draft)


@pytest.fixture(scope="module")
def mamba_reference(mamba_pair):
    """Greedy decoding of the unmodified model, one token at a time (mamba_ssm's Mamba2.step)."""
    target = mamba_pair[0]
    out = []
    for p in PROMPTS:
        dec = SequentialDecoder(target)
        logits = dec.feed(p)[-1]
        toks = []
        for _ in range(N_NEW):
            toks.append(int(logits.argmax()))
            logits = dec.step(toks[-1])
        out.append(toks)
    return out


def new_tokens(out):
    return [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("method,drafter", [
    ("ar-tree", None), ("tree", "static:fig4a"), ("tree", "beam:4x3"), ("tree", "chain:4"),
    ("chain", "chain:4"), ("unrolled", "static:fig4a"), ("tree", "dyspec:12"),
    ("tree", "dyspec-threshold:0.05:16"), ("tree", "dynatree:4x2:12"), ("tree", "dynatree2:16"),
    ("tree", "caterpillar:2,2,2,2"),
], ids=["ar-tree", "tree-fig4a", "tree-beam4x3", "tree-chain4", "chain-sd", "unrolled-fig4a",
        "tree-dyspec12", "tree-dyspec-threshold", "tree-dynatree4x2", "tree-dynatree2",
        "tree-caterpillar"])
def test_mamba2_greedy_equals_sequential_greedy(mamba_pair, mamba_reference, method, drafter):
    target, draft = mamba_pair
    out = stree.generate(target, draft, PROMPTS, N_NEW, method=method, drafter=drafter)
    assert new_tokens(out) == mamba_reference
    if method != "ar-tree":
        assert out.stats.tau > 1.2, f"tau {out.stats.tau}: the draft is never accepted?"


def test_hybrid_greedy_equals_its_own_generate():
    target = make_hybrid((1, 3), seed=8)
    draft = noisy_copy(target, 0.2, seed=2)
    refs = [target.generate(p[None], max_new_tokens=64)[0, len(p):].tolist() for p in PROMPTS]
    stree.patch(target), stree.patch(draft)
    for method, drafter in [("tree", "static:fig4a"), ("tree", "beam:3x2"), ("chain", "chain:4"),
                            ("tree", "dyspec:10"), ("tree", "dynatree2:12"),
                            ("tree", "caterpillar:3,2,2,1")]:
        out = stree.generate(target, draft, PROMPTS, 64, method=method, drafter=drafter)
        assert new_tokens(out) == refs, f"{method} {drafter}"


def test_a_draft_in_another_dtype_leaves_the_output_the_targets():
    """A bf16 draft for an fp32 target is allowed: it drafts token ids, and the distributions it
    drew them from reach the verifiers in fp32, so only acceptance depends on its dtype."""
    target = make_hybrid((1, 3), seed=8)
    draft = noisy_copy(target, 0.2, seed=2).to(torch.bfloat16)
    refs = [target.generate(p[None], max_new_tokens=48)[0, len(p):].tolist() for p in PROMPTS]
    stree.patch(target), stree.patch(draft)
    for method, drafter in [("tree", "caterpillar:2,2,2"), ("chain", "chain:4"), ("tree", "dyspec:10")]:
        out = stree.generate(target, draft, PROMPTS, 48, method=method, drafter=drafter)
        assert new_tokens(out) == refs, f"{method} {drafter}"
        assert out.stats.tau > 1.2, f"{drafter}: tau {out.stats.tau}, the bf16 draft is never accepted?"
    seen = []

    class Recording(stree.verify.MSSVerifier):
        def verify(self, draft, logits, sampling, generator=None):
            seen.append((draft.q.dtype, logits.dtype))
            return super().verify(draft, logits, sampling, generator)

    out = stree.generate(target, draft, PROMPTS[:1], 24, drafter="caterpillar:2,2,2", verifier=Recording(),
                         temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert out.lengths == [len(PROMPTS[0]) + 24]
    assert seen and set(seen) == {(torch.float32, torch.float32)}


def test_a_draft_on_another_device_is_refused_before_anything_runs(mamba_pair):
    target, draft = mamba_pair
    elsewhere = copy.deepcopy(draft).to("meta")  # a second device on a CPU-only machine
    with pytest.raises(ValueError, match="device mismatch: the target is on cpu, the draft on meta"):
        stree.generate(target, elsewhere, PROMPTS, 8)


def test_sampling_runs_with_mss_and_reports_stats(mamba_pair):
    target, draft = mamba_pair
    out = stree.generate(target, draft, PROMPTS[:1], 40, temperature=1.0, top_p=0.95,
                         generator=torch.Generator().manual_seed(0))
    s = out.stats
    assert out.lengths == [len(PROMPTS[0]) + 40] and s.new_tokens == 40
    assert sum(s.accept_hist.values()) == s.steps and s.tau >= 1.0
    assert s.tokens_per_s > 0 and s.draft_s > 0 and s.verify_s > 0 and s.replay_s > 0


class TreeForwardOnly:
    """A patched draft seen without ``level_forward``: drafters then re-run the partial tree from
    the committed state at every level (``tree_forward``, exact against step decoding) and the
    loop re-runs an accepted path as a chain. The oracle for the materialised node states."""

    def __init__(self, model):
        self.model, self.lm_head = model, model.lm_head

    def parameters(self):
        return self.model.parameters()

    def allocate_tree_cache(self, *args, **kwargs):
        return self.model.allocate_tree_cache(*args, **kwargs)

    def prefill(self, *args, **kwargs):
        return self.model.prefill(*args, **kwargs)

    def tree_forward(self, *args, **kwargs):
        return self.model.tree_forward(*args, **kwargs)


@pytest.mark.parametrize("drafter", ["static:fig4a", "beam:3x2", "dyspec:10", "dynatree:3x2:10"])
def test_level_drafting_drafts_what_rerunning_the_tree_drafts(drafter):
    """At T=0 drafts are deterministic functions of the draft's state, so the level-by-level draft
    (each node once, from its parent's stored state; the committed state taken from the last
    accepted node) must propose the same trees as re-running the partial tree, step after step:
    the same acceptance histogram. A wrong stored state shows up as a different draft."""
    target = make_hybrid((1, 3), seed=8)
    draft = noisy_copy(target, 0.2, seed=2)
    stree.patch(target), stree.patch(draft)
    level = stree.generate(target, draft, PROMPTS, 64, drafter=drafter)
    rerun = stree.generate(target, TreeForwardOnly(draft), PROMPTS, 64, drafter=drafter)
    assert new_tokens(level) == new_tokens(rerun)
    assert level.stats.accept_hist == rerun.stats.accept_hist and level.stats.tau > 1.2


@pytest.mark.parametrize("drafter", ["caterpillar:2,2,2,2", "caterpillar:2,2,2+suffix:16", "auto"])
def test_a_greedy_static_draft_runs_what_it_is_behind_as_its_lead(monkeypatch, tmp_path, mamba_pair,
                                                                  mamba_reference, drafter):
    """A greedy static draft of an attention-free draft model never runs the accepted leaf of
    its last tree (or a merged tree's accepted suffix nodes) by a forward of its own: the next
    draft runs them as its lead; the output is still the target's greedy decoding. So does
    ``auto`` choosing among static trees, merged or not (each step's choice takes the lead)."""
    target, draft = mamba_pair
    if drafter == "auto":  # every candidate drafts with the model: no backlog outgrows a lead
        monkeypatch.setenv("STREE_CACHE", str(tmp_path))  # its cost model's timings
        drafter = AutoDrafter(("caterpillar:2,2,2", "chain:4", "caterpillar:2,2,2+suffix:16"), warmup=2)
    leads, prefills = [], []
    draft_levels, prefill = draft.draft_levels, draft.prefill
    monkeypatch.setattr(draft, "draft_levels", lambda tokens, cache, levels, pick, lead=None: leads.append(
        lead) or draft_levels(tokens, cache, levels, pick, lead))
    monkeypatch.setattr(draft, "level_forward", lambda *a, **k: pytest.fail("a level ran outside a draft"))
    monkeypatch.setattr(draft, "prefill",
                        lambda ids, cache, **kw: prefills.append(len(leads)) or prefill(ids, cache, **kw))
    out = stree.generate(target, draft, PROMPTS, N_NEW, drafter=drafter)
    assert new_tokens(out) == mamba_reference
    ran = [lead for lead in leads if lead is not None]
    assert len(ran) > len(leads) // 10 and all(lead.shape[1] in (1, 2, 4, 8, 16) for lead in ran)
    assert prefills and set(prefills) == {0}  # the prompts only, before the first draft
    if isinstance(drafter, AutoDrafter):
        assert len(drafter.memory.times) > 1  # it ran more than one candidate


def test_auto_off_steps_are_caught_up_by_a_lead_or_a_prefill(monkeypatch, mamba_pair, mamba_reference):
    """``auto`` off (no draft: the target's one-token step) for runs of 1 to 40 steps between
    drafts: the draft model runs nothing on those steps, a backlog of up to ``MAX_LEAD`` (16)
    tokens is run as the next draft's lead, a longer one is prefilled first; the output is the
    target's greedy decoding."""
    from stree.draft.auto import OFF
    from stree.draft.base import MAX_LEAD

    target, draft = mamba_pair
    offs = itertools.cycle([3, 1, 40, 16, 17, 0, 8])
    plan = itertools.chain.from_iterable([OFF] * next(offs) + ["caterpillar:2,2,2"] for _ in itertools.count())
    monkeypatch.setattr(AutoDrafter, "choose", lambda self: next(plan))
    leads, prefills, draws = [], [], []
    draft_levels, prefill = draft.draft_levels, draft.prefill
    monkeypatch.setattr(draft, "draft_levels", lambda tokens, cache, levels, pick, lead=None: leads.append(
        lead) or draft_levels(tokens, cache, levels, pick, lead))
    monkeypatch.setattr(draft, "prefill",  # (ragged rows come back one by one)
                        lambda ids, cache, **kw: prefills.append((len(leads), ids)) or prefill(ids, cache, **kw))
    auto = AutoDrafter(("caterpillar:2,2,2", OFF), ForwardCost(0.0, 1e-3, 1e-2), ForwardCost(0.0, 1e-4, 1e-3),
                       remember=False)
    out = stree.generate(target, draft, PROMPTS, N_NEW, drafter=auto)
    assert new_tokens(out) == mamba_reference
    steps = auto.memory.chosen
    assert len(leads) == steps["caterpillar:2,2,2"] and steps[OFF] > 0.8 * out.stats.target_calls
    ran = [lead for lead in leads if lead is not None]
    assert ran and max(lead.shape[1] for lead in ran) == MAX_LEAD  # a backlog of 16: a lead
    catch_ups = {}  # by the draft it came before: the longest row
    for drafts, ids in prefills:
        if drafts and not isinstance(ids, list):
            catch_ups[drafts] = max(catch_ups.get(drafts, 0), ids.shape[1])
    assert catch_ups and min(catch_ups.values()) > MAX_LEAD and max(catch_ups.values()) >= 40


def test_a_sampled_static_draft_with_a_lead_draws_what_it_draws_after_a_catch_up(monkeypatch, mamba_pair):
    """Sampled, the lead changes how the draft reaches its state, not what is drawn: the same
    generator gives the same output as catching up by a forward of its own first."""
    from stree.draft.static import StaticTreeDrafter

    target, draft = mamba_pair
    leads = []
    draft_levels = draft.draft_levels
    monkeypatch.setattr(draft, "draft_levels", lambda tokens, cache, levels, pick, lead=None, *extra: leads.append(
        lead) or draft_levels(tokens, cache, levels, pick, lead, *extra))

    def run():
        return stree.generate(target, draft, PROMPTS, 64, temperature=1.0, drafter="caterpillar:2,2,2",
                              generator=torch.Generator().manual_seed(4)).sequences

    with_lead = run()
    assert any(lead is not None for lead in leads)
    monkeypatch.setattr(StaticTreeDrafter, "takes_lead", lambda self, model, sampling: False)
    leads.clear()
    assert torch.equal(run(), with_lead) and not any(lead is not None for lead in leads)
