"""phi3's LongRoPE in kvcli's sessions (Phi-3/3.5 with a 128k context).

llama.cpp picks the long or the short RoPE factors by the context's cells (more than the original context: long),
not by the positions; a compressed cache holds positions beyond its cells and kvcli resizes contexts and moves
sequences between them. So the sessions guard what llama.cpp does not: a position the short factors do not cover
is refused in one line (both engines), a resize keeps the factors the cached K rows were rotated with, a sequence
does not load into a context with the other factors, a .kvc file records them, and kvcli batch reads each document
with its shared cache's factors."""
from __future__ import annotations

import json

import pytest

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError
from kvcli.native.session import NativeSession
from kvcli.testing.tiny_gguf import write_tiny

FACTORS = {"rope_factors_long": [1.0, 1.5, 2, 4, 8, 8, 8, 8], "rope_factors_short": [1.0, 1, 1.2, 1.5, 2, 2, 2, 2]}
TEXT = "The station log records the weather, the instruments and the crew every day. " * 120


def _phi3(path, orig: int):
    return write_tiny(path, "phi3", n_ctx_train=8192, rope_tensors=FACTORS,
                      rope_scaling={"original_context_length": orig, "attn_factor": 1.2})


@pytest.fixture(scope="module")
def phi3_256(tmp_path_factory):
    return _phi3(tmp_path_factory.mktemp("longrope") / "phi3-256.gguf", 256)


def _compressed(session, n_tokens: int):
    tokens = session.tokenize(TEXT)[:n_tokens]
    prefill_and_compress(session, tokens, resolve(session.model_path, "snapkv", 48, {}))
    return session.seq(0)


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_a_position_beyond_the_short_factors_is_refused(phi3_256, engine):
    if engine == "native":
        session = NativeSession(phi3_256, n_ctx=256)
    else:
        from kvcli.reference.session import ReferenceSession
        session = ReferenceSession(phi3_256, n_ctx=256)
    st = _compressed(session, 200)          # one go, no re-indexing: positions go on at 200 in ~40 cells
    assert st.next_pos == 200 and st.cells < 100
    for _ in range(56):
        session.step({0: 42})
    assert st.next_pos == 256
    with pytest.raises(KvcliError) as e:
        session.step({0: 42})
    msg = str(e.value)
    assert "LongRoPE" in msg and "position 256" in msg and "below 256" in msg and "--chunk" in msg, msg
    assert "\n" not in msg
    assert session.seq(0).next_pos == 256    # nothing half-done


def test_resizing_keeps_the_factors_of_the_cached_rows(phi3_256):
    s = NativeSession(phi3_256, n_ctx=1024)
    assert s.rope_regime == "long"
    st = _compressed(s, 600)
    s.resize_context(128)                   # what chat does after compressing: the long factors need > 256 cells
    assert s.n_ctx == 512 and s.rope_regime == "long" and s.seq(0).next_pos == st.next_pos
    s.step({0: 42})                          # decodes at position 600 with the factors its cache was read with

    short = NativeSession(phi3_256, n_ctx=256)
    _compressed(short, 100)
    with pytest.raises(KvcliError, match="would rotate with the long RoPE factors"):
        short.resize_context(1024)
    assert short.n_ctx == 256 and short.seq(0).next_pos == 100


def test_a_sequence_does_not_load_into_a_context_with_the_other_factors(phi3_256):
    s = NativeSession(phi3_256, n_ctx=1024)
    _compressed(s, 300)
    snap = s.save_seq(0)
    assert snap.rope == "long"
    other = s.sibling(256)
    try:
        with pytest.raises(KvcliError, match="rotated with the long LongRoPE factors, a context of 256 cells"):
            other.restore_seq(snap, 0)
    finally:
        other.close()
    same = s.sibling(768)
    try:
        assert same.restore_seq(snap, 0) == snap.cells
    finally:
        same.close()


def test_a_kvc_file_reloads_with_its_factors(tmp_path, run_kvcli):
    """Read in one go (long factors: a context above 2560 cells), compressed and saved; reloading sizes the context
    for the cells kept + the conversation's room (2,304 cells: short factors) unless the file says long."""
    path = _phi3(tmp_path / "phi3-2560.gguf", 2560)
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT * 2)
    kvc = tmp_path / "doc.kvc"
    p = run_kvcli("compress", "--model", path, "--doc", doc, "--policy", "snapkv", "--budget", "64", "--chunk", "0",
                  "-o", kvc)
    assert p.returncode == 0, p.stderr
    from kvcli import kvc as kvc_file
    meta = kvc_file.read(kvc).meta
    assert meta["conversation"]["rope"] == "long" and meta["original_tokens"] > 2560
    p = run_kvcli("run", "--model", path, "--cache", kvc, "-n", "4", "--json", "What is recorded?")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["stats"]["kv_cells_allocated"] > 2560, out["stats"]


def test_batch_reads_each_document_with_the_shared_caches_factors(tmp_path, run_kvcli):
    """The shared cache (the model's 8k context) rotates with the long factors; each document is read in a context
    of its own and moved over, so that context rotates with the long factors too, however short the document."""
    path = _phi3(tmp_path / "phi3-2560.gguf", 2560)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(2):
        (docs / f"d{i}.txt").write_text(TEXT[: 1500 + 400 * i])
    out = tmp_path / "out.jsonl"
    p = run_kvcli("batch", "--model", path, "--docs", docs, "-i", "What is recorded?", "-o", out,
                  "--policy", "snapkv", "--budget", "64", "-n", "4")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2 and all(not x.get("error") for x in lines), lines


def test_kvc_schema_takes_files_without_the_rope_field():
    """Files written before `conversation.rope` existed still load; a bad value is refused."""
    from kvcli import kvc as kvc_file
    conv = {"reset_pos": 0, "reset_cells": 0, "next_pos": 5, "cells": 5, "reindexed": 0, "tail": "user",
            "pending": False, "turns": []}
    schema = kvc_file.META_SCHEMA["conversation"]
    assert kvc_file._matches(conv, schema) == ""
    assert kvc_file._matches({**conv, "rope": "long"}, schema) == ""
    assert kvc_file._matches({**conv, "rope": "medium"}, schema, "conversation") == "conversation.rope"
    del conv["tail"]
    assert kvc_file._matches(conv, schema, "conversation") == "conversation.tail (missing)"
