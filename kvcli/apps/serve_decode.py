"""kvcli serve's parallel decode: several requests in flight in the one model thread, their answers decoded together,
one llama_decode batch per token (llama-server's parallel slots, `-np N`, each with a cache compressed for its own
question). The engine is kvcli/apps/serve.py's, the HTTP side kvcli/apps/serve_http.py.

    context cells   [ document A ][ document B ][ q1 ][ q1's selection ][ q2 ][ q2's selection ][ a1 a2 a1 a2 ... ]
                      requests 1 and 2 ask about A: both questions share A's cells, each selection is gathered into
                      an answer sequence of the request's own (one of --parallel), and both decode in one batch

`Scheduler` (one thread, the only one that touches the model) keeps the requests in arrival order. Between two decode
steps it admits the next ones: a request's prompt is matched to a stored document, prefilled with observation,
planned and gathered (Engine.begin; serially, as one request alone is served), and the request joins the decode loop
as a `Flight`. `ParallelDecode.step` picks every flight's next token with its own sampler (temperature, seed,
penalties), decodes them all in one `session.step({seq: token, ...})`, streams each token's text through the
flight's own stop filter, and ends the flights that are done (end of generation, max_tokens, a stop string, a client
gone): their sequences (the question's and the answer's) are freed at once while the others go on.

Room. A flight reserves the tokens it may still decode (its max_tokens, capped by the model's training context). A
request beside flights is admitted only when its prompt's cells, its selection and its whole answer fit beside what
the flights hold and reserve (idle resident documents are freed for it, least recently used; a document that a
flight was answered from is not, `ServeResidents`); otherwise it waits in the queue, and one that fits the context
only alone waits until the flights in front of it have ended: never an error for want of room. Forms that need the
context to themselves run alone, between flights: a prompt served by bounded reading (its chunks take the context's
room) and a model with sliding-window layers (one sequence, its stored cache restored per request).

What one request decodes alone is what kvcli serve decoded before this loop existed, bit for bit: the same picks (the
sampler of kvcli/generate.py, `Decoding`), one sequence per step, its answer's tokens placed after its gathered
block. Flights decoded together each attend to their own cells only (the others' are masked), so their logits are
the ones they would have alone up to f16 rounding: the CPU flash-attention kernel sums a sequence's cells in cell
order, and a flight's next token may take a cell another flight freed, between its own earlier tokens (a request
alone never sees a cell freed under it); on several threads a single decoded token over 512 cells or more also takes
ggml's split-KV kernel, which a batch of several does not (native/src/README.md, "Several threads").
tests/test_serve_parallel.py measures the first on the tiny model at one thread (logits within 0.016, the same greedy
tokens and plans).
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvcli.drivers.resident import Residents
from kvcli.errors import KvcliError
from kvcli.generate import Decoding


class WaitForRoom(KvcliError):
    """Raised by Engine.begin beside flights: the request does not fit now (room, a free sequence); it waits in the
    queue and is tried again when a flight ends."""


class RunAlone(KvcliError):
    """Raised by Engine.begin beside flights: the request is served alone (an exclusive form, or it did not fit beside
    them after all); it waits until no flight is left."""


class Stopped(KeyboardInterrupt):
    """Raised from the text callback to end a generation (a stop string, a client gone): generate() and Decoding keep
    the tokens decoded so far, as for Ctrl-C."""


class StopFilter:
    """Text pieces through to `emit`, holding back what could be the start of a stop string; raises Stopped at
    one (the text before it is emitted, the stop string is not)."""

    def __init__(self, stops: list[str], emit):
        self.stops, self.emit = [s for s in stops if s], emit
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf, self.text, self.hit = "", "", False

    def __call__(self, piece: str) -> None:
        self.buf += piece
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._out(self.buf[:cut])
            self.buf, self.hit = "", True
            raise Stopped()
        safe = len(self.buf) - self.hold
        if safe > 0:
            self._out(self.buf[:safe])
            self.buf = self.buf[safe:]

    def flush(self) -> None:
        self._out(self.buf)
        self.buf = ""

    def _out(self, text: str) -> None:
        if text:
            self.text += text
            self.emit(text)


def text_callback(out: StopFilter, cancelled, gone: list):
    """The on_text of one answer: pieces through its stop filter; a client gone (`cancelled()`) ends it (gone[0])."""
    def piece(text):
        if gone[0] or out.hit:   # a stop or a cancel ended it: the decoder's flush sends nothing more
            return
        if cancelled():
            gone[0] = True
            raise Stopped()
        out(text)
    return piece


@dataclass
class Flight:
    """A request whose selection is gathered: decoding, or parked until its answer's room is free."""
    prompt: list[int]
    choice: object               # kvcli.apps.serve.Choice
    seq: int                     # the sequence its answer decodes from (taken from the engine's pool)
    qseq: int                    # its question's sequence (the document's extension afterwards, or freed)
    doc: object                  # the resident StoredDocument it was answered from
    r: object                    # its Reselection
    st: dict                     # the compressed cache's stats when its decode began
    t0: float                    # begun (admitted)
    t1: float                    # gathered: its decode may begin
    cancelled: object            # () -> bool: the client left
    out: StopFilter
    gone: list                   # [True] once the client left
    fresh: bool = False          # it read its document
    read: tuple = (0, 0.0)       # (tokens, seconds) of that read
    new_store: int = 0
    owned: set = field(default_factory=set)   # question sequences it frees when it ends (unless kept as extensions)
    queued_s: float = 0.0
    decoding: Decoding | None = None   # None: parked, waiting for its answer's room
    limit: int = 0               # tokens it may decode
    steps: int = 0               # decode steps it took part in
    together: int = 0            # the sum of the flights decoded in those steps
    most: int = 0                # the most flights decoded in one of them
    answer: object = None        # its Answer, once ended
    error: BaseException | None = None
    job: object = None           # the Scheduler's job it answers
    make: object = None          # make(limit) -> its Decoding

    @property
    def left(self) -> int:
        """Cells it may still take: the tokens it may still decode (0 while parked: it has no limit yet)."""
        return 0 if self.decoding is None else max(0, self.limit - len(self.decoding.tokens))


