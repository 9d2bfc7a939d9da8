"""kvcli bench on tiny settings: a tiny random llama GGUF, two short documents, a few tokens.

Asserts the structure and the sanity of what is measured: the baseline agrees with itself, memory
falls with the budget and with the cache type, repeats give min <= median <= max, the equal-memory
batch holds more compressed documents than full ones, unavailable policies are reported.
"""
from __future__ import annotations

import csv
import json

import pytest
from helpers import native_missing

from kvcli.cli import cli
from kvcli.testing.tiny_gguf import write_tiny_llama


NEEDS = ("kvcli_stats_get", "kvcli_apply_plan", "kvcli_observe_begin")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("bench") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=1024)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    words = "the station log records wind snow and the radio code of the north ridge".split()
    for i, n in enumerate((220, 300)):
        (d / f"doc{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(n)) + "\n")
    return d


@pytest.fixture(scope="module")
def result(tiny, docs, tmp_path_factory):
    missing = native_missing(*NEEDS)
    if missing:
        pytest.fail(f"the native library lacks {', '.join(missing)}: rebuild it (python -m kvcli.native.build)")
    from click.testing import CliRunner
    out = tmp_path_factory.mktemp("out")
    r = CliRunner().invoke(cli, ["bench", "--docs", str(docs), "--model", str(tiny), "--policies",
                                 "full,streamingllm,snapkv,nosuchpolicy", "--budgets", "32,64,128",
                                 "--cache-type", "f16,q8_0", "--gen", "6", "--repeat", "2", "--batch", "4",
                                 "--ctx", "512", "--policy-arg", "snapkv.window=8", "--json", "--quiet", "--csv",
                                 str(out / "b.csv"),
                                 "--plot", str(out / "b.png")])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), out


def _row(rows, doc, policy, budget, ct):
    m = [x for x in rows if (x["doc"], x["policy"], x["budget"], x["cache_type"]) == (doc, policy, budget, ct)]
    assert len(m) == 1, (doc, policy, budget, ct)
    return m[0]


def test_bench_rows_structure_and_baseline(result):
    res, _ = result
    rows = res["rows"]
    assert res["machine"]["cores"] >= 1 and res["settings"]["gen"] == 6
    # 2 docs x (full f16 + 2 cache types x (full + 2 policies x 3 budgets + unknown x 3)) - duplicate full f16
    assert len(rows) == 2 * (1 + 2 * (1 + 2 * 3 + 3) - 1)
    for doc in ("doc0.txt", "doc1.txt"):
        base = _row(rows, doc, "full", None, "f16")
        assert rows.index(base) == min(i for i, x in enumerate(rows) if x["doc"] == doc), "baseline first"
        assert base["status"] == "ok"
        assert base["agreement"] == 1.0 and base["kl_mean"] == pytest.approx(0.0, abs=1e-9)
        assert base["kv_cells"] == base["prompt_tokens"]
        assert base["kv_bytes"] > 0 and base["kv_bytes_vs_full"] == 1.0
        for x in rows:
            if x["doc"] == doc and x["status"] == "ok":
                assert 0 < x["prefill_tok_s"] and 0 <= x["compress_share"] < 1
                assert x["decode_tok_s_min"] <= x["decode_tok_s"] <= x["decode_tok_s_max"]
                assert x["decode_repeats"] == 2
                assert 0.0 <= x["agreement"] <= 1.0 and x["kl_mean"] >= 0.0
                assert x["peak_rss_bytes"] > 0


def test_bench_peak_memory_comes_from_a_fresh_process(result):
    """Issue #19: the peak-memory column is each configuration's own `kvcli run` in a fresh child process, next
    to the KV buffer it allocated, the live entries' bytes and the budget's bytes."""
    rows = result[0]["rows"]
    for x in rows:
        if x["status"] != "ok":
            continue
        assert x["peak_rss_scope"] == "fresh process (kvcli run)"
        assert x["peak_rss_bytes"] > x["kv_bytes_allocated"] > 0
        assert 0 < x["kv_bytes_live"] <= x["kv_bytes"]
        if x["budget"] is not None:
            cell = x["kv_bytes_full"] // (x["prompt_tokens"])   # bytes of one cell at this cache type
            assert x["kv_bytes_budget"] == x["budget"] * cell
    for doc in ("doc0.txt", "doc1.txt"):   # a q8_0 buffer is smaller than an f16 one of the same cells
        assert _row(rows, doc, "full", None, "q8_0")["kv_bytes_allocated"] < \
            _row(rows, doc, "full", None, "f16")["kv_bytes_allocated"]


def test_bench_memory_falls_with_budget_and_cache_type(result):
    rows = result[0]["rows"]
    for doc in ("doc0.txt", "doc1.txt"):
        full16 = _row(rows, doc, "full", None, "f16")
        full8 = _row(rows, doc, "full", None, "q8_0")
        assert full8["kv_bytes"] < full16["kv_bytes"]
        for pol in ("streamingllm", "snapkv"):
            for ct in ("f16", "q8_0"):
                b = [_row(rows, doc, pol, k, ct) for k in (32, 64, 128)]
                assert all(x["status"] == "ok" for x in b), [x["status"] for x in b]
                assert b[0]["kv_bytes"] < b[1]["kv_bytes"] < b[2]["kv_bytes"] < full16["kv_bytes"]
                assert [x["kv_cells"] for x in b] == [32, 64, 128]


