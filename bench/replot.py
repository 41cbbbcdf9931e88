"""Redraw the plots of saved ``bench/e2e.py`` results from their rows (the plots are derived data
and not committed): ``e2e_X.json`` -> ``e2e_X.png`` beside it (needs matplotlib).

    python bench/replot.py bench/results/e2e_humaneval_AMD_EPYC_20261124T093315.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import plot  # noqa: E402


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        png = path.with_suffix(".png")
        if not plot(json.loads(path.read_text(encoding="utf-8")), png):
            return 1
        print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
