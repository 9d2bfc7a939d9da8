"""Stored documents answer new questions (issue 30, deliverable 3) on tiny random models, through the CLI:

- `kvcli compress --store` writes a document's full cache (with column sums for h2o/d2o, or --colsum);
- `kvcli run --cache FILE --policy P --budget N` re-selects from it: the document is read zero times;
- `kvcli run` with several questions (INSTRUCTION, --question, --questions FILE) reads the document once and
  answers each question alone, as a `kvcli run` of that question alone answers it when it reads the document in
  one prefill, as here (re-selection of a question over the stored document gives exactly run's prompt and plan:
  tests/test_reselect.py; a run that reads in bounded chunks answers from another cache);
- `kvcli batch` with several questions reads each document once and answers as `kvcli run` does;
- bad combinations, and corrupt, truncated or foreign stored files, are refused in one line (exit 2);
- a document stored in bounded chunks (`chat --store DIR`, `compress --store -o DIR`, `/save DIR`) is a store
  folder that `run/chat --cache DIR --policy P --budget N` re-select from without reading the document, with the
  answers of the chat that read it; a damaged, foreign or misused one is refused in one line.
"""
from __future__ import annotations

import json
import os

import pytest

from kvcli.cli import cli

DOC = " ".join(f"Entry {i}: the {w} station logged code {1000 + 37 * i}." for i, w in
               enumerate(["north", "south", "river", "stone", "light", "delta", "gamma", "alpha"] * 6))
QS = ["Which code did the river station log?", "And the stone station?", "What is entry 7?"]
ASK = [QS[0], "--question", QS[1], "--question", QS[2]]   # INSTRUCTION and two --question
ASK2 = ["--question", QS[0], "--question", QS[1]]


@pytest.fixture(scope="module")
def tiny(tiny_2k):
    return tiny_2k


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    (d / "doc.txt").write_text(DOC, encoding="utf-8")
    (d / "qs.txt").write_text(f"{QS[1]}\n\n  {QS[2]}  \n", encoding="utf-8")
    (d / "long.txt").write_text(DOC * 8, encoding="utf-8")
    (d / "empty.txt").write_text("\n \n", encoding="utf-8")
    return d


# every test stores its documents in a cache folder of its own (conftest.py)
pytestmark = pytest.mark.usefixtures("cache_dir")


def kvcli(cli_runner, *args):
    return cli_runner.invoke(cli, [str(a) for a in args])


