"""kvcli/engines.py: how the layers above the engines open one and reach the native engine's capabilities."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli import engines
from kvcli.errors import KvcliError


class _Torch:
    engine = "reference"


@pytest.mark.parametrize("call", [
    lambda s: engines.seq_positions(s, 0),
    lambda s: engines.read_kv_layer(s, 0, 0, np.empty(0), np.empty(0)),
    lambda s: engines.kv_reader(s, 0, np.arange(3)),
    lambda s: engines.live_stats(s, 0),
    lambda s: engines.cache_state(s, 0),
    lambda s: engines.is_compressed(s, 0),
    lambda s: engines.set_header(s, 0, "snapkv", 64, 128),
    lambda s: engines.slot_origins(s, 0),
    lambda s: engines.token_pieces(s, [1, 2]),
    lambda s: engines.control_tokens(s, [1, 2]),
])
def test_a_native_capability_refuses_another_engine_in_one_line(call):
    with pytest.raises(KvcliError, match="^this needs the native engine's cache, not the reference engine's$"):
        call(_Torch())


def test_unknown_engine_and_planner_are_refused():
    with pytest.raises(KvcliError, match="unknown engine 'torch'"):
        engines.open_session("torch", "model.gguf")
    with pytest.raises(KvcliError, match="unknown planner 'torch'"):
        engines.planner("torch")
    assert engines.planner("native") is engines.native_plan


def test_what_another_engine_cannot_do_is_asked_by_name():
    """The drivers, apps and citations ask these, not the engine's name (tests/test_architecture.py)."""
    torch = _Torch()
    assert not engines.shares_cells(torch) and not engines.saves_state(torch) and not engines.cites(torch)
    snap = engines.SeqSnapshot(state=b"\x01\x02", next_pos=2, cells=2)
    assert engines.saved_state(snap) == b"\x01\x02"
    assert engines.saved_state(object()) is None   # the reference engine's snapshot: a copy of its torch cache


def test_the_native_engine_has_them(tiny_1k):
    with engines.open_native(tiny_1k, n_ctx=64) as s:
        assert engines.shares_cells(s) and engines.saves_state(s) and engines.cites(s)
        tokens = s.tokenize("hello world")
        s.prefill(tokens)
        assert engines.saved_state(s.save_seq(0))
        assert b"".join(engines.token_pieces(s, tokens)).decode() == s.detokenize(tokens)
        assert engines.control_tokens(s, tokens) == [False] * len(tokens)
        origins = engines.slot_origins(s, 0)
        assert len(origins) == s.info.n_layer and list(origins[0][0]) == list(range(len(tokens)))
