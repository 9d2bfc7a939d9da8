"""The shared base of kvcli's conversations (kvcli/apps/chat.py: what a Conversation is, its modes and prompt
layouts): the turn format read off the model's chat template, a turn, and the `Conversation` base class: the fields
every mode has, the cache bookkeeping, the context's sizing, the reporting rows the modes share.

`Conversation(...)` builds the mode's class: `reselect=True` a `Reselected` (kvcli/apps/chat_reselected.py), which
becomes a `ReselectedExact` (the same file) or a `ReselectedBounded` (kvcli/apps/chat_bounded.py) when its document is
read, in the store's form; a `question` a `QuestionKnown` (kvcli/apps/chat_once.py: compressed once for it), otherwise
a `CompressedOnce` (the same file: question-agnostic). Each registers itself by its `kind` when its module is imported
(kvcli/apps/chat.py imports them).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from kvcli import doc_formats, policies
from kvcli.drivers.chunked import TURN_ROOM, pad_cells, plan_chunking
from kvcli.drivers.reselect import StoredDocument
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.engines import live_stats
from kvcli.planning.planner import resolve

AWARE, AGNOSTIC, RESELECTED = "question-aware", "question-agnostic", "re-selected"
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


# ---------------------------------------------------------------------------------- conversation
@dataclass
class Conversation:
    """One sequence of a NativeSession holding a document and the turns after it. Conversation(...) is the mode's
    class: a Reselected with reselect=True (its form's class, ReselectedExact or ReselectedBounded, once the document
    is read), a QuestionKnown with a question, a CompressedOnce otherwise."""

    # kind ("once", "aware", "reselected"; a re-selected store's form: "exact", "bounded") -> the class, as defined
    kinds: ClassVar[dict] = {}

    session: object
    document: str
    system: str | None = None
    question: str | None = None          # set: question-aware compression
    seq: int = 0
    chunk: int | None = None             # chunked prefill (kvcli/drivers/chunked.py): None = automatic, 0 = off
    max_cache: int | None = None         # most cells the cache may hold (document + conversation)
    chunk_scoring: str = "question"      # chunked: which queries score each chunk (kvcli/drivers/chunked.py)
    # the compression the command built (kvcli.planning.planner.Compression; None: `full`), taken as it is: policy,
    # budget and policy_args below come from it; /policy, /budget put another in its place (`_new_choice`)
    compression: object = None
    policy: str = field(default="full", init=False)
    budget: int | None = field(default=None, init=False)
    policy_args: dict = field(default_factory=dict, init=False)
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
    reselect: bool = False                # re-select the cache for every question from the stored full cache
    store_path: Path | None = None        # re-selected: where the document's full cache is stored (kept at close)
    store: StoredDocument | None = None
    last_reselection: object = None       # re-selected: the Reselection of the last question
    notify: object = None                 # re-selected: called with a line to tell the user (the store re-read)
    prompt_len: int = 0                   # re-selected: tokens of the last question's whole prompt
    store_turns: bool = True              # re-selected: keep the conversation's turns in the stored full cache
    cache_type: str | None = None         # the K/V type asked for (default: the session's); a bounded store's chunk
                                          # files hold it, read in float16 (reselect_bounded.store_types)


    def __init_subclass__(cls, kind: str | None = None, **kw):
        super().__init_subclass__(**kw)
        if kind is not None:
            Conversation.kinds[kind] = cls

    def __new__(cls, *args, **kw):
        if cls is Conversation:   # the mode's class (its __init__ is the dataclass's, with the same arguments)
            kind = "reselected" if kw.get("reselect") else "aware" if kw.get("question") else "once"
            if kind not in Conversation.kinds:
                raise KvcliError(f"no {kind} conversation: import kvcli.apps.chat, not kvcli.apps.chat_base")
            cls = Conversation.kinds[kind]
        return super().__new__(cls)

    def __post_init__(self):
        if self.compression is not None:
            c = self.compression
            self.policy, self.budget, self.policy_args = c.policy, c.budget, dict(c.args)
        if self.policy == "full":   # re-selected with `full` (kvcli run's several questions): the whole stored
            self.budget = None      # document restored for every question, no plan
        self.cache_type = self.cache_type or self.session.cache_type
        self.fmt = self.fmt or TurnFormat.probe(self.session, self.system)
        if not self.prefix_tokens:
            self.prefix_tokens = self.session.tokenize(self.prefix_text())

    @property
    def mode(self) -> str:
        raise NotImplementedError

    def prefix_text(self) -> str:
        """The text the document's cache is read from (the mode's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ cache bookkeeping
    def _st(self):
        return self.session.seq(self.seq)

    def _measured_cells(self) -> int:
        return live_stats(self.session, self.seq)["n_cells"]

    def _truncate(self, pos: int) -> None:
        """Remove every cell at position >= pos from the sequence."""
        self.session.truncate(self.seq, pos)

    def chunking(self):
        """Chunked or not, and the cells to allocate: the prompt (or, read in chunks, budget + chunk) plus TURN_ROOM
        for the conversation (less when --max-cache leaves less)."""
        return plan_chunking(len(self.prefix_tokens), TURN_ROOM, self.session.n_ctx_train, self._cfg(self.question),
                             self.chunk, self.max_cache, cell_bytes=self.session.info.cell_bytes(self.cache_type))

    def ensure_context(self) -> None:
        if self.session.ctx is None:
            self.session.create_context(self.chunking().n_ctx)

    def _say(self, line: str) -> None:
        if self.notify:
            self.notify(f"[{line}]")
        else:
            print(f"kvcli: {line}", file=sys.stderr, flush=True)

    def _announce(self, form: str, what: str, probe_seq: int | None) -> str:
        """A long read of the document says its token count and estimated time before it starts
        (doc_formats.announce_read: "[line]" on stderr, or through notify); returns the key its speed is recorded
        under."""
        return doc_formats.announce_read(self.session, self.prefix_tokens, form, what, probe_seq,
                                         self._say if self.notify else None)

    def _cfg(self, question: str | None):
        """The policy resolved for the model: the compression the command built, passed down (resolved again for the
        question only where the policy resolves parameters from it: Compression.for_instruction), or /policy's and
        /budget's (`_new_choice`); resolved here only for a .kvc file's recorded policy (`from_kvc`), once, when it is
        first needed."""
        c = self.compression
        if c is None or not c.asked(self.policy, self.budget, self.policy_args):
            c = self.compression = resolve(self.session.model_path, self.policy, self.budget, dict(self.policy_args),
                                           question)
            return c
        return c.for_instruction(question)

    def fit_context(self) -> None:
        """Give back the cells the document needed and the compressed prefix does not: the context is
        reallocated for what the session holds + TURN_ROOM (NativeSession.resize_context), so a long-lived
        conversation does not keep a KV buffer sized for the whole document."""
        s = self.session
        want = min(pad_cells(s.cells_used() + TURN_ROOM), s.n_ctx_train)
        if want < s.n_ctx:
            s.resize_context(want)

    def _new_choice(self, policy: str | None, budget: int | None, policy_args: dict | None):
        """(policy, budget, policy_args) of /policy, /budget: checked (resolved for the model, kept for `_cfg` once the
        caller applies the choice), not applied."""
        new_policy = (policy or self.policy).lower()
        if new_policy == "full":
            if budget is not None and policy is None:
                raise KvcliError("policy full keeps every entry: choose a policy with /policy NAME N")
            return new_policy, None, {}
        policies.get(new_policy)
        new_budget = budget if budget is not None else self.budget
        if new_budget is None:
            raise KvcliError(f"policy '{new_policy}' needs a budget: /policy {new_policy} N")
        new_args = policy_args if policy_args is not None else (
            self.policy_args if new_policy == self.policy else {})
        self.compression = resolve(self.session.model_path, new_policy, new_budget, new_args, self.question)
        return new_policy, new_budget, new_args

    # ------------------------------------------------------------------ turns
    def room(self) -> int:
        """Tokens that can still be appended: free cells, and positions left in the model's context."""
        s = self.session
        return min(s.n_ctx - s.cells_used(), s.n_ctx_train - self._st().next_pos)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        s = self.session.stats(self.seq)
        live = live_stats(self.session, self.seq)
        s.update(live_entries=live["live_entries"],
                 k_bytes=live["k_bytes"], v_bytes=live["v_bytes"], bias_bytes=live["bias_bytes"],
                 next_pos=self._st().next_pos, n_ctx=self.session.n_ctx, peak_rss_bytes=peak_rss_bytes())
        s["mode"] = self.mode
        self._mode_stats(s)
        return s

    def _mode_stats(self, s: dict) -> None:
        """Add the mode's own figures to stats()."""

    def _mode_row(self, s: dict) -> str:
        """The first row of stats_table(): the mode and how the document was read."""
        raise NotImplementedError

    def stats_table(self) -> str:
        info = self.session.info
        s = self.stats()
        per_layer_bytes = (s["k_bytes"] + s["v_bytes"] + s["bias_bytes"]) / max(1, info.n_layer)
        rows = [self._mode_row(s),
                f"sequence: {s['kv_cells']} cells held, next position {s['next_pos']}, context "
                f"{self.session.cells_used()}/{s['n_ctx']} cells; {s['kv_bytes'] / 1e6:.2f} MB of "
                f"{s['kv_bytes_full'] / 1e6:.2f} MB uncompressed; {len(self.turns)} turn(s) since the document",
                f"memory: KV buffer allocated {s['kv_bytes_allocated'] / 1e6:.2f} MB "
                f"({s['kv_cells_allocated']} cells); "
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


    def close(self) -> None:
        """Delete the stored document's cache unless it is kept."""
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------ loading (the mode's class does it)
    @classmethod
    def from_kvc(cls, path, model: str | None = None, seq: int = 0, n_threads: int | None = None):
        """A compressed-once conversation loaded from a .kvc file (CompressedOnce.from_kvc)."""
        return Conversation.kinds["once"].from_kvc(path, model=model, seq=seq, n_threads=n_threads)

    @classmethod
    def from_store(cls, path, **kw):
        """A re-selected conversation over a stored full document cache (a ReselectedExact) or a bounded store folder
        (a ReselectedBounded): Reselected.from_store."""
        return Conversation.kinds["reselected"].from_store(path, **kw)

    @classmethod
    def from_chunked_store(cls, path, **kw):
        """A re-selected conversation over a bounded store folder (ReselectedBounded.open_store)."""
        return Conversation.kinds["bounded"].open_store(path, **kw)
