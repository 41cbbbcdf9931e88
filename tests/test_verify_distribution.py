"""Losslessness of the sampling verifiers, checked against the exact target distribution.

Each trial simulates one speculative step end to end, vectorised over the batch (one row = one
trial): a small target "model" (conditional tables over a tiny vocab) and a draft model; the
drafter samples a depth-2 tree from q in the mode under test; the verifier accepts a path and
emits one token. The emitted sequence is extended to three tokens with exact target samples (what
any later lossless step would produce), and the frequencies of (y1), (y1, y2) and (y1, y2, y3) are
chi-square tested against p(y1) p(y2|y1) p(y3|y1,y2). Seeds are fixed and the threshold is 1e-4, so
a pass is deterministic; negative controls (rules known to be biased) run through the same
machinery and must fail it, which shows the test has the power to catch a wrong rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chisquare

from stree.draft_types import Draft
from stree.sampling import SamplingConfig, sample_from, target_probs
from stree.tree import TokenTree
from stree.verify import get_verifier
from stree.verify import base
from stree.verify.base import NodeStep, Verdict, walk

V = 4
TRIALS = 30_000
ALPHA = 1e-4


@dataclass
class Models:
    """Target logits L1 (V,), L2 (V, V), L3 (V, V, V) = logits after prefixes of length 0, 1, 2;
    draft distributions q1 (V,), q2 (V, V) at the root and after one token."""

    L1: torch.Tensor
    L2: torch.Tensor
    L3: torch.Tensor
    q1: torch.Tensor
    q2: torch.Tensor


def _dist(g, *shape, floor=0.3):
    """Random distributions over the last dim, mixed with uniform so no cell is tiny."""
    d = -torch.rand(*shape, V, generator=g, dtype=torch.float64).log()
    d = d / d.sum(-1, keepdim=True)
    return ((1 - floor) * d + floor / V).float()


def make_models(seed: int, peaked_q: bool = False) -> Models:
    g = torch.Generator().manual_seed(seed)
    L1, L2, L3 = (_dist(g, *s).log() for s in [(), (V,), (V, V)])
    if peaked_q:  # a draft far from the target makes biased rules show up clearly
        q1 = torch.tensor([0.6, 0.3, 0.05, 0.05])
        q2 = torch.stack([q1.roll(i) for i in range(V)])
    else:
        q1, q2 = _dist(g), _dist(g, V)
    return Models(L1, L2, L3, q1, q2)


def draw_children(q: torch.Tensor, k: int, mode: str, g) -> torch.Tensor:
    """(N, V) distributions -> (N, k) children tokens in draft order, chosen as ``mode`` says."""
    if mode in ("iid", "chain"):
        return torch.multinomial(q, k, replacement=True, generator=g)
    if mode == "without_replacement":  # sequential draws from q renormalised, in draw order
        w, out = q.clone(), []
        for _ in range(k):
            t = torch.multinomial(w, 1, generator=g)
            out.append(t)
            w.scatter_(1, t, 0.0)
        return torch.cat(out, 1)
    if mode == "deterministic":  # top-k of q
        return torch.topk(q, k, dim=-1).indices
    raise AssertionError(mode)


def simulate(m: Models, widths: tuple[int, ...], draft_mode: str, verify, seed: int,
             sampling: SamplingConfig, label_mode: str | None = None, trials: int = TRIALS,
             q_seen=None):
    """Run ``trials`` speculative steps; return counts of emitted triples (V, V, V).

    widths (k1, k2[, inner]): the root has k1 children, the first ``inner`` of those (default:
    all) k2 children each (leaves); ``(k1, k2, 1)`` is a caterpillar.
    label_mode: the mode written into the Draft (defaults to draft_mode); a different label feeds
    a verifier children drawn some other way than it assumes.
    verify: callable(draft, logits, generator) -> Verdict.
    q_seen: optional map applied to the q handed to the verifier (children are still drawn from
    the true q), to model a verifier that sees a different q than the drafter used.
    """
    g = torch.Generator().manual_seed(seed)
    k1, k2, inner = (*widths, widths[0])[:3]
    n = 1 + k1 + inner * k2
    parents = [-1] + [0] * k1 + [1 + i for i in range(inner) for _ in range(k2)]
    N = trials
    t1 = draw_children(m.q1.expand(N, V), k1, draft_mode, g)                     # (N, k1)
    t2 = draw_children(m.q2[t1[:, :inner].reshape(-1)], k2, draft_mode, g).reshape(N, inner * k2)
    par1 = t1[:, :inner].repeat_interleave(k2, dim=1)                            # parent token
    tokens = torch.cat([torch.zeros(N, 1, dtype=torch.long), t1, t2], 1)
    logits = torch.cat([m.L1.expand(N, 1, V), m.L2[t1], m.L3[par1, t2]], 1)
    # Leaves' q rows are unused by contract: NaN makes any use of them visible.
    q1 = m.q2[t1].clone()
    q1[:, inner:] = float("nan")
    q = torch.cat([m.q1.expand(N, 1, V), q1, torch.full((N, inner * k2, V), float("nan"))], 1)
    assert logits.shape == q.shape == (N, n, V)
    tree = TokenTree(tokens, torch.tensor(parents))
    draft = Draft(tree=tree, q=q if q_seen is None else q_seen(q), mode=label_mode or draft_mode)
    verdict = verify(draft, logits, g)

    # Emitted tokens: accepted path tokens, then next_token; complete to 3 with target samples.
    acc = tree.path_tokens(verdict.path)[:, 1:]                                 # (N, 2), -1 padded
    seq = torch.cat([acc, torch.full((N, 1), -1)], 1)
    seq.scatter_(1, verdict.num_accepted.unsqueeze(1), verdict.next_token.unsqueeze(1))
    P2, P3 = target_probs(m.L2, sampling), target_probs(m.L3, sampling)
    fill2 = sample_from(P2[seq[:, 0]], g)
    seq[:, 1] = torch.where(seq[:, 1] < 0, fill2, seq[:, 1])
    fill3 = sample_from(P3[seq[:, 0], seq[:, 1]], g)
    seq[:, 2] = torch.where(seq[:, 2] < 0, fill3, seq[:, 2])
    assert (verdict.num_accepted <= 2).all() and (seq >= 0).all() and (seq < V).all()
    cell = seq[:, 0] * V * V + seq[:, 1] * V + seq[:, 2]
    return torch.bincount(cell, minlength=V**3).view(V, V, V)


def exact_triples(m: Models, sampling: SamplingConfig) -> torch.Tensor:
    P1, P2, P3 = (target_probs(L, sampling).double() for L in (m.L1, m.L2, m.L3))
    return P1[:, None, None] * P2[:, :, None] * P3


def pvalues(counts: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Chi-square p-values of the y1, (y1, y2) and (y1, y2, y3) frequencies. Cells the target
    gives probability 0 must be empty (reported as p = 0 otherwise)."""
    out = {}
    for name, dims in (("y1", (1, 2)), ("y1y2", (2,)), ("y1y2y3", ())):
        c = counts.double().sum(dims).flatten() if dims else counts.double().flatten()
        e = expected.sum(dims).flatten() if dims else expected.flatten()
        support = e > 0
        if c[~support].sum() > 0:
            out[name] = 0.0
            continue
        c, e = c[support], e[support]
        out[name] = float(chisquare(c.numpy(), (e / e.sum() * c.sum()).numpy()).pvalue)
    return out


