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
    from kvcli.apps.chat import Conversation
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


# ------------------------------------------------------------------------------ 3: piped chat goes on after a bad
# command
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
    from kvcli.drivers import compress
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
        try:
            r = kvcli("run", "Hi", "--model", tiny, stdin=feeder.stdout, timeout=120)
        finally:
            feeder.kill()
            feeder.wait()
            feeder.stdout.close()
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


# ------------------------------------------------------------------------------ 7: pyramidkv keeps its budget
@pytest.mark.parametrize("args, excess", [([], 0), (["--policy-arg", "schedule=factory"], 1)])
def test_pyramidkv_keeps_the_budget_on_average(tmp_path_factory, tmp_path, args, excess):
    """Measured from the live cache: the mean entries per (layer, KV head) is the budget with the default
    schedule; KVCache-Factory's rule, a named variant now, keeps more (main's default: mean 140.5 at 128 on 30
    layers)."""
    import numpy as np
    from click.testing import CliRunner

    from kvcli.cli import cli
    from kvcli.testing.tiny_gguf import write_tiny_llama
    model = write_tiny_llama(tmp_path_factory.mktemp("tiny30") / "tiny30.gguf", n_layer=30, n_head=4, n_head_kv=2,
                             head_dim=16, n_ctx_train=384)
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta epsilon. " * 40)
    budget = 48
    r = CliRunner().invoke(cli, ["run", "--model", str(model), "--doc", str(doc), "--policy", "pyramidkv", "--budget",
                                 str(budget), "-n", "1", "--json", "Summarise.", *args])
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)["stats"]
    assert st["prompt_tokens"] > 2 * budget
    entries = np.asarray(st["per_head_entries"]) - st["generated_tokens"]   # [layer, KV head], the compressed prefix
    assert entries[0, 0] > entries[-1, 0]                                   # still a pyramid
    if excess:
        assert entries.mean() > budget
    else:
        assert entries.sum(axis=0).tolist() == [budget * 30] * 2


# ------------------------------------------------------------------------------ 1: .kvc metadata and state are input
def _rebuild(src, dst, meta_edit=None, state_edit=None):
    """Write `src` to `dst` with its metadata and/or state bytes changed and a valid SHA-256, as a forger would."""
    import hashlib

    from kvcli import kvc
    raw = src.read_bytes()
    _, fmt, _, meta_len = kvc._HEAD.unpack_from(raw)
    p = kvc._HEAD.size
    meta = json.loads(raw[p:p + meta_len])
    body = bytearray(raw[p + meta_len:-32])
    if state_edit:
        name, dtype, n_state = meta["blobs"][-1]
        assert name == "state"
        stored = bytes(body[len(body) - n_state:])
        # format 2 stores the state without its zero blocks (kvc.pack_zero_blocks): edit the state itself
        state = bytearray(kvc.unpack_zero_blocks(stored) if dtype == "zblocks" else stored)
        state_edit(state)
        packed = kvc.pack_zero_blocks(state) if dtype == "zblocks" else bytes(state)
        body[len(body) - n_state:] = packed
        meta["blobs"][-1][2] = len(packed)
    if meta_edit:
        meta_edit(meta)
    meta_b = json.dumps(meta).encode()
    out = kvc._HEAD.pack(kvc.MAGIC, fmt, 0, len(meta_b)) + meta_b + bytes(body)
    dst.write_bytes(out + hashlib.sha256(out).digest())
    return dst


@pytest.fixture(scope="module")
def full_kvc(tiny, tmp_path_factory):
    """A .kvc of the full policy (no kvcli sequence header in its state: the offsets below are simple)."""
    d = tmp_path_factory.mktemp("kvcfull")
    doc = d / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    out = d / "c.kvc"
    r = kvcli("compress", "--doc", doc, "--model", tiny, "-o", out, "-q")
    assert r.returncode == 0, r.stderr
    return out


