"""A book, not a chapter (issue #46): resumable bounded reads and the block index that chooses which stored chunks a
question streams (kvcli/drivers/reselect_bounded.py, kvcli/drivers/block_index.py), on a tiny random model.

What it must show: a read stopped part-way (Ctrl-C; SIGTERM in a real process) stays in the document store as a
partial entry and the same read continues from it, writing the same chunk files, index and summary byte for byte as
an uninterrupted read; a read with other settings does not take it over, and one whose files were changed starts
over and says so. The index's page bounds are upper bounds of every real logit (read from a chunk file's keys); a
question streams the first, the last and the chosen chunks only, chosen by their real keys among the bounds' best
candidates (the model's GGUF header, which each question's queries need, parsed once per file version);
KVCLI_RESELECT_CHUNKS=all streams them all; a store of the previous format (no
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


def test_the_question_rows_queries_are_the_whole_probes_last_rows(tiny_2k, setup):
    """question_queries(rows=k) gives the last k rows of the whole probe's queries, turned to the same positions, and
    question_tokens takes the prompt after the stored document (at most QUESTION_TOKENS, PROBE_ROWS at least)."""
    from kvcli.drivers import block_index
    s, head, prompt = setup
    s.clear()
    s.prefill(head[:100], seq=0)
    probe = s.tokenize(" Which code did the river station log? Answer with the code only.")
    every = block_index.question_queries(s, 0, probe, at=500)
    last = block_index.question_queries(s, 0, probe, at=500, rows=5)
    assert s.seq(0).next_pos == 100 and last.shape[2] == 5
    np.testing.assert_allclose(last, every[:, :, -5:], rtol=1e-4, atol=1e-4)
    s.clear()
    split = len(head)
    assert block_index.question_tokens(prompt, split) == list(prompt[-block_index.PROBE_ROWS:])
    long = list(head) + [head[0]] * 300
    assert block_index.question_tokens(long, split) == long[-block_index.QUESTION_TOKENS:]
    mid = list(head) + [head[0]] * 100
    assert block_index.question_tokens(mid, split) == mid[split:]


def test_a_chunk_scores_by_how_far_it_stands_out_not_by_its_summed_share():
    """chunk_scores: a chunk that a few rows find far better than every other chunk (the passage a question quotes)
    outranks one that every row finds a little better (a chunk every question attends to), and a chunk that stands out
    in no row (never 3 standard deviations past the others) scores 0 but for a tie-break. Summed softmax shares ranked
    them the other way. With few chunks, where none can stand out 3 standard deviations, the cut comes down."""
    from kvcli.drivers import block_index
    rng = np.random.default_rng(0)
    m = rng.normal(0.0, 1.0, size=(60, 2, 4, 50))        # [chunks, layers, heads, queries]
    m[3] += 1.5                                          # a little better in every row
    m[11, 1, 2, :6] += 9.0                               # far better in six rows
    scores = block_index.chunk_scores(list(m))
    assert np.argmax(scores) == 11 and scores[11] > 1.5 * scores[3]
    flat = m.reshape(60, -1)
    assert np.all(np.abs(scores[(flat - flat.mean(axis=0)).max(axis=1) < 2.5]) < 1e-5)   # a tie-break, no more
    shares = np.exp(flat - flat.max(axis=0))
    assert np.argmax((shares / shares.sum(axis=0)).sum(axis=1)) == 3
    few = rng.normal(0.0, 1.0, size=(5, 2, 4, 50))
    few[2, 0, 1, :6] += 9.0
    assert block_index.z_cut(5) < 1.8 and np.argmax(block_index.chunk_scores(list(few))) == 2


def test_a_stored_chunks_keys_are_read_from_its_file(tiny_2k, setup, tmp_path):
    """chunk_keys reads a stored chunk file's K rows (float16, and q8_0 within its error) as the cache holds them
    after a restore, and key_maxima's logits are the real ones, under chunk_maxima's bound."""
    from kvcli.drivers import block_index
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.native.cache import read_kv
    from kvcli.native.state import Q8_0, chunk_keys, convert_chunk
    s, head, prompt = setup
    s.clear()
    store = ChunkedStore.read(s, head, cfg_of(tiny_2k), chunk=128)
    c = store.chunks[2]
    keys, pos = chunk_keys(store._read_chunk(c), s.info.n_head_kv)
    assert list(pos) == list(range(c.first_pos, c.first_pos + c.n))
    s.restore_seq(store._snapshot(c), 0)
    want, _ = read_kv(s.ctx, 0, s.info)
    s.clear(0)
    np.testing.assert_array_equal(keys, want)
    np.testing.assert_array_equal(chunk_keys(store._read_chunk(c), s.info.n_head_kv, slice(1, 3))[0], keys[1:3])
    q8, _ = chunk_keys(convert_chunk(store._read_chunk(c), Q8_0), s.info.n_head_kv)
    assert np.linalg.norm(q8 - keys) <= 0.02 * np.linalg.norm(keys)
    q = store.question_queries(s, 0, prompt)
    real = block_index.key_maxima(q, keys)
    group = s.info.n_head // s.info.n_head_kv
    for layer, h in ((0, 0), (s.info.n_layer - 1, s.info.n_head - 1)):
        brute = (q[layer, h] @ keys[layer, h // group].T).max(axis=1) / np.sqrt(s.info.head_dim)
        np.testing.assert_allclose(real[layer, h], brute, rtol=1e-5, atol=1e-5)
    bound = block_index.chunk_maxima(q, *block_index.load_pages(store._read_file(store.pages[2]), s.info))
    assert np.all(bound >= real - 1e-3 * (1 + np.abs(real)))
    store.close()


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


def test_the_chosen_chunks_are_the_page_bounds_candidates_best_by_their_real_keys(tiny_2k, setup, monkeypatch):
    """The index's two steps: the page bounds' best CANDIDATES x select chunks, of which the `select` whose real keys
    (read from their files) score best are streamed; CANDIDATES 1 is the page bounds' choice alone, and candidates
    past the store's chunks are the real keys' choice over every chunk."""
    from kvcli.drivers import block_index as bi
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.native.state import chunk_keys
    s, head, prompt = setup
    s.clear()
    cfg = cfg_of(tiny_2k)
    store = ChunkedStore.read(s, head, cfg, chunk=128)
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "2")
    inner = store.chunks[1:-1]
    assert len(inner) > 6
    q = store.question_queries(s, 0, prompt)
    bounds = store.index_scores(s, 0, prompt)
    real = [bi.key_maxima(q, chunk_keys(store._read_chunk(c), s.info.n_head_kv)[0]) for c in inner]
    for candidates in (1, 2, 100):
        monkeypatch.setattr(bi, "CANDIDATES", candidates)
        pool = bi.choose(bounds, candidates * 2)
        want = sorted(pool[j] for j in bi.choose(bi.chunk_scores([real[i] for i in pool]), 2))
        chosen, seconds = store._choose(s, 0, prompt, cfg)
        assert chosen[0] is store.chunks[0] and chosen[-1] is store.chunks[-1] and seconds > 0
        assert [inner.index(c) for c in chosen[1:-1]] == want
        if candidates == 1:
            assert want == bi.choose(bounds, 2)
        if candidates == 100:
            assert want == bi.choose(bi.chunk_scores(real), 2)
    assert s.cells_used() == 0
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


# ---------------------------------------------------------------------------------- a q8_0 store
@pytest.fixture(scope="module")
def tiny_32(tmp_path_factory):
    """tiny_2k with head_dim 32: a model whose cache llama.cpp can hold as q8_0 (a block per head)."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny32") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