def ok_json(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def one_line_error(r, message):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2, r.output
    assert len(lines) == 1 and message in lines[0], r.stderr


def single(cli_runner, tiny, doc, question, *policy):
    """The answer of a `kvcli run` of one question (the document read for it)."""
    return ok_json(kvcli(cli_runner, "run", "--model", tiny, "--doc", doc, *policy, "-n", 6, "--json", question))


@pytest.fixture(scope="module")
def singles():
    return {}


def run_answers(cli_runner, tiny, files, singles, policy):
    key = tuple(policy)
    if key not in singles:
        singles[key] = [single(cli_runner, tiny, files / "doc.txt", q, *policy)["answer"] for q in QS]
    return singles[key]


# ------------------------------------------------------------------------------ several questions, one read
@pytest.mark.parametrize("policy", [("-p", "snapkv", "-b", 48), ("-p", "h2o", "-b", 48), ("-p", "full")])
def test_several_questions_read_the_document_once_and_answer_as_run(cli_runner, tiny, files, singles, cache_dir,
                                                                     policy):
    r = ok_json(kvcli(cli_runner, "run", "--model", tiny, "--doc", files / "doc.txt", *policy, "-n", 6, "--json",
                      QS[0], "--questions", files / "qs.txt"))
    s = r["stats"]
    assert s["document_reads"] == 1 and s["questions"] == 3 and s["answered"] == 3 and s["read_s"] > 0
    assert s["store_bytes"] > 0
    assert [a["question"] for a in r["answers"]] == QS
    # each answered alone: what `kvcli run` answers for that question alone
    assert [a["answer"] for a in r["answers"]] == run_answers(cli_runner, tiny, files, singles, policy)
    for a in r["answers"]:
        if policy[1] == "full":
            assert s["mode"] == "restored" and a["stats"]["kv_cells"] >= a["stats"]["prompt_tokens"]
        else:
            assert s["mode"] == "re-selected" and a["stats"]["kv_cells"] <= 48 + 6 and a["stats"]["reselect_s"] > 0
    assert not any((cache_dir / "documents").iterdir())   # the temporary store is gone at exit


def test_several_questions_on_a_document_past_the_context_stream_a_bounded_store(cli_runner, tiny, files, cache_dir):
    """A document longer than the model's context (2k): several questions are answered from a store read chunk by
    chunk (bounded re-selection), each within the budget + its answer; --chunk N asks for the same on a short one."""
    for doc, extra in ((files / "long.txt", ()), (files / "doc.txt", ("--chunk", 128))):
        r = ok_json(kvcli(cli_runner, "run", "--model", tiny, "--doc", doc, "-p", "snapkv", "-b", 48, *extra, "-n", 4,
                          "--json", *ASK2))
        s = r["stats"]
        assert s["document_reads"] == 1 and s["answered"] == 2 and s["mode"] == "re-selected"
        for a in r["answers"]:
            assert a["stats"]["reselect_form"] == "bounded" and a["stats"]["reselect_chunks"] > 1
            assert a["stats"]["kv_cells"] <= 48 + 4
    assert not any((cache_dir / "documents").iterdir())   # the temporary store folder is gone at exit


def test_plain_output_is_one_block_per_question(cli_runner, tiny, files, singles):
    r = kvcli(cli_runner, "run", "--model", tiny, "--doc", files / "doc.txt", "-p", "snapkv", "-b", 48, "-n", 6,
              "--question", QS[0], "--question", QS[1], "--question", QS[2])
    assert r.exit_code == 0, r.output
    assert r.stdout == "\n\n".join(run_answers(cli_runner, tiny, files, singles, ("-p", "snapkv", "-b", 48))) + "\n"
    assert "document read once" in r.stderr and "3 of 3 question(s)" in r.stderr


# ------------------------------------------------------------------------------ stored documents
def test_stored_document_answers_without_reading(cli_runner, tiny, files, singles, tmp_path):
    store = tmp_path / "doc.kvc"
    c = ok_json(kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", "-o", store,
                      "--json", "-q"))
    assert c["mode"] == "stored" and c["colsum"] is False and c["file_bytes"] == store.stat().st_size
    assert c["stored_tokens"] > 0 and c["stats"]["store_bytes"] > 0 and c["stats"]["read_s"] > 0
    r = ok_json(kvcli(cli_runner, "run", "--cache", store, "-p", "snapkv", "-b", 48, "-n", 6, "--json",
                      "--question", QS[0], "--questions", files / "qs.txt"))
    assert r["stats"]["document_reads"] == 0 and r["stats"]["read_s"] == 0 and r["stats"]["load_s"] > 0
    assert [a["answer"] for a in r["answers"]] == run_answers(cli_runner, tiny, files, singles,
                                                              ("-p", "snapkv", "-b", 48))
    assert store.exists()   # a --cache file stays
    # one question: run's one-answer object
    one = ok_json(kvcli(cli_runner, "run", "--cache", store, "-p", "snapkv", "-b", 48, "-n", 6, "--json", QS[2]))
    assert one["answer"] == r["answers"][2]["answer"] and one["stats"]["document_reads"] == 0
    # without --policy: the whole stored document, as `--policy full` answers
    full = ok_json(kvcli(cli_runner, "run", "--cache", store, "-n", 6, "--json", "--questions", files / "qs.txt"))
    assert full["stats"]["mode"] == "restored" and full["stats"]["document_reads"] == 0
    assert [a["answer"] for a in full["answers"]] == run_answers(cli_runner, tiny, files, singles, ("-p", "full"))[1:]
    # a column-sum policy needs the sums: refused on this file, answered from one stored with them
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "-p", "h2o", "-b", 48, QS[0]), "no column sums")
    with_sums = tmp_path / "sums.kvc"
    c = ok_json(kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", "--policy",
                      "h2o", "-o", with_sums, "--json", "-q"))
    assert c["colsum"] is True and c["file_bytes"] > store.stat().st_size
    h = ok_json(kvcli(cli_runner, "run", "--cache", with_sums, "-p", "h2o", "-b", 48, "-n", 6, "--json", *ASK))
    assert [a["answer"] for a in h["answers"]] == run_answers(cli_runner, tiny, files, singles, ("-p", "h2o", "-b", 48))


