#!/usr/bin/env python3
"""`kvcli` with the bounded form's probe as it was before: `--probe last` (until 2026-12-07 02:00 UTC) the prompt's
last chunked.probe_length tokens (32 for a window of 32 and a 1,024-token chunk); `--probe rest` (ff157da-0720465)
what the question prefills after the streamed chunks, a conversation's last answer included, its last 256 tokens
at most and the policy's window at least. kvcli's own (reselect_bounded.ChunkedStore.question_probe) is the question
from the start of its turn. Everything else is kvcli's; the arguments after --probe are `kvcli`'s:

    python benchmarks/ask_last_probe.py --probe last eval corpus ask --model qwen2.5-coder-0.5b --corpus corpus/ \
        --split heldout --min-doc-tokens 28000 --mode bounded --forms index,all --policies snapkv --budgets 1024 \
        --stores /tmp/kept --json-out last-probe.json

docs/results/real-text.md, "The bounded form's probe", compares them on the same kept reads; benchmarks/book.py's
`last` and `rest` modes in a kvcli chat conversation.
"""
from __future__ import annotations

import sys

from bench_common import ROOT

sys.path.insert(0, str(ROOT))

from kvcli.cli import main  # noqa: E402
from kvcli.drivers import block_index, reselect_bounded  # noqa: E402
from kvcli.drivers.chunked import question_probe  # noqa: E402

PROBES = ("last", "rest")


def last_tokens_probe(store, prompt: list[int], base: int, window: int, is_eog) -> list[int]:
    return question_probe(prompt, window, store.chunk)


def rest_probe(store, prompt: list[int], base: int, window: int, is_eog) -> list[int]:
    return list(prompt[-max(min(len(prompt) - base, block_index.QUESTION_TOKENS), window):])


def use_probe(name: str) -> None:
    """Make ChunkedStore probe as it did before (PROBES)."""
    reselect_bounded.ChunkedStore.question_probe = last_tokens_probe if name == "last" else rest_probe


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--probe" or args[1] not in PROBES:
        sys.exit(f"usage: ask_last_probe.py --probe {{{','.join(PROBES)}}} KVCLI-ARGUMENTS...")
    use_probe(args[1])
    sys.argv = [sys.argv[0], *args[2:]]
    sys.exit(main())
