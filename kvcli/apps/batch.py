"""`kvcli batch`: one instruction over many documents, through one model and one shared KV cache.

A `Worker` loads the model once and holds one llama.cpp context of `max_cache` cells (all documents
together) with up to `parallel` sequences. Documents are admitted in order while they fit
(kvcli/drivers/lockstep.py: the cells of the prefill peak plus `max_tokens` for the answer, with every held
document's answer reserved too): each is prefilled and compressed in a reading context of its own (a
sibling of the shared one on the same loaded model, sized for the document being read, read in chunks as
in `kvcli run` when bounded reading applies, kvcli/drivers/chunked.py), moved into a free sequence of the shared
cache (save_seq / restore_seq), then all held documents decode together, one `llama_decode` per token
step. Reading apart matters for speed: llama.cpp's attention spans every used cell of a unified cache, so
a document prefilled beside 20 held ones attended over their cells too (masked) and took up to twice as
long per token (docs/results/speed.md, "Batch throughput"). A compressed document occupies a few
hundred cells instead of thousands, so more of them decode at once in the same memory.

Results go to a JSONL file, one line per document as it finishes (`ResultsFile`): appended, flushed and
fsynced line by line, so an interruption (Ctrl-C, kill -9) loses at most the documents in flight. Each
line carries a key (the document's absolute path + its content's SHA-256 + the settings that decide the
answer); a re-run with the same file skips the keys it holds, and drops a torn last line a kill left.
A document that fails (unreadable, not text, too long for `full`, ...) gets a line with its error and
the batch goes on. The same worker runs on every node of a Ray cluster (kvcli/apps/batch_ray.py).

A long read says so first, as kvcli run's does (kvcli.doc_formats.announce_read): just before a document's read
starts, a read estimated at KVCLI_READ_NOTICE_S or longer gets one line with its token count and the time it will
take (`Worker.say`: "[line]" on stderr; the Batch writes it above its progress bar, a Ray worker sends it to the
driver). Documents are tokenised one at a time as the worker asks for them, so each is announced on its own; the
speed a read measures is kept for the next one's estimate.

Several questions per document (`Settings.questions`): one job and one result line per (document, question),
keyed by the question too. A worker reads a document once for its questions (they come one after the other):
its full cache is stored (kvcli/drivers/reselect.py, a temporary file in kvcli's cache folder, deleted when the worker
moves to the next document) and each question is re-selected from it: restore, prefill the prompt's rest with
observation, plan, compact, exactly the prompt `kvcli run` reads for that question. A document too long to be
read in one prefill is read again for each question (in chunks, as `kvcli run` reads it). On Ray, the questions
of one document may go to several workers: each reads it once.
"""
from __future__ import annotations

import codecs
import fcntl
import glob
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvcli import doc_formats
from kvcli.drivers.lockstep import Lockstep
from kvcli.drivers.chunked import plan_chunking
from kvcli.drivers.compress import prefill_and_compress
from kvcli.documents import convert_bytes
from kvcli.errors import KvcliError
from kvcli.generate import Sampler, Sampling
from kvcli.models import read_model_info, resolve_model
from kvcli.engines import open_native
from kvcli.planning.planner import Compression, resolve
from kvcli.drivers.reselect import STORE_TAIL, Reselection, StoredDocument, common_prefix
from kvcli.templating import build_prompt

DOC_SUFFIXES = (".txt", ".md", ".text", ".rst", ".pdf", ".epub", ".docx", ".html", ".htm")
MAX_PARALLEL = 64       # sequences of one context when --parallel is not given
MIN_DOC_CELLS = 64      # a cache that leaves a document fewer cells than this after its answer is refused


