#!/usr/bin/env python3
"""The benchmark documents: station logbooks of about 4k and 8k SmolLM2 tokens (kvcli/evaluation/logbook.py,
fixed seeds), so every figure in docs/results.md can be reproduced byte for byte.

    python benchmarks/make_docs.py OUT_DIR
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# words -> tokens: about 1.3 SmolLM2 tokens per word; the bench reports the exact prompt length
DOCS = {"log-4k.txt": (3000, 1), "log-8k.txt": (5900, 2)}


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    from kvcli.evaluation import logbook as md  # noqa: PLC0415
    for name, (words, seed) in DOCS.items():
        text, _ = md.make_document(words, facts=4, seed=seed)
        (out / name).write_text(text)
        print(out / name)


if __name__ == "__main__":
    main()
