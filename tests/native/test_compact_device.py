"""Compaction's device path (native/src/README.md, "CUDA"): the kept K/V rows moved by a get_rows / set_rows graph
on the backend holding the cache instead of through host memory. A GPU cache takes it by itself
(KVCLI_COMPACT=auto); KVCLI_COMPACT=device forces it on the CPU, so these tests run it in CI against the host
path: the compacted sequence's saved state (every kept cell's K/V bytes, the dead slots' zeros, positions, bias)
and the logits decoded after it are identical, for plans with per-layer and per-head counts (dead slots), merged
replacement rows and log-multiplicity bias, and for the re-indexing compactions of a chunked read."""
from __future__ import annotations

import numpy as np
import pytest
from npref import prompt_tokens

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError

N, BUDGET = 160, 48
STEPS = (42, 7, 1234)
# d2o writes merged replacement rows, spindlekv merged entries' log(m) bias (low thresholds make it merge on random
# weights), pyramidkv and dynamickv keep different numbers per layer / head (dead slots in the B cells)
POLICIES = {"snapkv": {}, "pyramidkv": {}, "dynamickv": {}, "d2o": {}, "spindlekv": {"theta_k": 0.2, "theta_v": 0.2}}


def _compacted(make, model, monkeypatch, path, policy, cache_type, plan=None, chunk=None):
    monkeypatch.setenv("KVCLI_COMPACT", path)
    s = make(model, flash_attn=True, cache_type=cache_type)
    planner = (lambda spec, params, budget, obs: plan) if plan is not None else None
    cfg = resolve(s.model_path, policy, BUDGET, POLICIES.get(policy, {}))
    rep = prefill_and_compress(s, prompt_tokens(N), cfg, planner=planner,
                               instruction="Where is the key?", chunk=chunk)
    assert s.compact_path_taken() == path
    state = s.save_seq(0).state
    logits = []
    for t in STEPS:
        s.step({0: t})
        logits.append(s.logits().copy())
    return rep.plan, state, np.array(logits)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_device_path_gives_the_host_paths_cache_byte_for_byte(session_factory, tiny_model, monkeypatch, policy,
                                                              cache_type):
    plan, host_state, host_logits = _compacted(session_factory, tiny_model, monkeypatch, "host", policy, cache_type)
    _, dev_state, dev_logits = _compacted(session_factory, tiny_model, monkeypatch, "device", policy, cache_type,
                                          plan=plan)
    if policy == "d2o":
        assert plan.replace_entry.size > 0
    if policy in ("pyramidkv", "dynamickv"):
        assert (plan.n_kept != plan.n_kept.max()).any()     # dead slots: zeroed by both paths
    assert dev_state == host_state
    assert np.array_equal(dev_logits, host_logits)


def test_device_path_in_a_chunked_read_with_reindexing(session_factory, tiny_model, monkeypatch):
    """Bounded reading compacts after every chunk and re-indexes positions (K re-rotated after the move)."""
    _, host_state, host_logits = _compacted(session_factory, tiny_model, monkeypatch, "host", "snapkv", "f16",
                                            chunk=64)
    _, dev_state, dev_logits = _compacted(session_factory, tiny_model, monkeypatch, "device", "snapkv", "f16",
                                          chunk=64)
    assert dev_state == host_state
    assert np.array_equal(dev_logits, host_logits)


def test_auto_moves_on_the_host_for_a_cpu_cache_and_on_the_device_for_a_gpu_cache(session_factory, tiny_model,
                                                                                   monkeypatch):
    monkeypatch.delenv("KVCLI_COMPACT", raising=False)
    s = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    assert s.compact_path_taken() is None
    prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, "snapkv", BUDGET, {}))
    # a library with a GPU puts every layer's cache there (llama.cpp's default, n_gpu_layers=-1)
    assert s.compact_path_taken() == ("device" if s.L.llama_supports_gpu_offload() else "host")


@pytest.mark.parametrize("flash_attn,cache_type,model,says", [
    (True, "q8_0", "tiny_model_64", "q8_0 cache"),
    (False, "f16", "tiny_model", "transposed V"),
])
def test_forced_device_path_refuses_what_it_cannot_move_before_anything_changes(session_factory, request, monkeypatch,
                                                                                flash_attn, cache_type, model, says):
    monkeypatch.setenv("KVCLI_COMPACT", "device")
    s = session_factory(request.getfixturevalue(model), flash_attn=flash_attn, cache_type=cache_type)
    with pytest.raises(KvcliError, match=f"KVCLI_COMPACT=device cannot move the rows of a {says}"):
        prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, "snapkv", BUDGET, {}))
    assert s.stats(0)["kv_cells"] == N       # the sequence was left as it was


def test_a_bad_kvcli_compact_is_refused(session_factory, tiny_model, monkeypatch):
    monkeypatch.setenv("KVCLI_COMPACT", "gpu")
    s = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    with pytest.raises(KvcliError, match="KVCLI_COMPACT must be auto, host or device"):
        prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, "snapkv", BUDGET, {}))
