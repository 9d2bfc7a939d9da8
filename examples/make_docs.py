#!/usr/bin/env python3
"""Generate long example documents: a station logbook with facts planted at known depths.

    python examples/make_docs.py --words 3000 -o examples/station-log-4k.txt
    python examples/make_docs.py --tokens 100000 --facts 10 -o /tmp/book-100k.txt --facts-json /tmp/facts.json

The generator is kvcli.evaluation.logbook (kvcli eval niah uses the same); --facts-json records the
planted facts (depth, sentence, question, answer) for retrieval tests. About 1.38 SmolLM2 tokens per word.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvcli.evaluation.logbook import make_document

TOKENS_PER_WORD = 1.376   # SmolLM2's tokenizer on this logbook text (105,957 tokens for 77,000 words)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=None,
                    help="about this many SmolLM2 tokens instead of --words (1.376 tokens per word, measured)")
    ap.add_argument("--facts", type=int, default=0, help="facts planted at evenly spaced depths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--facts-json", default=None)
    a = ap.parse_args()
    words = round(a.tokens / TOKENS_PER_WORD) if a.tokens else a.words
    text, planted = make_document(words, a.facts, a.seed)
    Path(a.out).write_text(text)
    if a.facts_json:
        Path(a.facts_json).write_text(json.dumps(planted, indent=2))


if __name__ == "__main__":
    main()
