#!/usr/bin/env python3
"""`kvcli eval corpus ask` with the bounded form's probe as it was until 2026-12-07: the prompt's last
chunked.probe_length tokens (32 for a window of 32 and a 1,024-token chunk) instead of the whole question
(reselect_bounded.ChunkedStore.question_probe). Everything else is kvcli's; the arguments are `kvcli`'s:

    python benchmarks/ask_last_probe.py eval corpus ask --model qwen2.5-coder-0.5b --corpus corpus/ --split heldout \
        --min-doc-tokens 28000 --mode bounded --forms index,all --policies snapkv --budgets 1024 \
        --stores /tmp/kept --json-out last-probe.json

docs/results/real-text.md, "The bounded form's probe", compares the two on the same kept reads.
"""
from __future__ import annotations

import sys

from bench_common import ROOT

sys.path.insert(0, str(ROOT))

from kvcli.cli import main  # noqa: E402
from kvcli.drivers import reselect_bounded  # noqa: E402
from kvcli.drivers.chunked import question_probe  # noqa: E402


def last_tokens_probe(prompt: list[int], base: int, window: int) -> list[int]:
    return question_probe(prompt, window, reselect_bounded.ChunkedStore.chunk_for_probe)


def use_last_tokens_probe() -> None:
    """Make ChunkedStore probe by the prompt's last probe_length tokens, as before 2026-12-07."""
    store_class = reselect_bounded.ChunkedStore
    reselect = store_class.reselect

    def reselect_noting_chunk(self, session, prompt, cfg, **kw):
        store_class.chunk_for_probe = self.chunk
        return reselect(self, session, prompt, cfg, **kw)

    store_class.reselect = reselect_noting_chunk
    store_class.question_probe = staticmethod(last_tokens_probe)


if __name__ == "__main__":
    use_last_tokens_probe()
    sys.exit(main())
