"""One policy with two settings side by side in one corpus eval (issue #63: kvzip's alloc=head against alloc=global
on one prefill and one reconstruction pass): `POLICY:KEY=VALUE` labels in --policies, and --docs's order kept."""
from __future__ import annotations

import json

import pytest
from helpers import native_missing

from kvcli.cli import cli
from kvcli.errors import KvcliError
from kvcli.evaluation import corpus
from kvcli.evaluation.corpus_eval import check_variants, split_variant
from kvcli.testing.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("var") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=2048)


def test_split_variant_reads_its_arguments_and_refuses_bad_ones():
    assert split_variant("kvzip") == ("kvzip", {})
    assert split_variant("kvzip:alloc=global") == ("kvzip", {"alloc": "global"})
    assert split_variant("kvzip:alloc=layer:gqa=mean") == ("kvzip", {"alloc": "layer", "gqa": "mean"})
    for bad in ("kvzip:alloc", "kvzip:=head", "kvzip:alloc=head:alloc=global", ":alloc=head", "full:alloc=head"):
        with pytest.raises(KvcliError, match="POLICY:KEY=VALUE"):
            split_variant(bad)


def test_a_label_s_arguments_override_the_policy_arg(tiny):
    _, resolved = check_variants(tiny, ["full", "kvzip", "kvzip:alloc=global"], [48],
                                 {"kvzip": {"alloc": "head", "gqa": "mean"}})
    assert set(resolved) == {("full", None), ("kvzip", 48), ("kvzip:alloc=global", 48)}
    assert resolved[("kvzip", 48)].params["alloc"] == "head"
    glob = resolved[("kvzip:alloc=global", 48)]
    assert glob.policy == "kvzip" and glob.params["alloc"] == "global" and glob.params["gqa"] == "mean"
    with pytest.raises(KvcliError, match="alloc"):
        check_variants(tiny, ["kvzip:alloc=everywhere"], [48], {})


def test_fidelity_runs_both_allocations_on_one_prefill(cli_runner, tiny, tmp_path):
    if native_missing("kvcli_apply_plan"):
        pytest.fail("the native library lacks kvcli_apply_plan: rebuild it (python -m kvcli.native.build)")
    doc = tmp_path / "d.txt"
    doc.write_text(" ".join(f"Clause {i}: the tenant pays {i * 37 % 101} crowns by day {i % 28 + 1}."
                            for i in range(40)))
    r = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--doc", str(doc), "--policies",
                                "full,kvzip:alloc=head,kvzip:alloc=global", "--budgets", "48", "--lengths", "all",
                                "--cont", "6", "--threads", "1", "--json", "--quiet"])
    assert r.exit_code == 0, r.output
    recs = {r["policy"]: r for r in json.loads(r.stdout)["records"]}
    assert set(recs) == {"full", "kvzip:alloc=head", "kvzip:alloc=global"}
    head, glob = recs["kvzip:alloc=head"], recs["kvzip:alloc=global"]
    assert head["status"] == glob["status"] == "ok" and 0 <= head["top1"] <= 1 and glob["kl_mean"] >= 0
    # per KV head every head keeps 48; over all layers the widest head sets each layer's width, at least 48
    assert head["kv_bytes"] < recs["full"]["kv_bytes"] and glob["kv_bytes"] >= head["kv_bytes"]
    bad = cli_runner.invoke(cli, ["eval", "fidelity", "--model", str(tiny), "--doc", str(doc), "--policies",
                                  "full,kvzip:alloc", "--budgets", "48"])
    assert bad.exit_code != 0 and "POLICY:KEY=VALUE" in bad.output


def test_corpus_documents_keep_the_order_of_docs(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "package_version", lambda p: "1")
    srcs = []
    for i in range(6):
        f = tmp_path / f"s{i}.txt"
        f.write_text(f"Document {i}. " * 40)
        srcs.append(corpus.Source(f"doc-{i}", "legal", "p", "file", str(f), "table"))
    m = corpus.build_corpus(tmp_path / "c", None, sources=srcs)
    ids = [d["id"] for d in m["documents"] if d["split"] == "tune"]
    docs, _ = corpus.corpus_documents(tmp_path / "c", "tune", docs=",".join(reversed(ids)))
    assert [d.name for d in docs] == list(reversed(ids)) and len(ids) >= 2


def test_the_help_names_labels_where_they_are_read(cli_runner):
    """fidelity and corpus ask read POLICY:KEY=VALUE labels and say so; niah does not read them and does not."""
    for argv in (["eval", "fidelity", "--help"], ["eval", "corpus", "ask", "--help"]):
        r = cli_runner.invoke(cli, argv, terminal_width=400)
        assert r.exit_code == 0 and "POLICY:KEY=VALUE" in r.output and "snapkv:window=" in r.output, argv
    r = cli_runner.invoke(cli, ["eval", "niah", "--help"], terminal_width=400)
    assert r.exit_code == 0 and "POLICY:KEY=VALUE" not in r.output
