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
                                "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    recs = res["records"]
    # full: one configuration; the other modes: 2 policies; 2 documents x 3 questions each
    assert sum(x["mode"] == "full" for x in recs) == 6
    for mode in ("once", "reselect", "run"):
        assert sum(x["mode"] == mode for x in recs) == 12
    assert {x["budget"] for x in recs if x["mode"] != "full"} == {48}
    assert all(x["kv_cells"] <= 48 + 12 for x in recs if x["mode"] in ("reselect", "run"))
    assert all(0 <= x["score"] <= 100 and x["doc_tokens"] <= 600 for x in recs)
    summary = {(s["mode"], s["policy"]): s for s in res["summary"]}
    assert summary[("reselect", "snapkv")]["questions"] == 6 and summary[("reselect", "snapkv")]["documents"] == 2
    assert summary[("reselect", "snapkv")]["reselect_s"] > 0
    # one stored read per document for re-selection, deleted afterwards
    assert sum(x["mode"] == "reselect" for x in res["reads"]) == 2
    assert all(x["store_bytes"] > 0 for x in res["reads"] if x["mode"] == "reselect")
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
