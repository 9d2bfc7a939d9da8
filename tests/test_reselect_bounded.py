"""Bounded re-selection (kvcli/drivers/reselect_bounded.py) on a tiny random model.

What it must show: a document stored in one chunk is re-selected exactly as the exact form re-selects it (the
same observation at kvcli check's L2 thresholds, the same plan); stored in several chunks, the cache never holds
more than the kept entries + one chunk + the probe while a question is re-selected; a chunk moved to other
positions (llama.cpp's K-shift) is attended to as before (relative positions are what RoPE keeps); a changed or
deleted store, a column-sum policy and the reference engine are refused in one line; a kept store folder opens
again (ChunkedStore.open) and re-selects as the store that was read, and a store folder that is damaged, another
model's or another kvcli's is refused in one line.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvcli.drivers.check import Thresholds, compare_observations
from kvcli.errors import KvcliError
from kvcli.planning.planner import resolve
from helpers import reselection_session

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))
Q = "Which code did the river station log?"


# every test stores its documents in a cache folder of its own (conftest.py)
pytestmark = pytest.mark.usefixtures("cache_dir")


@pytest.fixture(autouse=True)
def every_chunk(monkeypatch):
    """These tests are about streaming the stored chunks: every one of them, as before the block index
    (tests/test_book.py tests the choice)."""
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "all")


@pytest.fixture(scope="module")
def setup(tiny_2k):
    """(session with two sequences, document head tokens, prompt tokens of Q)."""
    s, head, prompt = reselection_session(tiny_2k, DOC, Q)
    yield s, head, prompt
    s.close()


def cfg_of(model, policy="snapkv", budget=48):
    from kvcli.planning.planner import resolve
    return resolve(model, policy, budget, {}, Q)


def test_one_chunk_is_exact_reselection(tiny_2k, setup):
    from kvcli.drivers.reselect import StoredDocument
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    exact = StoredDocument.read(s, head)
    bounded = ChunkedStore.read(s, head, cfg, chunk=len(head) + cfg.observe[1] + 8)
    assert len(bounded.chunks) == 1 and bounded.chunks[0].n == bounded.split == exact.split
    seen = {}
    exact.reselect(s, prompt, cfg, on_step=lambda obs, plan: seen.update(exact=(obs.with_kv_arrays(), plan)))
    r = bounded.reselect(s, prompt, cfg, on_step=lambda obs, plan: seen.update(bounded=(obs.with_kv_arrays(), plan)))
    assert r.chunks == 1 and r.prefilled == len(prompt) - r.restored
    (obs_e, plan_e), (obs_b, plan_b) = seen["exact"], seen["bounded"]
    l2 = compare_observations(obs_e, obs_b, Thresholds())
    assert l2["pass"], l2
    assert all(np.array_equal(plan_e.kept(l, h), plan_b.kept(l, h))
               for l in range(plan_e.n_layer) for h in range(plan_e.n_head_kv))
    exact.close()
    bounded.close()


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv", "spindlekv", "streamingllm"])
def test_every_window_policy_reselects_bounded(tiny_2k, setup, policy):
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k, policy)
    store = ChunkedStore.read(s, head, cfg, chunk=128)
    r = store.reselect(s, prompt, cfg)
    assert r.chunks == len(store.chunks) > 1 and r.plan is not None
    assert s.stats(0)["kv_cells"] <= 2 * cfg.budget
    store.close()


def test_streamed_chunks_stay_within_kept_plus_chunk(tiny_2k, setup, cache_dir):
    from kvcli.drivers.chunked import probe_length
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.generate import generate
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    chunk = 128
    store = ChunkedStore.read(s, head, cfg, chunk=chunk)
    manifest = json.loads((store.path / "store.json").read_text())
    assert [c["n"] for c in manifest["chunks"]] == [c.n for c in store.chunks]
    _, window = cfg.observe
    assert sum(c.n for c in store.chunks) == store.split and len(store.chunks) > 1
    # each leaves its question's probe room
    assert all(c.n <= chunk - probe_length(window, chunk) for c in store.chunks)
    assert all((store.path / c.file).stat().st_size == c.nbytes for c in store.chunks)
    assert not list(cache_dir.glob("documents/*/*.part"))         # the folder was renamed into place
    held = []
    # the bound of the read (a context that holds more lets chunks that fit together be re-selected together)
    r = store.reselect(s, prompt, cfg, on_step=lambda obs, plan: held.append(obs.n), cells=cfg.budget + chunk)
    assert r.chunks == len(store.chunks) and len(held) == len(store.chunks)
    assert max(held) <= cfg.budget + chunk + len(prompt) - store.split, held   # chunks leave the probe room
    assert s.stats(0)["kv_cells"] <= cfg.budget                      # compacted for the question
    assert len(generate(s, 4).tokens) == 4                             # and it answers
    store.close()
    assert not store.path.exists()


def test_the_held_cells_are_probed_by_the_whole_question(tiny_2k, monkeypatch):
    """Between chunks the held cells are scored by the question prefilled after them (the prompt after the stored
    document, up to block_index.QUESTION_TOKENS), not by the prompt's last `window` tokens alone: a question that
    quotes a passage and ends with an instruction has the passage's tokens in its probe."""
    from kvcli.drivers import block_index, reselect_bounded
    from kvcli.drivers.reselect_bounded import ChunkedStore
    quote = " ".join(f"the {w} station logged code ___ at dawn;" for w in ["north", "river", "delta"] * 3)
    question = f'The document holds this passage: "{quote}". What is the missing number? Answer with it only.'
    s, head, prompt = reselection_session(tiny_2k, DOC, question)
    try:
        cfg = cfg_of(tiny_2k)
        _, window = cfg.observe
        store = ChunkedStore.read(s, head, cfg, chunk=128)
        after = len(prompt) - store.split
        assert window < after <= block_index.QUESTION_TOKENS
        probes, real = [], reselect_bounded.probe_window
        monkeypatch.setattr(reselect_bounded, "probe_window", lambda sess, seq, probe, obs, w:
                            probes.append((list(probe), w)) or real(sess, seq, probe, obs, w))
        store.reselect(s, prompt, cfg, cells=cfg.budget + 128)
        assert probes and all(p == prompt[store.split:] and w == window for p, w in probes)
        assert s.stats(0)["kv_cells"] <= cfg.budget
        store.close()
    finally:
        s.close()


