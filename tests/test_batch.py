"""Issue #18: `kvcli batch`, many documents through one model and one shared cache into a resumable JSONL.

The tiny random model (a 4,096-token context) carries the scheduling, resume and error paths on 20
generated documents of 1-3k tokens, with an f32 cache so that answers are exact across runs, batch sizes
and workers; the default model answers two documents end to end, as `kvcli run` does. The Ray test starts
a local Ray instance with two workers (Ray comes from requirements-ray.txt, which setup.sh installs)."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, KVCLI, ROOT

N_DOCS = 20
SNAP = ["--policy", "snapkv", "--budget", "128", "-n", "8", "--cache-type", "f32", "-i", "Summarise the log."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("batchmodel") / "tiny-4k.gguf", n_ctx_train=4096)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """20 station logbooks of about 1,000 to 3,000 tokens (kvcli.evaluation.logbook, ~1.38 tokens a word)."""
    from kvcli.evaluation.logbook import make_document
    d = tmp_path_factory.mktemp("batchdocs")
    for i in range(N_DOCS):
        text, _ = make_document(730 + 75 * i, 0, seed=i)
        (d / f"log-{i:02d}.txt").write_text(text, encoding="utf-8")
    return d


def kvcli(*args, input=None, env=None, timeout=900):
    e = {**os.environ, **(env or {})}
    return subprocess.run([*KVCLI, *map(str, args)], input=input, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=e)


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_batch_writes_every_document_and_a_killed_run_resumes(tiny, corpus, tmp_path):
    out = tmp_path / "results.jsonl"
    args = ["batch", "--docs", corpus, "--model", tiny, *SNAP, "--max-cache", 4096, "--out", out, "--json"]
    p = subprocess.Popen([*KVCLI, *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline and p.poll() is None and \
            (not out.exists() or out.read_bytes().count(b"\n") < 3):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, "the batch ended before it could be killed midway"
    before = out.read_bytes()
    done = lines(out)   # every line a kill -9 left is whole
    assert 3 <= len(done) < N_DOCS
    assert all(d["error"] is None and d["answer"] for d in done)

    r = kvcli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""                     # --json: the summary on stdout, no progress bar off a terminal
    summary = json.loads(r.stdout)
    assert (summary["skipped"], summary["answered"], summary["errors"]) == (len(done), N_DOCS - len(done), 0)
    assert out.read_bytes().startswith(before)    # the finished lines stay as they were, none is redone
    got = lines(out)
    assert len(got) == N_DOCS and len({d["key"] for d in got}) == N_DOCS
    assert sorted(Path(d["path"]).name for d in got) == sorted(f.name for f in corpus.iterdir())
    for d in got:
        st = d["stats"]
        assert d["policy"] == "snapkv" and d["budget"] == 128 and d["error"] is None
        assert 1000 <= st["prompt_tokens"] <= 3000
        assert st["kv_cells"] == 128 < st["peak_kv_cells"] == st["prompt_tokens"]
        assert 1 <= st["generated_tokens"] <= 8 and d["answer"]
    # the cache held several compressed documents at once and decoded them together
    assert max(d["stats"]["decoded_with"] or 0 for d in got) > 1

    # a third run has nothing left to do
    r = kvcli(*args)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["skipped"] == N_DOCS and out.read_bytes().count(b"\n") == N_DOCS

    # a line torn by a kill in the middle of its write: dropped, and its document done again
    whole = out.read_bytes()
    last = whole[whole.rstrip(b"\n").rfind(b"\n") + 1:]
    out.write_bytes(whole[: len(whole) - len(last) // 2 - 1])
    r = kvcli(*args[:-1])                       # without --json: the summary goes to stderr
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert "dropped a torn last line" in r.stderr
    assert f"1 answered, 0 errors, {N_DOCS - 1} already in" in r.stderr
    again = out.read_bytes()
    assert again.startswith(whole[: len(whole) - len(last)])
    redone, first = json.loads(again[len(whole) - len(last):]), json.loads(last)
    assert (redone["key"], redone["answer"]) == (first["key"], first["answer"])   # greedy, f32 cache


def test_batch_gives_the_answers_of_one_document_at_a_time(tiny, corpus, tmp_path):
    """Held together in one cache or one per context (--parallel 1): the same answers (greedy, f32)."""
    docs = sorted(corpus.iterdir())[:4]
    listing = "".join(f"{p}\n" for p in docs)
    both = {}
    for parallel in (0, 1):
        out = tmp_path / f"p{parallel}.jsonl"
        r = kvcli("batch", "--docs", "-", "--model", tiny, *SNAP, "--parallel", parallel, "--out", out,
                  input=listing)
        assert r.returncode == 0, r.stderr
        both[parallel] = {d["path"]: d for d in lines(out)}
    assert set(both[0]) == {str(p) for p in docs}
    for path, d in both[0].items():
        assert d["answer"] == both[1][path]["answer"]
        assert d["key"] == both[1][path]["key"]        # --parallel does not decide an answer
        assert both[1][path]["stats"]["decoded_with"] in (1, None)


def test_held_documents_of_a_layer_budget_policy_hold_their_live_entries(tiny, corpus, tmp_path):
    """Issue #45: several compressed documents in one cache each hold only their live entries (the cache is packed at
    every admission and release), with the answers of one document per context."""
    docs = sorted(corpus.iterdir())[:4]
    listing = "".join(f"{p}\n" for p in docs)
    pyr = ["--policy", "pyramidkv", "--budget", "128", "-n", "8", "--cache-type", "f32", "-i", "Summarise the log."]
    runs = {}
    for name, parallel, layout in (("packed", 0, "ragged"), ("alone", 1, "ragged"), ("cells", 0, "cells")):
        out = tmp_path / f"{name}.jsonl"
        r = kvcli("batch", "--docs", "-", "--model", tiny, *pyr, "--parallel", parallel, "--out", out, input=listing,
                  env={"KVCLI_LAYOUT": layout})
        assert r.returncode == 0, r.stderr
        runs[name] = {d["path"]: d for d in lines(out)}
    assert set(runs["packed"]) == {str(p) for p in docs}
    for path, d in runs["packed"].items():
        st = d["stats"]
        assert d["answer"] == runs["alone"][path]["answer"] == runs["cells"][path]["answer"]
        assert st["kv_bytes"] <= 1.10 * st["kv_bytes_live"], st
        assert runs["cells"][path]["stats"]["kv_bytes"] > 1.10 * st["kv_bytes_live"]   # what the cells layout held
    assert max(d["stats"]["decoded_with"] for d in runs["packed"].values()) > 1       # they were held together


def test_bad_documents_get_error_lines_and_the_batch_goes_on(tiny, corpus, tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a-good.txt").write_text((corpus / "log-00.txt").read_text(), encoding="utf-8")
    (d / "b-latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (d / "c-empty.txt").write_bytes(b"  \n")
    (d / "d-binary.txt").write_bytes(b"\x00\x01\x02" * 50)
    (d / "e-long.txt").write_text((corpus / "log-19.txt").read_text(), encoding="utf-8")   # ~3k tokens
    (d / "skipped.bin").write_bytes(b"not a document suffix")
    listing = "".join(f"{p}\n" for p in sorted(d.glob("*.txt"))) + f"{d / 'missing.txt'}\n"

    out = tmp_path / "full.jsonl"
    r = kvcli("batch", "--docs", "-", "--model", tiny, "--policy", "full", "-n", "8", "--cache-type", "f32",
              "--max-cache", 2048, "-i", "Summarise.", "--out", out, "--json", input=listing)
    assert r.returncode == 0, r.stderr
    got = {Path(x["path"]).name: x for x in lines(out)}
    assert set(got) == {"a-good.txt", "b-latin1.txt", "c-empty.txt", "d-binary.txt", "e-long.txt", "missing.txt"}
    assert got["a-good.txt"]["error"] is None and got["a-good.txt"]["answer"]
    assert "is not valid UTF-8: byte 0xe9" in got["b-latin1.txt"]["error"]
    assert got["c-empty.txt"]["error"].endswith("is empty")
    assert "not a text file" in got["d-binary.txt"]["error"]
    assert got["missing.txt"]["error"].startswith("document not found")
    assert got["e-long.txt"]["error"].startswith("the prompt is ") and "choose a compressing policy" in \
        got["e-long.txt"]["error"] and "less --max-tokens 8" in got["e-long.txt"]["error"]
    assert all(x["answer"] is None for n, x in got.items() if n != "a-good.txt")
    s = json.loads(r.stdout)
    assert (s["answered"], s["errors"], s["skipped"]) == (1, 5, 0)

    # error lines are kept on a re-run, and done again with --retry-errors
    r = kvcli("batch", "--docs", d, "--model", tiny, "--policy", "full", "-n", "8", "--cache-type", "f32",
              "--max-cache", 2048, "-i", "Summarise.", "--out", out, "--json", "--retry-errors")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["documents"], s["answered"], s["errors"], s["skipped"]) == (5, 0, 4, 1)

    # a compressing policy reads the long document in chunks within the same cache
    out = tmp_path / "snap.jsonl"
    r = kvcli("batch", "--docs", str(d / "[ae]-*.txt"), "--model", tiny, *SNAP, "--max-cache", 2048, "--out", out)
    assert r.returncode == 0, r.stderr
    got = {Path(x["path"]).name: x for x in lines(out)}
    assert set(got) == {"a-good.txt", "e-long.txt"}
    long = got["e-long.txt"]["stats"]
    assert long["chunks"] >= 2 and long["peak_kv_cells"] <= 2048 - 8 and long["kv_cells"] == 128
    assert "chunks" not in got["a-good.txt"]["stats"]


@pytest.mark.parametrize("args,message", [
    (["--docs", "/nonexistent/*.txt"], "no file matches"),
    (["--docs", "/nonexistent/x"], "no such file or folder"),
    (["--docs", "{docs}", "--ray-workers", "2"], "give --ray ADDRESS too"),
    (["--docs", "{docs}", "--policy", "snapkv", "--budget", "64", "--policy-arg", "window=zz"], "window"),
    (["--docs", "{docs}", "-i", " "], "the instruction is empty"),
    (["--docs", "{docs}", "--max-cache", "100", "-n", "64"], "leaves 36 cells"),
    (["--docs", "{docs}", "--policy", "d2o", "--budget", "64", "--policy-arg", "full_layers=7"],
     "full_layers item 7 is outside the model's"),
    (["--docs", "{docs}", "--dry-base", "0.5"], "--dry-base: 0.5 is out of range"),
])
def test_input_errors_are_one_line_and_exit_2(tiny, corpus, tmp_path, args, message):
    args = [str(corpus) if a == "{docs}" else a for a in args]
    r = kvcli("batch", "--model", tiny, "-i", "Summarise.", "--out", tmp_path / "o.jsonl", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()     # refused before --out is touched


def test_batch_says_a_long_reads_tokens_and_time_before_it_starts(tiny, corpus, tmp_path):
    """A document whose read is estimated long is announced as kvcli run's is (doc_formats.announce_read;
    KVCLI_READ_NOTICE_S=0 makes any read long enough): one line per document on stderr, with its prompt tokens, in
    one prefill or in chunks; with no speed given, the first read is measured and the next document's estimate
    uses it (so its notice came before its own read); several questions: one notice per document, for its one read."""
    from kvcli.drivers.chunked import DEFAULT_CHUNK
    docs = [corpus / "log-00.txt", corpus / "log-19.txt", corpus / "log-01.txt"]   # log-19: ~3k tokens, in chunks
    listing = "".join(f"{p}\n" for p in docs)
    args = ["batch", "--docs", "-", "--model", tiny, *SNAP, "--max-cache", 2048, "--json"]
    env = {"KVCLI_READ_NOTICE_S": "0", "KVCLI_READ_TOK_S": "500", "KVCLI_CACHE": tmp_path / "given"}
    r = kvcli(*args, "--out", tmp_path / "given.jsonl", input=listing, env=env)
    assert r.returncode == 0, r.stderr
    got = {Path(x["path"]).name: x for x in lines(tmp_path / "given.jsonl")}
    want = []
    for p in docs:
        n = got[p.name]["stats"]["prompt_tokens"]
        how = f"in chunks of {DEFAULT_CHUNK}" if p.name == "log-19.txt" else "in one prefill"
        assert ("chunks" in got[p.name]["stats"]) == (p.name == "log-19.txt")
        want.append(f"[this document is {n:,} tokens: reading it {how} will take about {round(n / 500)} s "
                    f"(estimated at 500 tokens/s: KVCLI_READ_TOK_S)]")
    assert r.stderr.splitlines() == want      # in the order the documents are read, and nothing else (--json)

    # no speed known: the first read (shorter than doc_formats.PROBE_FROM, no probe) says nothing and is measured,
    # the second document's notice gives the first's measured speed
    env = {"KVCLI_READ_NOTICE_S": "0", "KVCLI_CACHE": tmp_path / "measured"}
    r = kvcli(*args, "--out", tmp_path / "measured.jsonl", input=listing.replace(f"{docs[1]}\n", ""), env=env)
    assert r.returncode == 0, r.stderr
    got = {Path(x["path"]).name: x["stats"]["prompt_tokens"] for x in lines(tmp_path / "measured.jsonl")}
    notice = r.stderr.splitlines()
    assert len(notice) == 1 and notice[0].startswith(
        f"[this document is {got['log-01.txt']:,} tokens: reading it in one prefill will take about "), r.stderr
    assert f"tokens/s: measured by the last such read here: {got['log-00.txt']:,} tokens in " in notice[0]
    speeds = json.loads((tmp_path / "measured" / "read-speeds.json").read_text())
    assert [v["tokens"] for k, v in speeds.items() if k.startswith(f"{Path(tiny).name}|prefill|")] == \
        [got["log-01.txt"]]   # the last read's

    # several questions: each document read once (stored) and announced once
    env = {"KVCLI_READ_NOTICE_S": "0", "KVCLI_READ_TOK_S": "500", "KVCLI_CACHE": tmp_path / "questions"}
    two = [a for a in args if a not in ("-i", "Summarise the log.")]
    r = kvcli(*two, "--question", "Summarise the log.", "--question", "Who wrote it?", "--out",
              tmp_path / "questions.jsonl", input=f"{docs[0]}\n{docs[2]}\n", env=env)
    assert r.returncode == 0, r.stderr
    read = [x["stats"]["prompt_tokens"] for x in lines(tmp_path / "questions.jsonl") if x["stats"]["document_reads"]]
    notice = r.stderr.splitlines()
    assert len(read) == len(notice) == 2, r.stderr
    stored = [int(line.split()[3].replace(",", "")) for line in notice]   # the tokens stored: the prompt's start
    assert notice == [f"[this document is {n:,} tokens: reading it in one prefill (once for its questions) will take "
                      f"about {round(n / 500)} s (estimated at 500 tokens/s: KVCLI_READ_TOK_S)]" for n in stored]
    assert all(n < whole for n, whole in zip(stored, read))
    speeds = json.loads((tmp_path / "questions" / "read-speeds.json").read_text())
    assert [v["tokens"] for k, v in speeds.items() if k.startswith(f"{Path(tiny).name}|prefill|")] == [stored[1]]

    # a bad setting is one line before any document is read
    r = kvcli(*args, "--out", tmp_path / "bad.jsonl", input=listing, env={"KVCLI_READ_TOK_S": "fast"})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "kvcli: error: KVCLI_READ_TOK_S must be a number of tokens per second > 0 (got 'fast')"], r.stderr
    assert not (tmp_path / "bad.jsonl").exists()


def test_the_results_file_is_checked_and_locked(tiny, corpus, tmp_path):
    out = tmp_path / "other.jsonl"
    out.write_text('{"not": "a result"}\n')
    r = kvcli("batch", "--docs", corpus, "--model", tiny, "-i", "Summarise.", "--out", out)
    assert r.returncode == 2 and "line 1: not a kvcli batch result line" in r.stderr
    out.write_text("")
    with open(out, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)   # another kvcli batch writing it
        r = kvcli("batch", "--docs", corpus, "--model", tiny, "-i", "Summarise.", "--out", out)
    assert r.returncode == 2 and "is being written by another kvcli batch" in r.stderr


def test_ray_missing_is_one_line(tiny, corpus, tmp_path):
    fake = tmp_path / "noray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('Ray is not installed here')\n")
    r = kvcli("batch", "--docs", corpus, "--model", tiny, "-i", "Summarise.", "--out", tmp_path / "o.jsonl",
              "--ray", "local", env={"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"})
    assert r.returncode == 2
    assert r.stderr.strip() == "kvcli: error: --ray needs Ray, an optional extra: pip install 'kvcli[ray]' " \
                               "(or -r requirements-ray.txt)"


def test_ray_workers_give_the_local_answers(tiny, corpus, tmp_path):
    import importlib.util
    assert importlib.util.find_spec("ray"), "Ray is not installed: ./setup.sh installs requirements-ray.txt"
    docs = sorted(corpus.iterdir())[:6]
    listing = "".join(f"{p}\n" for p in docs)
    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    greedy = [*SNAP, "--dry-multiplier", "0"]    # plain argmax, no penalty: the answers are the logits' alone
    r = kvcli("batch", "--docs", "-", "--model", tiny, *greedy, "--out", local, input=listing)
    assert r.returncode == 0, r.stderr
    # the Ray run resumes what a local run left: the first three documents are answered already
    done = local.read_text(encoding="utf-8").splitlines(keepends=True)[:3]
    on_ray.write_text("".join(done), encoding="utf-8")
    r = kvcli("batch", "--docs", "-", "--model", tiny, *greedy, "--out", on_ray, "--json",
              "--ray", "local", "--ray-workers", 2, "--ray-cpus", 1, input=listing,
              env={"KVCLI_READ_NOTICE_S": "0", "KVCLI_READ_TOK_S": "500"})
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["skipped"], s["answered"], s["errors"], s["ray_workers"]) == (3, 3, 0, 2)
    a = {d["key"]: d for d in lines(local)}
    b = {d["key"]: d for d in lines(on_ray)}
    # each worker's long-read notices are said by the driver: one per document it read
    notice = sorted(ln for ln in r.stderr.splitlines() if ln.startswith("[this document is "))
    assert notice == sorted(f"[this document is {n:,} tokens: reading it in one prefill will take about "
                            f"{round(n / 500)} s (estimated at 500 tokens/s: KVCLI_READ_TOK_S)]"
                            for n in (d["stats"]["prompt_tokens"] for d in lines(on_ray)[3:])), r.stderr
    assert set(a) == set(b) and len(a) == 6       # the same keys, each document once
    assert all(a[k]["answer"] == b[k]["answer"] for k in a)   # greedy: the same answers on Ray
    assert {d["stats"]["worker"] for d in lines(on_ray)[3:]} <= {"ray-0", "ray-1"}


def test_batch_takes_the_flags_and_defaults_of_run():
    """One declaration (kvcli/commands/options.py) for the policy, sampling, reading, cache-type and thread flags
    of run and batch: the same names and the same defaults (batch used to decode plain greedy, with its own flags)."""
    from kvcli.apps.batch import Settings
    from kvcli.cli import cli
    from kvcli.generate import Sampling

    def params(cmd):   # a default read from the config file or the environment is a callable
        return {p.name: p.default() if callable(p.default) else p.default for p in cli.commands[cmd].params}
    run, batch = params("run"), params("batch")
    shared = ("policy", "budget", "policy_args", "max_tokens", "temperature", "seed", "top_k", "top_p", "min_p",
              "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "dry_multiplier",
              "dry_base", "dry_allowed_length", "dry_penalty_last_n", "chunk", "max_cache", "chunk_scoring",
              "cache_type", "threads", "system")
    assert {k: batch[k] for k in shared} == {k: run[k] for k in shared}
    assert run["dry_multiplier"] == 0.8 and Settings("x").sampling == Sampling()


def test_default_model_end_to_end_answers_as_run(default_model, tmp_path):
    """Two copies of the example decoded together by the default model: each answers as `kvcli run` does."""
    d = tmp_path / "docs"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_bytes((EXAMPLES / "solar-garden.txt").read_bytes())
    out = tmp_path / "e2e.jsonl"
    common = ["--policy", "snapkv", "--budget", "128", "-n", "24", "--cache-type", "f32"]
    r = kvcli("batch", "--docs", d, *common, "-i", "Summarise this document.", "--out", out)
    assert r.returncode == 0, r.stderr
    got = lines(out)
    assert len(got) == 2 and got[0]["sha256"] == got[1]["sha256"] and got[0]["key"] != got[1]["key"]
    # batch has run's defaults: its sampling (greedy with the DRY penalty) and its reading
    r = kvcli("run", "--doc", EXAMPLES / "solar-garden.txt", *common, "--json", "Summarise this document.")
    assert r.returncode == 0, r.stderr
    alone = json.loads(r.stdout)
    assert len(alone["answer"]) > 20
    for x in got:
        assert x["answer"] == alone["answer"]
        assert x["stats"]["kv_cells"] == 128 and x["stats"]["prompt_tokens"] == alone["stats"]["prompt_tokens"]
    assert max(x["stats"]["decoded_with"] for x in got) == 2