def test_compressed_cache_keeps_its_behaviour(cli_runner, tiny, files, tmp_path):
    """A compressed .kvc file answers several questions, each alone after its compressed document, as one `run
    --cache` answers each; policy flags are refused with it."""
    path = tmp_path / "once.kvc"
    kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "-p", "snapkv", "-b", 48, "-o", path,
          "-q")
    r = ok_json(kvcli(cli_runner, "run", "--cache", path, "-n", 6, "--json", *ASK))
    assert r["stats"]["document_reads"] == 0 and r["stats"]["mode"] == "question-agnostic"
    each = [ok_json(kvcli(cli_runner, "run", "--cache", path, "-n", 6, "--json", q)) for q in QS]
    assert [a["answer"] for a in r["answers"]] == [e["answer"] for e in each]
    assert all(e["stats"]["document_reads"] == 0 for e in each)
    one_line_error(kvcli(cli_runner, "run", "--cache", path, "-p", "snapkv", "-b", 48, QS[0]), "compressed cache")
    one_line_error(kvcli(cli_runner, "run", "--cache", path, "-p", "snapkv", "-b", 48, *ASK), "compressed cache")


def test_single_run_counts_its_read(cli_runner, tiny, files):
    assert single(cli_runner, tiny, files / "doc.txt", QS[0], "-p", "snapkv", "-b", 48)["stats"]["document_reads"] == 1


# ------------------------------------------------------------------------------ refusals
def test_bad_stored_files_are_refused_in_one_line(cli_runner, tiny, other_tiny, files, tmp_path):
    store = tmp_path / "doc.kvc"
    kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", "-o", store, "-q")
    raw = store.read_bytes()
    foreign = ["--model", other_tiny, "-p", "snapkv", "-b", 48]
    one_line_error(kvcli(cli_runner, "run", "--cache", store, *foreign, *ASK), "was compressed for model")
    cut = tmp_path / "cut.kvc"
    cut.write_bytes(raw[: len(raw) // 2])
    bad = tmp_path / "bad.kvc"
    bad.write_bytes(raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:-50]) + raw[-50:])
    junk = tmp_path / "junk.kvc"
    junk.write_bytes(b"not a cache at all")
    fifo = tmp_path / "fifo.kvc"
    os.mkfifo(fifo)   # refused at once, not read (it would block)
    for path, msg in ((cut, "truncated"), (bad, "corrupted"), (junk, "not a kvcli .kvc file"),
                      (fifo, "not a regular file")):
        one_line_error(kvcli(cli_runner, "run", "--cache", path, "-p", "snapkv", "-b", 48, *ASK), msg)
        one_line_error(kvcli(cli_runner, "run", "--cache", path, *ASK), msg)
        one_line_error(kvcli(cli_runner, "run", "--cache", path, QS[0]), msg)


