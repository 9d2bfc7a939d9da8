"""The attention path of compacted layers (native/src/README.md, "CUDA"; issue #17): the split path
(flash attention with one problem per KV head, the path a GPU cache takes) forced on the CPU through
KVCLI_ATTN_PATH=split gives the logits of the mask path (the CPU default) for every policy, cache type
and flash-attention setting; the path each layer took is read back from the library, so a test cannot
pass by comparing a path with itself. Every comparison runs on 1 and 2 threads."""
from __future__ import annotations

import numpy as np
import pytest
from npref import prompt_tokens

from kvcli import policies
from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError

N, BUDGET, STEPS = 160, 48, 4
COMPRESSING = [p for p in policies.available() if p != "full"]  # full never compacts: no slot bias, stock graph
TOL = {"f32": 1e-5, "f16": 1e-3, "q8_0": 1e-3}
THREADS = (1, 2)
# policies whose layers keep different numbers of entries (ragged per-layer counts: the shorter layers'
# slots beyond their count are dead, -inf, in the mask)
RAGGED_LAYERS = ("pyramidkv", "dynamickv", "d2o")
# random weights give dissimilar keys: low codebook thresholds make spindlekv merge (log-multiplicity bias)
POLICY_ARGS = {"spindlekv": {"theta_k": 0.2, "theta_v": 0.2}}


def _compressed_decode(make, path, model, policy, flash_attn, cache_type, monkeypatch, n_threads=1):
    """Logits of STEPS decode steps after `policy` compressed an N-token prompt to BUDGET, through `path`."""
    monkeypatch.setenv("KVCLI_ATTN_PATH", path)
    s = make(model, flash_attn=flash_attn, cache_type=cache_type, n_threads=n_threads)
    rep = prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, policy, BUDGET, POLICY_ARGS.get(policy, {})),
                               instruction="Where is the key?")
    assert rep.plan is not None and s.stats()["kv_cells"] < N, f"{policy} did not compact the prompt"
    out = []
    for t in (42, 7, 1234, 99)[:STEPS]:
        s.step({0: t})
        out.append(s.logits().copy())
    return np.array(out), s.attn_paths_taken(), rep.plan


@pytest.mark.parametrize("n_threads", THREADS)
@pytest.mark.parametrize("policy", COMPRESSING)
@pytest.mark.parametrize("flash_attn,cache_type", [(True, "f32"), (True, "f16"), (False, "f32"), (False, "f16")])
def test_forced_split_path_gives_the_mask_path_logits(session_factory, tiny_model, monkeypatch, policy, flash_attn,
                                                      cache_type, n_threads):
    mask, taken_mask, plan = _compressed_decode(session_factory, "mask", tiny_model, policy, flash_attn, cache_type,
                                                monkeypatch, n_threads)
    split, taken_split, _ = _compressed_decode(session_factory, "split", tiny_model, policy, flash_attn, cache_type,
                                               monkeypatch, n_threads)
    n_layer = len(taken_mask)
    assert taken_mask == ["mask"] * n_layer
    # without flash attention the mask path (mul_mat + soft_max_ext) is the one every backend runs
    assert taken_split == ["split" if flash_attn else "mask"] * n_layer
    assert np.isfinite(mask).all()
    assert np.abs(split - mask).max() <= TOL[cache_type]
    if policy in RAGGED_LAYERS:  # per-layer counts: layers below the most kept carry dead (-inf) entries
        assert len(set(plan.n_kept.max(axis=1).tolist())) > 1, plan.n_kept
    if policy == "dynamickv":  # per-head counts
        assert any(not np.array_equal(plan.kept(il, 0), plan.kept(il, 1)) for il in range(plan.n_layer))  # per head
    if policy == "d2o":  # merged rows: replacement K/V rows written into the cache
        assert plan.replace_entry.size > 0
    if policy == "spindlekv":  # merged entries: a log-multiplicity bias that is neither 0 nor -inf
        assert plan.log_mult is not None and (np.isfinite(plan.log_mult) & (plan.log_mult > 0)).any()


@pytest.mark.parametrize("n_threads", THREADS)
def test_split_path_with_more_query_heads_per_kv_head_and_a_quantised_cache(session_factory, tmp_path, monkeypatch,
                                                                            n_threads):
    """Group of 4 query heads per KV head, head_dim 64, q8_0 K/V (flash attention reads them quantised)."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    model = write_tiny_llama(tmp_path / "g4.gguf", n_layer=2, n_head=8, n_head_kv=2, head_dim=64, seed=3)
    for cache_type in ("f16", "q8_0"):
        mask, _, _ = _compressed_decode(session_factory, "mask", model, "snapkv", True, cache_type, monkeypatch,
                                        n_threads)
        split, taken, _ = _compressed_decode(session_factory, "split", model, "snapkv", True, cache_type, monkeypatch,
                                             n_threads)
        assert taken == ["split", "split"]
        assert np.abs(split - mask).max() <= TOL[cache_type]


@pytest.mark.parametrize("n_threads", THREADS)
def test_split_path_for_a_many_token_ubatch_after_compaction(session_factory, tmp_path, monkeypatch, n_threads):
    """A compressed sequence read on by a 70-token ubatch (a chunked read's next chunk), a group of 3."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    model = write_tiny_llama(tmp_path / "g3.gguf", n_layer=2, n_head=6, n_head_kv=2, head_dim=64, seed=5)
    out = {}
    for path in ("mask", "split"):
        monkeypatch.setenv("KVCLI_ATTN_PATH", path)
        s = session_factory(model, flash_attn=True, cache_type="f16", n_ctx=512, n_threads=n_threads)
        prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, "snapkv", BUDGET, {}))
        s.prefill(prompt_tokens(70, seed=3))
        first = s.logits().copy()
        s.step({0: 5})
        out[path] = (first, s.logits().copy(), s.attn_paths_taken())
    assert out["split"][2] == ["split", "split"] and out["mask"][2] == ["mask", "mask"]
    for i in (0, 1):
        assert np.abs(out["split"][i] - out["mask"][i]).max() <= TOL["f16"]


