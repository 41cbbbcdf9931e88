"""The generate loop on fake models: greedy exactness of every method, EOS / max_new_tokens edges,
errors, statistics, streaming, and the sampled output distribution at temperature > 0."""

import pytest
import torch
from scipy.stats import chisquare

from stree.draft import parse_drafter
from stree.generation import default_drafter, generate, resolve
from stree.sampling import SamplingConfig
from stree.verify import MSSVerifier
from tests.fakes import FakeCache, FakeLM, greedy_reference, target_probs_of_prefix

V = 23
PROMPTS = [torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([9, 4])]


@pytest.fixture(scope="module")
def target():
    return FakeLM(vocab_size=V)


@pytest.fixture(scope="module")
def draft():
    return FakeLM(vocab_size=V, noise=1.5)  # agrees with the target often, not always


def new_tokens(out, prompts):
    return [out.sequences[i, len(p):out.lengths[i]].tolist() for i, p in enumerate(prompts)]


@pytest.mark.parametrize("method,drafter,verifier,n", [
    ("ar", None, None, 256),
    ("ar-tree", None, None, 256),
    ("tree", "static:fig4a", None, 256),
    ("tree", "beam:4x3", None, 256),
    ("chain", None, None, 256),
    ("unrolled", "static:fig4a", None, 256),
    ("tree", "static:B", None, 96),
    ("tree", "chain:3", None, 96),
    ("tree", "static:fig4a", "mss", 96),     # temperature 0 through MSS == greedy
    ("tree", "static:D", "naive", 96),
    ("tree", "caterpillar:3,2,2", None, 96),
    ("chain", "chain:4", "sps", 96),
    ("chain", "chain:4", "asps", 96),
    ("unrolled", "beam:3x2", None, 96),
], ids=lambda x: str(x))
def test_greedy_equals_target_greedy(target, draft, method, drafter, verifier, n):
    out = generate(target, draft, PROMPTS, n, method=method, drafter=drafter, verifier=verifier)
    assert new_tokens(out, PROMPTS) == [greedy_reference(target, p, n) for p in PROMPTS]
    assert out.lengths == [len(p) + n for p in PROMPTS]
    assert out.sequences.shape == (2, len(PROMPTS[0]) + n)
    s = out.stats
    assert s.new_tokens == 2 * n
    assert sum(s.accept_hist.values()) == s.steps
    assert sum(k * c for k, c in s.accept_hist.items()) == s.new_tokens - 2  # first token: prefill
    assert s.steps <= 2 * s.target_calls
    if method in ("ar", "ar-tree"):
        assert s.tau == 1.0 and s.accept_hist == {1: s.steps} and s.draft_calls == 0
    else:
        assert s.tau > 1.5  # the draft does get accepted


def test_unrolled_matches_packed_tree_statistics(target, draft):
    """Same drafts and verdicts: the unrolled baseline accepts exactly what the packed tree does."""
    packed = generate(target, draft, PROMPTS, 64, drafter="beam:3x3").stats
    unrolled = generate(target, draft, PROMPTS, 64, drafter="beam:3x3", method="unrolled").stats
    assert packed.accept_hist == unrolled.accept_hist
    assert packed.target_calls == unrolled.target_calls


def test_batch_one_stats_and_ar_tau(target, draft):
    for method in ("ar", "ar-tree"):
        ar = generate(target, None, PROMPTS[:1], 40, method=method).stats
        assert (ar.tau, ar.target_calls, ar.steps, ar.new_tokens) == (1.0, 39, 39, 40)
    tree = generate(target, draft, PROMPTS[:1], 40).stats
    assert tree.steps == tree.target_calls == sum(tree.accept_hist.values())
    assert tree.tau == pytest.approx(39 / tree.target_calls)
    assert tree.draft_s > 0 and tree.verify_s > 0 and tree.replay_s > 0 and tree.total_s > 0


def test_ar_is_the_models_own_decoding_and_stops_at_any_eos(target):
    """method "ar" runs the model's own decoding (stree.native), never stree's tree path; equal-length
    prompts decode as one batch, and a row stops at the first of several stop ids."""
    target.calls.clear()
    prompts = [PROMPTS[0], PROMPTS[0].flip(0)]
    ref = [greedy_reference(target, p, 40) for p in prompts]
    eos = [ref[0][5], ref[1][9]]
    out = generate(target, None, prompts, 40, method="ar", eos_token_id=eos)
    assert [c.kind for c in target.calls] == ["native"]
    stops = [next(j for j, t in enumerate(r) if t in eos) for r in ref]
    assert new_tokens(out, prompts) == [r[:j + 1] for r, j in zip(ref, stops)]
    assert out.stats.steps == sum(stops) and out.stats.target_calls == max(stops)