@pytest.mark.parametrize("args, message", [
    (["run", "--doc", "DOC"], "no question"),
    (["run", "--doc", "DOC", "--question", " "], "--question is empty"),
    (["run", "--doc", "DOC", "  "], "the instruction is empty"),
    (["run", "--doc", "DOC", "--questions", "NOPE"], "no such file"),
    (["run", "--doc", "DOC", "--questions", "EMPTY"], "holds no question"),
    (["run", "--doc", "DOC", "--engine", "reference", *ASK2], "drop --engine reference"),
    (["run", "--doc", "DOC", "--no-template", *ASK2], "drop --no-template"),
    (["run", "--doc", "DOC", "-p", "snapkv", *ASK2], "needs --budget"),
    (["run", "--doc", "LONG", "-p", "h2o", "-b", "48", *ASK2], "column sums"),
    (["compress", "--doc", "DOC", "-o", "OUT", "--colsum"], "add --store"),
    (["compress", "--doc", "DOC", "-o", "OUT", "--store", "--question", "q"], "drop --question"),
    (["compress", "--doc", "DOC", "-o", "OUT", "--store", "-p", "snapkv", "-b", "48"], "drop --budget"),
    (["compress", "--doc", "DOC", "-o", "OUT", "--store", "--chunk", "128"], "give --policy P --budget N"),
    (["compress", "--doc", "LONG", "-o", "OUT", "--store"], "longer than the model's context (2048 tokens)"),
    (["compress", "--doc", "LONG", "-o", "OUT", "--store", "-p", "h2o", "-b", "48"], "column sums"),
    (["compress", "--doc", "LONG", "-o", "OUT", "--store", "-p", "snapkv", "-b", "48", "--chunk-scoring", "question"],
     "drop --chunk-scoring"),
    (["compress", "--doc", "DOC", "-o", "OUT", "--store", "-b", "48"], "add --policy P"),
])
def test_bad_combinations_one_line(cli_runner, tiny, files, tmp_path, args, message):
    names = {"DOC": files / "doc.txt", "LONG": files / "long.txt", "EMPTY": files / "empty.txt",
             "NOPE": tmp_path / "nope.txt", "OUT": tmp_path / "out.kvc"}
    r = kvcli(cli_runner, args[0], "--model", tiny, *[names.get(a, a) for a in args[1:]])
    one_line_error(r, message)
    assert not (tmp_path / "out.kvc").exists()


def test_cache_refuses_document_flags(cli_runner, tiny, files, tmp_path):
    store = tmp_path / "doc.kvc"
    kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", "-o", store, "-q")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "-p", "snapkv", "-b", 48, "--doc", files / "doc.txt",
                         *ASK), "drop --doc")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "--system", "x", *ASK), "drop --system")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "--budget", 48, *ASK), "add --policy P")
    # chat re-selects from it with --policy and --budget; without them it says so
    one_line_error(cli_runner.invoke(cli, ["chat", "--cache", str(store)], input=QS[0] + "\n"),
                   "give --policy P --budget N")


# ------------------------------------------------------------------------------ kvcli batch
def test_batch_reads_each_document_once_for_its_questions(cli_runner, tiny, files, singles, tmp_path, cache_dir):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOC, encoding="utf-8")
    (docs / "b.txt").write_text(DOC.replace("station", "post"), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    snap = ["-p", "snapkv", "-b", 48, "-n", 6]
    s = ok_json(kvcli(cli_runner, "batch", "--model", tiny, "--docs", docs, *snap, "-o", out, "--json", "-q",
                      "-i", QS[0], "--question", QS[1], "--question", QS[0]))   # a repeated question is asked once
    assert s["documents"] == 2 and s["questions"] == 4 and s["answered"] == 4 and s["document_reads"] == 2
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["path"][-5:], r["question"]) for r in rows) == sorted(
        (d, q) for d in ("a.txt", "b.txt") for q in QS[:2])
    assert len({r["key"] for r in rows}) == 4 and all(r["error"] is None for r in rows)
    assert sum(r["stats"]["document_reads"] for r in rows) == 2 and all(r["stats"]["reselect_s"] > 0 for r in rows)
    assert all(r["stats"]["kv_cells"] <= 48 + 6 for r in rows)
    # each answer is what `kvcli run` answers for that document and question alone
    for r in rows:
        assert r["answer"] == single(cli_runner, tiny, r["path"], r["question"], *snap[:4])["answer"], r
    assert not any((cache_dir / "documents").iterdir())   # the stored documents are gone
    # a question added later: only its lines are answered, each document read once more
    s = ok_json(kvcli(cli_runner, "batch", "--model", tiny, "--docs", docs, *snap, "-o", out, "--json", "-q",
                      "-i", QS[0], "--question", QS[1], "--questions", files / "qs.txt"))
    assert s["skipped"] == 4 and s["answered"] == 2 and s["document_reads"] == 2
    new = [json.loads(x) for x in out.read_text().splitlines()][4:]
    assert {r["question"] for r in new} == {QS[2]}
    assert new[0]["answer"] == single(cli_runner, tiny, new[0]["path"], QS[2], *snap[:4])["answer"]


