"""Issue #20: interruptions, hostile inputs and refusals that must come early, one line, exit 2."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import KVCLI, ROOT


def kvcli(*args, input=None, timeout=300, env=None, **kw):
    """kvcli as a real process (cwd: the checkout whose tests/conftest.py this imported)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVCLI_")}
    e.update({"XDG_CONFIG_HOME": "/nonexistent", **(env or {})})  # no user config file
    return subprocess.run([*KVCLI, *map(str, args)], input=input, capture_output=True, text=True, timeout=timeout,
                          env=e, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=16, n_ctx_train=384)


def _interrupt_after_decode(monkeypatch, L, nth: int) -> None:
    """Raise KeyboardInterrupt right after the nth llama_decode returns, as a Ctrl-C does (Python raises it at
    the first bytecode after the C call: the cells are in the cache, the Python bookkeeping not yet updated)."""
    real, calls = L.llama_decode, [0]

    def decode(ctx, batch):
        rc = real(ctx, batch)
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt
        return rc
    monkeypatch.setattr(L, "llama_decode", decode)


# ------------------------------------------------------------------------------ A: Ctrl-C during a reply
@pytest.mark.parametrize("nth", [1, 4])   # 1: during the question's prefill, 4: during the answer
def test_ctrl_c_during_a_reply_leaves_a_consistent_conversation(tiny, monkeypatch, tmp_path, nth):
    from kvcli.chat import Conversation
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny, n_ctx=0)
    conv = Conversation(s, "alpha beta gamma delta. " * 20)
    conv.compress()
    st = s.seq(0)
    before = st.next_pos
    _interrupt_after_decode(monkeypatch, s.L, nth)
    try:
        gen = conv.ask("Say something long.", 40)
        interrupted = gen.stopped == "interrupted"
    except KeyboardInterrupt:  # during the question's prefill: the turn is rolled back
        interrupted = True
    monkeypatch.undo()
    assert interrupted
    # the cache and the bookkeeping agree: last position, cell count
    assert s.L.llama_memory_seq_pos_max(s.mem, 0) == st.next_pos - 1
    assert conv._measured_cells() == st.cells
    if nth == 1:
        assert st.next_pos == before and not conv.turns
    else:  # the partial answer kept is exactly what the cache holds
        assert conv.turns[-1].tokens_out == st.next_pos - before - conv.turns[-1].tokens_in == 2
    again = conv.ask("Say something.", 5)        # main: llama_decode failed with code -1
    assert again.stopped in ("eog", "length")
    path = tmp_path / "c.kvc"
    conv.save(path)                               # main: a file that does not load
    loaded = Conversation.from_kvc(path, model=str(tiny))
    assert loaded.session.seq(0).next_pos == st.next_pos
    loaded.session.close()
    s.close()


# ------------------------------------------------------------------------------ 3: piped chat goes on after a bad command
def test_piped_chat_reports_a_bad_command_and_goes_on(tiny, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    r = kvcli("chat", "--doc", doc, "--model", tiny, "-n", "4", "--json",
              input=f"/policy bogus\n/budget -3\n/save {tmp_path}\nFirst?\n/policy snapkv 64\nSecond?\n")
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kvcli: error:")]
    assert len(errors) == 3 and "unknown policy" in errors[0] and "directory" in errors[2], r.stderr
    assert [json.loads(line)["question"] for line in r.stdout.splitlines()] == ["First?", "Second?"]


# ------------------------------------------------------------------------------ B and the output paths
def test_compress_refuses_an_output_that_appears_during_the_work(tiny, tmp_path, monkeypatch):
    """The target is created while the document is prefilled: without --force it is refused at the moment the
    file would appear (main replaced it silently), and no temporary stays behind."""
    from kvcli import compress
    from kvcli.cli import cli
    from click.testing import CliRunner
    doc, out = tmp_path / "d.txt", tmp_path / "out.kvc"
    doc.write_text("alpha beta gamma delta. " * 20)
    real = compress.prefill_and_compress

    def racing(*a, **k):  # another process writes the output while this one works
        out.write_text("someone else's work")
        return real(*a, **k)
    monkeypatch.setattr(compress, "prefill_and_compress", racing)
    r = CliRunner().invoke(cli, ["compress", "--doc", str(doc), "--model", str(tiny), "-o", str(out), "-q"])
    assert r.exit_code == 2 and "exists" in r.output and "--force" in r.output, r.output
    assert out.read_text() == "someone else's work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt", "out.kvc"]
    r = CliRunner().invoke(cli, ["compress", "--doc", str(doc), "--model", str(tiny), "-o", str(out), "-q", "-f"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(b"KVCLIKVC")


def test_output_paths_fail_in_one_line_before_the_work(tiny, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    long_name = "x" * 300 + ".txt"
    for args, message in [
        (["run", "Hi", "--doc", doc, "--out", tmp_path], "is a directory"),
        (["run", "Hi", "--doc", doc, "--out", tmp_path / "missing" / "a.txt"], "does not exist"),
        (["run", "Hi", "--doc", doc, "--out", tmp_path / long_name], "255"),
        (["run", "Hi", "--doc", tmp_path / long_name], "File name too long"),
        (["compress", "--doc", doc, "-o", tmp_path / long_name], "255"),
    ]:
        r = kvcli(*args, "--model", tiny, *(["-n", "2"] if args[0] == "run" else []))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, (args, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt"]   # no temporary left


def test_a_long_legal_output_name_gets_a_short_temporary_and_stale_ones_go(tiny, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    out = tmp_path / ("k" * 246 + ".kvc")                   # 250 bytes: legal; ".NAME.tmpPID" would not be
    from kvcli.outfile import _temp_prefix
    stale = tmp_path / f"{_temp_prefix(out)}{_dead_pid()}"   # what a kill -9 during compress leaves
    stale.write_bytes(b"half a file")
    r = kvcli("compress", "--doc", doc, "--model", tiny, "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["d.txt", out.name])


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno

    from kvcli import outfile
    from kvcli.errors import KvcliError

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(KvcliError, match="No space left on device"):
        outfile.write(tmp_path / "a.txt", [b"answer"])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------ C: endless documents
@pytest.mark.parametrize("source", ["/dev/zero", "yes"])
def test_an_endless_document_is_refused_in_one_line(tiny, source):
    if source == "yes":   # an endless text stream on stdin: read up to the documented limit, then refused
        feeder = subprocess.Popen(["yes", "all work and no play"], stdout=subprocess.PIPE)
        r = kvcli("run", "Hi", "--model", tiny, stdin=feeder.stdout, timeout=120)
        feeder.kill()
        feeder.wait()
    else:
        r = kvcli("run", "Hi", "--model", tiny, "--doc", source, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert ("larger than 64 MB" if source == "yes" else "not a text file") in r.stderr


# ------------------------------------------------------------------------------ 4: non-regular files, long prompts
def test_a_fifo_as_model_or_cache_is_refused_at_once(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta")
    for args in (["run", "Hi", "--doc", doc, "--model", fifo], ["chat", "--cache", fifo]):
        r = kvcli(*args, timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 2 and "not a regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("policy", [["--policy", "full"], ["--policy", "snapkv", "--budget", "64"]])
def test_an_instruction_longer_than_the_context_is_refused_at_once(tiny, tmp_path, policy):
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 5)
    instruction = "Explain every detail of this. " * 120    # the tiny model's context is 384 tokens
    r = kvcli("run", instruction, "--doc", doc, "--model", tiny, "-n", "2", *policy)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "the instruction is" in r.stderr and "put long text in --doc" in r.stderr, r.stderr