def run_verifier(name: str, sampling: SamplingConfig):
    verifier = get_verifier(name)
    return lambda draft, logits, g: verifier.verify(draft, logits, sampling, generator=g)


LOSSLESS = [
    # (verifier, draft mode, widths, sampling)
    ("naive", "deterministic", (3, 2), SamplingConfig(1.0)),
    ("naive", "iid", (2, 2), SamplingConfig(0.8, top_p=0.9)),
    ("mss", "iid", (3, 2), SamplingConfig(1.0)),
    ("mss", "iid", (3, 2), SamplingConfig(0.7, top_k=3)),
    ("mss", "without_replacement", (3, 2), SamplingConfig(1.0)),
    ("mss", "without_replacement", (4, 2), SamplingConfig(1.0)),  # root's q is exhausted
    ("mss", "without_replacement", (2, 3), SamplingConfig(0.6, top_p=0.8)),
    ("mss", "chain", (1, 1), SamplingConfig(1.0)),
    ("sps", "chain", (1, 1), SamplingConfig(1.0)),
    ("sps", "chain", (1, 1), SamplingConfig(0.5, top_k=3)),
    ("asps", "chain", (1, 1), SamplingConfig(1.0)),
    ("asps", "chain", (1, 1), SamplingConfig(0.7, top_p=0.8)),
    ("mss+asps", "chain", (1, 1), SamplingConfig(1.0)),               # runs asps
    ("mss+asps", "without_replacement", (3, 2), SamplingConfig(1.0)),  # runs mss
    ("mss", "without_replacement", (3, 2, 1), SamplingConfig(1.0)),    # caterpillar
    ("mss", "iid", (2, 2, 1), SamplingConfig(0.8, top_k=4)),           # caterpillar
    ("naive", "deterministic", (3, 2, 1), SamplingConfig(1.0)),        # caterpillar
]


