"""kvcli eval chat on a tiny random model: every mode runs on the same documents and questions, the records and
the summary agree, re-selection reads the document once, and the first re-selected question is `run`'s."""
from __future__ import annotations

import json

import pytest

from kvcli.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("evalchat") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


def test_eval_chat_modes_tiny(cli_runner, tiny, tmp_path, monkeypatch):
    from kvcli.cli import cli
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "chat.json"
    r = cli_runner.invoke(cli, ["eval", "chat", "--model", str(tiny), "--policies", "snapkv,h2o", "--budgets", "48",
                                "--lengths", "600", "--documents", "2", "--facts", "3", "--json-out", str(out),
                                "--modes", "full,once,reselect,run,reread", "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    recs = res["records"]
    # full: one configuration; the other modes: 2 policies; 2 documents x 3 questions each
    assert sum(x["mode"] == "full" for x in recs) == 6
    for mode in ("once", "reselect", "run", "reread"):
        assert sum(x["mode"] == mode for x in recs) == 12
    assert {x["budget"] for x in recs if x["mode"] != "full"} == {48}
    assert all(x["kv_cells"] <= 48 + 12 for x in recs if x["mode"] in ("reselect", "run", "reread"))
    # every answer records the memory it cost: bytes held (the ragged layout) and the live entries' bytes
    assert all(0 < x["kv_bytes_live"] <= x["kv_bytes"] for x in recs)
    assert all(summary_row.get("kv_bytes", 0) > 0 for summary_row in res["summary"])
    assert all(0 <= x["score"] <= 100 and x["doc_tokens"] <= 600 for x in recs)
    summary = {(s["mode"], s["policy"]): s for s in res["summary"]}
    assert summary[("reselect", "snapkv")]["questions"] == 6 and summary[("reselect", "snapkv")]["documents"] == 2
    assert summary[("reselect", "snapkv")]["reselect_s"] > 0
    # one stored read per document serves full, once and reselect; the store is deleted afterwards
    assert [x["mode"] for x in res["reads"]] == ["store", "store"]
    assert all(x["store_bytes"] > 0 for x in res["reads"])
    assert not any((tmp_path / "cache" / "documents").iterdir())
    # the first question of each document has no history: re-selected = question-aware run, same answer
    for d in (0, 1):
        for pol in ("snapkv", "h2o"):
            first = {x["mode"]: x["prediction"] for x in recs if x["doc"] == d and x["question"] == 0
                     and x["policy"] == pol}
            assert first["reselect"] == first["run"]


def test_eval_chat_refuses_a_length_beyond_the_context(cli_runner, tiny):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["eval", "chat", "--model", str(tiny), "--policies", "snapkv", "--budgets", "48",
                                "--lengths", "4k"])
    assert r.exit_code == 2 and "exceed the model's context" in r.output


def test_once_mode_compresses_as_compress_once_chat(tiny, tmp_path, monkeypatch):
    """The eval's `once` mode (re-selected once from the store for the generic instruction) keeps the entries
    `kvcli chat --compress-once` keeps (the document read with the generic instruction, then compressed), and the
    first question's next-token logits agree (a random model's greedy text is too flat to compare)."""
    import numpy as np

    from kvcli.apps.chat import Conversation
    from kvcli.drivers.compress import resolve
    from kvcli.evaluation.chat import make_chat_document, prefix_text, render
    from kvcli.native.session import NativeSession
    from kvcli.drivers.reselect import StoredDocument
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    s = NativeSession(tiny, n_ctx=2048)
    text, planted, _ = make_chat_document(s, 600, 2, 0)
    store = StoredDocument.read(s, s.tokenize(prefix_text(s, text, False)))
    agnostic = prefix_text(s, text, True)
    seen = {}
    store.reselect(s, s.tokenize(agnostic), resolve(tiny, "snapkv", 48), on_step=lambda o, plan: seen.update(plan=plan))
    q = planted[0]["question"]
    s.prefill(s.tokenize(render(s, text, [], q, agnostic=True)[len(agnostic):]), seq=0)
    store.close()
    conv = Conversation(NativeSession(tiny, n_ctx=0), text, compression=resolve(tiny, "snapkv", 48))
    conv.compress()
    plan = conv.report.plan
    assert all(np.array_equal(plan.kept(l, h), seen["plan"].kept(l, h))
               for l in range(plan.n_layer) for h in range(plan.n_head_kv))
    conv.session.prefill(conv.session.tokenize(conv.fmt.user_to_user + q + conv.fmt.after_user), seq=0)
    a, b = conv.session.logits(0), s.logits(0)
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()


def test_shared_reselections_answer_as_separate_ones(tiny, tmp_path, monkeypatch):
    """Configurations that re-select a prompt alike (one policy at two budgets; in `run` and `once` every
    configuration's prompt is the same) share one restore and observed prefill: every mode's records are those of
    separate re-selections (same answers, same cells kept), in the same order."""
    import kvcli.evaluation.chat as ec
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    runs = {}
    for share in (False, True):
        monkeypatch.setattr(ec, "SHARE", share)
        runs[share] = ec.run_chat_eval(tiny, ["snapkv", "h2o", "streamingllm"], [40, 64], [600], 1, 3,
                                       ("full", "once", "reselect", "run"), max_tokens=6)
    fields = ("mode", "policy", "budget", "doc", "question", "prediction", "score", "kv_cells", "n_tokens")
    assert [tuple(r[f] for f in fields) for r in runs[True]["records"]] == \
           [tuple(r[f] for f in fields) for r in runs[False]["records"]]
    assert not any(r.get("shared") for r in runs[False]["records"])
    shared = [r for r in runs[True]["records"] if r.get("shared")]
    # run and once: one prompt for all; the second budget of each policy shares the first's prefill
    assert {(r["mode"], r["policy"], r["budget"]) for r in shared if r["mode"] in ("run", "once")} == \
           {(m, p, 64) for m in ("run", "once") for p in ("snapkv", "h2o", "streamingllm")}
    assert all("reselect_s" not in r and r["shared_s"] >= 0 for r in shared if r["mode"] != "once")
    # reselect: the first question has no history yet, so the two budgets of a policy share its prefill
    assert {(r["policy"], r["budget"]) for r in shared if r["mode"] == "reselect" and r["question"] == 0} == \
           {(p, 64) for p in ("snapkv", "h2o", "streamingllm")}
    assert not any(r.get("shared") for r in runs[True]["records"] if r["mode"] == "full")


def test_eval_chat_bounded_mode(cli_runner, tiny, tmp_path, monkeypatch):
    """bounded: every window policy's conversation re-selected from a store read chunk by chunk (a column-sum policy
    gets no record); its first question streams more than one chunk and is answered from the budget."""
    from kvcli.cli import cli
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("kvcli.evaluation.chat.DEFAULT_CHUNK", 256)
    out = tmp_path / "chat.json"
    r = cli_runner.invoke(cli, ["eval", "chat", "--model", str(tiny), "--policies", "snapkv,h2o", "--budgets", "48",
                                "--lengths", "600", "--documents", "1", "--facts", "3", "--json-out", str(out),
                                "--modes", "bounded", "--quiet"])
    assert r.exit_code == 0, r.output
    recs = json.loads(out.read_text())["records"]
    assert len(recs) == 3 and {x["policy"] for x in recs} == {"snapkv"}
    assert all(x["reselect_chunks"] > 1 and x["kv_cells"] <= 48 + 12 and x["read_s"] > 0 for x in recs)
    assert not any((tmp_path / "cache" / "documents").iterdir())


def test_eval_chat_bounded_forms_past_the_context(cli_runner, tiny_1k, tmp_path, monkeypatch):
    """A document longer than the model's context: the bounded modes read it once per configuration (bounded and
    bounded_all answer from the same read; bounded_all streams every chunk) in the context kvcli chat would give it;
    a mode that keeps the full cache is refused in one line."""
    from kvcli.cli import cli
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVCLI_RESELECT_CHUNKS", raising=False)
    out = tmp_path / "chat.json"
    common = ["eval", "chat", "--model", str(tiny_1k), "--policies", "snapkv", "--budgets", "48", "--lengths", "1500",
              "--documents", "1", "--facts", "2", "--quiet"]
    r = cli_runner.invoke(cli, common + ["--modes", "bounded,bounded_all", "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    recs = result["records"]
    assert result["cache_type"] == "f16"
    assert [x["mode"] for x in recs] == ["bounded"] * 2 + ["bounded_all"] * 2
    assert all(x["doc_tokens"] > 1024 >= x["n_ctx"] and x["kv_cells"] <= 48 + 12 for x in recs)
    assert len({x["read_s"] for x in recs}) == 1                       # one read served both forms
    assert len({x["store_bytes"] for x in recs}) == 1 and recs[0]["store_bytes"] > 0   # its bytes on disk
    assert all(x["reselect_chunks"] == x["stored_chunks"] > 1 for x in recs if x["mode"] == "bounded_all")
    r = cli_runner.invoke(cli, common + ["--modes", "full,bounded"])
    assert r.exit_code != 0 and "exceed the model's context" in r.output and "Traceback" not in r.output


def test_eval_chat_from_document_reads_the_same_document(cli_runner, tiny, tmp_path, monkeypatch):
    """--from-document 1 --documents 1 evaluates the second document of a two-document run (same text, questions
    and answers, numbered 1), so a split evaluation pools like one run."""
    from kvcli.cli import cli
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    res = {}
    for name, args in (("both", ["--documents", "2"]), ("second", ["--documents", "1", "--from-document", "1"])):
        out = tmp_path / f"{name}.json"
        r = cli_runner.invoke(cli, ["eval", "chat", "--model", str(tiny), "--policies", "snapkv", "--budgets", "48",
                                    "--lengths", "600", "--facts", "3", "--modes", "full,reselect", "--quiet",
                                    "--json-out", str(out), *args])
        assert r.exit_code == 0, r.output
        res[name] = json.loads(out.read_text())
    assert res["second"]["first_document"] == 1
    key = ("mode", "policy", "budget", "doc", "question", "answer_expected", "prediction", "score", "doc_tokens")
    assert [tuple(x[k] for k in key) for x in res["second"]["records"]] == \
        [tuple(x[k] for k in key) for x in res["both"]["records"] if x["doc"] == 1]
    r = cli_runner.invoke(cli, ["eval", "chat", "--model", str(tiny), "--policies", "snapkv", "--budgets", "48",
                                "--lengths", "600", "--from-document", "-1"])
    assert r.exit_code == 2 and "-1" in r.output


def test_alone_and_context_modes_ask_each_question_alone(tiny, tmp_path, monkeypatch):
    """`alone` asks each question after the `once` cache without the earlier turns, `context` after the cache of
    the document alone (kvpress's pipeline layout, its full cache among the configurations): every question's cache
    is the compressed one plus that question's own tokens (nothing of an earlier question or answer left), and
    `alone`'s first question is `once`'s."""
    import kvcli.evaluation.chat as ec
    from kvcli.native.session import NativeSession
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    res = ec.run_chat_eval(tiny, ["snapkv", "kvzip"], [48], [600], 1, 3, ("once", "alone", "context"), max_tokens=6)
    recs = res["records"]
    s = NativeSession(tiny, n_ctx=0)
    text, planted, _ = ec.make_chat_document(s, 600, 3, 0)
    assert {(r["mode"], r["policy"]) for r in recs} == \
        {("once", "snapkv"), ("once", "kvzip"), ("alone", "snapkv"), ("alone", "kvzip"),
         ("context", "full"), ("context", "snapkv"), ("context", "kvzip")}
    for mode, agnostic in (("alone", True), ("context", False)):
        prefix = ec.prefix_text(s, text, agnostic)
        for pol in {r["policy"] for r in recs if r["mode"] == mode}:
            rs = [r for r in recs if r["mode"] == mode and r["policy"] == pol]
            assert [r["question"] for r in rs] == [0, 1, 2]
            # the cells after the answer: the compressed prefix, the question's tokens, 6 answer tokens (the random
            # model never stops early)
            asked = [ec.ask(planted[r["question"]]["question"]) for r in rs]
            base = {r["kv_cells"] - 6 - len(s.tokenize(ec.render(s, text, [], q, agnostic)[len(prefix):]))
                    for r, q in zip(rs, asked)}
            assert len(base) == 1, (mode, pol, base)
            if pol == "full":
                assert base == {len(s.tokenize(prefix))}
            else:
                assert base.pop() < len(s.tokenize(prefix))
    for pol in ("snapkv", "kvzip"):
        first = {r["mode"]: (r["prediction"], r["kv_cells"]) for r in recs if r["question"] == 0 and r["policy"] == pol}
        assert first["alone"] == first["once"]
    # once's later questions carry the conversation: more cells than alone's
    assert all(a["kv_cells"] < o["kv_cells"] for o, a in zip(
        [r for r in recs if r["mode"] == "once"], [r for r in recs if r["mode"] == "alone"]) if o["question"] > 0)
    assert [x["mode"] for x in res["reads"]] == ["store", "context"]
    assert all(r["reconstruct_s"] > 0 for r in recs if r["mode"] == "context" and r["policy"] == "kvzip")
    s.close()