def _set(path, value):
    def edit(meta):
        *parents, last = path
        d = meta
        for k in parents:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return edit


@pytest.mark.parametrize("edit, field", [
    (_set(["model", "n_layer"], "thirty"), "model.n_layer"),
    (_set(["model"], KeyError), "model"),
    (_set(["conversation", "next_pos"], -4), "conversation.next_pos"),
    (_set(["conversation", "turns"], [{"question": 1}]), "conversation.turns"),
    (_set(["policy_args"], "x=1"), "policy_args"),
])
def test_kvc_metadata_is_checked_against_a_schema(tiny, full_kvc, tmp_path, edit, field):
    bad = _rebuild(full_kvc, tmp_path / "bad.kvc", meta_edit=edit)
    r = kvcli("run", "Hi", "--cache", bad, "--model", tiny, "-n", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "corrupted" in r.stderr and field in r.stderr, r.stderr


# ------------------------------------------------------------------------------ refusals before the work
def test_d2o_full_layers_out_of_range_is_refused_before_the_prefill(tiny, monkeypatch, tmp_path):
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    from kvcli.planning.planner import resolve
    from kvcli.apps.run_document import run_document
    s = NativeSession(tiny, n_ctx=0)
    prefilled = []
    monkeypatch.setattr(NativeSession, "prefill", lambda self, *a, **k: prefilled.append(1))
    with pytest.raises(KvcliError, match="full_layers item 7 is outside the model's 2 layers"):
        run_document(s, "alpha beta gamma delta. " * 20, "Hi",
                     compression=resolve(s.model_path, "d2o", 64, {"full_layers": "7"}), max_tokens=2)
    assert not prefilled
    s.close()


@pytest.mark.parametrize("command", [["run", "Hi", "--doc", "{doc}"], ["chat", "--doc", "{doc}"],
                                     ["compress", "--doc", "{doc}", "-o", "{out}"],
                                     ["batch", "--docs", "{doc}", "-i", "Hi", "-o", "{out}"]])
def test_an_unsupported_architecture_is_refused_before_the_model_loads(tmp_path, command):
    """The header alone (no tensors, so llama.cpp could not load it) is enough for the one-line refusal: every
    command refuses before it loads the model or reads a document."""
    from tests.test_architectures import _header_only
    model = _header_only(tmp_path / "g.gguf", "gemma3n")
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    args = [str(a).format(doc=doc, out=tmp_path / "o.kvc") for a in command]
    r = kvcli(*args, "--policy", "snapkv", "--budget", "64", "--model", model, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "unsupported architecture 'gemma3n'" in r.stderr and "shared KV layers" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.txt", "g.gguf"]


def _poke(offset: int, data: bytes):
    def edit(state):
        state[offset:offset + len(data)] = data
    return edit


# full policy state: io magic + seq id (8), kvcli prefix (16) + 0 headers (4), n_stream (4), cells (4) at 32,
# 12 bytes per cell from 36 (position, n_seq_id, seq id), then v_trans, n_layer, K type, K row size, K rows
@pytest.mark.parametrize("damage, message", [
    (lambda cells: _poke(32, (cells - 1).to_bytes(4, "little")), "cells, the header says"),
    (lambda cells: _poke(36, (1).to_bytes(4, "little")), "not distinct positions"),
    (lambda cells: _poke(36 + 12 * cells + 8 + 12 + 64, b"\x00\x7e" * 8), "not finite"),
])
def test_a_damaged_state_with_a_valid_digest_is_refused(tiny, full_kvc, tmp_path, damage, message):
    from kvcli import kvc
    cells = kvc.read(full_kvc).meta["conversation"]["cells"]
    bad = _rebuild(full_kvc, tmp_path / "bad.kvc", state_edit=damage(cells))
    r = kvcli("run", "Hi", "--cache", bad, "--model", tiny, "-n", "2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "corrupted (cache state" in r.stderr and message in r.stderr, r.stderr


LONG_DOC = "alpha beta gamma delta. " * 150   # more than twice the longest chunk below (asserted)


@pytest.mark.parametrize("policy, budget, args, chunk", [
    ("pyramidkv", 128, {}, 128),                   # the widest layer keeps 242 of the 256-cell cap
    ("windowkv", 96, {"task": "localization"}, 96),
    ("d2o", 64, {"full_layers": "0"}, 128),        # a full layer keeps everything it reads
])
def test_a_layer_schedule_without_room_to_read_on_is_refused_before_the_prefill(tiny, monkeypatch, policy, budget,
                                                                               args, chunk):
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    from kvcli.apps.run_document import run_document
    from kvcli.planning.planner import resolve
    s = NativeSession(tiny, n_ctx=0)
    prefilled = []
    monkeypatch.setattr(NativeSession, "prefill", lambda self, *a, **k: prefilled.append(1))
    with pytest.raises(KvcliError, match="in its widest layer at budget .* room to read on"):
        run_document(s, LONG_DOC, "Hi", compression=resolve(s.model_path, policy, budget, args), max_tokens=2,
                     chunk=chunk)
    assert not prefilled
    s.close()


@pytest.mark.parametrize("policy, budget, args, chunk, refused", [
    ("pyramidkv", 96, {}, 192, False),
    ("pyramidkv", 64, {"schedule": "factory"}, 160, False),
    ("windowkv", 64, {"task": "localization"}, 160, False),
    ("spindlekv", 64, {"theta_k": "1"}, 128, False),
    ("pyramidkv", 128, {}, 128, True),
    ("pyramidkv", 64, {"schedule": "factory"}, 96, True),
    ("windowkv", 96, {"task": "localization"}, 96, True),
    ("d2o", 64, {"full_layers": "-1"}, 128, True),
])
@pytest.mark.parametrize("scoring", ["question", "chunk"])
def test_the_replayed_reading_is_the_real_one(tiny, monkeypatch, policy, budget, args, chunk, refused, scoring):
    """check_room replays the chunked reading on the layer schedule alone: the same chunks and cells as the real
    reading of a document, and a refusal (the same line) exactly where the real reading stops."""
    from kvcli.drivers import chunked
    from kvcli.drivers.compress import prefill_and_compress, resolve
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    from kvcli.apps.run_document import build_prompt
    from kvcli.planning.planner import resolve_for_model
    s = NativeSession(tiny, n_ctx=384)
    tokens = s.tokenize(build_prompt(s, LONG_DOC, "Hi"))
    assert len(tokens) > 2 * chunk
    spec, params = resolve_for_model(s.model_path, policy, args, budget, "Hi")
    _, window = spec.observe(params)
    probe = chunked.probe_length(window, chunk) if scoring == "question" and "window" in spec.needs else 0
    try:
        replayed = chunked.check_room(spec, params, s.info.n_layer, len(tokens), budget, chunk, budget + chunk,
                                      window, probe)
    except KvcliError as e:
        replayed = str(e)
    monkeypatch.setattr(chunked, "check_room", lambda *a, **k: None)   # the real reading, unchecked up front
    try:
        rep = prefill_and_compress(s, tokens, resolve(s.model_path, policy, budget, args), instruction="Hi",
                                   chunk=chunk, scoring=scoring)
        real = [(st.tokens, st.cells_after) for st in rep.steps]
    except KvcliError as e:
        real = str(e)
    if replayed is None:   # the scores decide a width before the last chunk: the reading checks each chunk itself
        assert not refused and isinstance(real, list) and len(real) > 1   # (windowkv's partial review window, with
        s.close()                                                          # the question probe's chunk sizes)
        return
    if isinstance(replayed, list) and replayed[-1][1] is None:   # the scores decide the last chunk's width
        real[-1] = (real[-1][0], None)
    assert replayed == real
    assert isinstance(real, str) == refused
    s.close()
