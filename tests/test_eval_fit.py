"""kvcli.evaluation.tasks._fit: sizing a generated prompt to a token target."""
from __future__ import annotations

import pytest

from kvcli.errors import KvcliError
from kvcli.evaluation.tasks import _fit


def stepped(step: int, overhead: int):
    """A generator that grows in whole entries of `step` words (one token each) plus a fixed overhead,
    like the logbook haystack: many sizes give the same text."""
    def build(n):
        entries = max(1, n // step)
        return "w " * (entries * step + overhead), {"entries": entries}
    return build, lambda p: len(p.split())


def test_fit_gets_under_a_target_the_secant_steps_stall_above():
    # 100-word entries + 50: sizes 1400..1499 all give 1450 words; the target 1448 sits just below
    # (the niah sample at 2048 tokens, depth 0.9, sample 0 on the default model stalled at 2050 like this)
    build, count = stepped(100, 50)
    prompt, t, meta = _fit(build, 1448, count, 1460)
    assert t <= 1448 and t == 1350 and meta["entries"] == 13


def test_fit_keeps_the_secant_result_when_it_fits():
    build, count = stepped(1, 10)
    _, t, _ = _fit(build, 500, count, 300)
    assert 492 <= t <= 500


def test_fit_fails_when_even_the_smallest_prompt_is_longer():
    build, count = stepped(1, 1000)
    with pytest.raises(KvcliError, match="even the smallest one is longer"):
        _fit(build, 100, count, 50)
