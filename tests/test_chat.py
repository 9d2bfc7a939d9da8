"""kvcli chat: the REPL through a real pseudo-terminal, the piped mode, and the Conversation API."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import time

import pytest

from tests.conftest import EXAMPLES, KVCLI, ROOT, sigint_default

DOC = (EXAMPLES / "station-log.txt").read_text(encoding="utf-8")[:1600]


class Pty:
    """A child process on a pseudo-terminal (stdin, stdout and stderr), driven like a person would."""

    def __init__(self, argv, env, timeout=120):
        self.timeout = timeout
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal, so ^C sends it SIGINT
            try:
                os.chdir(ROOT)
                sigint_default()
                os.execvpe(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.buf, self.pos = pid, fd, b"", 0

    def _read(self, deadline):
        r, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            data = b""
        if not data:
            raise EOFError(self.tail())
        self.buf += data
        return True

    def expect(self, pattern: str, timeout=None) -> re.Match:
        """Wait for `pattern` in the output that follows the last match."""
        rx = re.compile(pattern.encode())
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            m = rx.search(self.buf, self.pos)
            if m:
                self.pos = m.end()
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {pattern!r}; output so far:\n{self.tail()}")
            try:
                self._read(deadline)
            except EOFError:
                raise AssertionError(f"the process ended before {pattern!r}; output:\n{self.tail()}") from None

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def tail(self, n=3000) -> str:
        return self.buf[-n:].decode("utf-8", "replace")

    def wait(self, timeout=60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                self._read(min(deadline, time.monotonic() + 0.2))
            except EOFError:
                pass
        os.kill(self.pid, signal.SIGKILL)
        raise AssertionError(f"the process did not exit; output:\n{self.tail()}")

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


@pytest.fixture()
def chat_env(tmp_path):
    env = dict(os.environ, TERM="dumb", XDG_STATE_HOME=str(tmp_path / "state"), XDG_CONFIG_HOME=str(tmp_path / "cfg"))
    for k in ("KVCLI_POLICY", "KVCLI_BUDGET", "KVCLI_MODEL", "KVCLI_CONFIG", "KVCLI_HISTORY"):
        env.pop(k, None)
    return env


@pytest.fixture()
def doc(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text(DOC, encoding="utf-8")
    return p


PROMPT = r"\n> "


def test_repl_through_a_terminal(tmp_path, chat_env, doc):
    """Two turns, /stats, /save, Ctrl-C during an answer (the chat goes on), /quit; then the saved
    conversation reopens with --cache and Ctrl-D leaves. (Compressed once; the re-selected REPL:
    tests/test_reselect.py.)"""
    saved = tmp_path / "talk.kvc"
    p = Pty([*KVCLI, "chat", "--doc", str(doc), "--policy", "snapkv", "--budget", "128", "-n", "40",
             "--compress-once"], chat_env)
    try:
        p.expect(r"\[snapkv @ 128, question-agnostic\] \d+ tokens -> \d+ cells")
        p.expect(PROMPT)
        p.send("Who wrote this log?\r")
        p.expect(r"\[\d+ tokens, [\d.]+ tok/s; \d+/\d+ cells in use\]")
        p.expect(PROMPT)
        p.send("What happened next?\r")
        p.expect(r"\[\d+ tokens")
        p.expect(PROMPT)
        p.send("/stats\r")
        p.expect(r"2 turn\(s\) since the document")
        m = p.expect(r"\s+29\s+(\d+)\s+(\d+) (\d+) (\d+)\s+[\d,]+(?=\r?\n)")
        assert 0 < int(m.group(1)) <= 128 + 200
        p.expect(PROMPT)
        p.send(f"/save {saved}\r")
        p.expect(r"saved .*talk\.kvc \([\d.]+ MB, 2 turn\(s\)\)")
        p.expect(PROMPT)
        p.send("Copy the whole log, word for word, line by line.\r")
        p.expect(r"word for word, line by line\.\r?\n.{3}", timeout=60)  # the answer has started streaming
        p.send("\x03")
        p.expect(r"\[interrupted: the partial answer stays in the conversation\]")
        p.expect(PROMPT)
        # a Ctrl-C sent the instant the prompt appears was once lost under a load of 5 (not reproduced alone;
        # cause not found): let readline take the terminal first
        time.sleep(0.5)
        p.send("\x03")  # at the prompt: stays
        p.expect(r"Ctrl-D or /quit leaves")
        p.send("/nonsense\r")
        p.expect(r"error: unknown command /nonsense")
        p.expect(PROMPT)
        p.send("/quit\r")
        assert p.wait() == 0
    finally:
        p.close()
    history = (tmp_path / "state" / "kvcli" / "chat_history").read_text()
    assert "Who wrote this log?" in history and "/stats" in history

    p = Pty([*KVCLI, "chat", "--cache", str(saved), "-n", "8"], chat_env)
    try:
        p.expect(r"\[snapkv @ 128, question-agnostic\].*loaded in [\d.]+s")
        p.expect(PROMPT)
        p.send("/stats\r")
        p.expect(r"2 turn\(s\) since the document")
        p.send("/reset\r")
        p.expect(r"back to the compressed document")
        p.send("/stats\r")
        p.expect(r"0 turn\(s\) since the document")
        p.expect(PROMPT)
        p.send("\x04")  # Ctrl-D
        assert p.wait() == 0
    finally:
        p.close()


def test_piped_mode_scripts(run_kvcli, doc, chat_env):
    q = "Who wrote this log?"
    r = run_kvcli("chat", "--doc", doc, "--fresh", "-n", "10", input=f"{q}\n\n/stats\n{q}\n", env=chat_env)
    assert r.returncode == 0, r.stderr
    blocks = r.stdout.strip("\n").split("\n\n")
    assert len(blocks) == 2 and blocks[0].strip() and blocks[0] == blocks[1]  # --fresh: same start, same answer
    assert "layer" in r.stderr and "live cells" in r.stderr and "layer" not in r.stdout
    assert "[full, question-agnostic]" in r.stderr
    # the first message on the command line makes the compression question-aware and is answered first
    r2 = run_kvcli("chat", "--doc", doc, q, "-n", "10", input="", env=chat_env)
    assert r2.returncode == 0, r2.stderr
    assert "[full, question-aware]" in r2.stderr
    run = run_kvcli("run", "--doc", doc, q, "-n", "10", env=chat_env)
    assert r2.stdout.strip() == run.stdout.strip()


def test_chat_bad_input(run_kvcli, doc, chat_env):
    def bad(*args, input=""):
        r = run_kvcli(*args, input=input, env=chat_env)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvcli: error:"), r.stderr
        return lines[0]

    assert "needs a document" in bad("chat")
    assert "as a file" in bad("chat", "--doc", "-")
    assert "needs --budget" in bad("chat", "--doc", doc, "--policy", "snapkv")
    assert "unknown policy 'nope'" in bad("chat", "--doc", doc, "--policy", "nope")
    assert "not found" in bad("chat", "--cache", doc.with_suffix(".kvc"))
    assert "not a kvcli .kvc file" in bad("chat", "--cache", doc)


# ------------------------------------------------------------------------------ the Conversation API
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from kvcli.testing.tiny_gguf import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=16, n_ctx_train=384)


def test_context_full_offers_reset_and_reset_restores(tiny):
    from kvcli.apps.chat import ContextFullError, Conversation
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny, n_ctx=0)
    conv = Conversation(s, "alpha beta gamma delta. " * 20)
    conv.compress()
    n0, cells0 = conv.reset_mark
    assert conv.tail == "user" and not conv.pending
    first = conv.ask("Say something.", 12)
    full = None
    for _ in range(100):  # the tiny model's context is 384 positions: it fills up
        try:
            g = conv.ask("Say something long.", 200)
        except ContextFullError as e:
            full = str(e)
            break
        if g.stopped == "context_full":
            full = conv._full_message()
            break
    assert full and "/reset" in full
    conv.reset()
    assert s.seq(0).next_pos == n0 and s.seq(0).cells == cells0 and not conv.turns
    again = conv.ask("Say something.", 12)
    assert again.tokens == first.tokens  # greedy, same cache after /reset: same answer
    s.close()


def test_each_mode_is_its_own_class_and_a_kvc_file_keeps_it(tiny, tmp_path):
    """Conversation(...) is the mode's class (issue #65): a question known before the document is read makes a
    QuestionKnown (its prefix ends with the question, its first answer comes from the prefix's logits), none a
    CompressedOnce; a .kvc file is loaded back into the class it was saved from, answering the same."""
    from kvcli.apps.chat import AGNOSTIC, AWARE, CompressedOnce, Conversation, QuestionKnown
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    from kvcli.planning.planner import resolve
    doc, q = "alpha beta gamma delta. " * 20, "Say something."
    cfg = resolve(tiny, "snapkv", 48)
    for question, cls, mode in ((q, QuestionKnown, AWARE), (None, CompressedOnce, AGNOSTIC)):
        conv = Conversation(NativeSession(tiny, n_ctx=0), doc, compression=cfg, question=question)
        assert type(conv) is cls and conv.mode == mode
        conv.compress()
        assert (conv.tail, conv.pending, conv.prefix_logits is not None) == \
            (("assistant", True, True) if question else ("user", False, False))
        path = tmp_path / f"{mode}.kvc"
        conv.save(path)
        first = conv.ask(q, 6).text
        loaded = Conversation.from_kvc(path)
        assert type(loaded) is cls and loaded.mode == mode and loaded.ask(q, 6).text == first
    with pytest.raises(KvcliError, match="needs the question"):
        QuestionKnown(NativeSession(tiny, n_ctx=0), doc, compression=cfg)


def test_turn_format_matches_the_template(tiny):
    from kvcli.apps.chat import TurnFormat
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny, n_ctx=0)
    f = TurnFormat.probe(s, "Be brief.")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "D"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q"}]
    assert f.head + "D" + f.after_user + "A" + f.assistant_to_user + "Q" + f.after_user == \
        s.apply_chat_template(msgs, add_assistant=True)
    s.close()


def test_recompress_commands_and_failed_recompress_restores(tiny, monkeypatch):
    import io

    from kvcli.drivers import compress
    from kvcli.apps.chat import Conversation
    from kvcli.apps.chat_repl import Repl
    from kvcli.errors import KvcliError
    from kvcli.native.session import NativeSession
    s = NativeSession(tiny, n_ctx=0)
    conv = Conversation(s, "alpha beta gamma delta. " * 30)
    conv.compress()
    n_full = conv.stats()["kv_cells"]
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(conv, max_tokens=6, interactive=False, out=out, err=err)
    with pytest.raises(KvcliError, match="policy full keeps every entry"):
        repl.handle("/budget 64")
    repl.handle("/policy snapkv 64")
    assert conv.policy == "snapkv" and conv.budget == 64 and conv.stats()["kv_cells"] <= 64 < n_full
    assert "[snapkv @ 64, question-agnostic]" in err.getvalue()
    repl.handle("/budget 48")
    assert conv.budget == 48 and conv.stats()["kv_cells"] <= 48
    with pytest.raises(KvcliError, match="unknown policy"):
        repl.handle("/policy nope 64")
    repl.handle("Say hi.")
    answer, cells = conv.turns[-1].answer, conv.stats()["kv_cells"]

    real = compress.prefill_and_compress

    def interrupted(*a, **k):  # Ctrl-C right after the new prefill: the old cache must come back
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(compress, "prefill_and_compress", interrupted)
    with pytest.raises(KeyboardInterrupt):
        repl.handle("/policy snapkv 40")
    monkeypatch.setattr(compress, "prefill_and_compress", real)
    assert (conv.policy, conv.budget, len(conv.turns)) == ("snapkv", 48, 1)
    assert conv.stats()["kv_cells"] == cells
    conv.reset()
    assert conv.ask("Say hi.", 6).text == answer
    s.close()


def test_piped_json_lines(run_kvcli, tiny, tmp_path, chat_env):
    doc = tmp_path / "d.txt"
    doc.write_text("alpha beta gamma delta. " * 20)
    cfg = tmp_path / "cfg" / "kvcli" / "config.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(f'model = "{tiny}"\nmax_tokens = 5\n')  # chat reads its defaults from the config file too
    r = run_kvcli("chat", "--doc", doc, "--json", input="First?\nSecond?\n", env=chat_env)
    assert r.returncode == 0, r.stderr
    import json
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["question"] for x in rows] == ["First?", "Second?"]
    assert all(x["generated_tokens"] <= 5 and x["stopped"] in ("eog", "length") for x in rows)
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]  # the conversation is kept
