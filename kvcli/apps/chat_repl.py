"""The `kvcli chat` REPL: drives a Conversation (kvcli/apps/chat.py) from a terminal (readline: history, completion
of slash commands) or from piped lines, one question per line. Split out of kvcli/apps/chat.py (issue #49: no source
file above 800 lines); the conversation itself stays there."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from kvcli.apps.chat import MEMORY_STATS, ContextFullError, Conversation
from kvcli.citations import cite_turn
from kvcli.errors import KvcliError, Terminated
from kvcli.policies import parse_policy_args

HELP = """commands:
  /stats                   cells, entries and bytes per layer, measured from the cache
  /save FILE               write the compressed document and this conversation to FILE (.kvc)
  /reset                   forget the conversation, back to the compressed (or stored) document
  /policy P [N] [k=v ...]  policy P, budget N from now on: re-selected, for the next question; compressed once,
                           the original document is compressed again (drops the conversation)
  /budget N                budget N from now on (compressed once: recompresses, drops the conversation)
  /help                    this text
  /quit                    leave (Ctrl-D too); Ctrl-C interrupts an answer"""

SLASH = ["/stats", "/save", "/reset", "/policy", "/budget", "/help", "/quit", "/exit"]


def history_path() -> Path:
    if os.environ.get("KVCLI_HISTORY"):
        return Path(os.environ["KVCLI_HISTORY"]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvcli" / "chat_history"


def _setup_readline():
    """Line editing, a persistent history and tab completion of slash commands; returns a saver."""
    try:
        import readline  # noqa: PLC0415 (only for a terminal: importing it changes input())
    except ImportError:
        return lambda: None
    path = history_path()
    try:
        readline.read_history_file(path)
    except (FileNotFoundError, OSError):
        pass
    readline.set_history_length(2000)

    def complete(text, state):
        hits = [c for c in SLASH if c.startswith(text)] if text.startswith("/") else []
        return hits[state] if state < len(hits) else None

    readline.set_completer(complete)
    readline.set_completer_delims(" \t\n")
    readline.parse_and_bind("tab: complete")

    def save():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as e:
            print(f"kvcli: could not save the chat history to {path}: {e.strerror}", file=sys.stderr)
    return save


def _positive(word: str, what: str) -> int:
    try:
        n = int(word)
    except ValueError:
        n = 0
    if n <= 0:
        raise KvcliError(f"{what} expects a positive integer budget, got '{word}'")
    return n


class Repl:
    """Drives a Conversation from a terminal (readline) or from piped lines (one question per line)."""

    def __init__(self, conv: Conversation, *, max_tokens: int, sampler=None, interactive: bool, quiet: bool = False,
                 fresh: bool = False, jsonl: bool = False, progress_factory=None, out=None, err=None,
                 cite: bool = False):
        self.conv, self.max_tokens, self.sampler, self.cite = conv, max_tokens, sampler, cite
        self.interactive, self.quiet, self.fresh = interactive, quiet, fresh
        self.jsonl = jsonl and not interactive  # one JSON object per answer and line (answers may hold blank lines)
        self.progress_factory = progress_factory
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.n_answers = 0
        conv.notify = self.say
        conv.store_turns = not fresh   # every question alone: no turns to keep for the next one

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def _write(self, piece: str) -> None:
        self.out.write(piece)
        self.out.flush()

    # ------------------------------------------------------------------ answers
    def answer(self, question: str) -> None:
        if self.fresh and self.conv.turns:
            self.conv.reset()
        if not self.interactive and self.n_answers and not self.jsonl:
            self._write("\n")  # a blank line between answer blocks
        pos0 = self.conv.session.seq(self.conv.seq).tokens_read
        gen = self.conv.ask(question, self.max_tokens, self.sampler, on_text=None if self.jsonl else self._write)
        self.n_answers += 1
        cited = cite_turn(self.conv, gen) if self.cite or self.jsonl else None
        if self.jsonl:
            s = self.conv.stats()
            extra = {"mode": self.conv.mode}
            if self.conv.reselect:
                extra.update(store_bytes=s["store_bytes"], **self.conv.last_reselection.as_stats())
            elif self.conv.report is not None:   # compressed once: how the document was read
                extra.update(self.conv.report.as_stats())
            self._write(json.dumps({"question": question, "answer": gen.text, "stopped": gen.stopped,
                                    "prompt_tokens": self.conv.prompt_len if self.conv.reselect
                                    else pos0 + self.conv.turns[-1].tokens_in, **extra,
                                    "generated_tokens": len(gen.tokens), "kv_cells": self.conv._st().cells,
                                    "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None,
                                    **{k: s[k] for k in MEMORY_STATS}, "citations": cited.as_json(),
                                    **({"citations_note": cited.note} if cited.note else {})},
                                   ensure_ascii=False) + "\n")
        else:
            self._write("\n")
            if cited is not None and cited.lines():
                self._write("\n".join(cited.lines()) + "\n")
        if gen.stopped == "interrupted":
            self.say("[interrupted: the partial answer stays in the conversation]")
            if not self.interactive or Terminated.signum is not None:   # SIGTERM/SIGHUP: leave, as a script's Ctrl-C
                raise Terminated() if Terminated.signum is not None else KeyboardInterrupt
        elif gen.stopped == "context_full":
            msg = self.conv._full_message()
            if not self.interactive:
                raise ContextFullError(msg + " (or answer each question alone with --fresh)")
            self.say(f"[{msg}]")
        elif gen.stopped == "length" and not self.quiet:
            self.say(f"[stopped at --max-tokens {self.max_tokens}]")
        if not self.quiet and self.interactive:
            rate = f", {gen.decode_tok_s:.1f} tok/s" if gen.decode_tok_s else ""
            r = self.conv.last_reselection if self.conv.reselect else None
            if r is not None:
                rate += f"; re-selected in {r.total_s:.2f}s"
            self.say(f"[{len(gen.tokens)} tokens{rate}; {self.conv.session.cells_used()}/{self.conv.session.n_ctx} "
                     "cells in use]")

    # ------------------------------------------------------------------ commands
    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if name in ("/quit", "/exit", "/q"):
            return False
        if name in ("/help", "/?"):
            self.say(HELP)
        elif name == "/stats":
            self.say(self.conv.stats_table())
        elif name == "/save":
            if not rest:
                raise KvcliError("usage: /save FILE")
            path = Path(rest).expanduser()
            t0 = time.perf_counter()
            size = self.conv.save(path)
            self.say(f"saved {path} ({size / 1e6:.2f} MB, {len(self.conv.turns)} turn(s)) in "
                     f"{time.perf_counter() - t0:.2f}s")
        elif name == "/reset":
            self.conv.reset()
            self.say("[back to the compressed document]")
        elif name in ("/policy", "/budget"):
            if not rest:
                raise KvcliError(f"usage: {name} {'NAME [N] [key=value ...]' if name == '/policy' else 'N'}")
            words = rest.split()
            if name == "/policy":
                kw = {"policy": words[0]}
                words = words[1:]
                if words and "=" not in words[0]:
                    kw["budget"] = _positive(words.pop(0), "/policy NAME N")
                kw["policy_args"] = parse_policy_args(words, kw["policy"]) if words else None
            else:
                if len(words) != 1:
                    raise KvcliError("usage: /budget N")
                kw = {"budget": _positive(words[0], "/budget")}
            update, close = self.progress_factory(len(self.conv.prefix_tokens)) if self.progress_factory \
                else (None, lambda: None)
            try:
                self.conv.recompress(progress=update, **kw)
            finally:
                close()
            self.conv.load_s = None
            self.say(self.conv.summary_line())
        else:
            raise KvcliError(f"unknown command {name}: /help lists them")
        return True

    # ------------------------------------------------------------------ loops
    def handle(self, line: str) -> bool:
        line = line.strip()
        if not line:
            return True
        if line.startswith("/"):
            return self.command(line)
        self.answer(line)
        return True

    def run(self, first: str | None = None) -> None:
        if first:
            if self.interactive:
                self._write(f"> {first}\n")
            self.answer(first)
        if self.interactive:
            self._interactive()
        else:
            for raw in sys.stdin:
                try:
                    if not self.handle(raw):
                        break
                except ContextFullError:  # every later question would fail the same way
                    raise
                except KvcliError as e:  # a bad command: say it and go on, as on a terminal
                    self.say(f"kvcli: error: {e}")

    def _interactive(self) -> None:
        save = _setup_readline()
        if not self.quiet:
            self.say("Type a question, /help for commands, Ctrl-D to leave.")
        try:
            while True:
                try:
                    line = input("> ")
                except KeyboardInterrupt:
                    if Terminated.signum is not None:
                        raise
                    self._write("\n")
                    self.say("(Ctrl-D or /quit leaves)")
                    continue
                except EOFError:
                    self._write("\n")
                    break
                try:
                    if not self.handle(line):
                        break
                except KeyboardInterrupt:  # while a turn was being appended: it was rolled back
                    if Terminated.signum is not None:
                        raise
                    self._write("\n")
                    self.say("[interrupted]")
                except KvcliError as e:  # a bad command or a full context: say it, stay in the chat
                    self.say(f"error: {e}")
        finally:
            save()
