"""Citations in chat's bounded form (kvcli/drivers/reselect_bounded.py `Origins`, kvcli/citations.py cite_turn) and
the notice before a long read (kvcli/doc_formats.py read_notice, kvcli/apps/chat_bounded.py
ReselectedBounded._read_document).

No model: Origins follows entries through chunks put back, cuts and re-indexing compactions (the kept entries of each
head right-aligned in the order of their positions); the notice's estimate, its sources and its threshold. On the
default model: a bounded re-selection whose block index streamed some of the stored chunks maps every kept entry to
its prompt token (layer 0's V rows, which depend on the token alone, equal those of a plain prefill of the prompt),
the answer's citations name the planted line from a streamed chunk, and `kvcli chat --chunk N --cite` prints them
under the answer after one notice line on stderr."""
from __future__ import annotations

import json

import numpy as np
import pytest
from kvcli import doc_formats
from kvcli.drivers import reselect_bounded
from kvcli.drivers.reselect_bounded import Origins
from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from kvcli.planning.planner import resolve

pytestmark = pytest.mark.usefixtures("cache_dir")


class _Info:
    n_layer, n_head_kv = 1, 2


# ------------------------------------------------------------------------------------------ no model
def test_origins_follow_chunks_cuts_and_reindexing_compactions(monkeypatch):
    o = Origins.start(_Info(), list(range(40)))
    o.append(0, 10, 6)                       # positions 0..5 hold tokens 10..15
    assert o.of.tolist() == [[list(range(10, 16))] * 2]
    # head 0 keeps the slots of positions 1, 3, 5; head 1 those of 0, 4: right-aligned in B = 3 positions
    o.compact(np.arange(6, dtype=np.int32), Plan.from_lists([[np.array([1, 3, 5]), np.array([0, 4])]]))
    assert o.of.tolist() == [[[11, 13, 15], [-1, 10, 14]]]
    o.append(3, 20, 4)                       # a chunk put back after them
    o.truncate(5)                            # the last chunk cut where the prompt's rest begins
    assert o.of.tolist() == [[[11, 13, 15, 20, 21], [-1, 10, 14, 20, 21]]]
    # cells out of position order: the kept entries are laid out by position, not by slot
    cells = np.array([4, 0, 1, 2, 3], np.int32)
    monkeypatch.setattr(reselect_bounded, "seq_positions", lambda session, seq: np.append(cells, 7))

    class S:
        ctx = None
    got = o.slot_origins(S(), 0)             # position 7: an answer's token, no prompt token's
    assert [g.tolist() for g in got[0]] == [[21, 11, 13, 15, 20, -1], [21, -1, 10, 14, 20, -1]]
    o.compact(cells, Plan.from_lists([[np.array([0, 2]), np.array([0, 1, 3])]]))
    assert o.of.tolist() == [[[-1, 13, 21], [-1, 14, 21]]]    # head 1's dead slot (position 0) kept nothing


def test_read_notice_says_tokens_time_and_how_it_was_estimated(monkeypatch):
    monkeypatch.delenv("KVCLI_READ_NOTICE_S", raising=False)
    line = doc_formats.read_notice(48213, (120.0, "KVCLI_READ_TOK_S"), "reading it in chunks of 1024")
    assert line == ("this document is 48,213 tokens: reading it in chunks of 1024 will take about 6 min 42 s "
                    "(estimated at 120 tokens/s: KVCLI_READ_TOK_S)")
    assert doc_formats.read_notice(2000, (120.0, "x")) is None            # 17 s: below READ_NOTICE_S
    assert doc_formats.read_notice(10 ** 6, None) is None                 # no speed known
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "0")
    assert "2,000 tokens" in doc_formats.read_notice(2000, (120.0, "x"))
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "off")
    assert doc_formats.read_notice(10 ** 6, (1.0, "x")) is None
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "soon")
    with pytest.raises(KvcliError, match="KVCLI_READ_NOTICE_S"):
        doc_formats.read_notice(10, (1.0, "x"))
    assert doc_formats._duration(7322) == "2 h 02 min"


def test_read_speed_is_configured_or_the_last_read_measured_here(monkeypatch, cache_dir):
    monkeypatch.delenv("KVCLI_READ_TOK_S", raising=False)
    assert doc_formats.read_speed("m.gguf|bounded|f16|threads 1") is None
    doc_formats.record_read_speed("m.gguf|bounded|f16|threads 1", 100, 1.0)     # too short to measure
    assert doc_formats.read_speed("m.gguf|bounded|f16|threads 1") is None
    doc_formats.record_read_speed("m.gguf|bounded|f16|threads 1", 6000, 50.0)
    tok_s, how = doc_formats.read_speed("m.gguf|bounded|f16|threads 1")
    assert tok_s == 120.0 and how.startswith("measured by the last such read here: 6,000 tokens in 50 s, 20")
    assert (cache_dir / doc_formats.SPEEDS).is_file()
    assert doc_formats.read_speed("m.gguf|bounded|f16|threads 2") is None
    monkeypatch.setenv("KVCLI_READ_TOK_S", "300")
    assert doc_formats.read_speed("m.gguf|bounded|f16|threads 1") == (300.0, "KVCLI_READ_TOK_S")
    monkeypatch.setenv("KVCLI_READ_TOK_S", "-3")
    with pytest.raises(KvcliError, match="KVCLI_READ_TOK_S"):
        doc_formats.read_speed("x")
    (cache_dir / doc_formats.SPEEDS).write_text("{not json")
    monkeypatch.delenv("KVCLI_READ_TOK_S")
    assert doc_formats.read_speed("m.gguf|bounded|f16|threads 1") is None    # a damaged file: nothing known


