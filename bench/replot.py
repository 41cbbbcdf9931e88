"""Redraw the plots of saved ``bench/e2e.py`` results from their rows (the plots are derived data
and not committed): ``e2e_X.json`` -> ``e2e_X.png`` beside it (needs matplotlib).

    python bench/replot.py bench/results/e2e_all-methods_humaneval_AMD_EPYC_20261124T093315.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import plot  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, metavar="FILE.json",
                    help="summary rows written by bench/e2e.py")
    for path in ap.parse_args(argv).paths:
        png = path.with_suffix(".png")
        if not plot(json.loads(path.read_text(encoding="utf-8")), png):
            return 1
        print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
