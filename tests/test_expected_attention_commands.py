"""expected_attention (issue #32) end to end on the tiny 2k-context model: run keeps the budget, chat compresses it
once (question-agnostic), compress + run --cache, bench (reading in chunks: test_expected_attention_chunked.py);
`kvcli policies --explain` shows its parameters and deviations."""
from __future__ import annotations

import json

import pytest
from helpers import last_json

from tests.conftest import KVCLI, ROOT  # noqa: F401  (the subprocess fixture's module)

EA = ["--policy", "expected_attention", "--budget", "64"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    import random
    words = "alpha beta gamma delta river stone light north code station log entry".split()
    rng = random.Random(5)
    d = tmp_path_factory.mktemp("eadocs")
    (d / "doc0.txt").write_text(" ".join(rng.choice(words) for _ in range(600)), encoding="utf-8")
    return d


def test_run_keeps_the_budget(run_kvcli, tiny_2k, doc):
    p = run_kvcli("run", "--model", tiny_2k, "--doc", doc / "doc0.txt", *EA, "-n", "4", "--json", "What?")
    assert p.returncode == 0, p.stderr
    s = last_json(p.stdout)["stats"]
    assert max(s["per_layer_cells"]) <= 64 + 4   # the budget + the answer
    # a prompt that fits is read in one prefill (chunked: test_expected_attention_chunked)
    assert s.get("chunks") is None


def test_chat_compresses_once_and_policy_switches(run_kvcli, tiny_2k, doc):
    p = run_kvcli("chat", "--model", tiny_2k, "--doc", doc / "doc0.txt", *EA, "-n", "3",
                  input="First?\n/policy snapkv 48\nSecond?\n")
    assert p.returncode == 0, p.stderr
    assert "[expected_attention @ 64, question-agnostic]" in p.stderr
    # a re-selected chat (snapkv) takes /policy expected_attention: the question re-selected with its statistics
    p = run_kvcli("chat", "--model", tiny_2k, "--doc", doc / "doc0.txt", "--policy", "snapkv", "--budget", "64",
                  "-n", "3", "--json", input="/policy expected_attention\nQ?\n")
    assert p.returncode == 0, p.stderr
    assert last_json(p.stdout)["mode"] == "re-selected"
    assert "[expected_attention @ 64, re-selected per question]" in p.stderr


def test_batch_and_eval(run_kvcli, tiny_2k, doc, tmp_path):
    out = tmp_path / "b.jsonl"
    p = run_kvcli("batch", "--docs", doc, "--model", tiny_2k, *EA, "-n", "3", "--question", "Q1?", "--question", "Q2?",
                  "--out", out)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["error"] is None and r["stats"]["kv_cells"] == 64 for r in rows)
    assert rows[0]["stats"]["document_reads"] == 1   # one read serves both questions (re-selected per question)
    p = run_kvcli("eval", "chat", "--model", tiny_2k, "--policies", "expected_attention", "--budgets", "64",
                  "--lengths", "1k", "--documents", "1", "--facts", "2", "--modes", "once,run", "--json", "-q")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert {r["mode"] for r in res["records"] if r["policy"] == "expected_attention"} == {"once", "run"}


def test_compress_then_run_and_bench(run_kvcli, tiny_2k, doc, tmp_path):
    out = tmp_path / "d.kvc"
    p = run_kvcli("compress", "--model", tiny_2k, "--doc", doc / "doc0.txt", *EA, "-o", out, "--json")
    assert p.returncode == 0, p.stderr
    meta = last_json(p.stdout)
    assert meta["policy"] == "expected_attention" and meta["stats"]["kv_cells"] == 64
    p = run_kvcli("run", "--cache", out, "-n", "3", "Q?")
    assert p.returncode == 0, p.stderr
    p = run_kvcli("bench", "--docs", doc, "--model", tiny_2k, "--policies", "expected_attention,snapkv", "--budgets",
                  "64", "--gen", "3", "--json")
    assert p.returncode == 0, p.stderr
    rows = [r for r in json.loads(p.stdout)["rows"] if r["policy"] == "expected_attention"]
    assert rows and all(r["status"] == "ok" for r in rows)


def test_explain(run_kvcli):
    p = run_kvcli("policies", "--explain", "expected_attention")
    assert p.returncode == 0, p.stderr
    for text in ("Expected Attention", "n_future = 512", "window = 512", "Observes: query, kv", "Engines: native, "
                 "reference", "float64", "Deviations"):
        assert text in p.stdout, text
    assert "numpy" not in p.stdout and "host_plans" not in p.stdout   # planned in C++ like every policy