def _id(case):
    name, mode, widths, s = case
    return f"{name}-{mode}-{'x'.join(map(str, widths))}-T{s.temperature}-k{s.top_k}-p{s.top_p}"


@pytest.fixture(params=["batched", "per_depth"])
def walk_mode(request, monkeypatch):
    """Both ways ``walk`` runs a node rule: over every node at once, or per depth at the node
    each row reached (chosen by size; forced here)."""
    cap = 1 << 62 if request.param == "batched" else 0
    monkeypatch.setattr(base, "BATCHED_MAX_ELEMENTS", {"cpu": cap, "cuda": cap})
    return request.param


@pytest.mark.parametrize("peaked", [False, True], ids=["random_q", "peaked_q"])
@pytest.mark.parametrize("case", LOSSLESS, ids=[_id(c) for c in LOSSLESS])
def test_lossless(case, peaked, walk_mode):
    name, mode, widths, sampling = case
    m = make_models(seed=11, peaked_q=peaked)
    counts = simulate(m, widths, mode, run_verifier(name, sampling), seed=5, sampling=sampling)
    p = pvalues(counts, exact_triples(m, sampling))
    assert min(p.values()) > ALPHA, f"{name}/{mode} deviates from the target: p-values {p}"


# ---------------------------------------------------------------- negative controls (must fail)
def _buggy(rule, sampling):
    """A verify callable running ``rule(step, sampling, generator)`` through the shared walk."""
    return lambda draft, logits, g: walk(draft, logits, lambda step: rule(step, sampling, g))


def _resample_from_p_on_reject(step: NodeStep, sampling, g):
    """Chain SpS with the classic bug: after a rejection resample from p instead of (p - q)+."""
    p = target_probs(step.logits, sampling)
    tok = step.child_tokens[:, :1]
    ratio = (p.gather(1, tok) / step.q.gather(1, tok))[:, 0]
    accept = step.child_valid[:, 0] & (torch.rand(ratio.shape[0], generator=g) < ratio)
    return torch.where(accept, 0, -1), sample_from(p, g)


def _mss_unnormalised_residual(step: NodeStep, sampling, g):
    """MSS that forgets to renormalise R after a rejection before testing the next sibling."""
    R, Q = target_probs(step.logits, sampling), step.q
    slot = torch.full((R.shape[0],), -1)
    for j in range(step.child_tokens.shape[1]):
        live = step.child_valid[:, j] & (slot < 0)
        tok = step.child_tokens[:, j : j + 1]
        u = torch.rand(R.shape[0], generator=g)
        accept = live & (u * Q.gather(1, tok)[:, 0] < R.gather(1, tok)[:, 0])
        slot = torch.where(accept, j, slot)
        R = torch.where((live & ~accept)[:, None], (R - Q).clamp_min(0), R)
    return slot, sample_from(R, g)