def test_a_conversation_probes_by_the_answer_before_it_and_its_question(tiny_2k, monkeypatch):
    """A later question of a conversation prefills the answer before it and itself; its probe is both, as the last
    step observes them (a follow-up question may lean on the answer), not the prompt's last `window` tokens."""
    from kvcli.drivers import block_index, reselect_bounded
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, p1 = reselection_session(tiny_2k, DOC, "Which code did the river station log?")
    try:
        cfg = cfg_of(tiny_2k)
        _, window = cfg.observe
        store = ChunkedStore.read(s, head, cfg, chunk=128)
        store.reselect(s, p1, cfg, extend=True, cells=cfg.budget + 128)
        answer = "The river station logged code 1074 on its third entry, as the log of that morning says. " * 2
        quote = " ".join(f"the {w} station logged code ___ at dawn;" for w in ["north", "stone", "delta"] * 2)
        new = turn(s, answer, f'The document holds this passage: "{quote}". What is the missing number?')
        assert window < len(new) <= block_index.QUESTION_TOKENS
        probes, real = [], reselect_bounded.probe_window
        monkeypatch.setattr(reselect_bounded, "probe_window", lambda sess, seq, probe, obs, w:
                            probes.append(list(probe)) or real(sess, seq, probe, obs, w))
        r = store.reselect(s, p1 + new, cfg, extend=True, cells=cfg.budget + 128)
        assert r.source == "conversation" and r.prefilled == len(new)
        assert probes and all(p == new for p in probes)
        assert s.stats(0)["kv_cells"] <= cfg.budget
        store.close()
    finally:
        s.close()


