#!/usr/bin/env python3
"""`kvcli` with another probe between the bounded form's streamed chunks than its own
(reselect_bounded.ChunkedStore.question_probe: what the question prefills after the chunks, a conversation's last
answer included, up to 256 tokens, the policy's window at least). `--probe last`: the prompt's last
chunked.probe_length tokens (32 for a window of 32 and a 1,024-token chunk), kvcli's until 2026-12-07 02:00 UTC;
`--probe turn`: the last question from the start of its turn (after the end-of-turn token that closes the answer
before it), the window at least, tried on 2026-12-07 and not kept. Everything else is kvcli's; the arguments after
--probe are `kvcli`'s:

    python benchmarks/ask_last_probe.py --probe last eval corpus ask --model qwen2.5-coder-0.5b --corpus corpus/ \
        --split heldout --min-doc-tokens 28000 --mode bounded --forms index,all --policies snapkv --budgets 1024 \
        --stores /tmp/kept --json-out last-probe.json

docs/results/real-text.md, "The bounded form's probe" and "A conversation's probe", compares them (the latter with
benchmarks/book.py's `last` and `turn` modes, in kvcli chat).
"""
from __future__ import annotations

import sys

from bench_common import ROOT

sys.path.insert(0, str(ROOT))

from kvcli.cli import main  # noqa: E402
from kvcli.drivers import block_index, reselect_bounded  # noqa: E402
from kvcli.drivers.chunked import question_probe  # noqa: E402

PROBES = ("last", "turn")
_reselecting = {}   # the store and session of the re-selection under way (the probe is a static method)


def last_tokens_probe(prompt: list[int], base: int, window: int) -> list[int]:
    return question_probe(prompt, window, _reselecting["store"].chunk)


def turn_probe(prompt: list[int], base: int, window: int) -> list[int]:
    store, session = _reselecting["store"], _reselecting["session"]
    n = len(prompt)
    ends = [i for i in range(store.split, n) if session.is_eog(prompt[i])]
    start = max(ends[-2] + 1 if len(ends) >= 2 else store.split, base, n - block_index.QUESTION_TOKENS)
    return list(prompt[-max(n - start, window):])


def use_probe(name: str) -> None:
    """Make ChunkedStore probe by PROBES' `name`."""
    store_class = reselect_bounded.ChunkedStore
    reselect = store_class.reselect

    def reselect_noting(self, session, prompt, cfg, **kw):
        _reselecting.update(store=self, session=session)
        return reselect(self, session, prompt, cfg, **kw)

    store_class.reselect = reselect_noting
    store_class.question_probe = staticmethod(last_tokens_probe if name == "last" else turn_probe)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--probe" or args[1] not in PROBES:
        sys.exit(f"usage: ask_last_probe.py --probe {{{','.join(PROBES)}}} KVCLI-ARGUMENTS...")
    use_probe(args[1])
    sys.argv = [sys.argv[0], *args[2:]]
    sys.exit(main())