def _asps_without_reweighting(draft, logits, g):
    """ASpS on a two-token chain with its coupling broken: the second level does not re-weight
    the first level's rejection outcomes (SpS keeps them, ASpS scales them by r(a) / q(a))."""
    p, q, x = target_probs(logits, T1).double(), draft.q.double(), draft.tree.tokens
    N = x.shape[0]
    PN = torch.zeros(N, 3, V, dtype=torch.float64)
    PNs = torch.ones(N, dtype=torch.float64)
    for j in range(2):
        a = x[:, j + 1 : j + 2]
        if j:
            PN[:, 0].scatter_(1, x[:, 1:2], 0.0)
        m, qa = PNs[:, None] * p[:, j], q[:, j].gather(1, a)[:, 0]
        C1 = (q[:, j] - m).clamp_min(0)
        w = C1.gather(1, a)[:, 0] / C1.sum(-1).clamp_min(1e-300) / qa
        PN[:, j] = w[:, None] * (m - q[:, j]).clamp_min(0)
        PN[:, j].scatter_(1, a, (m.gather(1, a) / qa[:, None]).clamp_max(1.0))
        PNs = PN[:, j].gather(1, a)[:, 0]
    PN[:, 1].scatter_(1, x[:, 2:3], 0.0)
    PN[:, 2] = PNs[:, None] * p[:, 2]
    cell = sample_from(PN.flatten(1), g)
    acc = cell // V
    path = torch.where(torch.arange(3)[None] <= acc[:, None], torch.arange(3)[None], -1)
    return Verdict(path=path, num_accepted=acc, next_token=cell % V)


T1 = SamplingConfig(1.0)
NEGATIVE = {
    # children drawn without replacement, verified with the with-replacement (iid) update
    "mss_iid_rule_on_without_replacement_children":
        dict(mode="without_replacement", label="iid", widths=(3, 2),
             verify=run_verifier("mss", T1)),
    # deterministic top-k children passed off as i.i.d. samples to MSS
    "mss_on_deterministic_topk_children":
        dict(mode="deterministic", label="iid", widths=(2, 2), verify=run_verifier("mss", T1)),
    "sps_resample_from_p_on_reject":
        dict(mode="chain", label="chain", widths=(1, 1),
             verify=_buggy(_resample_from_p_on_reject, T1)),
    "mss_unnormalised_residual":
        dict(mode="iid", label="iid", widths=(3, 2), verify=_buggy(_mss_unnormalised_residual, T1)),
    "asps_without_reweighting":
        dict(mode="chain", label="chain", widths=(1, 1), verify=_asps_without_reweighting),
    # the verifier re-applies a temperature to q (what a verifier that "re-transforms q" does)
    "mss_with_retransformed_q":
        dict(mode="iid", label="iid", widths=(3, 2), verify=run_verifier("mss", T1),
             q_seen=lambda q: target_probs(q.log(), SamplingConfig(0.7))),
}


def test_without_replacement_rule_skips_copies_of_rejected_siblings():
    """A child q gives probability 0 is skipped (R and q unchanged): what makes a dynamic
    drafter's padding (copies of a sibling) inert. It also makes i.i.d. children lossless under
    the without-replacement rule: their distinct tokens, in order, are a sequential sample
    without replacement, and each repeat is a copy of a rejected sibling."""
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, (3, 2), "iid", run_verifier("mss", T1), seed=5, sampling=T1,
                      label_mode="without_replacement")
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) > ALPHA, p


@pytest.mark.parametrize("bug", list(NEGATIVE))
def test_negative_control_is_detected(bug, walk_mode):
    c = NEGATIVE[bug]
    m = make_models(seed=11, peaked_q=True)
    counts = simulate(m, c["widths"], c["mode"], c["verify"], seed=5, sampling=T1,
                      label_mode=c["label"], q_seen=c.get("q_seen"))
    p = pvalues(counts, exact_triples(m, T1))
    assert min(p.values()) < ALPHA, f"{bug} was not detected: p-values {p}"