def test_a_moved_chunk_is_attended_to_as_before(tiny_2k, setup):
    """The same chunk at its stored positions and moved 48 positions back (append_saved: llama.cpp's K-shift):
    a probe after it attends to it alike, since RoPE attention depends on relative positions only."""
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    store = ChunkedStore.read(s, head, cfg_of(tiny_2k), chunk=128)
    c = store.chunks[1]
    assert c.first_pos > 0
    probe = prompt[-16:]
    sums = []
    for moved in (False, True):
        s.clear(0)
        if moved:
            s.append_saved(store._snapshot(c), 0, 1, filler=probe[0])
            assert s.seq(0).next_pos == c.n                          # positions 0..n-1 now
        else:
            s.restore_seq(store._snapshot(c), 0)
            assert s.seq(0).next_pos == c.first_pos + c.n
        obs = s.prefill(probe, seq=0, observe=("window",), window=len(probe))
        sums.append(obs.window_sums[..., :c.n])
    np.testing.assert_allclose(sums[0], sums[1], rtol=2e-2, atol=2e-3)
    s.clear(0)
    store.close()


def test_refusals(tiny_2k, setup):
    from kvcli.drivers.reselect import StoreMissing
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    with pytest.raises(KvcliError, match="column sums"):
        ChunkedStore.read(s, head, cfg_of(tiny_2k, "h2o"), chunk=128)
    with pytest.raises(KvcliError, match="column maxima"):
        ChunkedStore.read(s, head, cfg_of(tiny_2k, "kvzip"), chunk=128)
    store = ChunkedStore.read(s, head, cfg, chunk=128)
    with pytest.raises(KvcliError, match="column sums"):
        store.reselect(s, prompt, cfg_of(tiny_2k, "h2o"))
    with pytest.raises(KvcliError, match="does not start with"):
        store.reselect(s, prompt[:5] + prompt, cfg)
    f = store.path / store.chunks[1].file
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(KvcliError, match="corrupted"):
        store.reselect(s, prompt, cfg)
    store.close()
    with pytest.raises(StoreMissing, match="gone"):
        store.reselect(s, prompt, cfg)
    from kvcli.reference.session import ReferenceSession
    ref = ReferenceSession(tiny_2k, n_ctx=1024, n_seq=2)
    with pytest.raises(KvcliError, match="native engine"):
        ChunkedStore.read(ref, head, cfg, chunk=128)


def test_chat_reselects_in_bounded_chunks_where_bounded_reading_applies(tiny_2k, cli_runner, tmp_path):
    """--chunk N (as a document above the bounded-reading threshold, or longer than the context) makes a re-selected
    chat bounded: the summary and every row say so, the answers come; a column-sum policy is refused in one line;
    a document longer than the model's context (2k) is served too."""
    from kvcli.cli import cli
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    qs = "Which code did the river station log?\nAnd the stone station?\n"
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "snapkv", "--budget",
                                "48", "--chunk", "128", "--fresh", "--json", "-n", "4"], input=qs)
    assert r.exit_code == 0, r.output
    assert "re-selected per question, bounded" in r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and all(x["reselect_chunks"] > 1 and x["generated_tokens"] >= 1 for x in rows)
    assert all(x["kv_cells"] <= 48 + x["generated_tokens"] for x in rows)
    # a conversation (no --fresh): later questions stream the kept turns and prefill less than the whole
    # conversation after the document, which a re-selection from the document alone prefills
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "snapkv", "--budget",
                                "48", "--chunk", "128", "--json", "-n", "4"], input=qs + "What is entry 7?\n")
    assert r.exit_code == 0, r.output
    conv = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["reselect_from"] for x in conv] == ["document", "conversation", "conversation"]
    split = conv[0]["prompt_tokens"] - conv[0]["reselect_prefilled_tokens"]
    assert all(x["reselect_prefilled_tokens"] < x["prompt_tokens"] - split for x in conv[1:])
    assert conv[2]["reselect_chunks"] > conv[0]["reselect_chunks"]
    # pyramidkv (an 8-token window, probed with the question before it) re-selects bounded too
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "pyramidkv",
                                "--budget", "48", "--chunk", "128", "--fresh", "-n", "2"], input=qs)
    assert r.exit_code == 0, r.output
    assert "re-selected per question, bounded" in r.stderr
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "h2o", "--budget",
                                "48", "--chunk", "128", "--fresh"], input=qs)
    assert r.exit_code != 0 and "column sums" in r.output and "Traceback" not in r.output
    # --store keeps the bounded store: a folder, whose answers are those of the chat that did not keep it
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "snapkv", "--budget",
                                "48", "--chunk", "128", "--store", str(tmp_path / "kept"), "--fresh", "--json", "-n",
                                "4"], input=qs)
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["answer"] for line in r.stdout.splitlines()] == [x["answer"] for x in rows]
    assert (tmp_path / "kept" / "store.json").is_file() and len(list((tmp_path / "kept").glob("chunk-*"))) > 1
    long = tmp_path / "long.txt"
    long.write_text(DOC * 5, encoding="utf-8")        # ~3.9k tokens: past the 2k context
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny_2k), "--doc", str(long), "--policy", "snapkv", "--budget",
                                "48", "--fresh", "--json", "-n", "2"], input=qs)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and rows[0]["prompt_tokens"] > 2048 and rows[0]["reselect_chunks"] > 2


