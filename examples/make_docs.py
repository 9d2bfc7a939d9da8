#!/usr/bin/env python3
"""Generate long example documents: a station logbook with facts planted at known depths.

    python examples/make_docs.py --words 3000 -o examples/station-log-4k.txt
    python examples/make_docs.py --words 77000 --facts 10 -o /tmp/book-100k.txt --facts-json /tmp/facts.json  # ~100k tokens

The generator is kvcli.evaluation.logbook (kvcli eval niah uses the same); --facts-json records the
planted facts (depth, sentence, question, answer) for retrieval tests. About 1.3 SmolLM2 tokens per word.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcli.evaluation.logbook import make_document


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--facts", type=int, default=0, help="facts planted at evenly spaced depths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--facts-json", default=None)
    a = ap.parse_args()
    text, planted = make_document(a.words, a.facts, a.seed)
    Path(a.out).write_text(text)
    if a.facts_json:
        Path(a.facts_json).write_text(json.dumps(planted, indent=2))


if __name__ == "__main__":
    main()
