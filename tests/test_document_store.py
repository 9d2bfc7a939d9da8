"""The document store (issue #48, kvcli/document_store.py): what a chat writes outlives it only as an entry
`kvcli documents list` shows. Real `kvcli chat` processes on the default model, stopped by SIGTERM, SIGHUP and
kill -9 while they read a document in bounded chunks (--chunk 256: a chunk file every second or two), then
`kvcli documents list --json` / `prune --all`; the cap, the expiry and the locks through the module's API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvcli import document_store
from kvcli.errors import KvcliError
from tests.conftest import KVCLI, ROOT, sigint_default


@pytest.fixture()
def store_env(tmp_path, monkeypatch):
    """A store of its own: KVCLI_CACHE for this process (the API) and for the kvcli processes it starts."""
    monkeypatch.setenv("KVCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVCLI_STORE_MAX_BYTES", raising=False)
    monkeypatch.delenv("KVCLI_STORE_EXPIRY_HOURS", raising=False)
    monkeypatch.setenv("KVCLI_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text("")
    return document_store.root()


@pytest.fixture(scope="module")
def long_doc(tmp_path_factory):
    """About 2,800 tokens of the default model: 11 chunks of 256."""
    from kvcli.evaluation.logbook import make_document
    text, _ = make_document(2000, 0, 1)
    p = tmp_path_factory.mktemp("storedoc") / "log.txt"
    p.write_text(text, encoding="utf-8")
    return p


def kvcli(*args, input=None, timeout=120):
    return subprocess.run([*KVCLI, *map(str, args)], input=input, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ), cwd=ROOT)


def listed() -> list[dict]:
    p = kvcli("documents", "list", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def start_chat(doc, *extra):
    """A chat reading `doc` in bounded chunks, its questions' stdin held open (it waits for them after the read)."""
    return subprocess.Popen([*KVCLI, "chat", "--doc", str(doc), "--policy", "snapkv", "--budget", "128",
                             "--chunk", "256", "-n", "2", "--threads", "2", *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ), cwd=ROOT, preexec_fn=sigint_default)