# ------------------------------------------------------------------------- greedy equivalence
def greedy_oracle(tree: TokenTree, logits: torch.Tensor):
    """Greedy tree verification written from its definition, one row at a time on the host: from
    the root, move to the first child (draft order) carrying the target's argmax; where none does,
    emit the argmax. Returns (paths as lists of node indices, next tokens)."""
    paths, nxt = [], []
    for r in range(tree.batch_size):
        parents, tokens = tree.parents[r].tolist(), tree.tokens[r].tolist()
        node, path = 0, [0]
        while True:
            y = int(logits[r, node].argmax())
            child = next((c for c in range(tree.num_nodes) if parents[c] == node and tokens[c] == y), None)
            if child is None:
                break
            node = child
            path.append(node)
        paths.append(path)
        nxt.append(y)
    return paths, nxt


def _greedy_verdicts(name, mode, sampling, verify=None):
    """Verdict of ``name`` on 2000 simulated greedy steps, with the oracle's answer."""
    m = make_models(seed=1)  # the deterministic (top-k of q) tree holds the greedy path here
    seen = {}

    def capture(draft, logits, g):
        seen["oracle"] = greedy_oracle(draft.tree, logits)
        run = verify or run_verifier(name, sampling)
        seen["verdict"] = run(draft, logits, g)
        return seen["verdict"]

    simulate(m, (3, 2), mode, capture, seed=1, sampling=sampling, trials=2000)
    return seen["verdict"], seen["oracle"]


def _matches(verdict, oracle) -> bool:
    paths, nxt = oracle
    got = [[int(i) for i in row if i >= 0] for row in verdict.path]
    return (got == paths and verdict.next_token.tolist() == nxt
            and verdict.num_accepted.tolist() == [len(p) - 1 for p in paths])


@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(1.0, top_k=1)],
                         ids=["T0", "T1-top_k1"])
@pytest.mark.parametrize("name,mode", [("greedy", "iid"), ("mss", "iid"),
                                       ("mss", "without_replacement"), ("naive", "deterministic"),
                                       ("naive", "iid"), ("mss", "deterministic")])
def test_temperature_zero_is_greedy(name, mode, sampling):
    """Every verifier under a greedy config equals the greedy oracle above, trial for trial."""
    verdict, oracle = _greedy_verdicts(name, mode, sampling)
    accepted = {len(p) - 1 for p in oracle[0]}
    # full paths are accepted; sampled trees (different per trial) also see rejections at the root
    assert accepted == ({2} if mode == "deterministic" else {0, 1, 2})
    assert _matches(verdict, oracle)


def test_greedy_oracle_catches_a_wrong_rule():
    """Accepting the *last* sibling that carries the argmax (iid children repeat tokens) differs
    from greedy decoding's draft order: the comparison above must see it."""
    def last_match(step: NodeStep):
        y = step.logits.argmax(-1)
        hit = (step.child_tokens == y[:, None]) & step.child_valid
        c = hit.shape[1]
        last = c - 1 - hit.flip(1).int().argmax(1)
        return torch.where(hit.any(1), last, -1), y

    verdict, oracle = _greedy_verdicts("greedy", "iid", SamplingConfig(0.0),
                                       verify=lambda d, lg, g: walk(d, lg, last_match))
    assert not _matches(verdict, oracle)


@pytest.mark.parametrize("name,mode", [("mss", "iid"), ("mss", "without_replacement"),
                                       ("naive", "iid")])