class ServeResidents(Residents):
    """Residents that never free a document a flight was answered from while other requests are in flight, and that
    say WaitForRoom, instead of failing, when the room a request needs beside the flights is not there. With no flight
    in the loop it is Residents, unchanged (one request alone frees what it always freed)."""

    def __init__(self, session, seqs, flights: dict):
        super().__init__(session, seqs)
        self.flights = flights

    def _victims(self, keep) -> list:
        busy = {id(f.doc) for f in self.flights.values()}   # never a document a request in flight came from
        return [d for d in super()._victims(keep) if id(d) not in busy]

    def _no_room(self, cells: int, any_free: bool) -> Exception:
        if not self.flights:
            return super()._no_room(cells, any_free)
        return WaitForRoom(f"{cells} cells beside the requests in flight")

    def room_beside(self, cells: int, keep=None) -> None:
        """Free idle documents until `cells` more fit the context (WaitForRoom when they cannot)."""
        self._forget_closed()
        while self.session.cells_used() + cells > self.session.n_ctx:
            if not self._free_one(keep):
                raise WaitForRoom(f"{cells} cells beside the requests in flight")


class ParallelDecode:
    """Engine's decode loop (kvcli/apps/serve.py mixes it in): its flights, the room they reserve, one step for all.
    The engine provides session, n_ctx, parallel, context_full (the session's ContextFull) and `_end(flight)`."""

    def _init_flights(self) -> None:
        self.flights: dict[int, Flight] = {}   # answer sequence -> flight, in admission order
        self.ended = 0                         # flights ended so far: room may have changed

    def reserved(self, but: Flight | None = None) -> int:
        """Cells the decoding flights (other than `but`) may still take."""
        return sum(f.left for f in self.flights.values() if f is not but)

    def parked(self) -> bool:
        return any(f.decoding is None for f in self.flights.values())

    def _unpark(self, f: Flight, make) -> bool:
        """Start `f`'s decode when its whole answer fits beside the decoding flights (alone: as one request always
        started, limited by the context's room). `make(limit)` builds its Decoding."""
        others = [g for g in self.flights.values() if g is not f and g.decoding is not None]
        s = self.session
        want = max(1, min(f.choice.max_tokens, s.n_ctx_train - s.seq(f.seq).next_pos))
        free = s.n_ctx - s.cells_used() - self.reserved(f)
        if others and free < want:
            return False
        f.limit = want if others else max(1, min(want, free))
        f.decoding = make(f.limit)
        return True

    def step(self) -> list[Flight]:
        """One decode step of every flight: each picks its next token, all are decoded in one batch; the flights
        that ended (their sequences freed, their Answer or error set) are returned."""
        ended = []
        for f in list(self.flights.values()):
            if f.decoding is not None:
                continue
            if f.cancelled():   # left while parked: nothing decoded
                f.gone[0] = True
                f.decoding = f.make(1)
                f.decoding.end("cancelled")
                ended.append(f)
            else:
                self._unpark(f, f.make)
        batch: dict[int, tuple[Flight, int]] = {}
        for f in self.flights.values():
            if f.decoding is None or f in ended:
                continue
            if f.cancelled():   # asked between tokens too: a token whose text is held back asks nothing
                f.gone[0] = True
                f.decoding.end("cancelled")
                ended.append(f)
                continue
            tok = f.decoding.next()
            if tok is None:
                ended.append(f)
            else:
                batch[f.seq] = (f, tok)
        if batch:
            try:
                self.session.step({s: t for s, (_, t) in batch.items()})
            except self.context_full:   # the reservations keep this from happening; if it does, they end here
                for f, _ in batch.values():
                    f.decoding.end("context_full")
                    ended.append(f)
                batch = {}
            except Exception as e:   # noqa: BLE001 (llama_decode failed: each flight of the batch gets the error)
                for f, _ in batch.values():
                    f.error = e
                    f.decoding.end("error")
                    ended.append(f)
                batch = {}
            for f, tok in batch.values():
                f.steps += 1
                f.together += len(batch)
                f.most = max(f.most, len(batch))
                f.decoding.took(tok)
                if f.decoding.result is not None:
                    ended.append(f)
        for f in ended:
            self._end(f)
        return ended

    def cancel_all(self) -> list[Flight]:
        """End every flight (the server is stopping): each as its client leaving."""
        for f in self.flights.values():
            f.cancelled = lambda: True
        out = []
        while self.flights:
            out += self.step()
        return out