def test_which_documents_are_re_selected_bounded(tiny_2k, monkeypatch):
    """Exact while the full cache is at most KVCLI_RESELECT_EXACT_MB (256 MiB by default), though bounded reading
    would read the document in chunks; bounded above it, and with --chunk N."""
    from kvcli.apps.chat import Conversation
    from kvcli.native.session import NativeSession
    monkeypatch.setenv("KVCLI_BOUNDED_ABOVE_MB", "0")      # bounded reading for any document longer than budget + chunk
    s = NativeSession(tiny_2k, n_ctx=0)
    conv = Conversation(s, DOC, compression=resolve(s.model_path, "snapkv", 48), reselect=True)
    cfg = conv._cfg(None)
    monkeypatch.setattr("kvcli.drivers.chunked.DEFAULT_CHUNK", 256)
    assert conv.chunking().chunk is not None
    assert conv.store_form(cfg)[0] == "exact"
    monkeypatch.setenv("KVCLI_RESELECT_EXACT_MB", "0")
    assert conv.store_form(cfg)[0] == "bounded"
    monkeypatch.setenv("KVCLI_RESELECT_EXACT_MB", "-1")
    with pytest.raises(KvcliError, match="KVCLI_RESELECT_EXACT_MB"):
        conv.store_form(cfg)
    monkeypatch.delenv("KVCLI_RESELECT_EXACT_MB")
    conv.chunk = 128
    assert conv.store_form(cfg)[0] == "bounded"
    s.close()


def test_each_form_is_its_own_class(tiny_2k, monkeypatch, tmp_path):
    """A re-selected conversation (issue #65) is a Reselected until its document is read, then its store's form's
    class, ReselectedExact or ReselectedBounded; a read again that picks the other form (the stored cache deleted
    after the exact form's size limit changed) changes the class with it, the turns kept; from_store opens a .kvc
    file and a store folder each in its form, answering as before."""
    from kvcli.apps.chat import Conversation, Reselected, ReselectedBounded, ReselectedExact
    from kvcli.native.session import NativeSession
    monkeypatch.setenv("KVCLI_BOUNDED_ABOVE_MB", "0")      # bounded reading for any document longer than budget + chunk
    monkeypatch.setattr("kvcli.drivers.chunked.DEFAULT_CHUNK", 256)
    cfg = resolve(tiny_2k, "snapkv", 48)
    conv = Conversation(NativeSession(tiny_2k, n_ctx=0), DOC, compression=cfg, reselect=True)
    said = []
    conv.notify = said.append
    assert type(conv) is Reselected
    conv.compress()
    assert type(conv) is ReselectedExact and conv.store.form == "exact"
    first = conv.ask(Q, 4).text
    conv.save(tmp_path / "exact.kvc")
    monkeypatch.setenv("KVCLI_RESELECT_EXACT_MB", "0")    # the same document is now past the exact form's size
    conv.store.path.unlink()
    conv.ask("And the stone station?", 3)
    assert any("gone" in line for line in said)
    assert type(conv) is ReselectedBounded and conv.store.form == "bounded" and len(conv.turns) == 2
    conv.reset()
    bounded_first = conv.ask(Q, 4).text
    conv.save(tmp_path / "bounded")
    conv.close()
    conv.session.close()
    for path, cls, answer in ((tmp_path / "exact.kvc", ReselectedExact, first),
                              (tmp_path / "bounded", ReselectedBounded, bounded_first)):
        loaded = Conversation.from_store(path, compression=cfg)
        assert type(loaded) is cls and len(loaded.turns) == 1
        loaded.reset()
        assert loaded.ask(Q, 4).text == answer
        loaded.close()
        loaded.session.close()


