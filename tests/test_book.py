"""A book, not a chapter (issue #46): resumable bounded reads and the block index that chooses which stored chunks a
question streams (kvcli/drivers/reselect_bounded.py, kvcli/drivers/block_index.py), on a tiny random model.

What it must show: a read stopped part-way (Ctrl-C; SIGTERM in a real process) stays in the document store as a
partial entry and the same read continues from it, writing the same chunk files, index and summary byte for byte as
an uninterrupted read; a read with other settings does not take it over, and one whose files were changed starts
over and says so. The index's page bounds are upper bounds of every real logit; a question streams the first, the
last and the chosen chunks only; KVCLI_RESELECT_CHUNKS=all streams them all; a store of the previous format (no
index) opens and streams every chunk.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvcli import document_store
from kvcli.errors import KvcliError
from helpers import reselection_session

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 12))
Q = "Which code did the river station log?"

pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture(scope="module")
def setup(tiny_2k):
    """(session with two sequences, document head tokens, prompt tokens of Q)."""
    s, head, prompt = reselection_session(tiny_2k, DOC, Q)
    yield s, head, prompt
    s.close()


def cfg_of(model, budget=48):
    from kvcli.planning.planner import resolve
    return resolve(model, "snapkv", budget, {}, Q)


def digests(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name != "store.json"}


class Stop:
    """A progress callable that stops the read (as Ctrl-C does) once `after` tokens are read."""

    def __init__(self, after: int):
        self.after, self.n, self.skipped = after, 0, 0

    def __call__(self, n: int) -> None:
        self.n += n
        if self.n >= self.after:
            raise KeyboardInterrupt

    def skip(self, n: int) -> None:
        self.skipped += n


def test_a_stopped_read_resumes_to_the_same_store(tiny_2k, setup, tmp_path):
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, _ = setup
    cfg = cfg_of(tiny_2k)
    whole = ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "whole", keep=True)
    assert len(whole.chunks) > 4 and whole.summary is not None and len(whole.pages) == len(whole.chunks)
    with pytest.raises(KeyboardInterrupt):
        ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "again", keep=True, progress=Stop(len(head) // 2))
    partial = [i for i in document_store.entries() if i.state == "partial"]
    assert len(partial) == 1 and 0 < partial[0].as_json()["chunks_done"] < len(whole.chunks)
    said, progress = [], Stop(10 ** 9)
    again = ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "again", keep=True, progress=progress,
                              notify=said.append)
    assert len(said) == 1 and "resuming an interrupted read" in said[0], said
    assert 0 < progress.skipped < whole.split and progress.skipped + progress.n == whole.split
    assert again.resumed_tokens == progress.skipped and whole.resumed_tokens == 0   # results can say so
    assert digests(tmp_path / "again") == digests(tmp_path / "whole")
    assert [vars(c) for c in again.chunks] == [vars(c) for c in whole.chunks]
    assert not [i for i in document_store.entries() if i.state == "partial"]
    whole.close()
    again.close()


def test_a_partial_read_is_resumed_only_by_the_same_read(tiny_2k, setup):
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, _ = setup
    cfg = cfg_of(tiny_2k)
    with pytest.raises(KeyboardInterrupt):
        ChunkedStore.read(s, head, cfg, chunk=128, progress=Stop(len(head) // 2))
    said = []
    other = ChunkedStore.read(s, head, cfg_of(tiny_2k, budget=40), chunk=128, notify=said.append)
    assert not said and len([i for i in document_store.entries() if i.state == "partial"]) == 1
    other.close()
    # a chunk file changed on disk: the partial read is not trusted, and the read starts over
    info = next(i for i in document_store.entries() if i.state == "partial")
    part = Path(info.record["part"])
    (part / "chunk-0000.state").write_bytes(b"changed")
    store = ChunkedStore.read(s, head, cfg, chunk=128, notify=said.append)
    assert len(said) == 1 and "did not check out" in said[0], said
    assert not [i for i in document_store.entries() if i.state == "partial"]
    store.close()


def test_page_bounds_hold_every_logit(tiny_2k, setup):
    """chunk_maxima's bound is at least the largest real logit of the chunk's keys, for every (layer, head, query)."""
    from kvcli.drivers import block_index
    from kvcli.native.cache import read_kv
    s, head, _ = setup
    s.clear()
    piece = head[:100]
    s.prefill(piece, seq=0)
    lo, hi = block_index.load_pages(block_index.chunk_pages(s, 0, 0, len(piece)), s.info)
    keys, _ = read_kv(s.ctx, 0, s.info)                                  # [L, H_kv, n, d]
    q = block_index.question_queries(s, 0, s.tokenize(" Which code?"), at=len(piece))
    bound = block_index.chunk_maxima(q, lo, hi)                          # [L, H, w]
    group = s.info.n_head // s.info.n_head_kv
    for layer in range(s.info.n_layer):
        for h in range(s.info.n_head):
            real = (q[layer, h] @ keys[layer, h // group].T).max(axis=1) / np.sqrt(s.info.head_dim)
            assert np.all(bound[layer, h] >= real - 1e-3 * (1 + np.abs(real)))
    s.clear()


def test_a_question_streams_the_chosen_chunks(tiny_2k, setup, monkeypatch):
    from kvcli.drivers.block_index import default_select
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    store = ChunkedStore.read(s, head, cfg, chunk=128)
    select = default_select(cfg.budget, store.chunk)
    assert len(store.chunks) > select + 2
    r = store.reselect(s, prompt, cfg)
    assert r.chunks == select + 2 and r.stored == len(store.chunks) and r.index_s > 0 and r.plan is not None
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "all")
    assert store.reselect(s, prompt, cfg).chunks == len(store.chunks)
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "1")
    assert store.reselect(s, prompt, cfg).chunks == 3
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "some")
    with pytest.raises(KvcliError, match="KVCLI_RESELECT_CHUNKS must be"):
        store.reselect(s, prompt, cfg)
    store.close()


def test_a_store_of_the_previous_format_streams_every_chunk(tiny_2k, setup, tmp_path):
    from kvcli.drivers import reselect_bounded as rb
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    rb.ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "st", keep=True).close()
    m = json.loads((tmp_path / "st" / "store.json").read_text())
    for key in ("index", "summary", "sha256"):
        m.pop(key)
    m["kvcli_store"] = 2
    rb.write_manifest(tmp_path / "st", m)
    old = rb.ChunkedStore.open(tmp_path / "st", tiny_2k)
    assert old.chunks_per_question(cfg.budget) is None
    assert old.reselect(s, prompt, cfg).chunks == len(old.chunks)
    old.close()


def test_sigterm_halfway_then_the_same_command_resumes(tiny_2k, tmp_path, cache_dir):
    """A real `kvcli compress --store` stopped by SIGTERM after a few chunks exits 130 and leaves a partial entry;
    the same command continues it (says so) and writes the store an uninterrupted command writes."""
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join([DOC] * 2), encoding="utf-8")
    env = {**os.environ, "KVCLI_CACHE": str(cache_dir), "KVCLI_THREADS": "1"}

    def command(out):
        return [sys.executable, "-m", "kvcli.cli", "compress", "--model", str(tiny_2k), "--doc", str(doc), "--store",
                "--policy", "snapkv", "--budget", "48", "--chunk", "160", "-o", str(out)]

    proc = subprocess.Popen(command(tmp_path / "st"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        recs = [i.record for i in document_store.entries(sweep_first=False)]
        if any(len(r.get("chunks_done") or []) >= 3 for r in recs):
            break
        time.sleep(0.05)
    if proc.poll() is not None:
        pytest.fail(f"the read ended before it could be stopped: {proc.communicate()}")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert [i.state for i in document_store.entries()] == ["partial"]
    again = subprocess.run(command(tmp_path / "st"), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming an interrupted read" in again.stderr
    whole = subprocess.run(command(tmp_path / "whole"), env=env, capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0 and "resuming" not in whole.stderr
    assert digests(tmp_path / "st") == digests(tmp_path / "whole")