def test_perfect_draft_accepts_whole_paths_and_reforwards_the_draft(target):
    """Draft == target: every step accepts a root-to-leaf path (depth + 1 tokens), which reaches
    the never-forwarded deepest layer, so the draft re-runs the path as one chain per step."""
    out = generate(target, target, PROMPTS[:1], 1 + 5 * 6, drafter="chain:4")
    s = out.stats
    assert s.accept_hist == {5: 6} and s.target_calls == 6
    assert s.draft_calls == 6 * 4 + 5  # the last step needs no commit
    assert new_tokens(out, PROMPTS[:1]) == [greedy_reference(target, PROMPTS[0], 31)]


@pytest.mark.parametrize("drafter", ["static:fig4a", "beam:3x3", "chain:4"])
def test_draft_cache_follows_the_target(drafter):
    """After every step the draft has committed exactly what the target committed, whether by
    committing its own tree's nodes or by re-running an accepted path that reached the deepest
    (never forwarded) layer; both happen in this run."""
    target, draft = FakeLM(vocab_size=V), FakeLM(vocab_size=V, noise=1.0)
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        model.allocate_tree_cache = lambda b, m, name=name: caches.setdefault(name, FakeCache(b, m))
    out = generate(target, draft, PROMPTS, 80, drafter=drafter)
    s, depth = out.stats, parse_drafter(drafter).depth
    reforwards = s.draft_calls - depth * s.target_calls
    assert 0 < reforwards < s.target_calls - 1
    for r in range(2):
        committed = caches["target"].committed(r)
        assert caches["draft"].committed(r) == committed
        assert committed == out.sequences[r, :len(committed)].tolist()


def test_max_new_tokens_truncates_an_accepted_path(target):
    out = generate(target, target, PROMPTS, 3, drafter="chain:4")  # paths of 5 would be accepted
    assert new_tokens(out, PROMPTS) == [greedy_reference(target, p, 3) for p in PROMPTS]
    assert out.stats.accept_hist == {2: 2} and out.stats.tau == 2.0
    one = generate(target, target, PROMPTS, 1)
    assert one.stats.target_calls == 0 and one.stats.new_tokens == 2
    assert one.lengths == [len(p) + 1 for p in PROMPTS]
    zero = generate(target, target, PROMPTS, 0)
    assert zero.lengths == [len(p) for p in PROMPTS]


def _mid_path_eos(target, prompt, path_len):
    """A token whose first occurrence in the greedy output is strictly inside an accepted path."""
    ref = greedy_reference(target, prompt, 60)
    for j in range(2, 60):
        if ref[j] not in ref[:j] and j % path_len != 0:
            return ref[j], ref[:j + 1]
    pytest.fail("no token of the toy greedy sequence first appears strictly inside a path")


@pytest.mark.parametrize("method", ["tree", "chain", "unrolled"])
def test_eos_inside_an_accepted_path(target, method):
    drafter = "chain:4" if method == "chain" else "static:fig4a"
    eos, expect0 = _mid_path_eos(target, PROMPTS[0], 5)
    out = generate(target, target, PROMPTS, 60, method=method, drafter=drafter, eos_token_id=eos,
                   pad_token_id=0)
    got = new_tokens(out, PROMPTS)
    assert got[0] == expect0
    assert got[1] == greedy_reference(target, PROMPTS[1], 60, eos_token_id=eos)
    assert out.lengths == [len(p) + len(g) for p, g in zip(PROMPTS, got)]
    for i, length in enumerate(out.lengths):
        assert (out.sequences[i, length:] == 0).all()


@pytest.mark.parametrize("method", ["tree", "ar"])
def test_streamer_gets_prompt_then_every_token(target, draft, method):
    class Collect:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, t):
            self.chunks.append(t.view(-1).tolist())

        def end(self):
            self.ended = True

    s = Collect()
    out = generate(target, draft, PROMPTS[0][None], 30, streamer=s, method=method)
    assert s.ended and s.chunks[0] == PROMPTS[0].tolist()
    assert sum(s.chunks[1:], []) == out.sequences[0, len(PROMPTS[0]):].tolist()
    assert len(s.chunks) == 2 + out.stats.target_calls  # prompt, prefill token, one per call
    with pytest.raises(ValueError, match="batch size 1"):
        generate(target, draft, PROMPTS, 5, streamer=s)