def test_ctrl_c_and_a_deleted_store_leave_a_bounded_chat_usable(tiny_2k, monkeypatch):
    """Ctrl-C while the stored chunks stream in leaves the conversation as it was before the question (nothing
    held, the loading sequence free); the store deleted mid-chat is read again, said in one line."""
    from kvcli.apps.chat import Conversation
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.native.session import NativeSession
    conv = Conversation(NativeSession(tiny_2k, n_ctx=0), DOC, compression=resolve(tiny_2k, "snapkv", 48),
                        reselect=True, chunk=128)
    said = []
    conv.notify = said.append
    conv.compress()
    assert conv.store.form == "bounded"
    conv.ask(Q, 3)
    real, calls = ChunkedStore._snapshot, []

    def interrupted(self, c):
        calls.append(c)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, c)
    kept = conv.store.extension
    assert kept is not None and kept.split == conv.prompt_len
    # /stats says where the turns are kept (the form's own words: TurnChunks.describe; it raised AttributeError)
    assert f"MB in {len(kept.chunks)} turn chunks)" in conv.stats_table()
    monkeypatch.setattr(ChunkedStore, "_snapshot", interrupted)
    with pytest.raises(KeyboardInterrupt):
        conv.ask("And the stone station?", 3)
    monkeypatch.setattr(ChunkedStore, "_snapshot", real)
    assert len(conv.turns) == 1 and conv.session.cells_used() == 0
    assert conv.store.extension is kept                              # the kept turns are as before the question
    import shutil
    shutil.rmtree(conv.store.path)
    gen = conv.ask("And the stone station?", 3)
    assert len(gen.tokens) >= 1 and len(conv.turns) == 2
    assert any("gone" in line for line in said) and conv.store.path.exists()
    conv.reset()   # the kept turns go (ChunkedStore.drop_extension)
    assert conv.store.extension is None and conv.turns == []
    conv.close()
    assert not conv.store.path.exists()
    conv.session.close()


# ------------------------------------------------------------------------------ a kept store folder
def kept_store(s, head, cfg, path):
    from kvcli.drivers.reselect_bounded import ChunkedStore
    return ChunkedStore.read(s, head, cfg, chunk=128, path=path, keep=True,
                             meta={"document": DOC, "system": None})


def test_a_kept_store_opens_and_reselects_as_it_was_read(tiny_2k, setup, tmp_path):
    """A store folder opened again (kvcli run/chat --cache DIR) re-selects the same plans from the same chunks as the
    store that read the document; /save DIR (save_as) writes a copy with the turns, which opens too."""
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, prompt = setup
    cfg = cfg_of(tiny_2k)
    read = kept_store(s, head, cfg, tmp_path / "store")
    opened = ChunkedStore.open(tmp_path / "store", tiny_2k)
    assert opened.keep and opened.form == "bounded" and opened.tokens == read.tokens and opened.split == read.split
    assert [vars(c) for c in opened.chunks] == [vars(c) for c in read.chunks]
    assert opened.meta["document"] == DOC and opened.meta["turns"] == []
    from kvcli.apps.chat import store_model
    assert store_model(tmp_path / "store") == tiny_2k   # the model a command resolves its compression for
    plans = {}
    for name, store in (("read", read), ("opened", opened)):
        store.reselect(s, prompt, cfg, on_step=lambda obs, plan, name=name: plans.setdefault(name, []).append(plan),
                       cells=cfg.budget + store.chunk)   # a probe and a plan per chunk
    assert len(plans["read"]) == len(plans["opened"]) == len(read.chunks)
    for a, b in zip(plans["read"], plans["opened"]):
        assert all(np.array_equal(a.kept(l, h), b.kept(l, h)) for l in range(a.n_layer) for h in range(a.n_head_kv))
    turn = {"question": Q, "answer": "1074", "stopped": "eos", "tokens_in": 12, "tokens_out": 3}
    size = opened.save_as(tmp_path / "copy", s, [turn])
    copy = ChunkedStore.open(tmp_path / "copy", tiny_2k)
    assert copy.meta["turns"] == [turn] and size == sum(f.stat().st_size for f in (tmp_path / "copy").iterdir())
    opened.save_as(tmp_path / "store", s, [turn, turn])       # onto itself: rewritten in place
    assert ChunkedStore.open(tmp_path / "store", tiny_2k).meta["turns"] == [turn, turn]
    # no .part / .old left behind; both folders listed as kept stores, once each (kvcli/document_store.py)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "kvcache") == ["copy", "store"]
    from kvcli import document_store
    assert sorted((i.state, Path(i.kept_path).name) for i in document_store.entries()) == \
        [("kept", "copy"), ("kept", "store")]
    opened.close()
    assert (tmp_path / "store").exists()                          # an opened store is kept