def test_with_no_speed_known_a_long_document_is_timed_on_its_first_tokens(monkeypatch):
    calls = []

    class Session:
        def prefill(self, tokens, seq):
            calls.append((len(tokens), seq))

        def clear(self, seq):
            calls.append(("clear", seq))
    assert doc_formats.probe_speed(Session(), list(range(doc_formats.PROBE_FROM - 1)), 1) is None and not calls
    tok_s, how = doc_formats.probe_speed(Session(), list(range(doc_formats.PROBE_FROM)), 1)
    assert calls == [(doc_formats.PROBE_TOKENS, 1), ("clear", 1)] and tok_s > 0
    assert how == f"the prefill speed of its first {doc_formats.PROBE_TOKENS} tokens, measured just now"


# ------------------------------------------------------------------------------------------ the default model
@pytest.fixture(scope="module")
def logbook():
    from kvcli.evaluation.logbook import make_document
    text, facts = make_document(600, 2, seed=0)
    return text, facts


@pytest.mark.slow
def test_bounded_chat_cites_from_the_entries_of_the_chunks_streamed(default_model, logbook, monkeypatch):
    from kvcli.apps.chat import Conversation
    from kvcli.citations import cite_turn
    from kvcli.native import cache
    from kvcli.native.session import NativeSession
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "off")
    text, facts = logbook
    fact = facts[1]
    s = NativeSession(default_model, n_ctx=0, n_threads=1)
    conv = Conversation(s, text, compression=resolve(s.model_path, "snapkv", 64), reselect=True, chunk=128)
    conv.store_turns = False
    try:
        conv.read_store()
        assert conv.store.form == "bounded" and len(conv.store.chunks) >= 6
        conv.store.select = 1            # the block index streams the first, the last and one chunk between
        gen = conv.ask(fact["question"], 24)
        r = conv.last_reselection
        assert len(r.streamed) == 3 < len(conv.store.chunks) and r.streamed[0] == 0
        o = r.origins
        assert o.tokens[:conv.store.split] == conv.store.tokens
        # every kept entry of the document is one of the streamed chunks' tokens
        held = {t for i in r.streamed for t in range(conv.store.chunks[i].first_token,
                                                     conv.store.chunks[i].first_token + conv.store.chunks[i].n)}
        doc = o.of[(o.of >= 0) & (o.of < conv.store.split)]
        assert doc.size and set(doc.tolist()) <= held
        # live entries per (layer, head): those the map names, and the answer's tokens (all heads) after them
        slots = o.slot_origins(s, conv.seq)
        live = cache.stats(s.ctx, conv.seq, s.info.n_layer_model, s.info.n_head_kv)["per_head_entries"]
        answer = int((cache.seq_positions(s.ctx, conv.seq) >= o.of.shape[2]).sum())
        assert answer == len(gen.tokens)
        assert [[int((h >= 0).sum()) + answer for h in layer] for layer in slots] == live
        # layer 0's V rows depend on the token alone: each kept entry's equals its prompt token's in a plain prefill
        _, v = cache.read_kv(s.ctx, conv.seq, s.info)
        with NativeSession(default_model, n_ctx=2048, n_threads=1) as full:
            full.prefill(list(o.tokens))
            _, vf = cache.read_kv(full.ctx, 0, full.info)
            slot_of = np.argsort(cache.seq_positions(full.ctx, 0))
        for h in range(s.info.n_head_kv):
            k = np.flatnonzero(slots[0][h] >= 0)
            want = vf[0, h, slot_of[slots[0][h][k]]]
            assert np.abs(v[0, h, k] - want).max() < 2e-2
            wrong = vf[0, h, slot_of[np.maximum(slots[0][h][k] - 1, 0)]]   # one token off: far
            assert np.abs(v[0, h, k] - wrong).max() > 0.1
        cited = cite_turn(conv, gen)
        assert cited.note is None and cited.passages
        first = cited.passages[0]
        assert fact["sentence"] in text[first.start:first.end]
        assert first.quote == fact["sentence"] and first.first_line == text[:first.start].count("\n") + 1
    finally:
        conv.close()
        s.close()


@pytest.mark.slow
def test_chat_cite_in_chunks_prints_the_notice_and_the_passages(cli_runner, logbook, tmp_path, monkeypatch):
    from kvcli.cli import cli
    text, facts = logbook
    fact = facts[1]
    doc = tmp_path / "log.txt"
    doc.write_text(text)
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "0")
    monkeypatch.setenv("KVCLI_READ_TOK_S", "50")
    args = ["chat", "--doc", str(doc), "-q", "--threads", "1", "-n", "24", "--policy", "snapkv", "--budget", "64",
            "--chunk", "128"]
    r = cli_runner.invoke(cli, args + ["--cite"], input=fact["question"] + "\n")
    assert r.exit_code == 0, r.output
    notice = [ln for ln in r.stderr.splitlines() if ln.startswith("[this document is ")]
    assert len(notice) == 1 and "reading it in chunks of 128 will take about" in notice[0]
    assert notice[0].endswith("(estimated at 50 tokens/s: KVCLI_READ_TOK_S)]")
    answer, *cited = r.stdout.splitlines()   # the answer's line, then the passages under it
    assert "north ridge" in answer and cited[0].startswith("[1] line ")
    assert fact["sentence"] in cited[0] and len(cited) <= 3
    # --json carries them, and the read's measured speed estimates the next one
    monkeypatch.delenv("KVCLI_READ_TOK_S")
    r = cli_runner.invoke(cli, args + ["--json"], input=fact["question"] + "\n")
    assert r.exit_code == 0, r.output
    line = json.loads(r.stdout.splitlines()[0])
    assert "citations_note" not in line and fact["sentence"] in line["citations"][0]["quote"]
    assert line["reselect_chunks"] <= line["stored_chunks"]
    assert "measured by the last such read here" in r.stderr