def test_the_first_token_reaches_the_streamer_before_the_draft_runs(target):
    """The first token needs the target's prefill alone (time to first token): the draft's
    prefill comes after it."""
    draft, events = FakeLM(vocab_size=V, noise=1.5), []
    prefill = draft.prefill

    def spy(*args, **kwargs):
        events.append("draft prefill")
        return prefill(*args, **kwargs)

    class Collect:
        def put(self, t):
            events.append(t.numel())

        def end(self):
            pass

    draft.prefill = spy
    generate(target, draft, PROMPTS[0][None], 5, streamer=Collect())
    assert events[:3] == [len(PROMPTS[0]), 1, "draft prefill"]


# ---------------------------------------------------------------------------------- errors
def test_vocab_mismatch(target):
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        generate(target, FakeLM(vocab_size=V + 2), PROMPTS, 5)


def test_missing_draft(target):
    with pytest.raises(ValueError, match="draft model"):
        generate(target, None, PROMPTS, 5)


@pytest.mark.parametrize("prompts", [torch.zeros(1, 0, dtype=torch.long), [[1, 2], []], []])
def test_empty_prompt(target, draft, prompts):
    with pytest.raises(ValueError, match="empty prompt|no prompts"):
        generate(target, draft, prompts, 5)


@pytest.mark.parametrize("drafter", ["static:fig9", "beam:4", "bogus"])
def test_unknown_preset(target, draft, drafter):
    with pytest.raises(ValueError, match="unknown"):
        generate(target, draft, PROMPTS, 5, drafter=drafter)


def test_unknown_method(target, draft):
    with pytest.raises(ValueError, match="unknown method"):
        generate(target, draft, PROMPTS, 5, method="fast")


@pytest.mark.parametrize("drafter,verifier,temperature", [
    ("beam:4x3", "mss", 1.0),                 # chosen children + MSS at T > 0
    ("static:fig4a:deterministic", "mss", 0.7),
    ("static:fig4a", "greedy", 1.0),          # greedy verification of a sampled target
    ("static:fig4a", "sps", 0.0),             # sps needs a chain
    ("static:A:iid", "sps", 1.0),
    ("static:A:iid", "asps", 1.0),            # asps needs a chain too
])
def test_non_lossless_pair_refused(target, draft, drafter, verifier, temperature):
    target.calls.clear()
    with pytest.raises(ValueError):
        generate(target, draft, PROMPTS, 5, drafter=drafter, verifier=verifier, temperature=temperature)
    assert target.calls == []  # refused before running anything


@pytest.mark.parametrize("kwargs,error,pattern", [
    ({"generator": 0}, TypeError, "generator must be a torch.Generator"),
    ({"streamer": object()}, TypeError, r"streamer must have put\(tokens\) and end\(\)"),
    ({"top_k": 1.5, "temperature": 1.0}, TypeError, "top_k must be an int"),
    ({"temperature": "1.0"}, TypeError, "temperature must be a number"),
    ({"top_p": None}, TypeError, "top_p must be a number"),
    ({"temperature": float("inf")}, ValueError, "temperature must be finite"),
], ids=lambda x: str(x) if isinstance(x, dict) else None)
def test_bad_options_refused_before_anything_runs(target, draft, kwargs, error, pattern):
    target.calls.clear()
    with pytest.raises(error, match=pattern):
        generate(target, draft, PROMPTS[:1], 5, **kwargs)
    assert target.calls == []


def test_numpy_integer_max_new_tokens_and_an_empty_run(target, draft):
    import numpy as np

    out = generate(target, draft, PROMPTS[:1], np.int64(3))
    assert out.lengths[0] == len(PROMPTS[0]) + 3
    assert "tau - tokens/target call" in generate(target, draft, PROMPTS[:1], 0).stats.summary()


def test_a_list_of_prompts_holds_1d_prompts(target, draft):
    """A (2, l) tensor inside a list was once flattened into one prompt of 2l tokens."""
    with pytest.raises(ValueError, match=r"prompt 0 of the list has shape \(2, 4\); each prompt of a list must be 1-D"):
        generate(target, draft, [torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])], 5)
    with pytest.raises(ValueError, match="must be 1-D"):
        generate(target, draft, [[[1, 2]]], 5)