def test_bench_reports_unavailable_policy(result):
    rows = [x for x in result[0]["rows"] if x["policy"] == "nosuchpolicy"]
    assert rows and all(x["status"].startswith("not available") for x in rows)


def test_bench_equal_memory_batch(result):
    batch = {b["config"]: b for b in result[0]["batch"]}
    full = batch["full/f16"]
    assert full["ctx"] == 512
    assert full["docs_held"] == 1  # 512 cells: one uncompressed document (+ its generated tokens) fits
    snap = batch["snapkv@32/f16"]
    assert snap["docs_held"] == 4 and snap["aggregate_tok_s"] > 0
    assert snap["cells_held"] == 4 * 32


def test_bench_files(result):
    _, out = result
    assert (out / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "b-batch.png").read_bytes()[:4] == b"\x89PNG"
    with open(out / "b.csv") as f:
        head = next(csv.reader(f))
    assert head[:3] == ["doc", "prompt_tokens", "policy"] and "kv_bytes" in head


@pytest.mark.parametrize("args, message", [
    (["--budgets", "12,x"], "not an integer"),
    (["--budgets", "0"], "must be >= 1"),
    (["--cache-type", "q5_9"], "unknown cache type"),
    (["--plot", "out.jpg"], ".png"),
    (["--ctx", "512"], "--batch"),
    (["--policy-arg", "window=4"], "POLICY.KEY=VALUE"),
])
def test_bench_bad_input_one_line(cli_runner, tiny, docs, args, message):
    r = cli_runner.invoke(cli, ["bench", "--docs", str(docs), "--model", str(tiny), *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and r.output.count("\n") == 1


def test_bench_missing_docs(cli_runner, tiny, tmp_path):
    r = cli_runner.invoke(cli, ["bench", "--docs", str(tmp_path / "nope.txt"), "--model", str(tiny)])
    assert r.exit_code == 2 and "not found" in r.output
    r = cli_runner.invoke(cli, ["bench", "--docs", str(tmp_path), "--model", str(tiny)])
    assert r.exit_code == 2 and "holds no document" in r.output


def test_shared_prefill_measures_the_same_caches(result, tiny, docs, cli_runner):
    """Each configuration prefilled on its own (prefill_and_compress) holds the very same cache as when
    its prefill is shared: same cells and bytes, same agreement and KL."""
    r = cli_runner.invoke(cli, ["bench", "--no-share-prefill", "--docs", str(docs / "doc1.txt"), "--model", str(tiny),
                                "--policies", "full,snapkv", "--budgets", "64",
                                "--policy-arg", "snapkv.window=8", "--gen", "6", "--repeat", "1",
                                "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    alone = json.loads(r.stdout)
    assert alone["settings"]["share_prefill"] is False
    shared = result[0]["rows"]
    for x in alone["rows"]:
        y = _row(shared, "doc1.txt", x["policy"], x["budget"], x["cache_type"])
        assert x["status"] == y["status"] == "ok", (x["status"], y["status"])
        assert (x["kv_cells"], x["kv_bytes"]) == (y["kv_cells"], y["kv_bytes"])
        assert x["agreement"] == y["agreement"]
        assert x["kl_mean"] == pytest.approx(y["kl_mean"], abs=1e-4)


def test_bench_says_each_documents_tokens_and_time_before_its_read(cli_runner, tiny, docs, monkeypatch, cache_dir):
    """kvcli bench announces each document's read as kvcli run does (doc_formats.announce_read; KVCLI_READ_NOTICE_S=0
    makes any read long enough): one line per document on stderr, with its prompt tokens, before that document's
    first read and before the result; with --no-share-prefill the read's measured speed is kept for the next one."""
    monkeypatch.setenv("KVCLI_READ_NOTICE_S", "0")
    monkeypatch.setenv("KVCLI_READ_TOK_S", "50")
    args = ["bench", "--docs", str(docs), "--model", str(tiny), "--policies", "full,snapkv", "--budgets", "32,64",
            "--policy-arg", "snapkv.window=8", "--gen", "2", "--repeat", "1", "--json"]
    for extra, reads in (([], "the first of its 2 reads, one per cache type and observation"),
                         (["--no-share-prefill"], "the first of its 3 reads, one per configuration")):
        r = cli_runner.invoke(cli, args + extra)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        notice = [ln for ln in r.stderr.splitlines() if ln.startswith("[this document is ")]
        assert len(notice) == 2, r.stderr
        lines = r.stderr.splitlines()
        for d, line in zip(out["settings"]["docs"], notice):
            n = d["tokens"]
            assert line == (f"[this document is {n:,} tokens: reading it in one prefill ({reads}) will take about "
                            f"{round(n / 50)} s (estimated at 50 tokens/s: KVCLI_READ_TOK_S)]"), line
            # after the log line that names the document, before the line of its first measured configuration
            at = lines.index(line)
            assert lines[at - 1].startswith(f"{d['name']} ({n} tokens): ") and lines[at + 1].startswith("  "), lines
        assert r.output.index(notice[-1]) < r.output.index('"kind": "bench"')   # said before the result