def _rewrite_manifest(path, change):
    from kvcli.drivers.reselect_bounded import write_manifest
    m = json.loads((path / "store.json").read_text())
    change(m)
    write_manifest(path, m)      # with a valid checksum: what the other checks see


def _damage(kind, path, other):
    manifest = path / "store.json"
    chunk = path / "chunk-0001.state"
    if kind == "no store.json":
        manifest.unlink()
    elif kind == "store.json edited":
        manifest.write_text(manifest.read_text().replace('"split": ', '"split": 1'))
    elif kind == "store.json truncated":
        manifest.write_bytes(manifest.read_bytes()[:100])
    elif kind == "chunk missing":
        chunk.unlink()
    elif kind == "chunk truncated":
        chunk.write_bytes(chunk.read_bytes()[:-10])
    elif kind == "chunk corrupted":
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))
    elif kind == "other kvcli":
        _rewrite_manifest(path, lambda m: m.update(kvcli_version="0.0.1"))
    elif kind == "file outside the folder":
        _rewrite_manifest(path, lambda m: m["chunks"][0].update(file="../chunk-0000.state"))
    elif kind == "chunks that do not tile":
        _rewrite_manifest(path, lambda m: m["chunks"][1].update(first_token=m["chunks"][1]["first_token"] + 1))
    elif kind == "another model":
        return other
    return None


DAMAGES = {"no store.json": "without store.json", "store.json edited": "corrupted (checksum mismatch)",
           "store.json truncated": "corrupted or truncated", "chunk missing": "chunk-0001.state is missing",
           "chunk truncated": "chunk-0001.state is truncated", "chunk corrupted": "chunk-0001.state is corrupted",
           "other kvcli": "was written by kvcli 0.0.1", "file outside the folder": "corrupted (chunk 0)",
           "chunks that do not tile": "does not follow chunk 0", "another model": "was compressed for model"}


@pytest.mark.parametrize("kind", list(DAMAGES))
def test_a_damaged_or_foreign_store_is_refused(tiny_2k, other_tiny_2k, setup, tmp_path, kind):
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, _ = setup
    path = tmp_path / "store"
    kept_store(s, head, cfg_of(tiny_2k), path)
    model = _damage(kind, path, other_tiny_2k) or tiny_2k
    with pytest.raises(KvcliError, match=re.escape(DAMAGES[kind])):
        ChunkedStore.open(path, model)