def test_batch_needs_a_question(cli_runner, tiny, files, tmp_path):
    for args, msg in (([], "no instruction"), (["--question", " "], "--question is empty"),
                      (["--questions", files / "empty.txt"], "holds no question")):
        one_line_error(kvcli(cli_runner, "batch", "--model", tiny, "--docs", files / "doc.txt", "-o",
                             tmp_path / "o.jsonl", *args), msg)
        assert not (tmp_path / "o.jsonl").exists()


def test_batch_manifest_gives_each_document_its_questions(cli_runner, tiny, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOC, encoding="utf-8")
    (docs / "b.txt").write_text(DOC.replace("station", "post"), encoding="utf-8")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "docs/a.txt", "questions": QS[:2]}) + "\n\n"
                        + json.dumps({"path": str(docs / "b.txt"), "question": QS[2]}) + "\n"
                        + json.dumps({"path": "docs/a.txt", "questions": [QS[1], QS[2]]}) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    s = ok_json(kvcli(cli_runner, "batch", "--model", tiny, "--manifest", manifest, "-p", "snapkv", "-b", 48,
                      "-n", 6, "-o", out, "--json", "-q"))
    assert s["documents"] == 2 and s["questions"] == 4 and s["answered"] == 4 and s["document_reads"] == 2
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["path"][-5:], r["question"]) for r in rows) == sorted(
        [("a.txt", QS[0]), ("a.txt", QS[1]), ("a.txt", QS[2]), ("b.txt", QS[2])])
    b = next(r for r in rows if r["path"].endswith("b.txt"))
    assert b["answer"] == single(cli_runner, tiny, docs / "b.txt", QS[2], "-p", "snapkv", "-b", 48)["answer"]
    # the same answers through --docs and --question: the same keys (nothing asked again)
    again = ok_json(kvcli(cli_runner, "batch", "--model", tiny, "--docs", docs / "b.txt", "-p", "snapkv", "-b", 48,
                          "-n", 6, "-o", out, "--json", "-q", "--question", QS[2], "--question", QS[0]))
    assert again["skipped"] == 1 and again["answered"] == 1
    bad = tmp_path / "bad.jsonl"
    for text, msg in (('{"path": "x.txt"}\n', "line 1: expected"), ("\nnot json\n", "line 2: not JSON"),
                      ("", "lists no document")):
        bad.write_text(text, encoding="utf-8")
        one_line_error(kvcli(cli_runner, "batch", "--model", tiny, "--manifest", bad, "-o", tmp_path / "o.jsonl"),
                       msg)
    one_line_error(kvcli(cli_runner, "batch", "--model", tiny, "--manifest", manifest, "--docs", docs,
                         "-o", tmp_path / "o.jsonl"), "--docs, or with their questions in --manifest")
    assert not (tmp_path / "o.jsonl").exists()


def test_out_file_and_ctrl_c(cli_runner, tiny, files, singles, tmp_path, cache_dir, monkeypatch):
    snap = ("-p", "snapkv", "-b", 48)
    out = tmp_path / "answers.txt"
    r = kvcli(cli_runner, "run", "--model", tiny, "--doc", files / "doc.txt", *snap, "-n", 6, "-q", "-o", out, *ASK)
    assert r.exit_code == 0, r.output
    assert out.read_text() == "\n\n".join(run_answers(cli_runner, tiny, files, singles, snap)) + "\n"
    # Ctrl-C during the second re-selection: the first answer was given, the temporary store is gone, exit 130
    from kvcli.drivers import reselect
    real, calls = reselect.StoredDocument.reselect, []

    def interrupted(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kw)

    monkeypatch.setattr(reselect.StoredDocument, "reselect", interrupted)
    r = kvcli(cli_runner, "run", "--model", tiny, "--doc", files / "doc.txt", *snap, "-n", 6, "-q", *ASK)
    assert r.exit_code == 130
    assert r.stdout.startswith(run_answers(cli_runner, tiny, files, singles, snap)[0] + "\n")
    assert not any((cache_dir / "documents").iterdir())


