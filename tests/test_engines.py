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