def test_a_store_replaces_only_a_store(tiny_2k, setup, tmp_path):
    """Writing a store where a folder of other files is refused before anything is read (nothing deleted); an
    existing file is not replaced by a folder; an earlier store folder is replaced."""
    from kvcli.drivers.reselect_bounded import ChunkedStore, check_store_target
    s, head, _ = setup
    cfg = cfg_of(tiny_2k)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(KvcliError, match="not a kvcli store"):
        kept_store(s, head, cfg, mine)
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1
    (tmp_path / "file.kvc").write_bytes(b"x")
    with pytest.raises(KvcliError, match="is a file"):
        kept_store(s, head, cfg, tmp_path / "file.kvc")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvcliError, match="name a file"):           # the exact form's .kvc file
        check_store_target(tmp_path / "empty", form="exact")
    first = kept_store(s, head, cfg, tmp_path / "store")
    (tmp_path / "store" / "stray").write_text("")          # a store folder is replaced whole
    second = kept_store(s, head, cfg_of(tiny_2k, budget=64), tmp_path / "store")
    assert second.read_budget == 64 and not (tmp_path / "store" / "stray").exists()
    assert ChunkedStore.open(tmp_path / "store", tiny_2k).read_budget == 64 and first.path == second.path


# ------------------------------------------------------------------------------ a conversation's turns
def turn(s, answer, question):
    """The tokens a conversation adds after a prompt: the answer, then the next question's user turn."""
    from kvcli.apps.chat import TurnFormat
    fmt = TurnFormat.probe(s, None)
    return s.tokenize(answer + fmt.assistant_to_user + question + fmt.after_user)


def test_kept_turns_observe_what_the_document_path_observes(tiny_2k, setup):
    """With a budget that keeps every stored entry (nothing is evicted while the chunks stream), the turns kept from
    the first question's re-selection are the cells the second question's prefill would compute: the same
    observation (kvcli check's L2 thresholds) and the same plan as re-selecting it from the document alone."""
    from kvcli.drivers.reselect_bounded import ChunkedStore
    s, head, p1 = setup
    store = ChunkedStore.read(s, head, cfg_of(tiny_2k), chunk=128)
    cfg = cfg_of(tiny_2k, budget=store.split + 8)
    window = cfg.observe[1]
    p2 = p1 + turn(s, "Code 1074.", "And the stone station?")
    r1 = store.reselect(s, p1, cfg, extend=True)
    assert r1.source == "document" and store.extension.split == len(p1) and r1.keep_s > 0
    assert [(c.first_token, c.n) for c in store.extension.chunks] == [(store.split, len(p1) - store.split)]
    seen = {}
    r2 = store.reselect(s, p2, cfg, on_step=lambda obs, plan: seen.update(turns=(obs.with_kv_arrays(), plan)))
    assert r2.source == "conversation" and r2.prefilled == max(len(p2) - len(p1), window) < len(p2) - store.split
    store.extension = None
    r3 = store.reselect(s, p2, cfg, on_step=lambda obs, plan: seen.update(document=(obs.with_kv_arrays(), plan)))
    assert r3.source == "document" and r3.prefilled == len(p2) - store.split
    (obs_d, plan_d), (obs_t, plan_t) = seen["document"], seen["turns"]
    assert obs_d.n == obs_t.n == len(p2)
    l2 = compare_observations(obs_d, obs_t, Thresholds())
    assert l2["pass"], l2
    assert all(np.array_equal(plan_d.kept(l, h), plan_t.kept(l, h))
               for l in range(plan_d.n_layer) for h in range(plan_d.n_head_kv))
    store.close()