@dataclass
class Job:
    prompt: list[int]
    choice: object
    on_text: object
    cancelled: object
    future: Future
    queued: float
    alone: bool = False          # served only with no flight in the loop (RunAlone)
    blocked_at: int = -1         # engine.ended when it last did not fit (WaitForRoom): tried again after a change


class Scheduler:
    """The model thread: requests queued in arrival order, admitted between decode steps while they fit, decoded
    together (kvcli/apps/serve.py's Engine.begin and ParallelDecode.step). `submit` is called from any thread and
    returns a concurrent Future of the request's Answer (None when its client left before its turn)."""

    def __init__(self, engine, log=None):
        self.engine = engine
        self.log = log or (lambda line: None)
        self.queue: collections.deque[Job] = collections.deque()
        self.cv = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="kvcli-model", daemon=True)
        self.thread.start()

    @property
    def waiting(self) -> int:
        """Requests not admitted yet."""
        return len(self.queue)

    @property
    def decoding(self) -> int:
        """Requests in flight (decoding, or gathered and waiting for their answer's room)."""
        return len(self.engine.flights)

    def submit(self, prompt, choice, on_text=None, cancelled=lambda: False) -> Future:
        fut: Future = Future()
        with self.cv:
            if self.closed:
                raise KvcliError("the server is stopping")
            self.queue.append(Job(prompt, choice, on_text, cancelled, fut, time.perf_counter()))
            self.cv.notify()
        return fut

    def close(self, timeout: float = 30.0) -> None:
        """Stop: the flights end as cancelled, the queued requests are cancelled; waits for the model thread (a
        document being read finishes its read first)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout)

    # ------------------------------------------------------------------ the model thread
    def _run(self) -> None:
        e = self.engine
        while True:
            with self.cv:
                while not self.closed and not self.queue and not e.flights:
                    self.cv.wait()
                if self.closed:
                    break
            self._admit()
            if e.flights:
                try:
                    ended = e.step()
                except BaseException as x:   # noqa: BLE001 (a bug of ours: every flight gets it, the loop goes on)
                    ended = self._fail_all(x)
                for f in ended:
                    self._deliver(f)
        for f in e.cancel_all():
            self._deliver(f)
        with self.cv:
            jobs, self.queue = list(self.queue), collections.deque()
        for job in jobs:
            job.future.cancel()

    def _fail_all(self, x: BaseException) -> list[Flight]:
        e = self.engine
        out = []
        for f in list(e.flights.values()):
            f.error = x
            if f.decoding is None:
                f.decoding = f.make(1)
            f.decoding.end("error")
            try:
                e._end(f)
            except BaseException:   # noqa: BLE001 (freeing failed too: the flight is dropped)
                e.flights.pop(f.seq, None)
            out.append(f)
        return out

    def _admit(self) -> None:
        """Begin the queued requests that fit now, in order (one that does not fit holds back those behind it)."""
        e = self.engine
        while True:
            with self.cv:
                if not self.queue or self.closed:
                    return
                job = self.queue[0]
            if job.cancelled():   # its client left before its turn
                self._pop()
                job.future.set_result(None)
                continue
            if e.flights and (e.parked() or job.alone or job.blocked_at == e.ended
                              or len(e.flights) >= e.parallel):
                return
            self._pop()
            try:
                got = e.begin(job.prompt, job.choice, job.on_text, job.cancelled,
                              queued_s=time.perf_counter() - job.queued)
            except WaitForRoom:
                job.blocked_at = e.ended
                self._push_front(job)
                return
            except RunAlone:
                job.alone = True
                self._push_front(job)
                return
            except BaseException as x:   # noqa: BLE001 (the request's error: 400 for ours, 500 for a bug)
                job.future.set_exception(x)
                continue
            if isinstance(got, Flight):
                got.job = job
            else:   # served whole (an exclusive form)
                job.future.set_result(got)

    def _pop(self) -> None:
        with self.cv:
            self.queue.popleft()

    def _push_front(self, job: Job) -> None:
        with self.cv:
            self.queue.appendleft(job)

    @staticmethod
    def _deliver(f: Flight) -> None:
        if f.job is None:
            return
        if f.error is not None:
            f.job.future.set_exception(f.error)
        else:
            f.job.future.set_result(f.answer)