@dataclass
class Settings:
    """Everything a worker needs; `fingerprint` is the part that decides an answer. The defaults are `kvcli
    run`'s: its sampling (llama.cpp's sampler chain, greedy with a DRY penalty) and its reading
    (kvcli/drivers/chunked.py)."""

    instruction: str
    model: str | None = None
    policy: str = "full"
    budget: int | None = None
    policy_args: dict = field(default_factory=dict)
    max_tokens: int = 256
    sampling: Sampling = field(default_factory=Sampling)
    system: str | None = None
    cache_type: str = "f16"
    chunk: int | None = None
    chunk_scoring: str = "question"
    max_cache: int | None = None     # cells of the whole cache (all documents); None: the model's context
    parallel: int = 0                # most documents held at once; 0: as many as fit (up to MAX_PARALLEL)
    threads: int | None = None
    questions: list[str] = field(default_factory=list)   # several questions per document (instruction "")
    per_document: bool = False       # a manifest gives each document its questions (besides `questions`)

    def __post_init__(self):
        if self.policy == "full":
            self.budget = None   # full keeps everything: a budget would only split the resume keys

    def fingerprint(self, model_path) -> str:
        """A digest of what decides an answer (the model file by name and size, not by where it lies)."""
        p = Path(model_path)
        # the questions are not in it: each line's key holds its own (a question added later keeps the others')
        what = {k: v for k, v in asdict(self).items()
                if k not in ("model", "parallel", "threads", "questions", "per_document")}
        what["model"] = [p.name, p.stat().st_size]
        if not self.sampling.temperature:   # greedy: the seed and the sampling filters change nothing
            for name in ("seed", "top_k", "top_p", "min_p"):
                what["sampling"].pop(name)
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def check_settings(settings: Settings) -> tuple[Path, Compression]:
    """Input errors before any document is read: the model, the policy and its arguments, the room a document
    gets. Returns the model's path and the compression resolved for it (for the first question, else the
    instruction), which the Worker takes as it is."""
    if not settings.instruction.strip() and not settings.questions and not settings.per_document:
        raise KvcliError("the instruction is empty")
    if any(not q.strip() for q in settings.questions):
        raise KvcliError("a question is empty")
    settings.sampling.validate()
    doc_formats.notice_seconds()   # a bad KVCLI_READ_NOTICE_S or KVCLI_READ_TOK_S: refused here, not per document
    doc_formats.read_speed("")
    path = resolve_model(settings.model)
    compression = resolve(path, settings.policy, settings.budget, settings.policy_args,
                          settings.questions[0] if settings.questions else settings.instruction or None)
    document_cells(settings, path)
    return path, compression


def document_cells(settings: Settings, model_path) -> tuple[int, int]:
    """(cells of the whole cache, cells one document may use: the model's context or the cache, less its answer)."""
    n_ctx_train = read_model_info(model_path).n_ctx_train
    cells = settings.max_cache or n_ctx_train
    doc = min(cells, n_ctx_train) - settings.max_tokens
    if doc < MIN_DOC_CELLS:
        raise KvcliError(f"--max-tokens {settings.max_tokens} leaves {max(doc, 0)} cells of the "
                         f"{doc + settings.max_tokens}-cell context for a document: raise --max-cache or "
                         "lower --max-tokens")
    return cells, doc


