"""Conversations over one compressed document, and the `kvcli chat` REPL on top of them.

A `Conversation` owns one sequence of a NativeSession. Its cache holds:

    [ compressed prefix                 ][ turn ][ turn ] ...
      system + document (+ question)       each turn appends; nothing is recompressed

Prompt layout (see docs/terminal.md):

- question-aware (a question is known before compressing: `--question`, or the first message
  given on the command line): the prefix is the whole first prompt, the question after the
  document in the same user turn, then the assistant header, as the papers do. The policy's
  observation window therefore covers the question.
- question-agnostic (no question yet): the prefix is the user turn holding the document followed
  by GENERIC_SUFFIX, a neutral instruction that becomes the observation window (kvpress's
  question-agnostic setting: compress the context alone, ask afterwards). Each question is then
  a new user turn appended after the compressed prefix.

Turns are templated with the model's own chat template: the text between turns is read off
renderings of probe conversations (TurnFormat), so any template llama.cpp applies works.
`/reset` removes every cell after the prefix (`session.truncate` at the prefix's end position: llama_memory_seq_rm
in the native engine), which the native patch keeps consistent with the slot bias.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import __version__, compress, config, kvc, policies
from kvcli.chunked import plan_chunking
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.generate import generate
from kvcli.models import model_hash, resolve_model
from kvcli.native import cache
from kvcli.native.lib import identity
from kvcli.native.session import ContextFull, NativeSession, SeqSnapshot
from kvcli.policies import parse_policy_args

GENERIC_SUFFIX = "Read the document above carefully: questions about it follow."
CTX_PAD = 256
TURN_ROOM = 2048          # cells (and positions) kept free for the conversation after the prefix
AWARE, AGNOSTIC = "question-aware", "question-agnostic"
# the memory figures every --json output carries (run, chat, compress): docs/internals.md, "Memory figures"
MEMORY_STATS = ("kv_bytes_allocated", "kv_cells_allocated", "kv_bytes_live", "peak_rss_bytes")


class ContextFullError(KvcliError):
    """The conversation does not fit the context any more; /reset makes room."""


# ---------------------------------------------------------------------------------- templates
_MA, _MB, _MC = "KVCLIPROBEAAAA", "KVCLIPROBEBBBB", "KVCLIPROBECCCC"


@dataclass
class TurnFormat:
    """The chat template cut at message boundaries."""

    head: str                 # everything before the first user message's content (system turn, BOS...)
    after_user: str           # end of a user message + start of the assistant's
    assistant_to_user: str    # end of an assistant message + start of the next user message
    user_to_user: str         # end of a user message + start of another user message

    @classmethod
    def probe(cls, session, system: str | None) -> "TurnFormat":
        sys_msg = [{"role": "system", "content": system}] if system else []

        def render(*msgs):
            roles = ["user", "assistant", "user"] if len(msgs) == 3 else ["user", "user"]
            return session.apply_chat_template(sys_msg + [{"role": r, "content": c} for r, c in zip(roles, msgs)],
                                               add_assistant=True)

        try:
            abc = render(_MA, _MB, _MC)
            ac = render(_MA, _MC)
        except Exception as e:  # a jinja template may refuse two user turns in a row
            raise KvcliError(f"the model's chat template cannot hold a multi-turn conversation ({e})") from None
        try:
            ia, ib, ic = abc.index(_MA), abc.index(_MB), abc.index(_MC)
            ja, jc = ac.index(_MA), ac.index(_MC)
        except ValueError:
            raise KvcliError("the model's chat template drops message contents: cannot lay out turns") from None
        fmt = cls(head=abc[:ia], after_user=abc[ic + len(_MC):],
                  assistant_to_user=abc[ib + len(_MB):ic], user_to_user=ac[ja + len(_MA):jc])
        if ac[:ja] != fmt.head or abc[ia + len(_MA):ib] != fmt.after_user:
            raise KvcliError("the model's chat template renders turns inconsistently: cannot lay out turns")
        return fmt


def user_content(document: str, tail: str) -> str:
    return f"{document.strip()}\n\n{tail.strip()}"


def _jsonable(params: dict | None) -> dict | None:
    return None if params is None else {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


# ---------------------------------------------------------------------------------- conversation
@dataclass
class Turn:
    question: str
    answer: str
    stopped: str
    tokens_in: int
    tokens_out: int


class _Primed:
    """The session, but whose first logits() are given (a restored or reset prefix has no live logits)."""

    def __init__(self, session, logits: np.ndarray):
        self._session, self._logits = session, logits

    def logits(self, seq: int = 0):
        if self._logits is not None:
            out, self._logits = self._logits, None
            return out.copy()
        return self._session.logits(seq)

    def __getattr__(self, name):
        return getattr(self._session, name)


@dataclass
class Conversation:
    session: object
    document: str
    policy: str = "full"
    budget: int | None = None
    policy_args: dict = field(default_factory=dict)
    system: str | None = None
    question: str | None = None          # set: question-aware compression
    seq: int = 0
    chunk: int | None = None             # chunked prefill (kvcli/chunked.py): None = automatic, 0 = off
    max_cache: int | None = None         # most cells the cache may hold (document + conversation)
    chunk_scoring: str = "question"      # chunked: which queries score each chunk (kvcli/chunked.py)
    # filled by compress() / from_kvc()
    fmt: TurnFormat | None = None
    prefix_tokens: list[int] = field(default_factory=list)
    reset_mark: tuple[int, int] = (0, 0)  # (next position, cells) right after the compressed prefix
    prefix_logits: np.ndarray | None = None
    tail: str = "user"                    # the cache ends inside a "user" or an "assistant" message
    pending: bool = False                 # question-aware prefix whose question is not answered yet
    turns: list[Turn] = field(default_factory=list)
    report: object = None                 # CompressReport of the last compression
    resolved_params: dict | None = None   # the policy parameters as resolved when a loaded file was compressed
    load_s: float | None = None          # reading + checking + restoring a .kvc file (not the model)
    model_s: float | None = None          # loading the model and allocating the context, for a .kvc file

    def __post_init__(self):
        if self.policy == "full":
            self.budget = None
        self.fmt = self.fmt or TurnFormat.probe(self.session, self.system)
        if not self.prefix_tokens:
            self.prefix_tokens = self.session.tokenize(self.prefix_text())

    @property
    def mode(self) -> str:
        return AWARE if self.question else AGNOSTIC

    def prefix_text(self) -> str:
        if self.question:
            return self.fmt.head + user_content(self.document, self.question) + self.fmt.after_user
        return self.fmt.head + user_content(self.document, GENERIC_SUFFIX)

    # ------------------------------------------------------------------ cache bookkeeping
    def _st(self):
        return self.session.seq(self.seq)

    def _measured_cells(self) -> int:
        info = self.session.info
        return cache.stats(self.session.ctx, self.seq, info.n_layer_model, info.n_head_kv)["n_cells"]

    def _truncate(self, pos: int) -> None:
        """Remove every cell at position >= pos from the sequence."""
        self.session.truncate(self.seq, pos)

    def chunking(self):
        """Chunked or not, and the cells to allocate: the prompt (or, read in chunks, budget + chunk) plus TURN_ROOM
        for the conversation (less when --max-cache leaves less)."""
        return plan_chunking(len(self.prefix_tokens), TURN_ROOM, self.session.n_ctx_train, self.policy, self.budget,
                             self.chunk, self.max_cache, cell_bytes=self.session.bytes_per_cell())

    def ensure_context(self) -> None:
        if self.session.ctx is None:
            self.session.create_context(self.chunking().n_ctx)

    # ------------------------------------------------------------------ compression
    def compress(self, progress=None, on_cache=None):
        """Prefill the prefix and compress it (kvcli.compress.prefill_and_compress), in chunks when it is longer
        than the context allows."""
        chunking = self.chunking()
        if self.session.ctx is not None and self.session.n_ctx < chunking.n_ctx:
            # the context was fitted to an earlier compressed prefix (or a .kvc file): reading needs more
            self.session.clear(self.seq)
            self.session.resize_context(chunking.n_ctx)
        self.ensure_context()
        if chunking.chunk is None and len(self.prefix_tokens) > self.session.n_ctx:
            raise KvcliError(f"the prompt is {len(self.prefix_tokens)} tokens but this context holds "
                             f"{self.session.n_ctx} cells")
        if self.seq in self.session.seqs:
            self.session.clear(self.seq)
        # the question (aware) is the instruction task-adaptive policies classify; agnostic has none
        self.report = compress.prefill_and_compress(self.session, self.prefix_tokens, self.policy, self.budget,
                                                    dict(self.policy_args), seq=self.seq, progress=progress,
                                                    instruction=self.question, chunk=chunking.chunk,
                                                    cap=chunking.cap, on_cache=on_cache, scoring=self.chunk_scoring)
        st = self._st()
        st.cells = self._measured_cells()
        self.reset_mark = (st.next_pos, st.cells)
        self.prefix_logits = self.session.logits(self.seq) if self.question else None
        if self.report.plan is not None:
            cache.set_header(self.session.ctx, self.seq, self.policy, int(self.budget), len(self.prefix_tokens))
            self.fit_context()
        self._at_prefix()
        return self.report

    def fit_context(self) -> None:
        """Give back the cells the document needed and the compressed prefix does not: the context is
        reallocated for what the session holds + TURN_ROOM (NativeSession.resize_context), so a long-lived
        conversation does not keep a KV buffer sized for the whole document."""
        s = self.session
        want = min(-(-(s.cells_used() + TURN_ROOM) // CTX_PAD) * CTX_PAD, s.n_ctx_train)
        if want < s.n_ctx:
            s.resize_context(want)

    def _at_prefix(self) -> None:
        self.tail = "assistant" if self.question else "user"
        self.pending = bool(self.question)
        self.turns = []

    def recompress(self, policy: str | None = None, budget: int | None = None, policy_args: dict | None = None,
                   progress=None):
        """Compress the original document again with another policy or budget (the conversation is
        dropped). If that fails or is interrupted, the cache as it was is put back."""
        new_policy = (policy or self.policy).lower()
        if new_policy == "full":
            if budget is not None and policy is None:
                raise KvcliError("policy full keeps every entry: choose a policy with /policy NAME N")
            new_budget, new_args = None, {}
        else:
            policies.get(new_policy)
            new_budget = budget if budget is not None else self.budget
            if new_budget is None:
                raise KvcliError(f"policy '{new_policy}' needs a budget: /policy {new_policy} N")
            new_args = policy_args if policy_args is not None else (
                self.policy_args if new_policy == self.policy else {})
            policies.prepare(new_policy, new_args, new_budget, instruction=self.question)
        # snapshot: the sequence's state (a few MB) with its bookkeeping, and the conversation's fields
        snap, fields = self.session.save_seq(self.seq), dict(self.__dict__)
        self.policy, self.budget, self.policy_args = new_policy, new_budget, dict(new_args)
        try:
            return self.compress(progress)
        except BaseException:
            self.__dict__.update(fields)
            self.session.restore_seq(snap, self.seq)
            raise

    def reset(self) -> None:
        """Back to the compressed document: every turn's cells are removed."""
        pos, cells = self.reset_mark
        self._truncate(pos)
        if self._st().cells != cells:
            raise KvcliError(f"/reset left {self._st().cells} cells, expected the {cells} of the compressed document")
        self._at_prefix()

    # ------------------------------------------------------------------ turns
    def room(self) -> int:
        """Tokens that can still be appended: free cells, and positions left in the model's context."""
        s = self.session
        return min(s.n_ctx - s.cells_used(), s.n_ctx_train - self._st().next_pos)

    def _full_message(self) -> str:
        st = self._st()
        return (f"the context is full ({st.cells} of {self.session.n_ctx} cells, position {st.next_pos} of "
                f"{self.session.n_ctx_train}): /reset goes back to the compressed document")

    def ask(self, question: str, max_tokens: int, sampler=None, on_text=None):
        """Append one user turn and generate the answer; returns the Generation."""
        question = question.strip()
        if not question:
            raise KvcliError("the question is empty")
        st = self._st()
        mark = st.next_pos
        n_in = 0
        if self.pending and question == self.question.strip():
            # the prefix already ends with this question and the assistant header: answer it
            driver = _Primed(self.session, self.prefix_logits)
        else:
            between = self.fmt.assistant_to_user if self.tail == "assistant" else self.fmt.user_to_user
            tokens = self.session.tokenize(between + question + self.fmt.after_user)
            n_in = len(tokens)
            if n_in + 1 > self.room():
                raise ContextFullError(self._full_message())
            try:
                self.session.prefill(tokens, seq=self.seq)
            except ContextFull:
                self._truncate(mark)
                raise ContextFullError(self._full_message()) from None
            except KeyboardInterrupt:  # nothing half-appended stays behind
                self._truncate(mark)
                raise
            driver = self.session
        self.pending = False
        self.tail = "assistant"
        limit = min(max_tokens, self.room())
        gen = generate(driver, limit, sampler, seq=self.seq, on_text=on_text)
        if gen.stopped == "length" and limit < max_tokens:
            gen.stopped = "context_full"
        self.turns.append(Turn(question, gen.text, gen.stopped, n_in, len(gen.tokens)))
        return gen

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        info = self.session.info
        s = self.session.stats(self.seq)
        live = cache.stats(self.session.ctx, self.seq, info.n_layer_model, info.n_head_kv)
        s.update(live_entries=live["live_entries"],
                 k_bytes=live["k_bytes"], v_bytes=live["v_bytes"], bias_bytes=live["bias_bytes"],
                 next_pos=self._st().next_pos, n_ctx=self.session.n_ctx, peak_rss_bytes=peak_rss_bytes())
        return s

    def summary_line(self) -> str:
        """One line after compressing/loading: tokens, kept entries, memory saved, time, mode."""
        info = self.session.info
        s = self.stats()
        n = len(self.prefix_tokens)
        full_entries = n * info.n_layer * info.n_head_kv
        label = self.policy if self.budget is None else f"{self.policy} @ {self.budget}"
        saved = 1 - s["kv_bytes"] / s["kv_bytes_full"] if s["kv_bytes_full"] else 0.0
        line = (f"[{label}, {self.mode}] {n} tokens -> {s['kv_cells']} cells, {s['live_entries']:,} of "
                f"{full_entries:,} entries kept; {s['kv_bytes'] / 1e6:.2f} MB of {s['kv_bytes_full'] / 1e6:.2f} MB "
                f"({100 * saved:.1f}% saved)")
        if self.load_s is not None:
            line += f"; loaded in {self.load_s:.2f}s (+ model {self.model_s:.2f}s)"
        elif self.report is not None:
            line += f"; prefill {self.report.prefill_s:.2f}s, compress {self.report.compress_s:.2f}s"
            if self.report.note:
                line += f" ({self.report.note})"
        return line

    def stats_table(self) -> str:
        info = self.session.info
        s = self.stats()
        per_layer_bytes = (s["k_bytes"] + s["v_bytes"] + s["bias_bytes"]) / max(1, info.n_layer)
        rows = [f"sequence: {s['kv_cells']} cells held, next position {s['next_pos']}, context "
                f"{self.session.cells_used()}/{s['n_ctx']} cells; {s['kv_bytes'] / 1e6:.2f} MB of "
                f"{s['kv_bytes_full'] / 1e6:.2f} MB uncompressed; {len(self.turns)} turn(s) since the document",
                f"memory: KV buffer allocated {s['kv_bytes_allocated'] / 1e6:.2f} MB ({s['kv_cells_allocated']} cells); "
                f"live entries {s['kv_bytes_live'] / 1e6:.2f} MB; process peak RSS "
                + ("not measured" if s["peak_rss_bytes"] is None else f"{s['peak_rss_bytes'] / 1e6:.0f} MB"),
                f"{'layer':>5} {'live cells':>10} {'entries per KV head':>22} {'bytes':>10}"]
        for il in range(len(s["per_layer_cells"])):
            heads = " ".join(str(x) for x in s["per_head_entries"][il])
            if il in info.sliding_layers:  # llama.cpp's window cache, not compressed
                rows.append(f"{il:>5} {s['per_layer_cells'][il]:>10} {heads:>22} {'sliding':>10}")
            else:
                rows.append(f"{il:>5} {s['per_layer_cells'][il]:>10} {heads:>22} {per_layer_bytes:>10,.0f}")
        return "\n".join(rows)

    # ------------------------------------------------------------------ .kvc files
    def to_kvc(self):
        s, info, st = self.session, self.session.info, self._st()
        ident = identity()
        meta = {
            "kvcli_version": __version__, "native_state_format": ident["state_format"],
            "llama_commit": ident["llama_commit"], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": {"hash": model_hash(Path(s.model_path)), "name": info.name, "path": str(s.model_path),
                      "n_layer": info.n_layer, "n_head_kv": info.n_head_kv, "head_dim": info.head_dim,
                      "sliding_layers": list(info.sliding_layers),
                      "n_vocab": s.n_vocab},
            "cache_type": s.cache_type, "flash_attn": s.flash_attn,
            "policy": self.policy, "budget": self.budget, "policy_args": dict(self.policy_args),
            "resolved_params": _jsonable(getattr(self.report, "params", None)) if self.report else self.resolved_params,
            "original_tokens": len(self.prefix_tokens), "mode": self.mode, "question": self.question,
            "system": self.system, "document": self.document,
            "generic_suffix": None if self.question else GENERIC_SUFFIX,
            "compressed": bool(cache.is_compressed(s.ctx, self.seq)),
            "conversation": {"reset_pos": self.reset_mark[0], "reset_cells": self.reset_mark[1],
                             "next_pos": st.next_pos, "cells": st.cells, "reindexed": st.reindexed,
                             "rope": s.rope_regime, "tail": self.tail,
                             "pending": self.pending, "turns": [t.__dict__ for t in self.turns]},
        }
        kept = st.kept_positions
        return kvc.KvcFile(meta=meta, prefix_tokens=np.asarray(self.prefix_tokens, np.int32),
                           state=cache.get_state(s.ctx, self.seq), kept_positions=kept,
                           prefix_logits=self.prefix_logits)

    def save(self, path, force: bool = True) -> int:
        return kvc.write(path, self.to_kvc(), force=force)

    @classmethod
    def from_kvc(cls, path, model: str | None = None, seq: int = 0, n_threads: int | None = None):
        """Load a .kvc file into a fresh session of its model (checked by hash)."""
        t0 = time.perf_counter()
        f = kvc.read(path)
        kvc.check_versions(f)
        kvc.check_meta(f)
        kvc.check_state(f)
        m = f.meta
        recorded = Path(m["model"]["path"])
        read_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if model is None and recorded.is_file():
            model_path = resolve_model(recorded)
        else:  # --model, else KVCLI_MODEL / the config file, else the default
            model_path = resolve_model(model or config.get("model"))
        kvc.check_model(f, model_path)
        session = NativeSession(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                                n_threads=n_threads)
        conv = cls(session, m["document"], policy=m["policy"], budget=m["budget"],
                   policy_args=dict(m.get("policy_args") or {}), system=m.get("system"), question=m.get("question"),
                   seq=seq, prefix_tokens=[int(t) for t in f.prefix_tokens])
        c = m["conversation"]
        if conv.prefix_tokens != session.tokenize(conv.prefix_text()):
            raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
        # sized for what the file holds + TURN_ROOM, not for the document it was compressed from
        # (recompressing with /policy or /budget reallocates for the document first)
        n_ctx = min(session.n_ctx_train, -(-(int(c["cells"]) + TURN_ROOM) // CTX_PAD) * CTX_PAD)
        if c.get("rope") == "long" and session.longrope:   # a LongRoPE cache read with the long factors keeps them
            n_ctx = max(n_ctx, session.longrope.long_ctx())
        session.create_context(n_ctx)
        conv.model_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        snap = SeqSnapshot(state=f.state, next_pos=int(c["next_pos"]), cells=int(c["cells"]),
                           prompt_tokens=len(conv.prefix_tokens), kept_positions=f.kept_positions,
                           reindexed=int(c.get("reindexed", 0)), rope=c.get("rope"))
        try:
            session.restore_seq(snap, seq)  # checks the cells and the last position against the file's
        except KvcliError as e:
            raise KvcliError(f"{path}: {e}") from None
        conv.resolved_params = m.get("resolved_params")
        conv.reset_mark = (int(c["reset_pos"]), int(c["reset_cells"]))
        conv.prefix_logits = f.prefix_logits
        conv.tail, conv.pending = c["tail"], bool(c["pending"])
        if conv.pending and conv.prefix_logits is None:
            raise KvcliError(f"{path} is corrupted (an unanswered question-aware prefix without its logits)")
        conv.turns = [Turn(**t) for t in c.get("turns", [])]
        conv.load_s = read_s + time.perf_counter() - t2  # the cache itself; the model load is model_s
        return conv


# ---------------------------------------------------------------------------------- the REPL
HELP = """commands:
  /stats                   cells, entries and bytes per layer, measured from the cache
  /save FILE               write the compressed document and this conversation to FILE (.kvc)
  /reset                   forget the conversation, back to the compressed document
  /policy P [N] [k=v ...]  recompress the original document with policy P, budget N (drops the conversation)
  /budget N                recompress the original document with budget N (drops the conversation)
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
                 fresh: bool = False, jsonl: bool = False, progress_factory=None, out=None, err=None):
        self.conv, self.max_tokens, self.sampler = conv, max_tokens, sampler
        self.interactive, self.quiet, self.fresh = interactive, quiet, fresh
        self.jsonl = jsonl and not interactive  # one JSON object per answer and line (answers may hold blank lines)
        self.progress_factory = progress_factory
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.n_answers = 0

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
        if self.jsonl:
            s = self.conv.stats()
            self._write(json.dumps({"question": question, "answer": gen.text, "stopped": gen.stopped,
                                    "prompt_tokens": pos0 + self.conv.turns[-1].tokens_in,
                                    "generated_tokens": len(gen.tokens), "kv_cells": self.conv._st().cells,
                                    "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None,
                                    **{k: s[k] for k in MEMORY_STATS}},
                                   ensure_ascii=False) + "\n")
        else:
            self._write("\n")
        if gen.stopped == "interrupted":
            self.say("[interrupted: the partial answer stays in the conversation]")
            if not self.interactive:
                raise KeyboardInterrupt
        elif gen.stopped == "context_full":
            msg = self.conv._full_message()
            if not self.interactive:
                raise ContextFullError(msg + " (or answer each question alone with --fresh)")
            self.say(f"[{msg}]")
        elif gen.stopped == "length" and not self.quiet:
            self.say(f"[stopped at --max-tokens {self.max_tokens}]")
        if not self.quiet and self.interactive:
            rate = f", {gen.decode_tok_s:.1f} tok/s" if gen.decode_tok_s else ""
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
                kw["policy_args"] = parse_policy_args(words) if words else None
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
                    self._write("\n")
                    self.say("[interrupted]")
                except KvcliError as e:  # a bad command or a full context: say it, stay in the chat
                    self.say(f"error: {e}")
        finally:
            save()