def test_auto_takes_the_split_path_only_for_a_cache_off_the_cpu(session_factory, tiny_model, monkeypatch):
    import llama_cpp

    from kvcli.native.lib import attn_path
    monkeypatch.delenv("KVCLI_ATTN_PATH", raising=False)
    assert attn_path(True, cache_on_cpu=True)[0] == "mask"
    assert attn_path(True, cache_on_cpu=False)[0] == "split"   # the default of a GPU cache
    assert attn_path(False, cache_on_cpu=False)[0] == "mask"   # mul_mat + soft_max_ext: every backend
    s = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    expected = "mask" if not llama_cpp.llama_supports_gpu_offload() else "split"  # CPU-only library: mask
    assert s.attn_path[0] == expected
    assert s.attn_paths_taken() == [None] * s.info.n_layer     # no graph with a compacted sequence yet
    prefill_and_compress(s, prompt_tokens(N), resolve(s.model_path, "snapkv", BUDGET, {}))
    s.step({0: 42})
    assert s.attn_paths_taken() == [expected] * s.info.n_layer


def test_a_bad_setting_is_refused_before_any_model_loads(session_factory, tiny_model, monkeypatch):
    monkeypatch.setenv("KVCLI_ATTN_PATH", "gpu")
    with pytest.raises(KvcliError, match=r"KVCLI_ATTN_PATH must be auto, split or mask \(got KVCLI_ATTN_PATH='gpu'\)"):
        session_factory(tiny_model)


def test_info_says_which_path_compressed_layers_take(run_kvcli, tiny_model):
    import json
    r = run_kvcli("info", "--json", tiny_model)
    assert r.returncode == 0, r.stderr
    att = json.loads(r.stdout)["native"]["compressed_attention"]
    on_cpu = att["kv_cache_device"] == "CPU"   # CPU: the library has no GPU device (always so in CI)
    assert att["setting"] == "auto" and att["flash_attn"]["path"] == ("mask" if on_cpu else "split")
    assert ("KV cache on the CPU" if on_cpu else "KV cache on an accelerator") in att["flash_attn"]["why"]
    assert att["no_flash_attn"]["path"] == "mask"
    r = run_kvcli("info", tiny_model, env={"KVCLI_ATTN_PATH": "split"})
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("compressed attention"))
    assert "split with flash attention" in line and "KVCLI_ATTN_PATH=split" in line and line.endswith("mask without")
    r = run_kvcli("info", tiny_model, env={"KVCLI_ATTN_PATH": "fast"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kvcli: error: KVCLI_ATTN_PATH must be auto, split or mask (got KVCLI_ATTN_PATH='fast')"], r.stderr


def test_two_threads_over_512_cells_the_split_path_keeps_the_one_thread_arithmetic(session_factory, tiny_model,
                                                                                   monkeypatch):
    """A decoded token over n_kv >= 512 cells on 2 threads: ggml's CPU flash-attention kernel then splits the
    one query's KV range across the threads and merges the halves (use_split_kv_path, taken only when
    Q->ne[3] == 1: the mask path, never the split path, whose KV heads are Q's ne[3]). Its f16 V accumulator
    rounds differently over two halves than over one range, so the mask path's logits on 2 threads differ from
    its own 1-thread logits (llama.cpp's numerics, the same for the uncompressed cache: native/src/README.md
    "Numerics"). The split path must give the mask path's 1-thread arithmetic on any number of threads."""
    n, budget = 400, 300  # 300 kept cells + the decoded ones: n_kv = 512 (llama.cpp pads n_kv to 256)
    out = {}
    for path in ("mask", "split"):
        for n_threads in THREADS:
            monkeypatch.setenv("KVCLI_ATTN_PATH", path)
            s = session_factory(tiny_model, flash_attn=True, cache_type="f32", n_ctx=1024, n_threads=n_threads)
            prefill_and_compress(s, prompt_tokens(n), resolve(s.model_path, "snapkv", budget, {}))
            assert 256 < s.stats()["kv_cells"] <= budget
            logits = []
            for t in (42, 7, 1234, 99):
                s.step({0: t})
                logits.append(s.logits().copy())
            assert s.attn_paths_taken() == [path] * s.info.n_layer
            out[path, n_threads] = np.array(logits)
    assert np.abs(out["mask", 1] - out["split", 1]).max() <= TOL["f32"]
    assert np.abs(out["split", 2] - out["split", 1]).max() <= TOL["f32"]
    assert np.abs(out["split", 2] - out["mask", 1]).max() <= TOL["f32"]
