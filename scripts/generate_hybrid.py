#!/usr/bin/env python
"""Generate with a MambaInLlama hybrid target (and draft): ``stree generate --model-type hybrid``.

    python scripts/generate_hybrid.py --target DIR --draft DIR --prompt "..." [stree generate options]

Both directories must hold a MambaInLlama checkpoint (``config.json`` + ``mamba_config.json`` +
weights); see ``stree generate --help`` for the options.
"""
import sys

from stree.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", "--model-type", "hybrid", *sys.argv[1:]]))