def test_a_q8_0_store_is_read_in_float16_and_quantises_each_chunk_once(tiny_32, tmp_path):
    """`chunk_type="q8_0"`: the read is the float16 read (the same carried cache, the same summary), only the chunk
    files are q8_0 rows (each key quantised once, about 17/32 of the bytes), put back as float16 rows within q8_0's
    error; a re-selection from it answers as from the float16 store, and the folder opens again as a q8_0 store."""
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.native import cache
    s, head, prompt = reselection_session(tiny_32, DOC, Q)
    try:
        cfg = cfg_of(tiny_32)
        f16 = ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "f16", keep=True)
        q8 = ChunkedStore.read(s, head, cfg, chunk=128, path=tmp_path / "q8", keep=True, chunk_type="q8_0")
        assert q8.chunk_type == "q8_0" and f16.chunk_type == "f16" and len(q8.chunks) == len(f16.chunks) > 4
        assert q8.summary["sha256"] == f16.summary["sha256"]          # the read itself is float16's
        assert [p["sha256"] for p in q8.pages] == [p["sha256"] for p in f16.pages]
        for a, b in zip(f16.chunks, q8.chunks):
            assert (a.first_pos, a.n) == (b.first_pos, b.n) and 0.5 < b.nbytes / a.nbytes < 0.6
            rows = []
            for store, c in ((f16, a), (q8, b)):
                s.restore_seq(store._snapshot(c), 0)
                rows.append(cache.read_kv(s.ctx, 0, s.info))
                s.clear(0)
            for want, got in zip(*rows):
                assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want)
        logits = []
        # every chunk streamed: the index's choice between chunks of a random model, none standing out, may move with
        # q8_0's error in the keys it scores; this compares what the stored rows answer
        for store in (f16, q8):
            store.select = 0
            store.reselect(s, prompt, cfg)
            logits.append(s.logits(0).copy())
            s.clear()
        assert np.corrcoef(logits[0], logits[1])[0, 1] > 0.99
        f16.close()
        q8.close()
        again = ChunkedStore.open(tmp_path / "q8", tiny_32)
        assert again.chunk_type == "q8_0" and json.loads((tmp_path / "q8" / "store.json").read_text())[
            "cache_type"] == "f16"
        again.select = 0
        again.reselect(s, prompt, cfg)
        np.testing.assert_allclose(s.logits(0), logits[1], rtol=0, atol=1e-4)
        s.clear()
        again.close()
    finally:
        s.close()