def test_batch_questions_on_ray_give_the_local_answers(run_kvcli, tiny, files, tmp_path):
    """On Ray the questions of one document may go to several workers (each reads it once): the same answers."""
    import importlib.util
    assert importlib.util.find_spec("ray"), "Ray is not installed: ./setup.sh installs requirements-ray.txt"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(DOC, encoding="utf-8")
    (docs / "b.txt").write_text(DOC.replace("station", "post"), encoding="utf-8")
    args = ["batch", "--model", tiny, "--docs", docs, "-p", "snapkv", "-b", 48, "-n", 6, "--dry-multiplier", 0,
            "-q", "--json", "-i", *ASK]
    env = {"KVCLI_CACHE": str(tmp_path / "kvcache")}
    local = run_kvcli(*args, "-o", tmp_path / "local.jsonl", env=env)
    on_ray = run_kvcli(*args, "-o", tmp_path / "ray.jsonl", "--ray", "local", "--ray-workers", 2, "--ray-cpus", 1,
                       env=env)
    assert local.returncode == 0 and on_ray.returncode == 0, on_ray.stderr
    s = json.loads(on_ray.stdout)
    assert s["answered"] == 6 and 2 <= s["document_reads"] <= 4 and json.loads(local.stdout)["document_reads"] == 2
    read = lambda name: {d["key"]: d for d in map(json.loads, (tmp_path / name).read_text().splitlines())}  # noqa: E731
    a, b = read("local.jsonl"), read("ray.jsonl")
    assert set(a) == set(b) and all(a[k]["answer"] == b[k]["answer"] for k in a)
    assert not any((tmp_path / "kvcache" / "documents").iterdir())


# ------------------------------------------------------------------------------ bounded store folders
BOUNDED = ["-p", "snapkv", "-b", 48, "--chunk", 128]


def chat_rows(cli_runner, *args, input):
    r = cli_runner.invoke(cli, ["chat", *[str(a) for a in args], "--json", "-n", "6"], input=input)
    assert r.exit_code == 0, r.output
    return r, [json.loads(line) for line in r.stdout.splitlines()]


def test_bounded_store_folder_is_kept_and_reused(cli_runner, tiny, files, tmp_path, cache_dir):
    """chat --store DIR keeps the bounded store as a folder; run --cache DIR and chat --cache DIR re-select from it
    without reading the document and answer as the chat that read it; compress --store -o DIR writes the same store
    (a document past the model's context too); /save DIR of a bounded chat writes one with the turns."""
    store = tmp_path / "store"
    piped = "\n".join(QS) + "\n"
    r, rows = chat_rows(cli_runner, "--model", tiny, "--doc", files / "doc.txt", *BOUNDED, "--store", store,
                        "--fresh", input=piped)
    assert "bounded" in r.stderr and str(store) in r.stderr and "deleted at exit" not in r.stderr
    assert (store / "store.json").is_file() and all(x["reselect_chunks"] > 1 for x in rows)
    answers = [x["answer"] for x in rows]
    run = ok_json(kvcli(cli_runner, "run", "--cache", store, "-p", "snapkv", "-b", 48, "-n", 6, "--json", *ASK))
    assert run["stats"]["document_reads"] == 0 and run["stats"]["read_s"] == 0 and run["stats"]["load_s"] > 0
    assert [a["answer"] for a in run["answers"]] == answers
    assert all(a["stats"]["reselect_chunks"] > 1 and a["stats"]["kv_cells"] <= 48 + 6 for a in run["answers"])
    one = ok_json(kvcli(cli_runner, "run", "--cache", store, "-p", "snapkv", "-b", 48, "-n", 6, "--json", QS[1]))
    assert one["answer"] == answers[1] and one["stats"]["document_reads"] == 0
    r, again = chat_rows(cli_runner, "--cache", store, "-p", "snapkv", "-b", 48, "--fresh", input=piped)
    assert "bounded] " in r.stderr and [x["answer"] for x in again] == answers
    # kept, and listed as such (kvcli documents); nothing temporary made
    assert store.exists() and [json.loads((p / "entry.json").read_text())["state"]
                               for p in cache_dir.glob("documents/*")] == ["kept"]
    # compress --store -o DIR: the same reading, the same store, the same answers
    c = ok_json(kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", *BOUNDED,
                      "-o", tmp_path / "compressed", "--json", "-q"))
    assert c["form"] == "bounded" and c["chunks"] > 1 and c["read_policy"] == "snapkv" and c["read_budget"] == 48
    assert c["file_bytes"] == sum(f.stat().st_size for f in (tmp_path / "compressed").iterdir())
    run2 = ok_json(kvcli(cli_runner, "run", "--cache", tmp_path / "compressed", "-p", "snapkv", "-b", 48, "-n", 6,
                         "--json", *ASK))
    assert [a["answer"] for a in run2["answers"]] == answers
    # past the model's context (2k): stored in bounded chunks without --chunk, answered without reading it
    c = ok_json(kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "long.txt", "--store", "-p",
                      "snapkv", "-b", 48, "-o", tmp_path / "long", "--json", "-q"))
    assert c["form"] == "bounded" and c["stored_tokens"] > 2048
    long = ok_json(kvcli(cli_runner, "run", "--cache", tmp_path / "long", "-p", "pyramidkv", "-b", 64, "-n", 4,
                         "--json", *ASK2))
    assert long["stats"]["document_reads"] == 0 and long["stats"]["answered"] == 2
    assert all(a["stats"]["generated_tokens"] >= 1 and a["stats"]["reselect_chunks"] > 2 for a in long["answers"])
    # /save DIR in a bounded chat: the store with the conversation's turns, which --cache continues
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny), "--doc", str(files / "doc.txt"),
                                *[str(a) for a in BOUNDED], "-n", "4"], input=f"{QS[0]}\n/save {tmp_path / 'saved'}\n")
    assert r.exit_code == 0, r.output
    assert "1 turn(s)" in r.stderr and (tmp_path / "saved" / "store.json").is_file()
    r, rows = chat_rows(cli_runner, "--cache", tmp_path / "saved", "-p", "snapkv", "-b", 48, input=QS[1] + "\n")
    assert "1 turn(s)" in r.stderr and rows[0]["generated_tokens"] >= 1
    assert rows[0]["prompt_tokens"] > again[1]["prompt_tokens"]   # the saved turn is in the prompt


