""".kvc files: format round trip, atomic writes, refusals; compress + chat/run --cache == in memory."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvcli import kvc
from kvcli.errors import KvcliError
from tests.conftest import EXAMPLES

# ~400 tokens: long enough that budget 128 really compresses, short enough for CI
DOC = (EXAMPLES / "station-log.txt").read_text(encoding="utf-8")[:1600]
QUESTIONS = ["Who wrote this log?", "What happened first?"]


def _toy(n_layer=2, n_head_kv=3) -> kvc.KvcFile:
    rng = np.random.default_rng(0)
    kept = [[np.sort(rng.choice(50, size=5 + h, replace=False)).astype(np.int32) for h in range(n_head_kv)]
            for _ in range(n_layer)]
    return kvc.KvcFile(meta={"kvcli_version": "0.1.0", "model": {"n_layer": n_layer, "n_head_kv": n_head_kv,
                                                                  "hash": "abc", "name": "toy", "path": "/x"},
                             "document": "Ünïcode doc"},
                       prefix_tokens=np.arange(50, dtype=np.int32), state=bytes(range(256)) * 10,
                       kept_positions=kept, prefix_logits=rng.standard_normal(100).astype(np.float32))


def test_format_round_trip(tmp_path):
    f = _toy()
    path = tmp_path / "toy.kvc"
    size = kvc.write(path, f)
    assert size == path.stat().st_size
    g = kvc.read(path)
    assert g.meta == f.meta and g.state == f.state
    assert np.array_equal(g.prefix_tokens, f.prefix_tokens) and np.array_equal(g.prefix_logits, f.prefix_logits)
    for a, b in zip(g.kept_positions, f.kept_positions):
        for x, y in zip(a, b):
            assert np.array_equal(x, y)
    assert [p.name for p in tmp_path.iterdir()] == ["toy.kvc"]  # no temporary left behind


@pytest.mark.parametrize("cut", [4, 20, 100, -33, -1])
def test_truncated_file_refused(tmp_path, cut):
    path = tmp_path / "toy.kvc"
    kvc.write(path, _toy())
    raw = path.read_bytes()
    path.write_bytes(raw[:cut])
    with pytest.raises(KvcliError, match="truncated|not a kvcli"):
        kvc.read(path)


def test_corrupted_and_foreign_files_refused(tmp_path):
    path = tmp_path / "toy.kvc"
    kvc.write(path, _toy())
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # a flipped byte inside the state
    path.write_bytes(bytes(raw))
    with pytest.raises(KvcliError, match="corrupted \\(checksum mismatch\\)"):
        kvc.read(path)
    path.write_bytes(bytes(raw) + b"xx")
    with pytest.raises(KvcliError, match="trailing bytes"):
        kvc.read(path)
    other = tmp_path / "notes.kvc"
    other.write_text("hello, not a cache")
    with pytest.raises(KvcliError, match="not a kvcli .kvc file"):
        kvc.read(other)
    newer = tmp_path / "newer.kvc"
    kvc.write(newer, _toy())
    raw = bytearray(newer.read_bytes())
    raw[8:12] = (max(kvc.READS) + 1).to_bytes(4, "little")
    newer.write_bytes(bytes(raw))
    with pytest.raises(KvcliError, match=f"format {max(kvc.READS) + 1}; this kvcli reads formats 1, 2, 3"):
        kvc.read(newer)


def _write_format_1(path, f):
    """A .kvc file as kvcli wrote it before format 2: the state stored whole, as uint8."""
    import hashlib
    import json
    blobs = [(n, t, b) if n != "state" else (n, "uint8", bytes(f.state)) for n, t, b in f.blobs()]
    meta = json.dumps(dict(f.meta, blobs=[[n, t, len(b)] for n, t, b in blobs]), sort_keys=True).encode()
    body = kvc._HEAD.pack(kvc.MAGIC, 1, 0, len(meta)) + meta + b"".join(b for _, _, b in blobs)
    path.write_bytes(body + hashlib.sha256(body).digest())


def test_state_zero_blocks_are_left_out_and_format_1_still_loads(tmp_path):
    """Format 2 leaves the state's all-zero 64-byte blocks out (a compacted sequence's dead slots are zero rows):
    the file shrinks by them and reads back byte for byte; a format-1 file (state whole) loads as before."""
    rng = np.random.default_rng(0)
    state = bytearray(rng.integers(1, 255, 64 * 100 + 13, dtype=np.uint8).tobytes())
    state[64 * 10:64 * 70] = bytes(64 * 60)          # 60 zero blocks
    f = _toy()
    f.state = bytes(state)
    path = tmp_path / "z.kvc"
    size = kvc.write(path, f)
    back = kvc.read(path)
    assert back.state == bytes(state)
    old = tmp_path / "old.kvc"
    _write_format_1(old, f)
    assert kvc.read(old).state == bytes(state)
    # the 60 zero blocks, less the length, the block map (13 bytes) and the last block's padding (51 bytes)
    assert 60 * 64 - 8 - 13 - 51 - 8 <= old.stat().st_size - size <= 60 * 64
    assert kvc.unpack_zero_blocks(kvc.pack_zero_blocks(b"")) == b""
    with pytest.raises(KvcliError, match="zero-block state"):
        kvc.unpack_zero_blocks(kvc.pack_zero_blocks(bytes(state))[:-1], "x.kvc")


def test_interrupted_write_leaves_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "doc.kvc"
    kvc.write(path, _toy())
    before = path.read_bytes()

    def boom(*a, **k):
        raise KeyboardInterrupt  # Ctrl-C between writing and renaming

    monkeypatch.setattr(os, "fsync", boom)
    f = _toy()
    f.meta["document"] = "something else"
    with pytest.raises(KeyboardInterrupt):
        kvc.write(path, f)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["doc.kvc"]


# ------------------------------------------------------------------------------ with the real model
def _piped_answers(stdout: str) -> list[str]:
    return [b.strip() for b in stdout.strip().split("\n\n")]


@pytest.mark.parametrize("policy", [["--policy", "full"], ["--policy", "snapkv", "--budget", "128"]],
                         ids=["full", "snapkv128"])
def test_compress_then_cache_matches_in_memory(run_kvcli, tmp_path, policy):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    questions = "\n".join(QUESTIONS) + "\n"
    mem = run_kvcli("chat", "--doc", doc, *policy, "-n", "12", "--compress-once", input=questions)
    assert mem.returncode == 0, mem.stderr
    assert "question-agnostic" in mem.stderr
    out = tmp_path / "doc.kvc"
    c = run_kvcli("compress", "--doc", doc, *policy, "-o", out, "--json")
    assert c.returncode == 0, c.stderr
    info = json.loads(c.stdout)
    assert info["file_bytes"] == out.stat().st_size and info["mode"] == "question-agnostic"
    if "snapkv" in policy:
        assert info["stats"]["kv_cells"] <= 128 < info["original_tokens"]
    cached = run_kvcli("chat", "--cache", out, "-n", "12", input=questions)
    assert cached.returncode == 0, cached.stderr
    assert "loaded in" in cached.stderr
    assert _piped_answers(cached.stdout) == _piped_answers(mem.stdout)
    assert len(_piped_answers(mem.stdout)) == 2 and all(_piped_answers(mem.stdout))
    # run --cache answers the first question exactly like the chat did
    r = run_kvcli("run", "--cache", out, QUESTIONS[0], "-n", "12", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["answer"].strip() == _piped_answers(mem.stdout)[0]
    assert res["stats"]["load_s"] > 0   # measured and reported (its speed is a benchmark's, not a test's)


def test_question_aware_file_answers_like_run(run_kvcli, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    q = QUESTIONS[0]
    direct = run_kvcli("run", "--doc", doc, q, "-n", "12", "--json")
    assert direct.returncode == 0, direct.stderr
    out = tmp_path / "q.kvc"
    c = run_kvcli("compress", "--doc", doc, "--question", q, "-o", out, "-q")
    assert c.returncode == 0, c.stderr
    cached = run_kvcli("run", "--cache", out, q, "-n", "12", "--json")
    assert cached.returncode == 0, cached.stderr
    assert json.loads(cached.stdout)["answer"] == json.loads(direct.stdout)["answer"]
    assert json.loads(cached.stdout)["stats"]["mode"] == "question-aware"


def _one_line_error(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvcli: error:"), r.stderr
    return lines[0]


def test_wrong_model_version_and_truncated_refused(run_kvcli, tmp_path):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC[:400], encoding="utf-8")
    out = tmp_path / "doc.kvc"
    assert run_kvcli("compress", "--doc", doc, "-o", out, "-q").returncode == 0
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    msg = _one_line_error(run_kvcli("run", "--cache", out, "--model", tiny, "hi"))
    assert "was compressed for model" in msg and "tiny.gguf" in msg
    # another kvcli version
    f = kvc.read(out)
    f.meta["kvcli_version"] = "0.0.1"
    old = tmp_path / "old.kvc"
    kvc.write(old, f)
    assert "written by kvcli 0.0.1" in _one_line_error(run_kvcli("chat", "--cache", old, input="hi\n"))
    # truncated
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    assert "truncated" in _one_line_error(run_kvcli("run", "--cache", cut, "hi"))
    # --cache fixes the document: a contradicting flag is refused (this file holds the full cache: --policy P
    # --budget N re-select from it, tests/test_reselect_cli.py)
    assert "drop --system" in _one_line_error(run_kvcli("run", "--cache", out, "--system", "x", "hi"))
    assert "needs --budget" in _one_line_error(run_kvcli("run", "--cache", out, "--policy", "snapkv", "hi"))
    assert "exists" in _one_line_error(run_kvcli("compress", "--doc", doc, "-o", out))