def test_near_zero_temperature_sampling_path_matches_greedy(name, mode):
    """At T = 1e-3 p is one-hot in fp32, so the *sampling* code path must agree with greedy."""
    m = make_models(seed=4)
    out = {}

    def both(draft, logits, g):
        out["greedy"] = get_verifier("greedy").verify(draft, logits, SamplingConfig(0.0))
        return get_verifier(name).verify(draft, logits, SamplingConfig(1e-3), generator=g)

    simulate(m, (3, 2), mode, lambda d, lg, g: out.setdefault("other", both(d, lg, g)), seed=2,
             sampling=SamplingConfig(1e-3), trials=2000)
    assert torch.equal(out["other"].path, out["greedy"].path)
    assert torch.equal(out["other"].next_token, out["greedy"].next_token)


@pytest.mark.parametrize("mode,widths,rule", [("chain", (1, 1), "asps"), ("iid", (1, 1), "mss"),
                                              ("without_replacement", (3, 2), "mss")])
def test_mss_asps_dispatches_on_the_draft_mode(mode, widths, rule):
    """mss+asps gives exactly the verdicts of asps on chain-mode drafts and of mss on every other
    draft (a chain-shaped draft of another mode included), draw for draw."""
    m, sampling = make_models(seed=3, peaked_q=True), SamplingConfig(1.0)
    both = simulate(m, widths, mode, run_verifier("mss+asps", sampling), seed=9, sampling=sampling,
                    trials=4000)
    alone = simulate(m, widths, mode, run_verifier(rule, sampling), seed=9, sampling=sampling,
                     trials=4000)
    assert torch.equal(both, alone)


# ---------------------------------------------------------------- root-only trees
ROOT_ONLY = [("naive", "deterministic", SamplingConfig(1.0)), ("naive", "iid", SamplingConfig(0.8, top_p=0.9)),
             ("mss", "iid", SamplingConfig(0.7, top_k=3)), ("mss", "without_replacement", T1),
             ("sps", "chain", T1), ("asps", "chain", SamplingConfig(0.6)), ("mss+asps", "chain", T1),
             ("traversal", "iid", T1), ("block", "chain", SamplingConfig(0.8, top_k=3))]


def _root_only_pvalue(verify, mode: str, sampling: SamplingConfig) -> float:
    """A step that drafted nothing, TRIALS times (one batch row each): the emitted token's
    frequencies against the target's distribution at the root (chi-square p-value); every
    verdict must accept nothing."""
    g = torch.Generator().manual_seed(8)
    logits = make_models(seed=6).L1.expand(TRIALS, 1, V)
    q = None if mode == "deterministic" else _dist(g).expand(TRIALS, 1, V)
    tree = TokenTree(torch.randint(0, V, (TRIALS, 1), generator=g), [-1])
    verdict = verify(Draft(tree, q, mode), logits, g)
    assert verdict.path.shape == (TRIALS, 1) and not verdict.path.any() and not verdict.num_accepted.any()
    p = target_probs(logits[:1, 0], sampling)[0].double()
    counts = torch.bincount(verdict.next_token, minlength=V).double()
    if counts[p == 0].sum() > 0:
        return 0.0
    return float(chisquare(counts[p > 0].numpy(), (p[p > 0] / p.sum() * TRIALS).numpy()).pvalue)


@pytest.mark.parametrize("name,mode,sampling", ROOT_ONLY, ids=[f"{n}-{m}" for n, m, _ in ROOT_ONLY])
def test_root_only_tree_emits_a_target_sample(name, mode, sampling):
    """What every step that drafts nothing (``auto``'s ``off``, ``ar-tree``) verifies: a tree of
    its root alone, whose token must be a sample of the target's distribution."""
    assert _root_only_pvalue(run_verifier(name, sampling), mode, sampling) > ALPHA


def test_root_only_control_is_detected():
    """The same check on a rule that samples the root at T = 1 whatever the request's
    temperature (through the shared walk's root-only path): it must fail."""
    sampling = SamplingConfig(0.6)

    def untempered(step, s, g):
        return torch.full((step.logits.shape[0],), -1), sample_from(target_probs(step.logits, T1), g)

    assert _root_only_pvalue(_buggy(untempered, sampling), "iid", sampling) < ALPHA
