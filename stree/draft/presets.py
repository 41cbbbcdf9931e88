"""Named drafter presets and the drafter spec strings of the API and CLI (all but ``"auto"``, which
:mod:`stree.draft.parse` adds on top: ``auto`` parses its candidates here).

Spec strings: ``"chain:K"``, ``"static:NAME"`` (NAME in :data:`STATIC_TREES`), ``"static:w1,w2,..."``
(layer widths), ``"caterpillar:c1,c2,..."`` (a chain whose node at depth d has c_d children, the
first continuing the chain and the others leaves: the draft runs one node per level, as for a
chain; :func:`stree.tree.parents_caterpillar`), any static form with a ``":MODE"`` suffix
(``"static:fig4a:iid"``),
``"beam:NxM"`` (N steps, M beams), or a bare static name (``"fig4a"``, ``"A"``). Dynamic trees
(a shape per step and row, see ``dyspec.py`` and ``dynatree.py``): ``"dyspec:N[:D[:VT]]"`` (and
``"dyspec-paper:..."``, without the online calibration),
``"dyspec-threshold:T[:N[:D]]"``, ``"dynatree:DxB:N[:TAU]"``, ``"dynatree2[:N]"``; ``"auto"``
picks among chains, static presets and DySpec budgets by predicted tokens/s (``auto.py``).
Trees with no draft model (``suffix.py``): ``"suffix:N"`` (at most N drafted nodes) with optional
``":key=value,..."`` options of :class:`~stree.draft.suffix_index.SpeculationConfig` (``depth``,
``min_prob``, ``factor``, ``offset``), e.g. ``"suffix:16:min_prob=0.2,factor=2"``; a draft model's
tree merged with one (``merged.py``): ``"caterpillar:2,2,2+suffix:16"``, and with
``":solo=S"`` among the suffix tree's options the suffix trees alone where they all score at
least ``S`` expected tokens (``"caterpillar:2,2,2+suffix:16:solo=3"``: no draft model that step).

The paper gives the static trees only as images (Fig. 4a, appendix Fig. 5) and Table 3's numbers
(max width, depth below the root, tokens with the root). The shapes chosen here match those numbers
and are stored as layer widths, nodes of a layer hanging round-robin from the layer above
(:func:`stree.tree.parents_from_widths`), so the true figures can replace them by one line each:

=======  ============  =====  =====  ====================================================
name     widths        depth  nodes  shape
=======  ============  =====  =====  ====================================================
fig4a    3,3,3,3       4      13     root's top-3 children, each continued as a chain (Fig. 4a
                                     caption: 4 steps, 3 tokens per layer; same tree as A)
A        3,3,3,3       4      13     = fig4a
B        4,8,16        3      29     4 children of the root, then 2 below every node
C        3,6,6         3      16     3 children of the root, 2 below each, then chains
D        4,4,2,2       4      13     4 children of the root, the first 2 continue to depth 4
E        3,3,3,3,3     5      16     A one layer deeper (three chains of 5)
=======  ============  =====  =====  ====================================================
"""
from __future__ import annotations

import re

from stree.draft.base import Drafter
from stree.draft.beam import BeamTreeDrafter
from stree.draft.calibration import AcceptanceCalibration
from stree.draft.chain import ChainDrafter
from stree.draft.dynatree import DynaTree2Drafter, DynaTreeDrafter
from stree.draft.dyspec import DySpecDrafter
from stree.draft.merged import MergedDrafter
from stree.draft.static import StaticTreeDrafter
from stree.draft.suffix import ContextIndex, SuffixDrafter
from stree.draft.suffix_index import SpeculationConfig, SuffixCache
from stree.tree import parents_caterpillar

STATIC_TREES: dict[str, tuple[int, ...]] = {
    "fig4a": (3, 3, 3, 3),
    "A": (3, 3, 3, 3),
    "B": (4, 8, 16),
    "C": (3, 6, 6),
    "D": (4, 4, 2, 2),
    "E": (3, 3, 3, 3, 3),
}

_MODES = ("deterministic", "iid", "without_replacement")
_HELP = ("expected 'chain:K', 'static:NAME', 'static:W1,W2,...' or 'caterpillar:C1,C2,...' "
         "(optionally ':MODE'), 'suffix:N[:key=value,...]', 'MODEL_TREE+suffix:N', "
         "'beam:NxM', 'dyspec[-paper]:N[:D[:VT]]', 'dyspec-threshold:T[:N[:D]]', 'dynatree:DxB:N[:TAU]', "
         f"'dynatree2[:N]', 'auto', or a bare static name; NAME in {sorted(STATIC_TREES)}, "
         f"MODE in {list(_MODES)}")
_NUM = r"(\d+(?:\.\d*)?(?:e-?\d+)?)"
_SUFFIX_OPTIONS = {"depth": int, "min_prob": float, "factor": float, "offset": float}
_SUFFIX_HELP = ("expected 'suffix:N' (N >= 1 drafted nodes) or 'suffix:N:key=value,...' with keys "
                f"{sorted(_SUFFIX_OPTIONS)}")


