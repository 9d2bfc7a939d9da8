"""Issue #19: memory as a measured figure. The --json stats of run / compress / chat carry the process's peak
RSS and the KV buffer the context allocated; reading is bounded by default with a budget; a long-lived
session (chat, run --cache) keeps a KV buffer sized for what it holds, not for the document."""
from __future__ import annotations

import json

import pytest

from kvcli.planning.planner import resolve

N_LAYER, N_HEAD_KV, HEAD_DIM = 2, 2, 16
CELL_F16 = N_LAYER * N_HEAD_KV * HEAD_DIM * 2 * 2     # K + V bytes of one cell, f16
BIAS_CELL = N_LAYER * N_HEAD_KV * 4                   # kvcli's float32 slot bias, per cell
TURN_CELLS = 2048                                     # kvcli.drivers.chunked.TURN_ROOM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("mem") / "tiny.gguf", n_layer=N_LAYER, n_head=4,
                            n_head_kv=N_HEAD_KV, head_dim=HEAD_DIM, n_ctx_train=8192)


@pytest.fixture(scope="module")
def doc(word_doc):
    """About 3.5k tokens: longer than budget + the default chunk, so bounded reading turns on by itself."""
    return word_doc(3500, seed=1)


def _json(run_kvcli, *args):
    # the tiny model's cache is far below the default 64 MiB above which reading is bounded: bound it all
    r = run_kvcli(*[str(a) for a in args], "--json", env={"KVCLI_BOUNDED_ABOVE_MB": "0"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _pad(n: int) -> int:
    return -(-n // 256) * 256


def test_run_stats_measure_peak_rss_and_the_allocated_kv_buffer(run_kvcli, tiny, doc):
    full = _json(run_kvcli, "run", "--doc", doc, "--model", tiny, "--policy", "full", "-n", "4", "Why?")["stats"]
    n = full["prompt_tokens"]
    assert n > 64 + 1024
    # the buffer llama.cpp allocated for the whole prompt + the answer, read back from the backend buffers
    assert full["kv_cells_allocated"] >= n + 4
    assert full["kv_bytes_allocated"] == full["kv_cells_allocated"] * CELL_F16
    assert full["kv_bytes_live"] == full["kv_bytes"] == full["kv_cells"] * CELL_F16
    assert full["peak_rss_bytes"] > full["kv_bytes_allocated"]

    bounded = _json(run_kvcli, "run", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "64",
                    "-n", "4", "Why?")["stats"]
    assert bounded["chunks"] >= 3 and bounded["chunk"] == 1024        # bounded reading by default with a budget
    assert bounded["peak_kv_cells"] <= 64 + 1024
    # K/V buffer for budget + chunk + the answer, plus the slot bias allocated at the first compaction
    assert bounded["kv_cells_allocated"] == _pad(64 + 1024 + 4)
    assert bounded["kv_bytes_allocated"] == bounded["kv_cells_allocated"] * (CELL_F16 + BIAS_CELL)
    assert bounded["kv_bytes_allocated"] < full["kv_bytes_allocated"] / 2
    assert 0 < bounded["kv_bytes_live"] <= bounded["kv_bytes"]

    one_go = _json(run_kvcli, "run", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "64",
                   "--chunk", "0", "-n", "4", "Why?")["stats"]
    assert "chunks" not in one_go and one_go["peak_kv_cells"] == n    # --chunk 0: read in one go, as before
    assert one_go["kv_bytes_allocated"] > bounded["kv_bytes_allocated"] * 2
    assert one_go["kv_cells"] == bounded["kv_cells"] <= 64 + 4

    capped = _json(run_kvcli, "run", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "64",
                   "--max-cache", "512", "-n", "4", "Why?")["stats"]
    assert capped["kv_cells_allocated"] == 512 and capped["peak_kv_cells"] <= 512


def test_compress_and_run_cache_report_memory_and_load_into_a_small_context(run_kvcli, tiny, doc, tmp_path):
    kvc = tmp_path / "d.kvc"
    out = _json(run_kvcli, "compress", "--doc", doc, "--model", tiny, "--policy", "snapkv", "--budget", "64",
                "-o", kvc, "--question", "Why?")
    s = out["stats"]
    assert s["peak_rss_bytes"] > s["kv_bytes_allocated"] > 0
    # the conversation's context was fitted to the compressed prefix + the turn room after reading
    assert s["kv_cells_allocated"] == _pad(s["kv_cells"] + TURN_CELLS) < out["original_tokens"] + TURN_CELLS
    res = _json(run_kvcli, "run", "--cache", kvc, "-n", "4", "Why?")["stats"]
    assert res["kv_cells_allocated"] == _pad(s["kv_cells"] + TURN_CELLS)
    assert res["kv_bytes_allocated"] == res["kv_cells_allocated"] * (CELL_F16 + BIAS_CELL)
    assert res["peak_rss_bytes"] > 0 and 0 < res["kv_bytes_live"] <= res["kv_bytes"]


def test_chat_json_lines_carry_the_memory_figures(run_kvcli, tiny, doc):
    r = run_kvcli("chat", "--doc", str(doc), "--model", str(tiny), "--policy", "snapkv", "--budget", "64",
                  "-n", "3", "--json", "--compress-once", input="First?\nSecond?\n")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2
    for x in rows:
        assert x["peak_rss_bytes"] > x["kv_bytes_allocated"] > 0
        assert x["kv_cells_allocated"] == _pad(64 + TURN_CELLS)  # the agnostic prefix keeps the budget's cells


def test_a_fitted_conversation_answers_as_the_unfitted_one(tiny, doc, monkeypatch):
    """Shrinking the context after compression moves the sequence into a new buffer: the same cache, the same
    greedy answers, and /budget still re-reads the whole document (the context grows back for it)."""
    from kvcli.apps.chat import Conversation
    from kvcli.native.session import NativeSession
    text = doc.read_text()

    def answers(fit: bool):
        if not fit:
            monkeypatch.setattr(Conversation, "fit_context", lambda self: None)
        s = NativeSession(tiny, n_ctx=0)
        conv = Conversation(s, text, compression=resolve(s.model_path, "snapkv", 64), question="Why?", chunk=0)
        conv.compress()
        n_ctx = s.n_ctx
        got = [conv.ask("Why?", 6).tokens, conv.ask("And then?", 6).tokens]
        monkeypatch.undo()
        return s, conv, n_ctx, got

    s0, _, n_ctx0, unfitted = answers(fit=False)
    s0.close()
    s, conv, n_ctx, fitted = answers(fit=True)
    assert n_ctx0 == _pad(len(conv.prefix_tokens) + TURN_CELLS)
    assert n_ctx == _pad(conv.reset_mark[1] + TURN_CELLS) < n_ctx0
    assert fitted == unfitted
    conv.recompress(budget=48)
    assert conv.stats()["kv_cells"] <= 48 and s.n_ctx == _pad(conv.stats()["kv_cells"] + TURN_CELLS)
    assert conv.ask("Why?", 6).tokens
    s.close()


def test_resize_refuses_a_context_smaller_than_what_it_holds(tiny):
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny, n_ctx=512)
    s.prefill(list(range(10, 310)), seq=0)
    with pytest.raises(KvcliError, match="hold 300"):
        s.resize_context(256)
    assert s.n_ctx == 512 and s.measured_cells(0) == 300   # nothing was freed
    s.resize_context(1024)
    assert s.n_ctx == 1024 and s.measured_cells(0) == 300 and s.seq(0).next_pos == 300
    s.close()


def test_explain_reports_the_bytes_layer_budget_policies_occupy():
    """kvcli policies --explain: for the policies whose layers keep different counts, the measured layout record
    (benchmarks/layout.py) gives the bytes held (each layer as wide as its widest KV head: the ragged layout) next
    to the live entries', the budget's and the shared cells'; the uniform policies have no such note."""
    from kvcli import policies as P
    rec = json.loads(P.LAYOUT_RECORD.read_text())
    per_cell = rec["bytes_per_cell"]
    for r in rec["rows"]:
        assert r["cells_bytes"] == r["cells"] * per_cell and r["budget_bytes"] == r["budget"] * per_cell
        assert 0 < r["live_bytes"] <= r["cells_bytes"] and r["cells"] >= r["budget"] * 0.9
    for name in ("pyramidkv", "windowkv", "dynamickv", "compresskv", "d2o", "spindlekv"):
        text = P.explain_text(name)
        row = next(r for r in rec["rows"] if r["policy"] == name and r["budget"] == 256)
        assert row["live_bytes"] <= row["layer_ragged_bytes"] <= row["cells_bytes"]
        assert f"budget 256: {row['layer_ragged_bytes'] / 1e6:.2f} MB held" in text
        assert f"shared cells: {row['cells']} cells, {row['cells_bytes'] / 1e6:.2f} MB" in text
        assert "KVCLI_LAYOUT=ragged" in text
    for name in ("snapkv", "h2o", "streamingllm"):
        assert "KVCLI_LAYOUT=ragged" not in P.explain_text(name)