def test_a_quantised_cache_does_not_read_a_bounded_store(tiny_32):
    """Bounded reading in a quantised cache would re-quantise the kept keys at every chunk: refused in one line, and
    other quantised chunk types than q8_0 are refused by name."""
    from kvcli.drivers.reselect_bounded import ChunkedStore, store_types
    from kvcli.native.session import NativeSession
    assert store_types("q8_0") == ("f16", "q8_0") and store_types("f16") == ("f16", "f16")
    with pytest.raises(KvcliError, match="float16 or q8_0 rows, not q4_0"):
        store_types("q4_0")
    s = NativeSession(tiny_32, n_ctx=1024, n_seq=2, cache_type="q8_0")
    try:
        head = s.tokenize(DOC)
        with pytest.raises(KvcliError, match="read in a float16 cache"):
            ChunkedStore.read(s, head, cfg_of(tiny_32), chunk=128)
        # a session changes its cache type only while empty
        s.prefill(head[:40])
        with pytest.raises(KvcliError, match="a sequence holds cells"):
            s.use_cache_type("f16")
        s.clear()
        s.use_cache_type("f16")
        assert s.ctx is None and s.cache_type == "f16"
        s.create_context(1024)
        s.prefill(head[:40])
        assert s.seq(0).cells == 40
    finally:
        s.close()