def parse_tree(spec: str, *, suffix_cache: SuffixCache | None = None,
               index: ContextIndex | None = None) -> Drafter:
    """The drafter of a spec string other than ``"auto"`` (see the module docstring; ``"auto"``,
    which picks among these, is :func:`stree.draft.parse.parse_drafter`'s). ``suffix_cache``: the
    earlier outputs its suffix trees also read; ``index``: the per-request suffix index to share
    (one is made per call otherwise, shared by every suffix tree the spec holds)."""
    index = index or ContextIndex(suffix_cache)
    if "+" in spec:
        return _merged(spec, index)
    kind, _, rest = spec.strip().partition(":")
    if kind == "suffix":
        return SuffixDrafter(suffix_config(rest, spec), index, name=spec.strip())
    if not rest and kind in STATIC_TREES:
        kind, rest = "static", kind
    if kind == "chain" and re.fullmatch(r"\d+", rest):
        return ChainDrafter(int(rest))
    if kind == "beam" and (m := re.fullmatch(r"(\d+)x(\d+)", rest)):
        return BeamTreeDrafter(int(m[1]), int(m[2]))
    if kind in ("dyspec", "dyspec-paper") and (
            m := re.fullmatch(r"(\d+)(?::(\d+)(?::" + _NUM + ")?)?", rest)):
        return DySpecDrafter(int(m[1]), int(m[2] or 10), value_temperature=float(m[3] or 0.6),
                             calibration=AcceptanceCalibration() if kind == "dyspec" else None)
    if kind == "dyspec-threshold" and (m := re.fullmatch(_NUM + r"(?::(\d+))?(?::(\d+))?", rest)):
        return DySpecDrafter(int(m[2] or 32), int(m[3] or 10), threshold=float(m[1]))
    if kind == "dynatree" and (m := re.fullmatch(r"(\d+)x(\d+):(\d+)(?::" + _NUM + ")?", rest)):
        return DynaTreeDrafter(int(m[3]), int(m[1]), branch=int(m[2]),
                               tau=float(m[4]) if m[4] else 0.05)
    if kind == "dynatree2" and (m := re.fullmatch(r"(\d*)", rest)):
        return DynaTree2Drafter(int(m[1] or 32))
    if kind in ("static", "caterpillar") and rest:
        shape, _, mode = rest.partition(":")
        if mode and mode not in _MODES:
            raise ValueError(f"unknown draft mode {mode!r} in drafter spec {spec!r}; {_HELP}")
        if kind == "caterpillar":
            if not re.fullmatch(r"\d+(,\d+)*", shape):
                raise ValueError(f"bad caterpillar {shape!r} in drafter spec {spec!r}; {_HELP}")
            return StaticTreeDrafter(tuple(parents_caterpillar([int(c) for c in shape.split(",")])),
                                     mode=mode or None, name=f"caterpillar:{shape}")
        if shape in STATIC_TREES:
            widths = STATIC_TREES[shape]
        elif re.fullmatch(r"\d+(,\d+)*", shape):
            widths = tuple(int(w) for w in shape.split(","))
        else:
            raise ValueError(f"unknown static tree {shape!r} in drafter spec {spec!r}; {_HELP}")
        return StaticTreeDrafter.from_widths(widths, mode=mode or None, name=f"static:{shape}")
    raise ValueError(f"unknown drafter spec {spec!r}; {_HELP}")


def suffix_config(rest: str, spec: str) -> SpeculationConfig:
    """The :class:`SpeculationConfig` of ``"suffix:" + rest``; ValueError naming the problem."""
    size, _, options = rest.partition(":")
    if not re.fullmatch(r"\d+", size) or int(size) < 1:
        raise ValueError(f"bad tree size {size!r} in drafter spec {spec!r}; {_SUFFIX_HELP}")
    values: dict = {"nodes": int(size), "depth": int(size)}
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key not in _SUFFIX_OPTIONS or not eq:
            raise ValueError(f"unknown suffix option {item!r} in drafter spec {spec!r}; {_SUFFIX_HELP}")
        try:
            values[key] = _SUFFIX_OPTIONS[key](value)
        except ValueError:
            raise ValueError(f"suffix option {key} needs a number, got {value!r} in {spec!r}") from None
    try:
        return SpeculationConfig(**values)
    except ValueError as err:
        raise ValueError(f"{err} (drafter spec {spec!r})") from None


def _merged(spec: str, index: ContextIndex) -> Drafter:
    parts = [p.strip() for p in spec.split("+")]
    suffixes = [p for p in parts if p.startswith("suffix:")]
    models = [p for p in parts if not p.startswith("suffix:")]
    if len(parts) != 2 or len(suffixes) != 1 or models[0] == "auto":
        raise ValueError(f"a merged drafter is one draft model's tree and one suffix tree, as in "
                         f"'caterpillar:2,2,2+suffix:16'; got {spec!r}")
    # ``solo=S`` among the suffix tree's options is the merge's (MergedDrafter.solo), not the tree's
    head, _, options = suffixes[0].partition(":")
    size, _, options = options.partition(":")
    kept, solo = [], None
    for item in filter(None, options.split(",")):
        key, eq, value = item.partition("=")
        if key != "solo":
            kept.append(item)
            continue
        try:
            solo = float(value)
        except ValueError:
            raise ValueError(f"solo needs a number, got {value!r} in {spec!r}") from None
    suffix_spec = f"{head}:{size}" + (":" + ",".join(kept) if kept else "")
    base = parse_tree(models[0])
    suffix = parse_tree(suffix_spec, index=index)
    try:
        return MergedDrafter(base, suffix, name=f"{models[0]}+{suffixes[0]}", solo=solo)
    except ValueError as err:
        raise ValueError(f"{err} (drafter spec {spec!r})") from None
