"""`kvcli eval corpus ask --mode reselect|bounded` (issue #63): the corpus's questions answered as kvcli chat answers
them, re-selected per question from the stored full cache (exact form) or from a chunk store (bounded form: the
block index's chunks against every chunk streamed), scored against the right answers and against the reference's."""
from __future__ import annotations

import json
import math

import pytest
from helpers import native_missing

from kvcli.cli import cli
from kvcli.evaluation import corpus, runner
from kvcli.evaluation.corpus_eval import agreement, questions_table, summarise
from kvcli.testing.tiny_gguf import write_tiny_llama

NATO = ("ALPHA BRAVO CHARLIE DELTA ECHO FOXTROT GOLF HOTEL INDIA JULIETT KILO LIMA MIKE NOVEMBER OSCAR PAPA QUEBEC "
        "ROMEO SIERRA TANGO UNIFORM VICTOR WHISKEY XRAY YANKEE ZULU").split()


def man_page(sections: int) -> str:
    """A manual page of `sections` sections, each with a number and an identifier written once."""
    parts = ["NAME\n       demo - a demonstration page\n"]
    for k in range(sections):
        parts.append(f"{NATO[k % 26]} {'TABLES' if k < 26 else 'QUEUES'}\n"
                     f"       The daemon keeps up to {1000 + 37 * k} records in its {NATO[k % 26].lower()} table and "
                     f"writes them back to disk every few minutes.\n       The option DEMO_LIMIT_{k}X sets how many "
                     "of them stay in memory before the oldest is dropped.\n")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cres") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


@pytest.fixture()
def book(tmp_path, monkeypatch):
    """A one-document corpus (about 1,400 tokens of the tiny model) and its part."""
    monkeypatch.setattr(corpus, "package_version", lambda p: "1")
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVCLI_RESELECT_CHUNKS", raising=False)
    f = tmp_path / "demo.txt"
    f.write_text(man_page(22))
    m = corpus.build_corpus(tmp_path / "c", None, sources=(corpus.Source("demo", "technical", "p", "file", str(f),
                                                                          "man"),))
    return tmp_path / "c", m["documents"][0]["split"]


def _ask(cli_runner, tiny, book, *args):
    r = cli_runner.invoke(cli, ["eval", "corpus", "ask", "--model", str(tiny), "--corpus", str(book[0]), "--split",
                                book[1], "--per-kind", "1", "--threads", "1", "--quiet", *args])
    return r


