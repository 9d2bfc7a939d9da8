"""kvcli eval niah|ruler --agnostic on a tiny random model: the document is compressed before the question (the kept
entries do not depend on the question), in eval chat's `once` layout, for kvzip and snapkv; the JSON says the mode."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from kvcli.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("evalagn") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


def _plans(session, monkeypatch):
    """Every plan applied to `session`, in order."""
    seen = []
    real = type(session).apply_plan

    def spy(self, plan, *a, **k):
        seen.append(plan)
        return real(self, plan, *a, **k)
    monkeypatch.setattr(type(session), "apply_plan", spy)
    return seen


def test_agnostic_compression_does_not_depend_on_the_question(tiny, monkeypatch):
    """Two questions over one document: the agnostic prefix (template head, document, generic instruction) is the
    same, kvzip and snapkv keep the same entries for both, and each question is prefilled after the compressed
    cache (eval chat's `once` layout). Question-aware, the same two questions give other plans."""
    from kvcli.evaluation.chat import prefix_text
    from kvcli.evaluation.runner import agnostic_split, sample_variants
    from kvcli.evaluation.tasks import _chat, ruler_sample
    from kvcli.native.session import NativeSession
    from kvcli.planning.planner import resolve
    from kvcli.templating import GENERIC_SUFFIX

    s = NativeSession(tiny, n_ctx=1024)
    a = ruler_sample(s, "niah_single", 500, 0.5, 0, 0)
    other = "Which magic number comes first in the provided text?"
    b = dataclasses.replace(a, question=other, prompt=_chat(s, f"{a.document}\n{other}", a.answer_prefix))
    assert _chat(s, f"{a.document}\n{a.question}", a.answer_prefix) == a.prompt   # the question-aware layout
    (pa, qa), (pb, qb) = agnostic_split(s, a), agnostic_split(s, b)
    assert pa == pb and qa != qb
    assert s.tokenize(prefix_text(s, a.document, True)) == pa
    assert s.detokenize(pa).rstrip().endswith(GENERIC_SUFFIX) and a.question not in s.detokenize(pa)
    assert s.detokenize(qa).rstrip().endswith(a.answer_prefix) and a.question in s.detokenize(qa)

    cfgs = [("full", None), ("snapkv", 64), ("kvzip", 64)]
    plans, firsts, stats = {}, {}, {}
    for name, (toks, q) in {"a": (pa, qa), "b": (pb, qb), "aware_a": (s.tokenize(a.prompt), []),
                            "aware_b": (s.tokenize(b.prompt), [])}.items():
        seen = _plans(s, monkeypatch)
        out = list(sample_variants(s, toks, q, cfgs, {c: resolve(tiny, *c) for c in cfgs}, {}, reserve=a.max_tokens))
        assert [o[2] for o in out] == ["ok"] * 3
        plans[name], firsts[name] = list(seen), [o[3] for o in out]
        stats[name] = {o[0]: o[5] for o in out}
    same = lambda x, y: np.array_equal(x.n_kept, y.n_kept) and np.array_equal(x.slots, y.slots)  # noqa: E731
    assert len(plans["a"]) == len(plans["b"]) == 2
    assert all(same(x, y) for x, y in zip(plans["a"], plans["b"]))
    assert not all(same(x, y) for x, y in zip(plans["aware_a"], plans["aware_b"]))
    # the question is read after the compressed cache: the answers' first logits differ by question
    assert all(not np.array_equal(x, y) for x, y in zip(firsts["a"], firsts["b"]))
    assert stats["a"]["kvzip"]["reconstruct_s"] > 0 and "question_prefill_s" in stats["a"]["snapkv"]
    assert "question_prefill_s" not in stats["aware_a"]["snapkv"]
    # the full cache with the question appended answers as the whole agnostic prompt prefilled at once
    s.clear()
    s.prefill(pa + qa, seq=0)
    ref = s.logits(0)
    assert np.abs(firsts["a"][0] - ref).max() <= 1e-2 * np.abs(ref).max()
    s.close()


def test_eval_agnostic_cli_marks_the_mode(cli_runner, tiny):
    from kvcli.cli import cli

    def run(*args):
        r = cli_runner.invoke(cli, ["eval", *args, "--model", str(tiny), "--budgets", "64", "--lengths", "400",
                                    "--samples", "1", "--depths", "0.5", "--json", "--quiet"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    res = run("ruler", "--agnostic", "--policies", "full,snapkv,kvzip,truncate", "--tasks", "niah_single,vt")
    assert res["settings"]["mode"] == "agnostic" and "generic instruction" in res["settings"]["layout"]
    recs = res["records"]
    assert len(recs) == 2 * 4 and all(r["status"] == "ok" and r["mode"] == "agnostic" for r in recs)
    assert all(r["prefix_tokens"] + r["question_tokens"] > r["tokens"] for r in recs)  # + instruction, + a turn
    kv = [r for r in recs if r["policy"] == "kvzip"]
    assert all(r["reconstruct_s"] > 0 and r["compress_s"] >= r["reconstruct_s"] for r in kv)
    summ = {(r["task"], r["policy"]): r for r in res["summary"]}
    assert summ[("vt", "kvzip")]["reconstruct_s"] > 0 and "compress_s" in summ[("vt", "snapkv")]
    res = run("niah", "--agnostic", "--policies", "full,snapkv")
    assert res["settings"]["mode"] == "agnostic" and all(r["mode"] == "agnostic" for r in res["records"])
    res = run("niah", "--policies", "full,snapkv")
    assert res["settings"]["mode"] == "aware" and all(r["mode"] == "aware" and "prefix_tokens" not in r
                                                      for r in res["records"])
    r = cli_runner.invoke(cli, ["eval", "ruler", "--help"])
    assert "--agnostic" in r.output and "generic instruction" in r.output


def test_eval_stored_answers_from_one_read_in_both_forms(cli_runner, tiny, cache_dir):
    """--stored (kvcli chat's path over a book): each configuration reads the document once into a bounded store,
    past the model's 2k context here, and answers from it through the block index and through every chunk; `full` is
    not run; results, summary and the table are per form."""
    from kvcli.cli import cli
    args = ["eval", "ruler", "--stored", "--model", str(tiny), "--policies", "full,snapkv", "--budgets", "48,96",
            "--lengths", "2600", "--tasks", "niah_single", "--samples", "1", "--depths", "0.5", "--chunk", "256"]
    r = cli_runner.invoke(cli, args + ["--json", "--quiet"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["settings"]["mode"] == "stored" and res["settings"]["forms"] == ["index", "every_chunk"]
    recs = res["records"]
    assert [(x["policy"], x["budget"], x["form"]) for x in recs] == [
        ("full", None, "index"), ("full", None, "every_chunk"), ("snapkv", 48, "index"), ("snapkv", 48, "every_chunk"),
        ("snapkv", 96, "index"), ("snapkv", 96, "every_chunk")]
    assert all(x["status"].startswith("not run") for x in recs[:2])
    ok = recs[2:]
    assert all(x["status"] == "ok" and x["mode"] == "stored" and x["tokens"] > 2048 for x in ok)
    for a, b in (ok[:2], ok[2:]):   # one read serves both forms
        assert a["read_s"] == b["read_s"] and a["store_bytes"] == b["store_bytes"] > 0
        assert a["stored_chunks"] == b["stored_chunks"] > 4 and a["chunk"] == 256
        assert b["reselect_chunks"] == b["stored_chunks"] and a["reselect_chunks"] <= a["stored_chunks"]
        assert a["kv_cells"] <= a["budget"] + 32 and b["kv_cells"] <= b["budget"] + 32
    assert {(s["budget"], s["form"]) for s in res["summary"] if s["policy"] == "snapkv"} == {
        (48, "index"), (48, "every_chunk"), (96, "index"), (96, "every_chunk")}
    table = cli_runner.invoke(cli, args)
    assert table.exit_code == 0 and "snapkv@48 index" in table.output and "snapkv@48 every_chunk" in table.output
    only = ["snapkv" if a == "full,snapkv" else a for a in args]   # full is listed only when asked for
    r = cli_runner.invoke(cli, only + ["--budgets", "48", "--json", "--quiet"])
    assert r.exit_code == 0 and [x["policy"] for x in json.loads(r.stdout)["records"]] == ["snapkv"] * 2