def test_unpatched_models_are_named():
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"the target \(Linear\) has no tree API: call stree.patch"):
        generate(plain, FakeLM(vocab_size=V), PROMPTS, 5)
    with pytest.raises(TypeError, match=r"the draft \(Linear\) has no tree API"):
        generate(FakeLM(vocab_size=V), plain, PROMPTS, 5)


def test_chain_method_needs_a_chain(target, draft):
    with pytest.raises(ValueError, match="chain drafter"):
        generate(target, draft, PROMPTS, 5, method="chain", drafter="static:A")


def test_sequence_past_cache_length(target, draft):
    with pytest.raises(ValueError, match="max_seqlen"):
        generate(target, draft, PROMPTS, 50, max_seqlen=60)  # 7 + 50 + 13 > 60
    out = generate(target, draft, PROMPTS, 40, max_seqlen=60)
    assert out.lengths[0] == 47


def test_resolved_pairs():
    hot = SamplingConfig(temperature=1.0)
    d, v = resolve("tree", "static:A", None, hot)
    assert (d.mode, v.name) == ("without_replacement", "mss")
    d, v = resolve("tree", "static:A", "naive", hot)
    assert (d.mode, v.name) == ("deterministic", "naive")  # top-k children for naive (paper)
    d, v = resolve("tree", "static:A", None, SamplingConfig())
    assert (d.mode, v.name) == ("deterministic", "greedy")
    d, v = resolve("chain", None, None, hot)
    assert (d.mode, v.name) == ("chain", "sps")
    d, v = resolve("tree", "auto", None, hot)  # chains among its candidates: asps for those
    assert (d.mode, v.name) == ("without_replacement", "mss+asps")
    assert resolve("tree", "auto", None, SamplingConfig())[1].name == "greedy"
    assert resolve("tree", "dyspec:8", None, hot)[1].name == "mss"  # no chain candidates


# ------------------------------------------------------------------------ sampled distribution
def _expected(target, prompt, rows):
    p = target_probs_of_prefix(target, prompt, 3).reshape(-1).double()
    return p / p.sum() * rows


def _joint(out, prompt, length, v):
    toks = out.sequences[:, len(prompt):len(prompt) + length]
    idx = torch.zeros(toks.shape[0], dtype=torch.long)
    for j in range(length):
        idx = idx * v + toks[:, j]
    return torch.bincount(idx, minlength=v ** length)


@pytest.mark.parametrize("method,drafter,verifier", [
    ("tree", "static:3,2", None),          # sampled without replacement + MSS
    ("tree", "static:3,2:iid", "mss"),
    ("tree", "beam:2x2", "naive"),
    ("chain", "chain:2", None),             # sps
    ("chain", "chain:3", "asps"),
])
def test_sampled_output_has_the_target_distribution(method, drafter, verifier):
    """The first 3 tokens of 3000 rows against the exact target joint (v^3 cells, chi-square)."""
    v, rows = 5, 3000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0, method=method,
                   drafter=drafter, verifier=verifier, generator=torch.Generator().manual_seed(0))
    assert out.stats.tau > 1.3  # speculation did happen
    expect = _expected(target, prompt, rows)
    assert chisquare(_joint(out, prompt, 3, v).double(), expect).pvalue > 1e-3


def test_distribution_test_catches_a_wrong_rule():
    """Control: MSS over top-k (chosen) children, refused normally, is visibly biased."""
    class Unchecked(MSSVerifier):
        def check(self, draft_mode, sampling):
            pass

    v, rows = 5, 3000
    target, draft = FakeLM(vocab_size=v, scale=1.0), FakeLM(vocab_size=v, scale=1.0, noise=0.8)
    prompt = torch.tensor([1, 2])
    out = generate(target, draft, prompt.expand(rows, -1), 3, temperature=1.0,
                   drafter="static:3,2:deterministic", verifier=Unchecked(),
                   generator=torch.Generator().manual_seed(0))
    expect = _expected(target, prompt, rows)
    assert chisquare(_joint(out, prompt, 3, v).double(), expect).pvalue < 1e-6


def test_default_drafter_follows_the_method_and_device(target, draft):
    assert default_drafter("tree", "cuda") == default_drafter("unrolled", "cpu") == "static:fig4a"
    assert default_drafter("tree", torch.device("cpu")) == "caterpillar:2,2,2"
    assert default_drafter("chain", "cuda") == "chain:4"
    out = generate(target, draft, PROMPTS, 8)  # CPU models: the caterpillar
    assert out.stats.drafter == "caterpillar:2,2,2"
    assert resolve("tree", None, None, SamplingConfig(), device="cuda")[0].name == "static:fig4a"