def test_reselect_answers_as_the_full_cache_where_the_budget_holds_the_prompt(cli_runner, tiny, book):
    """Re-selected per question: a budget past the prompt keeps it whole and answers every question exactly as the
    full cache of the same prompt does (the same words, the same cells held); a small budget holds less. Every
    record carries the mode and its fields; the summary compares each configuration with the full cache."""
    if native_missing("kvcli_gather_plan"):
        pytest.fail("the native library lacks kvcli_gather_plan: rebuild it (python -m kvcli.native.build)")
    r = _ask(cli_runner, tiny, book, "--mode", "reselect", "--policies", "full,snapkv,streamingllm", "--budgets",
             "48,4096", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["settings"]["mode"] == "reselect" and "exact form" in res["settings"]["layout"]
    recs = res["records"]
    assert {x["mode"] for x in recs} == {"reselect"} and {x["status"] for x in recs} == {"ok"}
    questions = sorted({x["question"] for x in recs})
    assert len(questions) >= 4 and {x["kind"] for x in recs} >= {"fact", "copy", "structure", "summary"}
    by = {(x["question"], x["policy"], x["budget"]): x for x in recs}
    assert len(by) == len(recs) == 5 * len(questions)
    for q in questions:
        full = by[(q, "full", None)]
        assert full["doc_tokens"] > 1000 and full["prompt_tokens"] > full["doc_tokens"] and full["store_read_s"] > 0
        assert 0 <= full["score"] <= 100 and full["prediction"] is not None
        for pol in ("snapkv", "streamingllm"):
            wide, small = by[(q, pol, 4096)], by[(q, pol, 48)]
            assert wide["prediction"] == full["prediction"] and wide["score"] == full["score"]
            assert wide["kv_cells"] == full["kv_cells"] == full["prompt_tokens"]
            assert small["kv_cells"] <= 48 + 128 and small["kv_bytes"] < full["kv_bytes"]
            assert "reselect_s" in small or "shared_s" in small
    rows = {(x["policy"], x["budget"], x["kind"]): x for x in res["summary"]}
    for pol in ("snapkv", "streamingllm"):
        wide = rows[(pol, 4096, "questions")]
        assert wide["mode"] == "reselect" and wide["reference"] == "full"
        assert wide["score"] == wide["ref_score"] == wide["full_score"] == rows[("full", None, "questions")]["score"]
        assert wide["agree"] in (None, 1.0)
        assert rows[(pol, 4096, "summary")]["score"] == rows[("full", None, "summary")]["score"]
    assert "agree" not in rows[("full", None, "questions")]   # the reference is not compared with itself
    table = questions_table(res)
    assert "re-selected per question" in table and "snapkv@48" in table


def test_bounded_index_and_every_chunk_from_one_read(cli_runner, tiny, book, monkeypatch):
    """The bounded form: per configuration one read into a chunk store, then each question through the block
    index's chunks and through every chunk; `all` streams every stored chunk, `index` the first, the last and its
    choice between; the reference of `index` is `all`. Policies it cannot serve (full, column sums) are recorded
    as not run; the store is gone afterwards."""
    monkeypatch.setattr("kvcli.evaluation.corpus_reselect.DEFAULT_CHUNK", 128)
    r = _ask(cli_runner, tiny, book, "--mode", "bounded", "--policies", "full,snapkv,h2o", "--budgets", "48",
             "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["settings"]["mode"] == "bounded" and res["settings"]["forms"] == ["index", "all"]
    recs = res["records"]
    ok = [x for x in recs if x["policy"] == "snapkv"]
    assert ok and {x["status"] for x in ok} == {"ok"} and [x["form"] for x in ok[:2]] == ["index", "all"]
    assert all(x["score"] is None and x["status"].startswith("not run") for x in recs if x["policy"] != "snapkv")
    assert "column sums" in next(x["status"] for x in recs if x["policy"] == "h2o")
    assert len({x["read_s"] for x in ok}) == 1 and ok[0]["store_bytes"] > 0 and ok[0]["chunk"] == 128
    for x in ok:
        assert x["kv_cells"] <= 48 + 12 and x["stored_chunks"] > 8
        assert (x["answer_kept"] is None) == (x["kind"] == "summary")
        assert x["kind"] == "summary" or 0 <= x["answer_kept"] <= 1
        if x["form"] == "all":
            assert x["reselect_chunks"] == x["stored_chunks"] and x["chunks_per_question"] is None
        else:
            assert x["reselect_chunks"] == x["chunks_per_question"] + 2 < x["stored_chunks"]
            assert x["streamed"] == sorted(x["streamed"]) and x["streamed"][0] == 0
    rows = {(x["policy"], x["form"], x["kind"]): x for x in res["summary"]}
    index = rows[("snapkv", "index", "questions")]
    assert index["reference"] == "snapkv@48 all" and index["ref_score"] == rows[("snapkv", "all", "questions")]["score"]
    assert "full_score" not in index
    assert not any((book[0].parent / "cache" / "documents").iterdir())
    assert "bounded form" in questions_table(res) and "answer kept" in questions_table(res)
    assert rows[("snapkv", "all", "questions")]["answer_kept_n"] == sum(x["kind"] != "summary" for x in ok) // 2


def test_bounded_stores_keeps_the_reads_and_the_second_run_reuses_them(cli_runner, tiny, book, monkeypatch, tmp_path):
    """--stores DIR: the first run saves each configuration's read as DIR/DOC-POLICY-BUDGET, the second opens it
    instead of reading (the same read_s, the store's) and answers every question the same; a store of other read
    settings under that name is refused in one line."""
    monkeypatch.setattr("kvcli.evaluation.corpus_reselect.DEFAULT_CHUNK", 128)
    stores = tmp_path / "reads"
    args = ("--mode", "bounded", "--policies", "snapkv", "--budgets", "48", "--stores", str(stores), "--json")
    r = _ask(cli_runner, tiny, book, *args)
    assert r.exit_code == 0, r.output
    first = json.loads(r.stdout)
    kept = stores / "demo-snapkv-48"
    assert (kept / "store.json").exists()
    opened, reads, orig_open, orig_read = [], [], runner.ChunkedStore.open, runner.ChunkedStore.read
    monkeypatch.setattr(runner.ChunkedStore, "open", lambda *a, **k: opened.append(a) or orig_open(*a, **k))
    monkeypatch.setattr(runner.ChunkedStore, "read", lambda *a, **k: reads.append(a) or orig_read(*a, **k))
    second = json.loads(_ask(cli_runner, tiny, book, *args).stdout)
    assert len(opened) == 1 and not reads
    key = [(x["question"], x["form"], x["prediction"], x["read_s"]) for x in first["records"]]
    assert key == [(x["question"], x["form"], x["prediction"], x["read_s"]) for x in second["records"]]
    r = _ask(cli_runner, tiny, book, "--mode", "bounded", "--policies", "snapkv", "--budgets", "64", "--stores",
             str(stores))
    assert r.exit_code == 0, r.output       # another budget: its own folder
    (stores / "demo-snapkv-48").rename(stores / "demo-snapkv-40")
    r = _ask(cli_runner, tiny, book, "--mode", "bounded", "--policies", "snapkv", "--budgets", "40", "--stores",
             str(stores))
    assert r.exit_code == 2 and "a store of other tokens or settings (read snapkv@48" in r.output
    assert "Traceback" not in r.output
    r = _ask(cli_runner, tiny, book, "--mode", "reselect", "--stores", str(stores))
    assert r.exit_code == 2 and "--stores is for --mode bounded" in r.output


def test_corpus_ask_bad_input_is_one_line(cli_runner, tiny, book, monkeypatch, tmp_path):
    for extra, msg in ((["--forms", "index"], "--forms is for --mode bounded"),
                       (["--mode", "bounded", "--forms", "index,some"], "unknown form 'some'"),
                       (["--min-doc-tokens", "10", "--max-doc-tokens", "5"], "is more than --max-doc-tokens"),
                       (["--mode", "reselect", "--policies", "truncate"], "policy 'truncate'")):
        r = _ask(cli_runner, tiny, book, *extra)
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, (extra, r.output)
    monkeypatch.setenv("KVCLI_RESELECT_CHUNKS", "all")
    r = _ask(cli_runner, tiny, book, "--mode", "bounded")
    assert r.exit_code == 2 and "KVCLI_RESELECT_CHUNKS is set" in r.output
    small = write_tiny_llama(tmp_path / "small.gguf", n_layer=2, n_head=4, n_head_kv=2, head_dim=32, n_ctx_train=1024)
    r = _ask(cli_runner, small, book, "--mode", "reselect")
    assert r.exit_code == 2 and "more than the model's context (1024)" in r.output and "--mode bounded" in r.output


def _rec(mode, pol, bud, q, score, form=None, kind="fact"):
    return {"mode": mode, "policy": pol, "budget": bud, "form": form, "doc": "d", "question": q, "kind": kind,
            "status": "ok", "score": score, "answers": ["1"], "depth": 0.5}


def test_agreement_counts_what_the_reference_gets_right():
    assert agreement([(100, 100), (0, 100), (100, 0), (50, 100)]) == pytest.approx(
        {"agree_n": 3, "agree": 1 / 3, "agree_se": math.sqrt(1 / 3 * 2 / 3 / 3)})
    assert agreement([(100, 0)]) == {"agree_n": 0, "agree": None, "agree_se": None}
    recs = [_rec("reselect", "full", None, q, s) for q, s in enumerate([100, 100, 100, 100, 0])]
    recs += [_rec("reselect", "snapkv", 1024, q, s) for q, s in enumerate([100, 100, 0, 100, 100])]
    recs += [_rec("bounded", "snapkv", 1024, q, s, form) for form, ss in (("index", [100, 0]), ("all", [100, 100]))
             for q, s in enumerate(ss)]
    rows = {(x["mode"], x["policy"], x["form"], x["kind"]): x for x in summarise(recs)}
    snap = rows[("reselect", "snapkv", None, "questions")]
    assert snap["agree"] == 0.75 and snap["agree_n"] == 4 and snap["full_score"] == 80 and snap["score"] == 80
    assert snap["agree_se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    index = rows[("bounded", "snapkv", "index", "questions")]
    assert index["reference"] == "snapkv@1024 all" and index["agree"] == 0.5 and index["ref_score"] == 100
    table = questions_table({"summary": summarise(recs)})
    assert "reselect snapkv@1024" in table and "bounded snapkv@1024 index" in table and "75 +- 22 (of 4)" in table