def test_a_conversation_prefills_only_what_is_new_within_the_bound(tiny_2k, setup):
    """Three questions: the second and third prefill only the answer before them and their question; the kept turns
    tile the conversation, one chunk per question; while the chunks stream the cache holds at most the kept entries +
    a chunk (the probe included), the turns costing no probe of their own; a prompt that leaves the kept turns part-way
    uses them up to
    there, one that leaves them at once (another first question) is re-selected from the document."""
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.generate import generate
    s, head, p1 = setup
    cfg = cfg_of(tiny_2k)
    window, chunk = cfg.observe[1], 128
    store = ChunkedStore.read(s, head, cfg, chunk=chunk)
    long_answer = "The river station logged code 1074 on its third entry, as the log of that morning says. " * 2
    p2 = p1 + turn(s, long_answer, "And the stone station, which logged after it?")
    p3 = p2 + turn(s, long_answer.replace("river", "stone"), "What is entry 7?")
    held, rs = [], []
    for p in (p1, p2, p3):
        held.append([])
        rs.append(store.reselect(s, p, cfg, extend=True, on_step=lambda obs, plan: held[-1].append(obs.n),
                                 cells=cfg.budget + chunk))
        assert s.stats(0)["kv_cells"] <= cfg.budget and len(generate(s, 2).tokens) == 2
    assert [r.source for r in rs] == ["document", "conversation", "conversation"]
    assert [r.prefilled for r in rs] == [max(len(p1) - store.split, window), len(p2) - len(p1), len(p3) - len(p2)]
    assert all(r.prefilled > window for r in rs[1:])
    ext = store.extension
    assert ext.split == len(p3) and [(c.first_token, c.n) for c in ext.chunks] == [
        (store.split, len(p1) - store.split), (len(p1), len(p2) - len(p1)), (len(p2), len(p3) - len(p2))]
    assert rs[2].chunks == len(store.chunks) + 2
    # probed with the kept entries and at most a chunk (the probe's room left); the last step adds what it prefills
    assert all(n <= cfg.budget + chunk - window for h in held for n in h[:-1]), held
    assert all(h[-1] <= cfg.budget + chunk - window + r.prefilled for h, r in zip(held, rs)), held
    # the turns are streamed beside the held cells while they fit (a probe every so many, not one each): here the
    # first rides with the document's last chunk, the two together (132 tokens) need one probe more
    assert [len(h) - len(held[0]) for h in held] == [0, 0, 1], held
    # leaves the kept turns inside the second question's chunk: the first chunk whole, the second replaced
    p2b = p1 + turn(s, long_answer, "And the north station?")
    same = next(i for i, (a, b) in enumerate(zip(p2b, p3)) if a != b)
    r = store.reselect(s, p2b, cfg, extend=True)
    assert r.source == "conversation" and r.restored == min(same, len(p2b) - window)
    assert [c.first_token for c in store.extension.chunks] == [store.split, len(p1)]
    assert store.extension.chunks[-1].n == len(p2b) - len(p1)
    # another first question: only the document's last tokens of the kept turns apply, the rest is prefilled
    other = head + s.tokenize("\n\nWhich code did the delta station log, and which code did the gamma station log "
                              "in the entry after it, on the same morning?")
    same = next(i for i, (a, b) in enumerate(zip(other, p2b)) if a != b)
    assert store.split < same < len(p1)
    r = store.reselect(s, other, cfg, extend=True)
    assert r.restored == min(same, len(other) - window) and r.prefilled == len(other) - r.restored
    assert [(c.first_token, c.n) for c in store.extension.chunks] == [(store.split, len(other) - store.split)]
    # a short one, whose window reaches before the kept turns: re-selected from the document alone
    short = head + s.tokenize("\n\nWhich code?")
    r = store.reselect(s, short, cfg, extend=True)
    assert r.source == "document" and r.restored == len(short) - window
    store.close()


def test_a_policy_bounded_re_selection_cannot_serve_is_refused_when_chosen(tiny_2k):
    """/policy on a bounded chat: a column-sum or column-maxima policy is refused at once, in bounded re-selection's
    one message (check_usable's, the same as `kvcli chat --policy h2o --chunk N` gets), and the chat goes on with
    the policy it had (issue #65: one message per mistake)."""
    from kvcli.apps.chat import Conversation
    from kvcli.drivers.reselect_bounded import check_usable
    from kvcli.native.session import NativeSession
    conv = Conversation(NativeSession(tiny_2k, n_ctx=0), DOC, compression=resolve(tiny_2k, "snapkv", 48),
                        reselect=True, chunk=128)
    conv.compress()
    assert conv.store.form == "bounded"
    for policy, what in (("h2o", "column sums"), ("kvzip", "column maxima")):
        with pytest.raises(KvcliError) as chosen:
            conv.recompress(policy, 48)
        with pytest.raises(KvcliError) as direct:
            check_usable(conv.session, cfg_of(tiny_2k, policy))
        assert str(chosen.value) == str(direct.value) and what in str(chosen.value)
        assert (conv.policy, conv.budget) == ("snapkv", 48)
    assert len(conv.ask(Q, 3).tokens) >= 1 and conv.last_reselection is not None
    conv.close()
    conv.session.close()
