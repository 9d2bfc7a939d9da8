"""kvzip (issue #32) wherever a policy works, on the tiny 2k-context model: run, chat (compress-once by default, and
/policy in a re-selected chat), compress + run --cache, batch, bench, eval chat; the reconstruction pass's time is
reported on its own. Bounded (chunked) reading: tests/test_kvzip_chunked.py."""
from __future__ import annotations

import json

import pytest
from helpers import last_json

from tests.conftest import KVCLI, ROOT  # noqa: F401  (the subprocess fixture's module)

KZ = ["--policy", "kvzip", "--budget", "64"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    import random
    words = "alpha beta gamma delta river stone light north code station log entry".split()
    rng = random.Random(3)
    d = tmp_path_factory.mktemp("kvzipdocs")
    for i, n in enumerate((600, 420)):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(n)), encoding="utf-8")
    return d


def test_run_reports_the_reconstruction_and_keeps_the_budget(run_kvcli, tiny_2k, doc):
    p = run_kvcli("run", "--model", tiny_2k, "--doc", doc / "doc0.txt", *KZ, "-n", "4", "--json", "What?")
    assert p.returncode == 0, p.stderr
    s = last_json(p.stdout)["stats"]
    assert s["reconstruct_s"] > 0 and s["compress_s"] >= s["reconstruct_s"]
    assert max(s["per_layer_cells"]) <= 64 + 4   # the budget + the answer


def test_chat_compresses_once_and_policy_switches(run_kvcli, tiny_2k, doc):
    p = run_kvcli("chat", "--model", tiny_2k, "--doc", doc / "doc0.txt", *KZ, "-n", "3",
                  input="First?\n/policy snapkv 48\nSecond?\n")
    assert p.returncode == 0, p.stderr
    assert "[kvzip @ 64, question-agnostic]" in p.stderr
    # a re-selected chat (snapkv) takes /policy kvzip: every question re-selected with its reconstruction pass
    p = run_kvcli("chat", "--model", tiny_2k, "--doc", doc / "doc0.txt", "--policy", "snapkv", "--budget", "64",
                  "-n", "3", "--json", input="/policy kvzip\nQ?\n")
    assert p.returncode == 0, p.stderr
    row = last_json(p.stdout)
    assert row["mode"] == "re-selected" and row["reconstruct_s"] > 0


def test_compress_then_run_from_the_file(run_kvcli, tiny_2k, doc, tmp_path):
    out = tmp_path / "d.kvc"
    p = run_kvcli("compress", "--model", tiny_2k, "--doc", doc / "doc0.txt", *KZ, "-o", out, "--json")
    assert p.returncode == 0, p.stderr
    meta = last_json(p.stdout)
    assert meta["policy"] == "kvzip" and meta["stats"]["kv_cells"] == 64 and meta["stats"]["reconstruct_s"] > 0
    p = run_kvcli("run", "--cache", out, "-n", "3", "Q?")
    assert p.returncode == 0, p.stderr


def test_batch_bench_and_eval(run_kvcli, tiny_2k, doc, tmp_path):
    out = tmp_path / "b.jsonl"
    p = run_kvcli("batch", "--docs", doc, "--model", tiny_2k, *KZ, "-n", "3", "--question", "Q1?", "--question", "Q2?",
                  "--out", out)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 4 and all(r["error"] is None and r["stats"]["reconstruct_s"] > 0 for r in rows)
    p = run_kvcli("bench", "--docs", doc, "--model", tiny_2k, "--policies", "kvzip", "--budgets", "64", "--gen", "3",
                  "--json")
    assert p.returncode == 0, p.stderr
    rows = [r for r in json.loads(p.stdout)["rows"] if r["policy"] == "kvzip"]
    assert rows and all(r["status"] == "ok" and r["reconstruct_s"] > 0 for r in rows)
    p = run_kvcli("eval", "chat", "--model", tiny_2k, "--policies", "kvzip", "--budgets", "64", "--lengths", "1k",
                  "--documents", "1", "--facts", "2", "--modes", "once,run", "--json", "-q")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert {r["mode"] for r in res["records"] if r["policy"] == "kvzip"} == {"once", "run"}


def test_reconstruction_leaves_the_sequence_as_it_was(tiny_2k):
    """The passes are rolled back: same cells, positions and (re-decoded) logits; a pass shorter than the prompt
    (a small context) scores every slot; the maxima are probabilities."""
    import numpy as np

    from kvcli.policies.reconstruction import passes, reconstruct
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny_2k, n_ctx=768, cache_type="f32", flash_attn=False)
    try:
        toks = s.tokenize("alpha beta gamma delta river stone " * 80)[:400]
        s.prefill(toks)
        before, pos = s.logits(), s.kept_positions(0)
        assert len(passes(s, toks, 2048)) == 2          # 368 free cells: two passes of the 400 tokens
        colmax, secs = reconstruct(s, toks, 0, 2048)
        assert colmax.shape == (s.info.n_layer, s.info.n_head, 400) and secs > 0
        assert (colmax > 0).all() and (colmax <= 1).all()
        assert s.seq(0).cells == 400 and s.seq(0).next_pos == 400
        assert all(np.array_equal(a, b) for la, lb in zip(pos, s.kept_positions(0)) for a, b in zip(la, lb))
        np.testing.assert_allclose(s.logits(), before, atol=1e-4)
    finally:
        s.close()