def test_bad_store_folders_are_refused_in_one_line(cli_runner, tiny, other_tiny, files, tmp_path):
    store = tmp_path / "store"
    ok_json(kvcli(cli_runner, "compress", "--model", tiny, "--doc", files / "doc.txt", "--store", *BOUNDED, "-o",
                  store, "--json", "-q"))
    snap = ["-p", "snapkv", "-b", 48]
    one_line_error(kvcli(cli_runner, "run", "--cache", store, *ASK), "give a compressing --policy P and --budget N")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, QS[0]), "give a compressing --policy P and --budget N")
    one_line_error(cli_runner.invoke(cli, ["chat", "--cache", str(store)], input=QS[0] + "\n"),
                   "give --policy P --budget N")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "-p", "h2o", "-b", 48, QS[0]), "column sums")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, "--model", other_tiny, *snap, QS[0]),
                   "was compressed for model")
    one_line_error(kvcli(cli_runner, "run", "--cache", store, *snap, "--doc", files / "doc.txt", QS[0]), "drop --doc")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("mine")
    one_line_error(kvcli(cli_runner, "run", "--cache", plain, *snap, QS[0]), "not a kvcli store")
    # chat --store onto a folder that is not a store: refused before reading, nothing deleted
    r = cli_runner.invoke(cli, ["chat", "--model", str(tiny), "--doc", str(files / "doc.txt"),
                                *[str(a) for a in BOUNDED], "--store", str(plain)], input=QS[0] + "\n")
    one_line_error(r, "not a kvcli store")
    assert [p.name for p in plain.iterdir()] == ["notes.txt"]
    chunk = store / "chunk-0001.state"
    raw = chunk.read_bytes()
    for damage, msg in ((lambda: chunk.write_bytes(raw[:-7]), "is truncated"),
                        (lambda: chunk.write_bytes(raw[:99] + bytes([raw[99] ^ 0xFF]) + raw[100:]), "is corrupted"),
                        (chunk.unlink, "is missing"),
                        (lambda: (store / "store.json").write_text("{"), "corrupted or truncated")):
        damage()
        one_line_error(kvcli(cli_runner, "run", "--cache", store, *snap, *ASK), msg)
        one_line_error(cli_runner.invoke(cli, ["chat", "--cache", str(store), *[str(a) for a in snap]],
                                         input=QS[0] + "\n"), msg)
        chunk.write_bytes(raw)
