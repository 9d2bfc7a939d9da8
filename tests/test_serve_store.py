"""kvcli serve's stores in kvcli's document store (--store disk, the default): listed by `kvcli documents list`,
restored from after a restart, capped by --store-max-bytes. Real `kvcli serve` processes on the default model, their
document store in the test's own folder (KVCLI_CACHE)."""
from __future__ import annotations

import json
import os
import subprocess

import openai
import pytest

from tests.conftest import KVCLI, ROOT
from tests.test_serve import serving


@pytest.fixture(scope="module")
def docs():
    from kvcli.evaluation.logbook import make_document
    return [make_document(260, facts=2, seed=s) for s in (5, 6)]


def args(model, *more) -> list[str]:
    return ["--model", str(model), "--policy", "snapkv", "--budget", "64", "--ctx", "1024", "--max-tokens", "4",
            "--threads", "1", *more]


def ask(port, model, doc, i, **body) -> dict:
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    text, planted = doc
    r = c.chat.completions.create(model=model.stem, messages=[
        {"role": "user", "content": f"{text}\n\n{planted[i]['question']}"}], extra_body=body or None)
    return r.model_extra["kvcli"]


def listed(cache) -> list[dict]:
    r = subprocess.run([*KVCLI, "documents", "list", "--json"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "KVCLI_CACHE": str(cache)}, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_stores_are_listed_and_survive_a_restart(default_model, docs, tmp_path):
    cache = tmp_path / "kvcache"
    env = {"KVCLI_CACHE": str(cache)}
    with serving(args(default_model), tmp_path / "first.log", env) as (port, _):
        first = ask(port, default_model, docs[0], 0)
        assert first["document_read_tokens"] > 300 and first["store"] == "disk" and first["store_written"] == 1
        items = listed(cache)   # listed while the server runs
        # h2o's store (the column sums of its queries) is an entry of its own
        h2o = ask(port, default_model, docs[0], 0, kvcli={"policy": "h2o", "budget": 64})
        assert h2o["document_read_tokens"] > 300 and h2o["store_written"] == 2
    assert [(i["state"], i["model"], i["tokens"]) for i in items] == \
        [("cached", default_model.stem, first["document_read_tokens"])]
    assert items[0]["bytes"] > 0 and not items[0]["in_use"]
    assert len(listed(cache)) == 2

    with serving(args(default_model), tmp_path / "second.log", env) as (port, _):
        again = ask(port, default_model, docs[0], 1)   # another question about the same document, after a restart
        h2o_again = ask(port, default_model, docs[0], 1, kvcli={"policy": "h2o", "budget": 64})
    assert again["document_read_tokens"] == 0 and again["store_loaded"] == 1 and again["store_written"] == 0
    assert again["prefix_reused_tokens"] >= first["document_read_tokens"] - 40 and again["prefilled_tokens"] < 64
    # the store with the sums is loaded for h2o (the one without them cannot serve it), restored whole
    assert h2o_again["document_read_tokens"] == 0 and h2o_again["store_loaded"] == 2
    assert h2o_again["prefix_reused_tokens"] == h2o["document_read_tokens"]
    assert items[0]["id"] in [i["id"] for i in listed(cache)] and len(listed(cache)) == 2   # no new entry


def test_cap_evicts_the_least_recently_used(default_model, docs, tmp_path):
    cache = tmp_path / "kvcache"
    env = {"KVCLI_CACHE": str(cache)}
    # one logbook's full cache is ~8 MB on the default model (f16): one fits under 12 MiB, two do not
    with serving(args(default_model, "--store-max-bytes", "12M"), tmp_path / "cap.log", env) as (port, _):
        a = ask(port, default_model, docs[0], 0)
        before = listed(cache)
        b = ask(port, default_model, docs[1], 0)
        after = listed(cache)
        again = ask(port, default_model, docs[1], 1)
    assert a["document_read_tokens"] > 300 and b["document_read_tokens"] > 300 and len(before) == 1
    assert b["store_entries"] == 1 and b["store_evicted"] == 1   # evicted in memory
    assert len(after) == 1 and after[0]["id"] != before[0]["id"]   # and on disk: the newer document stays
    assert after[0]["tokens"] == b["document_read_tokens"] and after[0]["store_bytes"] <= 12 << 20
    assert again["document_read_tokens"] == 0


def test_memory_store_writes_nothing(default_model, docs, tmp_path):
    cache = tmp_path / "kvcache"
    with serving(args(default_model, "--store", "memory"), tmp_path / "mem.log", {"KVCLI_CACHE": str(cache)}) \
            as (port, _):
        s = ask(port, default_model, docs[0], 0)
    assert s["document_read_tokens"] > 300 and "store_written" not in s
    assert listed(cache) == []


def test_bounded_store_is_listed_and_survives_a_restart(default_model, tmp_path):
    """A document past the context (--ctx 1024) is stored in bounded chunks as a cached entry of the document store;
    a restarted server loads it (its chunks, not a read) for another question about the document."""
    from kvcli.evaluation.logbook import make_document
    doc = make_document(900, facts=2, seed=21)
    cache = tmp_path / "kvcache"
    env = {"KVCLI_CACHE": str(cache)}
    with serving(args(default_model), tmp_path / "first.log", env) as (port, _):
        first = ask(port, default_model, doc, 0)
    assert first["document_read_tokens"] > 1024 and first["bounded_chunks"] >= 2 and first["store_written"] == 1
    items = listed(cache)
    assert [(i["state"], i["form"], i["tokens"]) for i in items] == \
        [("cached", "bounded", first["document_read_tokens"])]
    with serving(args(default_model), tmp_path / "second.log", env) as (port, _):
        again = ask(port, default_model, doc, 1)
    assert again["document_read_tokens"] == 0 and again["store_loaded"] == 1 and again["store_written"] == 0
    assert again["prefix_reused_tokens"] >= again["prompt_tokens"] - 64
    assert [i["id"] for i in listed(cache)] == [items[0]["id"]]



def test_a_prompt_within_the_context_is_exact_unless_capped(default_model, tmp_path):
    """Within --ctx a prompt is served exact (its full cache resident, as llama-server holds it), whatever its size;
    KVCLI_RESELECT_EXACT_MB, where set, caps the exact form as in `kvcli chat`: above it (and past bounded
    reading's own threshold, KVCLI_BOUNDED_ABOVE_MB), bounded chunks."""
    from kvcli.evaluation.logbook import make_document
    doc = make_document(900, facts=2, seed=21)
    wide = [a if a != "1024" else "4096" for a in args(default_model)]
    env = {"KVCLI_CACHE": str(tmp_path / "kvcache"), "KVCLI_BOUNDED_ABOVE_MB": "0.001"}
    with serving(wide, tmp_path / "exact.log", env) as (port, _):
        exact = ask(port, default_model, doc, 0)
    assert exact["document_read_tokens"] > 1024 + 64 and "bounded_chunks" not in exact
    env = {**env, "KVCLI_CACHE": str(tmp_path / "kvcache2"), "KVCLI_RESELECT_EXACT_MB": "0.001"}
    with serving(wide, tmp_path / "capped.log", env) as (port, _):
        capped = ask(port, default_model, doc, 0)
    assert capped["prompt_tokens"] < 4096 and capped["bounded_chunks"] >= 2


def test_plan_form_keeps_a_fitting_prompt_exact_whatever_its_bytes(monkeypatch):
    """Without KVCLI_RESELECT_EXACT_MB a prompt that fits the server's context is exact, however large its full
    cache (serve once went bounded above 256 MiB, `kvcli chat`'s rule, slower than exact at 30k tokens)."""
    from types import SimpleNamespace

    from kvcli.apps import serve
    from kvcli.apps.serve import Choice, Engine

    def bounded(*a, **k):
        raise AssertionError("the bounded form was considered")
    monkeypatch.setattr(serve, "check_usable", bounded)
    monkeypatch.delenv("KVCLI_RESELECT_EXACT_MB", raising=False)
    huge = SimpleNamespace(bytes_per_cell=lambda: 1 << 30)   # a cell of 1 GiB: above every default threshold
    engine = SimpleNamespace(session=huge, fits=lambda prompt, c: True, n_ctx=32768)
    c = Choice(policy="snapkv", budget=256, policy_args={}, max_tokens=24, sampling=None)
    assert Engine.plan_form(engine, list(range(30000)), None, c) is None


def test_a_stored_document_sharing_only_the_head_leaves_the_prompt_read_alone(default_model, tmp_path):
    """Another version of a document (the same first paragraphs, another rest) whose whole stored cache, held
    resident beside the new rest, would not fit the context: the prompt is read alone and answered (it was a 400
    'the document needs N cells', for a prompt that fits the context by itself)."""
    from kvcli.evaluation.logbook import make_document
    first, planted = make_document(430, facts=1, seed=11)
    other, other_planted = make_document(330, facts=1, seed=12)
    head = first[: len(first) // 2]
    with serving(args(default_model, "--store", "memory"), tmp_path / "serve.log", {}) as (port, _):
        a = ask(port, default_model, (first, planted), 0)
        b = ask(port, default_model, (head + other, other_planted), 0)
    b_tokens = b["document_read_tokens"] + b["prefilled_tokens"]
    assert a["document_read_tokens"] > 500 and b_tokens < 1024
    assert a["document_read_tokens"] + b_tokens // 2 > 1024   # held beside A, B's rest would not have fitted
    assert b["document_read_tokens"] > 600 and b["prefix_reused_tokens"] == 0
