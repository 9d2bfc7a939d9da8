"""A stored document's full cache in pieces (issue 62): NativeSession.save_seq_pieces / restore_seq_pieces and the
.kvc format 3 (kvc.write_pieces, a streamed digest check, iter_state_pieces): round trips byte for byte, the same
refusals as format 2, nothing left by an interrupted write, and peak RSS that grows by a piece, not by the state."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcli import kvc
from kvcli.errors import KvcliError
from tests.conftest import ROOT


def _toy_meta(n_layer=2, n_head=4, split=6) -> dict:
    return {"kvcli_version": "0.1.0", "document": "Ünïcode doc", "compressed": False,
            "model": {"n_layer": n_layer, "n_head_kv": 2, "hash": "abc", "name": "toy", "path": "/x"},
            "store": {"split": split, "n_head": n_head, "colsum": True}}


def _toy_pieces(n=3, size=5000, seed=0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + 7 * i, dtype=np.uint8).tobytes() for i in range(n)]


def _write_toy(path, pieces=None, **kw) -> int:
    colsum = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    return kvc.write_pieces(path, _toy_meta(), np.arange(50, dtype=np.int32), colsum,
                            iter(pieces if pieces is not None else _toy_pieces()), **kw)


def test_format_3_round_trip_leaves_the_state_on_disk(tmp_path):
    path = tmp_path / "doc.kvc"
    pieces = _toy_pieces()
    size = _write_toy(path, pieces, prefix_logits=np.ones(10, np.float32))
    assert size == path.stat().st_size and [p.name for p in tmp_path.iterdir()] == ["doc.kvc"]
    raw = path.read_bytes()
    assert raw[:24] == kvc._HEAD.pack(kvc.MAGIC, 3, 0, 0) and raw[-40:-32] == b"KVCLIEND"
    assert hashlib.sha256(raw[:-32]).digest() == raw[-32:]
    f = kvc.read(path)
    assert f.state is None and len(f.pieces) == 3 and f.state_nbytes == sum(map(len, pieces))
    assert f.meta == _toy_meta() and np.array_equal(f.prefix_tokens, np.arange(50))
    assert f.colsum.shape == (2, 4, 6) and np.array_equal(f.prefix_logits, np.ones(10, np.float32))
    assert list(kvc.iter_state_pieces(f)) == pieces
    assert kvc.peek_meta(path)["document"] == "Ünïcode doc"
    assert np.array_equal(kvc.peek_tokens(path), np.arange(50))
    # kvc.write of a format-3 file read copies it in format 3, its pieces read one at a time
    copy = tmp_path / "copy.kvc"
    f.meta["document"] = "renamed"
    kvc.write(copy, f)
    g = kvc.read(copy)
    assert g.meta["document"] == "renamed" and list(kvc.iter_state_pieces(g)) == pieces
    # a format-2 file's whole state is one piece
    old = kvc.KvcFile(meta=_toy_meta(), prefix_tokens=np.arange(5, dtype=np.int32), state=b"abc" * 100)
    kvc.write(tmp_path / "two.kvc", old)
    assert list(kvc.iter_state_pieces(kvc.read(tmp_path / "two.kvc"))) == [b"abc" * 100]


@pytest.mark.parametrize("cut", [4, 20, 30, 5000, -41, -33, -1])
def test_format_3_truncated_refused(tmp_path, cut):
    path = tmp_path / "doc.kvc"
    _write_toy(path)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(KvcliError, match="truncated|not a kvcli") as e:
        kvc.read(path)
    assert "\n" not in str(e.value)
    assert kvc.peek_meta(path) is None and kvc.peek_tokens(path) is None


def test_format_3_corrupted_refused(tmp_path):
    path = tmp_path / "doc.kvc"
    _write_toy(path)
    good = path.read_bytes()
    for at in (100, 24 + 200 + 4 + 192 + 3000, -100, -36, -10):   # tokens, a piece, the meta, meta_len, the digest
        raw = bytearray(good)
        raw[at] ^= 0xFF
        path.write_bytes(bytes(raw))
        with pytest.raises(KvcliError, match="corrupted|truncated"):
            kvc.read(path)
    path.write_bytes(good + b"xx")
    with pytest.raises(KvcliError, match="corrupted \\(2 unexpected trailing bytes\\)"):
        kvc.read(path)
    # a valid digest over a meta whose blobs do not add up to the file
    body = good[:-32 - 16]
    meta = json.loads(body[-struct.unpack("<Q", good[-48:-40])[0]:])
    start = len(body) - struct.unpack("<Q", good[-48:-40])[0]
    meta["blobs"][-1][2] += 1
    mb = json.dumps(meta).encode()
    body = body[:start] + mb + struct.pack("<Q8s", len(mb), b"KVCLIEND")
    path.write_bytes(body + hashlib.sha256(body).digest())
    with pytest.raises(KvcliError, match="do not add up"):
        kvc.read(path)


def test_a_changed_file_is_refused_while_its_pieces_are_read(tmp_path):
    path = tmp_path / "doc.kvc"
    _write_toy(path)
    f = kvc.read(path)
    _write_toy(path, _toy_pieces(seed=1))   # replaced (renamed over) after it was read
    with pytest.raises(KvcliError, match="changed since it was read"):
        list(kvc.iter_state_pieces(f))
    path.unlink()
    with pytest.raises(KvcliError, match="cannot read"):
        list(kvc.iter_state_pieces(f))


def test_interrupted_write_pieces_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "doc.kvc"

    def stopped():
        yield b"x" * 1000
        raise KeyboardInterrupt   # Ctrl-C while the second piece is made

    with pytest.raises(KeyboardInterrupt):
        _write_toy(path, stopped())
    assert list(tmp_path.iterdir()) == []
    _write_toy(path)
    before = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        _write_toy(path, stopped())
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(KvcliError, match="cannot write .*No space left"):
        _write_toy(path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["doc.kvc"]
    asked = []

    def counted():
        asked.append(1)
        yield b"y"
    with pytest.raises(KvcliError, match="exists"):   # the target is refused before the first piece is made
        _write_toy(path, counted(), force=False)
    assert not asked
    with pytest.raises(KvcliError, match="compressed cache is written whole"):
        kvc.write_pieces(tmp_path / "c.kvc", {"compressed": True}, np.zeros(1, np.int32), None, iter([b"z"]))


# ------------------------------------------------------------------------------ with a model
def _stored_meta(session, n: int) -> dict:
    """The meta a stored document's file carries (reselect.StoredDocument.to_kvc's)."""
    meta = kvc.base_meta(session)
    meta.update({"policy": "full", "budget": None, "policy_args": {}, "resolved_params": None,
                 "original_tokens": n, "mode": "question-agnostic", "question": None, "system": None,
                 "document": "doc", "generic_suffix": None, "compressed": False,
                 "conversation": {"reset_pos": n, "reset_cells": n, "next_pos": n, "cells": n, "reindexed": 0,
                                  "rope": session.rope_regime, "tail": "user", "pending": False, "turns": []},
                 "store": {"split": n, "n_head": session.info.n_head, "colsum": False}})
    return meta


def _session(model, n_seq=3, **kw):
    from kvcli.native.session import NativeSession
    return NativeSession(model, n_seq=n_seq, n_threads=2, **kw)


def _tokens(session, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(100, session.n_vocab - 100, n)]


def _round_trip(model, tmp_path, n, piece, **kw):
    """Prefill n tokens, write them to a format-3 file from the context, read it back into a fresh context (checked
    as load_checked checks it): the restored state equals the original byte for byte and decodes the same logits."""
    a = _session(model, **kw)
    a.prefill(_tokens(a, n), seq=0)
    whole = a.save_seq(0).state
    path = tmp_path / "doc.kvc"
    kvc.write_pieces(path, _stored_meta(a, n), np.array(_tokens(a, n)), None, a.save_seq_pieces(0, 2, piece))
    assert a.seq(2).cells == 0 and a.measured_cells(2) == 0 and a.measured_cells(-1) == n   # the scratch is empty
    f = kvc.load_checked(path, model)
    assert f.state is None and len(f.pieces) == -(-n // piece)
    b = _session(model, **kw)
    assert b.restore_seq_pieces(kvc.iter_state_pieces(f), 0, 1, next_pos=n, cells=n) == n
    st = b.seq(0)
    assert (st.next_pos, st.cells, st.prompt_tokens) == (n, n, n) and b.measured_cells(1) == 0
    assert b.save_seq(0).state == whole
    a.step({0: 42})
    b.step({0: 42})
    return a, b, whole


def test_pieces_round_trip_tiny(tiny_2k, tmp_path):
    a, b, whole = _round_trip(tiny_2k, tmp_path, 700, 128, n_ctx=2048, cache_type="f32", flash_attn=False)
    assert np.array_equal(a.logits(0), b.logits(0))
    ref = b.logits(0)
    # a whole state is one piece
    b.clear()
    assert b.restore_seq_pieces(iter([whole]), 0, 2, next_pos=700) == 700
    assert b.save_seq(0).state == whole
    b.clear()
    b.restore_seq_pieces(iter([whole]), 1, 2, next_pos=700)   # sequence 1 holds it from now on
    # a fragmented cell pool: the pieces fill the hole another sequence left, then go on after the sequence beside it
    c = _session(tiny_2k, n_ctx=2048, n_seq=4, cache_type="f32", flash_attn=False)
    c.prefill(_tokens(c, 300, seed=1), seq=0)
    c.prefill(_tokens(c, 300, seed=2), seq=1)
    c.clear(0)
    assert c.restore_seq_pieces(kvc.iter_state_pieces(kvc.read(tmp_path / "doc.kvc")), 2, 3, next_pos=700) == 700
    assert (c.measured_cells(2), c.measured_cells(-1)) == (700, 1000)
    c.step({2: 42})
    assert np.allclose(c.logits(2), ref, atol=1e-4)
    c.close()
    # refusals, each in one line, leaving the sequences as they were
    with pytest.raises(KvcliError, match="not load as saved"):
        b.restore_seq_pieces(iter([whole]), 0, 2, next_pos=800)
    assert b.seq(0).cells == 0 and b.measured_cells(0) == 0 and b.measured_cells(2) == 0
    with pytest.raises(KvcliError, match="cannot load the cache state"):
        b.restore_seq_pieces(iter([whole[:1000]]), 0, 2, next_pos=700)
    assert b.measured_cells(0) == 0 and b.measured_cells(2) == 0 and b.seq(1).cells == 700
    with pytest.raises(KvcliError, match="scratch sequence must be empty"):
        next(b.save_seq_pieces(0, 1))
    with pytest.raises(KvcliError, match="its own scratch"):
        next(b.save_seq_pieces(1, 1))
    from kvcli.planning.formats import Plan   # a compressed sequence
    b.prefill(_tokens(b, 300, seed=3), seq=0)
    keep = np.arange(0, 300, 2, dtype=np.int32)
    b.apply_plan(Plan.from_lists([[keep] * b.info.n_head_kv] * b.info.n_layer), seq=0)
    with pytest.raises(KvcliError, match="is compressed .* only an uncompressed sequence is saved in pieces"):
        next(b.save_seq_pieces(0, 2))
    assert b.measured_cells(2) == 0
    a.close()
    b.close()


def test_pieces_refusals_of_a_file(tiny_2k, other_tiny_2k, tmp_path):
    a = _session(tiny_2k, n_ctx=2048, cache_type="f32", flash_attn=False)
    n = 300
    a.prefill(_tokens(a, n), seq=0)
    path = tmp_path / "doc.kvc"
    pieces = list(a.save_seq_pieces(0, 1, 128))
    kvc.write_pieces(path, _stored_meta(a, n), np.array(_tokens(a, n)), None, iter(pieces))
    with pytest.raises(KvcliError, match="was compressed for model .*other.gguf"):
        kvc.load_checked(path, other_tiny_2k)
    # a damaged piece behind a valid digest: check_state reads the pieces one by one
    bad = bytearray(pieces[1])
    bad[36:40] = (0).to_bytes(4, "little")          # its first cell's position: position 0 twice
    kvc.write_pieces(path, _stored_meta(a, n), np.array(_tokens(a, n)), None, iter([pieces[0], bytes(bad),
                                                                                    pieces[2]]))
    with pytest.raises(KvcliError, match="not distinct positions"):
        kvc.load_checked(path, tiny_2k)
    kvc.write_pieces(path, _stored_meta(a, n), np.array(_tokens(a, n)), None, iter(pieces[:2]))
    with pytest.raises(KvcliError, match="256 cells in its pieces, the header says 300"):
        kvc.load_checked(path, tiny_2k)
    a.close()


def test_pieces_round_trip_sliding_window(tmp_path):
    """gemma3 (sliding-window layers): each piece carries its range's window cells; the restored cache writes the
    same state and decodes the logits a whole restore does."""
    from kvcli.testing.tiny_gguf import write_tiny
    model = write_tiny(tmp_path / "g3.gguf", "gemma3", n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    a, b, whole = _round_trip(model, tmp_path, 400, 64, n_ctx=1024, cache_type="f16", flash_attn=True)
    c = _session(model, n_ctx=1024, cache_type="f16", flash_attn=True)
    from kvcli.native.session import SeqSnapshot
    c.restore_seq(SeqSnapshot(state=whole, next_pos=400, cells=400), 0)
    c.step({0: 42})
    assert np.allclose(b.logits(0), c.logits(0), atol=1e-4)
    for s in (a, b, c):
        s.close()


def test_pieces_round_trip_default_model(default_model, tmp_path):
    a, b, _ = _round_trip(default_model, tmp_path, 300, 128, n_ctx=1024)
    assert np.array_equal(a.logits(0), b.logits(0))
    a.close()
    b.close()


# ------------------------------------------------------------------------------ peak RSS
_MEMORY = r'''
import ctypes, gc, json, sys
import numpy as np
from kvcli import kvc
from kvcli.native.session import NativeSession, SeqSnapshot
from tests.test_kvc_pieces import _stored_meta

model, folder, n, piece = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
libc = ctypes.CDLL("libc.so.6")

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def phase():
    gc.collect()
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # resets VmHWM to the current RSS
    return status("VmRSS")

s = NativeSession(model, n_ctx=n + 2 * piece, n_seq=3, n_threads=2)
# the document: 256 tokens read, their cells repeated at the positions of n (a state of n cells, its RSS as real)
block = 256
s.prefill([int(t) for t in np.random.default_rng(0).integers(100, s.n_vocab - 100, block)], seq=0)
one = bytes(next(s.save_seq_pieces(0, 2, block)))
s.clear(0)
def tiled():
    for p in range(0, n, block):
        state = bytearray(one)
        for i in range(block):
            struct_at = 36 + 12 * i
            state[struct_at:struct_at + 4] = (p + i).to_bytes(4, "little")
        yield state
s.restore_seq_pieces(tiled(), 0, 2, next_pos=n, cells=n)
meta, tokens = _stored_meta(s, n), np.zeros(n, np.int32)
state_bytes = len(s.save_seq(0).state)
out = {"state_mb": state_bytes / 1e6, "piece_mb": state_bytes * piece / n / 1e6}

base = phase()
kvc.write_pieces(f"{folder}/new.kvc", meta, tokens, None, s.save_seq_pieces(0, 2, piece))
out["new_write_mb"] = (status("VmHWM") - base) / 1e6
base = phase()
f = kvc.read(f"{folder}/new.kvc")
kvc.check_state(f)
s.restore_seq_pieces(kvc.iter_state_pieces(f), 0, 2, next_pos=n, cells=n)
out["new_read_mb"] = (status("VmHWM") - base) / 1e6
del f

base = phase()
snap = s.save_seq(0)
kvc.write(f"{folder}/old.kvc", kvc.KvcFile(meta=meta, prefix_tokens=tokens, state=snap.state))
del snap
out["old_write_mb"] = (status("VmHWM") - base) / 1e6
base = phase()
f = kvc.read(f"{folder}/old.kvc")
kvc.check_state(f)
s.restore_seq(SeqSnapshot(state=f.state, next_pos=n, cells=n, prompt_tokens=n), 0)
del f
out["old_read_mb"] = (status("VmHWM") - base) / 1e6
print(json.dumps(out))
'''


def test_peak_rss_of_writing_and_reading_a_store_is_a_piece(default_model, tmp_path):
    """A ~4k-token document on the default model (SmolLM2, ~23 KB a cell: a ~95 MB state) written from the context
    with write_pieces and read back with restore_seq_pieces: each adds at most ~2 pieces (1024 cells, ~24 MB) to the
    process's peak RSS, where the whole-state write (kvc.write) and read add several copies of the state."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    r = subprocess.run([sys.executable, "-c", _MEMORY, str(default_model), str(tmp_path), "4096", "1024"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps({k: round(v, 1) for k, v in m.items()}))
    assert m["state_mb"] > 80
    assert m["new_write_mb"] < 40 and m["new_read_mb"] < 40, m
    assert m["old_write_mb"] > 150, m      # what the pieces avoid (the state and its packed copies)