def wait_for(cond, proc, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cond():
            return
        if proc.poll() is not None:
            raise AssertionError(f"kvcli ended first ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out")


def chunk_files(root: Path) -> list[Path]:
    return list(root.glob("*/chunks.part/chunk-*.state"))


def chunks_recorded(root: Path) -> int:
    """The chunks the reading entry records as done (entry.json, rewritten after each chunk file)."""
    for rec in root.glob("*/entry.json"):
        try:
            return len(json.loads(rec.read_text()).get("chunks_done") or [])
        except ValueError:   # being replaced
            return 0
    return 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_reading_leaves_a_partial_read(store_env, long_doc, sig):
    """Stopped after whole chunks, a read stays listed as `partial` (for the same read to resume: tests/test_book.py),
    not in use, its files in its entry; nothing else is left."""
    proc = start_chat(long_doc)
    wait_for(lambda: chunks_recorded(store_env) >= 1, proc)
    assert [e["state"] for e in listed()] == ["reading"]   # listed while it reads, in use
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err          # as Ctrl-C
    assert f"kvcli: stopped by {sig.name}" in err and "Traceback" not in err
    [e] = listed()
    assert e["state"] == "partial" and not e["in_use"] and e["chunks_done"] >= 1 and e["bytes"] > 0
    [entry] = list(store_env.iterdir())
    assert Path(e["path"]).parent == entry and sorted(p.name for p in entry.iterdir()) == [
        "chunks.part", "entry.json", "lock"]


def test_sigterm_while_chatting_removes_the_temporary_store(store_env, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("The locker of the lower lake is number 41. " * 20, encoding="utf-8")
    proc = subprocess.Popen([*KVCLI, "chat", "--doc", str(doc), "--policy", "snapkv", "--budget", "64", "-n", "2"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ), cwd=ROOT, preexec_fn=sigint_default)
    wait_for(lambda: any(e.state == "temporary" for e in document_store.entries(sweep_first=False)), proc)
    [e] = listed()        # read, stored, waiting for a question
    assert e["in_use"] and e["form"] == "exact" and e["bytes"] > 0
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert list(store_env.iterdir()) == []


def test_sigterm_at_the_chat_prompt_on_a_terminal_leaves(store_env, tiny_2k, tmp_path):
    """On a terminal a chat stays at its prompt after Ctrl-C; after SIGTERM or SIGHUP it leaves, cleaning up."""
    import pty
    doc = tmp_path / "d.txt"
    doc.write_text("The locker of the lower lake is number 41. " * 20, encoding="utf-8")
    master, slave = pty.openpty()
    proc = subprocess.Popen([*KVCLI, "chat", "--model", str(tiny_2k), "--doc", str(doc), "--policy", "snapkv",
                             "--budget", "64", "-n", "2"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "XDG_STATE_HOME": str(tmp_path)}, cwd=ROOT,
                            preexec_fn=sigint_default)
    os.close(slave)
    try:
        wait_for(lambda: any(e.state == "temporary" for e in document_store.entries(sweep_first=False)), proc)
        time.sleep(1.0)   # at its prompt
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(master)
        if proc.poll() is None:   # it stayed at its prompt: the test fails, nothing is left running
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and "stopped by SIGTERM" in err, err
    assert list(store_env.iterdir()) == []


def test_kill9_leaves_a_listed_partial_read_that_prune_removes(store_env, long_doc, tmp_path):
    proc = start_chat(long_doc)
    wait_for(lambda: chunks_recorded(store_env) >= 1, proc)
    proc.kill()
    proc.wait()
    [e] = listed()        # the next kvcli finds it: its owner is gone, its chunks are a partial read
    assert e["state"] == "partial" and not e["in_use"] and e["chunks_done"] >= 1
    assert e["model"] == "SmolLM2-135M-Instruct.Q4_1" and e["tokens"] > 2000 and e["document_sha256"]
    assert e["bytes"] == e["store_bytes"] == du(Path(e["entry"]))
    assert du(store_env) == du(store_env.parent / store_env.name) == e["bytes"] + store_env.lstat().st_size
    # the next chat (another document, to its end) leaves the partial read listed and its own store removed
    short = tmp_path / "short.txt"
    short.write_text("The locker of the lower lake is number 41. " * 20, encoding="utf-8")
    p = kvcli("chat", "--doc", short, "--policy", "snapkv", "--budget", "64", "-n", "2", input="Which locker?\n")
    assert p.returncode == 0, p.stderr
    assert [x["state"] for x in listed()] == ["partial"]
    p = kvcli("documents", "prune", "--all")
    assert p.returncode == 0 and "removed 1 stored document(s)" in p.stderr, p.stderr
    assert list(store_env.iterdir()) == []


def test_a_kept_store_is_listed_and_removed(store_env, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("The locker of the lower lake is number 41. " * 20, encoding="utf-8")
    kept = tmp_path / "kept.kvc"
    p = kvcli("chat", "--doc", doc, "--policy", "snapkv", "--budget", "64", "-n", "2", "--store", kept,
              input="Which locker?\n")
    assert p.returncode == 0, p.stderr
    [e] = listed()
    assert (e["state"], e["path"], e["form"]) == ("kept", str(kept), "exact")
    assert e["bytes"] == kept.stat().st_size + e["store_bytes"]
    table = kvcli("documents", "list").stdout
    assert e["id"] in table and "kept" in table and str(kept) in table
    # used again with --cache: still one entry, marked used now
    p = kvcli("chat", "--cache", kept, "--policy", "snapkv", "--budget", "64", "-n", "2", input="Which?\n")
    assert p.returncode == 0, p.stderr
    [again] = listed()
    assert again["id"] == e["id"] and again["last_used"] >= e["last_used"]
    assert kvcli("documents", "prune").returncode == 0 and len(listed()) == 1   # kept: not expired
    p = kvcli("documents", "prune", "--all")
    assert p.returncode == 0, p.stderr
    assert not kept.exists() and list(store_env.iterdir()) == []


def _cached(tokens, payload_bytes: int, key=None) -> document_store.Entry:
    e = document_store.create(form="exact", model_path=Path(__file__), tokens=tokens, key=key)
    e.payload.write_bytes(b"x" * payload_bytes)
    e.finish("cached")
    return e


def test_live_entries_are_never_removed_by_another_process(store_env):
    mine = document_store.create(form="exact", model_path=Path(__file__), tokens=[1, 2, 3])
    p = kvcli("documents", "prune", "--all")
    assert p.returncode == 0 and "1 in use by a running kvcli left" in p.stderr, p.stderr
    p = kvcli("documents", "rm", mine.id)
    assert p.returncode == 2 and "in use by a running kvcli" in p.stderr
    assert (store_env / mine.id).is_dir()
    mine.release()   # still "reading": a read that never finished goes
    assert list(store_env.iterdir()) == []


def test_cap_removes_least_recently_used_and_says_so(store_env, monkeypatch, capsys):
    a = _cached([1], 4000, key="a")
    b = _cached([2], 4000, key="b")
    a.release(), b.release()
    document_store.find("a").release()   # a used after b: b is the least recently used
    held = sum(i.store_bytes for i in document_store.entries())   # payloads, entry folders and records
    monkeypatch.setenv("KVCLI_STORE_MAX_BYTES", str(held + 4000 - 1))   # no room for 4000 more bytes
    c = document_store.create(form="exact", model_path=Path(__file__), tokens=[3], reserve=4000)
    err = capsys.readouterr().err
    assert "past its cap" in err and b.id in err and a.id not in err
    assert sorted(i.id for i in document_store.entries()) == sorted([a.id, c.id])
    c.abandon()
    with pytest.raises(KvcliError, match="not an integer|positive integer"):
        monkeypatch.setenv("KVCLI_STORE_MAX_BYTES", "lots")
        document_store.max_bytes()


def test_cached_and_partial_entries_expire_kept_ones_do_not(store_env, monkeypatch, tmp_path):
    c = _cached([1], 10, key="c")
    kept = tmp_path / "k.kvc"
    k = document_store.create(form="exact", model_path=Path(__file__), tokens=[2], kept_path=kept)
    kept.write_bytes(b"y")
    k.finish("kept")
    c.release(), k.release()
    monkeypatch.setenv("KVCLI_STORE_EXPIRY_HOURS", str(1 / 3600))   # a second
    time.sleep(1.2)
    assert [i.state for i in document_store.entries()] == ["kept"] and kept.exists()
    assert document_store.find("c") is None


def test_what_an_older_kvcli_left_is_swept_once_its_process_is_gone(store_env):
    dead = 2 ** 22 + 17      # above the largest pid_max (2^22): nobody's pid
    live = subprocess.Popen(["sleep", "60"])
    try:
        for name in (f"M.0123456789ab.{dead}.kvc", f"M.0123456789ab.{dead}.chunks.part",
                     f"M.0123456789ab.{live.pid}.kvc"):
            p = store_env / name
            p.mkdir() if name.endswith(".part") else p.write_bytes(b"old")
        assert [(i.state, i.in_use) for i in document_store.entries()] == [("unknown", True)]   # the live one's
        removed, busy = document_store.prune(everything=True)
        assert not removed and [i.id for i in busy] == [f"M.0123456789ab.{live.pid}.kvc"]
    finally:
        live.kill()
        live.wait()
    removed, busy = document_store.prune()
    assert len(removed) == 1 and not busy and list(store_env.iterdir()) == []


def test_another_process_probing_an_entry_its_owner_removes_leaves_nothing(store_env, monkeypatch):
    """What failed once in CI (two Ray workers): a process sweeping or listing the store read a temporary entry's record
    just before its owner removed the entry, then probed its lock after the owner had unlinked the files but before it
    removed the folder. The probe must not re-create the lock file (the folder would stay, record-less, forever)."""
    e = document_store.create(form="exact", model_path=Path(__file__), tokens=[1, 2, 3])
    e.payload.write_bytes(b"x" * 100)
    e.finish("temporary")
    folder, real_rmtree = e.folder, document_store.shutil.rmtree

    def rmtree_with_a_probe_between(path, ignore_errors=False):
        if Path(path) != folder:
            return real_rmtree(path, ignore_errors=ignore_errors)
        for f in Path(path).iterdir():   # rmtree's order: the files, then the folder
            f.unlink()
        assert document_store._in_use(folder)   # the probe of a sweep or a listing: no lock file = not to be touched
        assert document_store._hold_exclusive(folder) is None
        os.rmdir(path)

    monkeypatch.setattr(document_store.shutil, "rmtree", rmtree_with_a_probe_between)
    e.release()
    assert list(store_env.iterdir()) == []


def test_a_removal_that_died_midway_is_swept_after_a_minute(store_env):
    left = store_env / "0123abcd"          # an entry folder whose record went, then its process died
    left.mkdir()
    (left / "lock").write_bytes(b"")
    document_store.sweep()
    assert left.is_dir()                   # it may be a removal under way
    os.utime(left, (time.time() - 120, time.time() - 120))
    document_store.sweep()
    assert not left.exists()


def test_documents_command_errors_are_one_line(store_env, cli_runner):
    from kvcli.cli import cli
    r = cli_runner.invoke(cli, ["documents", "path"])
    assert r.exit_code == 0 and r.output.strip() == str(store_env)
    for args, message in ((["rm", "nope"], "no stored document 'nope'"), (["prune", "--older-than", "soon"],
                                                                          "--older-than expects a duration")):
        r = cli_runner.invoke(cli, ["documents", *args])
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"kvcli: error: {message}"), r.output


def test_a_document_kept_by_key_is_found_and_reused(store_env, tiny_2k, word_doc):
    """The API a server would use: read once under a key (a `cached` entry that outlives close()), find it, reuse."""
    from kvcli.drivers.reselect import StoredDocument
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny_2k, n_ctx=1024, n_threads=2)
    try:
        tokens = s.tokenize(word_doc(200, 4).read_text())
        key = document_store.key_of(tiny_2k, tokens, form="exact")
        assert document_store.find(key) is None
        read = StoredDocument.read(s, tokens, key=key, meta={"document": "d"})
        read.close()
        [info] = document_store.entries()
        assert info.state == "cached" and not info.in_use and info.record["key"] == key
        e = document_store.find(key)
        again = StoredDocument.from_file(e.payload, s)
        assert again.tokens == read.tokens and [i.in_use for i in document_store.entries()] == [True]
        again.close()
        e.release()
        assert [i.state for i in document_store.entries()] == ["cached"]
    finally:
        s.close()


def test_an_ignored_sighup_stays_ignored():
    """`nohup kvcli batch ...` must survive the terminal closing: kvcli handles SIGHUP only where it is not ignored."""
    from kvcli.cli import terminate_as_interrupt
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        terminate_as_interrupt()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and callable(signal.getsignal(signal.SIGTERM))
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def test_durations():
    assert [document_store.parse_duration(x) for x in ("90s", "30m", "12h", "2d", "1w", "5")] == \
        [90, 1800, 43200, 172800, 604800, 5]
    with pytest.raises(KvcliError, match="--older-than"):
        document_store.parse_duration("soon")