# ------------------------------------------------------------------------------ documents
def read_manifest(path) -> dict[str, list[str]]:
    """A JSONL manifest of documents and their questions: one {"path": ..., "questions": [...]} (or "question":
    "...") per line, a relative path taken from the manifest's folder; the same path on several lines gathers
    their questions. Refused in one line (its line number) when malformed."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KvcliError(f"--manifest: no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KvcliError(f"--manifest: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    out: dict[str, list[str]] = {}
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise KvcliError(f"--manifest {path}, line {i}: not JSON") from None
        qs = line.get("questions", [line["question"]] if "question" in line else None) \
            if isinstance(line, dict) else None
        if not isinstance(line, dict) or not isinstance(line.get("path"), str) or not isinstance(qs, list) \
                or not qs or not all(isinstance(q, str) and q.strip() for q in qs):
            raise KvcliError(f'--manifest {path}, line {i}: expected {{"path": "...", "questions": ["...", ...]}} '
                             "with non-empty questions")
        doc = Path(line["path"]).expanduser()
        doc = str(doc if doc.is_absolute() else p.parent / doc)
        out.setdefault(doc, [])
        out[doc] += [q.strip() for q in qs if q.strip() not in out[doc]]
    if not out:
        raise KvcliError(f"--manifest {path} lists no document")
    return out


def list_documents(specs, stdin=None) -> list[str]:
    """The paths named by --docs: a folder (its *.txt/*.md/... files, recursively, sorted), a glob
    pattern (the files it matches, sorted), a file, or '-' (a list of paths on stdin, one per line)."""
    out = []
    for spec in specs:
        if spec == "-":
            stdin = stdin or sys.stdin
            if stdin is None or stdin.isatty():
                raise KvcliError("--docs -: pipe a list of document paths on standard input, one per line")
            out += [line.strip() for line in stdin.read().splitlines() if line.strip()]
            continue
        path = Path(spec).expanduser()
        if any(c in spec for c in "*?["):
            found = sorted(p for p in glob.glob(str(path), recursive=True) if os.path.isfile(p))
            if not found:
                raise KvcliError(f"--docs {spec}: no file matches")
            out += found
        elif path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DOC_SUFFIXES)
            if not found:
                raise KvcliError(f"--docs {spec}: the folder holds no document (*{', *'.join(DOC_SUFFIXES)})")
            out += found
        elif path.is_file():
            out.append(str(path))
        else:
            raise KvcliError(f"--docs {spec}: no such file or folder")
    seen, unique = set(), []
    for p in out:
        a = os.path.abspath(os.path.expanduser(p))
        if a not in seen:
            seen.add(a)
            unique.append(p)
    if not unique:
        raise KvcliError("no document: pass --docs DIR, --docs 'GLOB', --docs FILE or --docs - (paths on stdin)")
    return unique


@dataclass
class Job:
    """One document to answer: read by the driver, so a worker on another machine needs no shared files."""

    path: str
    key: str
    sha256: str | None
    text: str | None = None
    error: str | None = None
    question: str | None = None   # several questions per document: this job's (else the settings' instruction)


def question_job(job: Job, question: str) -> Job:
    """The job of one question about a read document, keyed by the question too."""
    key = hashlib.sha256(json.dumps([job.key, question]).encode()).hexdigest()[:32]
    return Job(job.path, key, job.sha256, job.text, job.error, question)


def read_job(path: str, fingerprint: str) -> Job:
    """Read and key one document; a document that cannot be read or is not text carries its error."""
    data, error = None, None
    try:
        data = Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        error = f"document not found: {path}"
    except IsADirectoryError:
        error = f"{path} is a directory, not a document"
    except OSError as e:
        error = f"cannot read {path}: {e.strerror}"
    sha = None if data is None else hashlib.sha256(data).hexdigest()
    key = hashlib.sha256(json.dumps([os.path.abspath(os.path.expanduser(path)), sha, fingerprint])
                         .encode()).hexdigest()[:32]
    job = Job(path, key, sha, error=error)
    if data is not None:
        try:
            job.text = convert_bytes(data, path).text
        except KvcliError as e:
            job.error = str(e)
    return job


def error_line(job: Job, error: str, settings: Settings) -> dict:
    line = {"path": job.path, "sha256": job.sha256, "key": job.key, "answer": None, "error": error,
            "policy": settings.policy, "budget": settings.budget}
    if job.question is not None:
        line["question"] = job.question
    return line


# ------------------------------------------------------------------------------ the results file
class ResultsFile:
    """The JSONL results: locked against a second writer, its torn last line (a killed run's) dropped,
    and every line appended with one write, then fsynced."""

    def __init__(self, path: str, retry_errors: bool = False, warn=None):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise KvcliError(f"cannot open --out {path}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise KvcliError(f"{path} is being written by another kvcli batch") from None
        self.done: set[str] = set()
        self.answered = self.failed = 0
        try:
            self._load(retry_errors, warn or (lambda msg: None))
        except BaseException:
            self.close()
            raise

    def _load(self, retry_errors: bool, warn) -> None:
        data = b""
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line cut short by a kill: everything before it was written whole
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
            warn(f"kvcli: {self.path}: dropped a torn last line ({len(data) - end} bytes) left by an interrupted run")
        for i, raw in enumerate(data[:end].splitlines(), 1):
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
                key, failed = line["key"], line.get("error") is not None
            except (ValueError, TypeError, KeyError):
                raise KvcliError(f"{self.path}, line {i}: not a kvcli batch result line (choose another --out)") \
                    from None
            self.failed += failed
            self.answered += not failed
            if not (failed and retry_errors):
                self.done.add(key)

    def write(self, line: dict) -> None:
        data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
        while data:  # O_APPEND: every write lands at the end, whatever else happened to the file
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)   # the lock goes with it
            self.fd = None


# ------------------------------------------------------------------------------ one model, one cache
@dataclass
class _Ready:
    job: Job
    tokens: list
    chunking: object
    peak: int           # cells the document needs while it is prefilled (and compressed)
    stored: bool = False   # one of several questions: re-selected from the document's stored full cache


@dataclass
class _Slot:
    ready: _Ready
    report: object
    cache: dict         # the sequence's cache figures once compressed
    sampler: object
    decoder: object
    tokens: list = field(default_factory=list)
    text: str = ""
    t0: float = 0.0
    steps: int = 0      # decode steps it took part in
    together: int = 0   # sum over those steps of the sequences decoded in each
    read_s: float | None = None   # re-selected: the document's one read, on the question that made it (else 0)


class Worker:
    """One model and one KV cache of `max_cache` cells that documents share (see the module doc)."""

    def __init__(self, settings: Settings, checked: tuple[Path, Compression] | None = None, say=None):
        """`checked`: what check_settings returned for these settings in this process (else checked here); `say`:
        where a long read's notice goes (doc_formats.announce_read's `say`; None: "[line]" on stderr)."""
        self.settings = s = settings
        self.say = say
        self.announced = None   # (path, sha256) of the last document whose read was announced
        self.model_path, first = checked or check_settings(settings)
        self.cells, self.doc_cells = document_cells(s, self.model_path)   # the whole cache, one document's share
        self.session = open_native(self.model_path, n_ctx=self.cells, n_seq=s.parallel or MAX_PARALLEL,
                                   cache_type=s.cache_type, n_threads=s.threads)
        self.reader = None   # the reading context, grown to the largest document read so far
        self.store = None    # several questions: the stored full cache of the document being asked
        self.store_of = None   # (path, sha256) of that document
        self.compression = first
        self.configs = {first.instruction: first}   # the policy resolved once per instruction

    def close(self) -> None:
        self._drop_store()
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        self.session.close()

    def _reader(self, peak: int):
        """A reading context of at least `peak` + 1 cells (padded to 256), on the shared session's model."""
        need = -(-(peak + 1) // 256) * 256
        lr = self.session.longrope
        if lr and self.session.rope_regime == "long":   # its K rows move to the shared cache: the same RoPE factors
            need = max(need, lr.long_ctx())
        if self.reader is None:
            self.reader = self.session.sibling(need)
        elif self.reader.n_ctx < need:
            self.reader.resize_context(need)
        return self.reader

    def run(self, jobs, emit) -> None:
        """Answer every job of the iterable `jobs`; `emit(line)` is called once per job as it finishes."""
        lock = Lockstep(self.session, reserve=self.settings.max_tokens, cells=self.cells)
        jobs = iter(jobs)
        slots: dict[int, _Slot] = {}
        try:
            waiting = self._next_ready(jobs, emit)
            while waiting is not None or slots:
                while waiting is not None and lock.fits(waiting.peak):
                    self._admit(waiting, lock, slots, emit)
                    waiting = self._next_ready(jobs, emit)
                if not slots and waiting is not None:  # _prepare checked that it fits an empty cache
                    raise RuntimeError(f"{waiting.job.path} does not fit an empty cache ({lock.room()} cells)")
                self._step(lock, slots, emit)
        finally:
            self._drop_store()

    # -------------------------------------------------------------------------- several questions
    def _drop_store(self) -> None:
        if self.store is not None:
            self.store.close()   # its temporary file goes
        self.store, self.store_of = None, None

    def _stored(self, ready: _Ready, reader) -> tuple[StoredDocument, float]:
        """The stored full cache of ready's document: read now (its read time returned) unless it is the one held."""
        job, s = ready.job, self.settings
        if self.store is not None and self.store_of == (job.path, job.sha256):
            return self.store, 0.0
        self._drop_store()
        # what every question's prompt starts with: the prompt up to where two questions part, less STORE_TAIL
        # tokens (where the tokenizer may merge the document's end with what follows)
        other = reader.tokenize(build_prompt(reader, job.text, "?" if job.question != "?" else "!", s.system))
        split = max(1, common_prefix(ready.tokens, other) - STORE_TAIL)
        key = self._announce(reader, job, ready.tokens[:split], "prefill",
                             "reading it in one prefill (once for its questions)")
        store = StoredDocument.read(reader, ready.tokens, split=split, colsum="colsum" in self._cfg(job).observe[0])
        self.store, self.store_of = store, (job.path, job.sha256)
        doc_formats.record_read_speed(key, split, store.read_s)
        return store, store.read_s

    def _announce(self, reader, job: Job, tokens: list[int], form: str, what: str) -> str:
        """Just before a document's first read: a long one says its token count and estimated time (doc_formats
        .announce_read, through `self.say`; with no speed known, a probe may be prefilled in the reader's empty
        sequence 0); a document read again for its next question is not announced again. Returns the key the
        read's measured speed is recorded under."""
        if self.announced == (job.path, job.sha256):
            return doc_formats.speed_key(reader, form)
        self.announced = (job.path, job.sha256)
        return doc_formats.announce_read(reader, tokens, form, what, probe_seq=0, say=self.say)

    def _cfg(self, job: Job):
        return self._resolved(job.question)

    def _resolved(self, instruction: str | None):
        """The policy resolved for the model and this instruction, once (kvcli.planning.planner.Compression): the
        settings' compression, resolved again only for a policy whose parameters depend on the question."""
        if instruction not in self.configs:
            self.configs[instruction] = self.compression.for_instruction(instruction)
        return self.configs[instruction]

    # -------------------------------------------------------------------------- stages of one document
    def _next_ready(self, jobs, emit) -> _Ready | None:
        """The next job, tokenised and planned; a job that fails here gets its error line."""
        for job in jobs:
            try:
                return self._prepare(job)
            except Exception as e:  # noqa: BLE001 - the document's line says what happened, the batch goes on
                emit(error_line(job, _why(e), self.settings))
        return None

    def _prepare(self, job: Job) -> _Ready:
        s, session = self.settings, self.session
        tokens = session.tokenize(build_prompt(session, job.text, job.question or s.instruction, s.system))
        # read as `kvcli run` reads (in one go, or bounded reading in chunks of DEFAULT_CHUNK), within the cells
        # one document may use: they stand for run's model context here
        chunking = plan_chunking(len(tokens), s.max_tokens, self.doc_cells, self.compression, s.chunk,
                                 cell_bytes=session.bytes_per_cell(),
                                 limit_name=f"the {self.doc_cells} cells a document may use (the model's context "
                                            f"or --max-cache, less --max-tokens {s.max_tokens})")
        peak = chunking.cap if chunking.chunk else len(tokens)
        # several questions: re-selected from the stored document, unless it is read in chunks (then once each)
        return _Ready(job, tokens, chunking, peak, stored=job.question is not None and not chunking.chunk)

    def _admit(self, ready: _Ready, lock, slots: dict, emit) -> None:
        s, session = self.settings, self.session
        seq = lock.free_seq()
        read_s = None
        try:
            # a policy's second pass holds its chunk after the prompt (bounded reading: after the chunk read)
            cfg = self._cfg(ready.job)
            room = cfg.spec.room_after(ready.chunking.chunk or len(ready.tokens), cfg.params) \
                if cfg.spec.second_pass is not None else 0
            reader = self._reader(ready.peak + room)
            try:
                if ready.stored:
                    store, read_s = self._stored(ready, reader)
                    report = store.reselect(reader, ready.tokens, self._cfg(ready.job), seq=0)
                else:
                    instruction = ready.job.question or s.instruction
                    chunk = ready.chunking.chunk
                    how = f"in chunks of {chunk}" if chunk else "in one prefill"
                    key = self._announce(reader, ready.job, ready.tokens, "chunked" if chunk else "prefill",
                                         f"reading it {how}" + (" (once for each of its questions)"
                                                                if ready.job.question is not None else ""))
                    t0 = time.perf_counter()
                    report = prefill_and_compress(reader, ready.tokens, self._resolved(instruction),
                                                  seq=0, instruction=instruction,
                                                  chunk=chunk, cap=ready.chunking.cap, scoring=s.chunk_scoring)
                    doc_formats.record_read_speed(key, len(ready.tokens), time.perf_counter() - t0)
                session.restore_seq(reader.save_seq(0), seq)
            finally:
                if 0 in reader.seqs:
                    reader.clear(0)
            lock.hold(seq)   # packs the cache: what the document holds is measured after
            cache = session.stats(seq)
        except Exception as e:  # noqa: BLE001 - the document's line says what happened, the batch goes on
            lock.release(seq)
            emit(error_line(ready.job, _why(e), s))
            return
        slots[seq] = _Slot(ready, report, cache, Sampler(s.sampling).start(session, s.max_tokens),
                           codecs.getincrementaldecoder("utf-8")("replace"), t0=time.perf_counter(), read_s=read_s)

    def _step(self, lock, slots: dict, emit) -> None:
        """Pick every held document's next token; finish those that ended; decode the others together."""
        session, limit = self.session, self.settings.max_tokens
        batch = {}
        for seq, slot in list(slots.items()):
            tok = slot.sampler(session.logits(seq))
            if session.is_eog(tok):
                self._finish(seq, "eog", lock, slots, emit)
                continue
            slot.tokens.append(tok)
            slot.text += slot.decoder.decode(session.token_bytes(tok))
            if len(slot.tokens) >= limit:
                self._finish(seq, "length", lock, slots, emit)
                continue
            batch[seq] = tok
        if batch:
            lock.step(batch)
            for seq in batch:
                slots[seq].steps += 1
                slots[seq].together += len(batch)

    def _finish(self, seq: int, stopped: str, lock, slots: dict, emit) -> None:
        slot = slots.pop(seq)
        lock.release(seq)
        decode_s = time.perf_counter() - slot.t0
        r, c, s = slot.report, slot.cache, self.settings
        if isinstance(r, Reselection):   # re-selected from the stored document (read with an earlier question or now)
            read = {**r.as_stats(), "document_reads": int(bool(slot.read_s)), "document_read_s": round(slot.read_s, 4),
                    "prefill_s": round(r.prefill_s, 4), "compress_s": round(r.plan_s, 4)}
        else:
            read = {**r.as_stats(), "document_reads": 1, "prefill_s": round(r.prefill_s, 4),
                    "compress_s": round(r.compress_s, 4)}
        stats = {"prompt_tokens": len(slot.ready.tokens), "generated_tokens": len(slot.tokens),
                 "kv_cells": c["kv_cells"], "kv_bytes": c["kv_bytes"], "kv_bytes_live": c["kv_bytes_live"],
                 "kv_bytes_full": c["kv_bytes_full"],
                 **read, "decode_s": round(decode_s, 4),
                 "decode_tok_s": round(len(slot.tokens) / decode_s, 2) if slot.tokens and decode_s > 0 else None,
                 "decoded_with": round(slot.together / slot.steps, 2) if slot.steps else None}
        if getattr(r, "note", None):
            stats["note"] = r.note
        job = slot.ready.job
        line = {"path": job.path, "sha256": job.sha256, "key": job.key}
        if job.question is not None:
            line["question"] = job.question
        emit({**line, "answer": slot.text + slot.decoder.decode(b"", final=True), "error": None,
              "model": str(self.model_path), "policy": s.policy, "budget": s.budget, "stopped": stopped,
              "stats": stats})


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, KvcliError) else f"internal error: {type(e).__name__}: {e}"


# ------------------------------------------------------------------------------ the driver
class Batch:
    """Lists, keys and reads the documents in order, skips those `results` holds, writes every line
    that comes back, and counts (the progress bar and the summary)."""

    def __init__(self, settings: Settings, paths: list[str], results: ResultsFile | None = None, *,
                 progress: bool = False, questions_for: dict[str, list[str]] | None = None):
        self.settings = settings
        self.paths = paths
        self.questions_for = questions_for or {}   # a manifest's questions of each document
        self.checked = check_settings(settings)   # (model path, compression): the local Worker takes them
        self.fingerprint = settings.fingerprint(self.checked[0])
        self.results = results      # set before running: opened once the settings are known to be good
        self.counts = {"answered": 0, "errors": 0, "skipped": 0, "prompt_tokens": 0, "generated_tokens": 0,
                       "document_reads": 0}
        self.t0 = time.perf_counter()
        self.ray_workers = None     # set by a run on Ray
        self.bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415
            n = sum(len(self.questions(p)) for p in paths)
            self.bar = tqdm(total=n, desc="batch", unit="answer" if n > len(paths) else "doc",
                            file=sys.stderr, dynamic_ncols=True)

    def jobs(self):
        """The documents still to answer, read one at a time as the workers ask for them; those that
        cannot be read get their error line here."""
        for path in self.paths:
            doc = read_job(path, self.fingerprint)
            qs = self.questions(path)
            for job in ([question_job(doc, q) for q in qs] if qs != [None] else [doc]):
                if job.key in self.results.done:
                    self.counts["skipped"] += 1
                    self._tick()
                elif job.error:
                    self.record(error_line(job, job.error, self.settings))
                else:
                    yield job

    def questions(self, path: str) -> list:
        """The questions asked of one document ([None]: the settings' one instruction)."""
        s = self.settings
        if not s.questions and not s.per_document:
            return [None]
        return s.questions + [q for q in self.questions_for.get(path, []) if q not in s.questions]

    def record(self, line: dict) -> None:
        self.results.write(line)
        self.results.done.add(line["key"])
        if line["error"] is None:
            self.counts["answered"] += 1
            self.counts["prompt_tokens"] += line["stats"]["prompt_tokens"]
            self.counts["generated_tokens"] += line["stats"]["generated_tokens"]
            self.counts["document_reads"] += line["stats"].get("document_reads", 1)
        else:
            self.counts["errors"] += 1
        self._tick()

    def _tick(self) -> None:
        if self.bar is not None:
            dt = max(time.perf_counter() - self.t0, 1e-9)
            c = self.counts
            self.bar.set_postfix_str(f"{c['prompt_tokens'] / dt:.0f} prompt + {c['generated_tokens'] / dt:.1f} "
                                     f"answer tok/s, {c['errors']} errors", refresh=False)
            self.bar.update(1)

    def notice(self, line: str) -> None:
        """A long read's notice (Worker.say): "[line]" on stderr, above the progress bar when there is one."""
        if self.bar is not None:
            self.bar.write(f"[{line}]", file=sys.stderr)
        else:
            print(f"[{line}]", file=sys.stderr, flush=True)

    def receive(self, item: dict) -> None:
        """What a Ray worker sent: a result line (`record`), or {"notice": line} (`notice`)."""
        if "notice" in item:
            self.notice(item["notice"])
        else:
            self.record(item)

    def run_local(self) -> None:
        worker = Worker(self.settings, self.checked, say=self.notice)
        try:
            worker.run(self.jobs(), self.record)
        finally:
            worker.close()

    def summary(self) -> dict:
        dt = time.perf_counter() - self.t0
        c = self.counts
        return {"kind": "batch", "out": self.results.path, "documents": len(self.paths),
                "questions": sum(len(self.questions(p)) for p in self.paths), **c,
                "elapsed_s": round(dt, 3), "docs_per_hour": round(c["answered"] / dt * 3600, 1) if dt > 0 else None,
                "ray_workers": self.ray_workers, "settings": asdict(self.settings)}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