def test_a_question_known_while_reading_is_read_in_float16_when_q8_0_is_asked(tiny_32):
    """`kvcli run`'s bounded reading re-indexes its kept keys at every chunk as a store's read does: asked for q8_0,
    it reads in float16 (the same cells and answer as asked for float16) and says so; the evaluations read as it
    does and give the session back in the type asked; the driver itself refuses a q8_0 cache in one line."""
    from kvcli.apps.run_document import run_document
    from kvcli.drivers.compress import prefill_and_compress
    from kvcli.evaluation.runner import chunked_variants
    from kvcli.native.session import NativeSession
    from kvcli.planning.planner import resolve
    runs = {}
    for t in ("f16", "q8_0"):
        s = NativeSession(tiny_32, n_ctx=0, cache_type=t)
        try:
            runs[t] = run_document(s, DOC, Q, compression=resolve(tiny_32, "snapkv", 48), max_tokens=6,
                                   chunk=128), s.cache_type
        finally:
            s.close()
    (f16, f16_type), (q8, q8_type) = runs["f16"], runs["q8_0"]
    assert f16_type == q8_type == "f16" and q8.stats["cache_type"] == "f16" and "cache_type" not in f16.stats
    assert "read in a float16 cache, not q8_0" in q8.stats["note"] and q8.stats["chunks"] > 4
    assert q8.answer == f16.answer and q8.stats["kv_cells"] == f16.stats["kv_cells"]
    s = NativeSession(tiny_32, n_ctx=1024, cache_type="q8_0")
    try:
        tokens = s.tokenize(DOC)
        variants = list((pol, status, note) for pol, _, status, _, note, _ in
                        chunked_variants(s, tokens, [("snapkv", 48)], {("snapkv", 48): resolve(tiny_32, "snapkv", 48)},
                                         {}, chunk=128, reserve=8))
        assert variants == [("snapkv", "ok", read_in_float16(q8.stats["note"]))]
        assert s.cache_type == "q8_0" and s.n_ctx == 1024
        with pytest.raises(KvcliError, match="would quantise its kept keys again at every chunk: read it with "
                                             "--cache-type f16"):
            prefill_and_compress(s, tokens, resolve(s.model_path, "snapkv", 48, {}), chunk=128)
    finally:
        s.close()


def read_in_float16(note: str) -> str:
    return next(part for part in note.split("; ") if part.startswith("read in a float16 cache"))


def test_chat_cache_type_q8_0_stores_q8_0_chunks_read_in_float16(tiny_32, tmp_path, cache_dir):
    """`kvcli compress --store --cache-type q8_0` writes q8_0 chunk files read in a float16 cache (store.json says
    both); `kvcli run --cache DIR` answers from it; q4_0 (no chunk format) is refused in one line."""
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    env = {**os.environ, "KVCLI_CACHE": str(cache_dir), "KVCLI_THREADS": "1"}
    base = [sys.executable, "-m", "kvcli.cli"]
    out = tmp_path / "st"
    r = subprocess.run(base + ["compress", "--model", str(tiny_32), "--doc", str(doc), "--store", "--policy", "snapkv",
                               "--budget", "48", "--chunk", "128", "--cache-type", "q8_0", "-o", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "store.json").read_text())
    assert (m["cache_type"], m["chunk_type"]) == ("f16", "q8_0")
    run = base + ["run", "--model", str(tiny_32), "--cache", str(out), "--policy", "snapkv", "--budget", "48",
                  "-n", "4", Q]
    ok = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    # a random model's 4 tokens may be whitespace: the answer is there when its tokens are counted and printed
    assert ok.returncode == 0 and ok.stdout and "4 answer tokens" in ok.stderr, ok.stderr
    q4 = subprocess.run(base + ["compress", "--model", str(tiny_32), "--doc", str(doc), "--store", "--policy",
                                "snapkv", "--budget", "48", "--chunk", "128", "--cache-type", "q4_0", "-o",
                                str(tmp_path / "q4")], env=env, capture_output=True, text=True, timeout=300)
    assert q4.returncode != 0 and "float16 or q8_0 rows, not q4_0" in q4.stderr and "Traceback" not in q4.stderr


def test_a_gguf_header_is_parsed_once_per_file_version(tmp_path):
    """models.header_values, asked by every observed prefill, parses a file once: a caller's changes to the dict do not
    reach the next caller, and a file rewritten in place (another size or time) is parsed again."""
    from kvcli.models import header_values
    from kvcli.testing.tiny_gguf import write_tiny_llama
    path = tmp_path / "m.gguf"
    write_tiny_llama(path, n_ctx_train=1024)
    first = header_values(path)
    assert first["llama.context_length"] == 1024
    first["llama.context_length"] = 7
    assert header_values(path)["llama.context_length"] == 1024
    write_tiny_llama(path, n_ctx_train=2048)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))   # a rewrite within the clock's tick: time differs
    assert header_values(path)["llama.context_length"] == 2048
