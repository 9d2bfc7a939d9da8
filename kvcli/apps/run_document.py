"""Document + instruction -> (compressed) cache -> streamed answer, with stats from the cache.

The CLI commands are thin layers over `run_document`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from kvcli import doc_formats
from kvcli.citations import Citations, cite
from kvcli.doc_formats import Document
from kvcli.drivers import compress
from kvcli.drivers.chunked import (FollowOrigins, keeps_positions, plan_chunking, read_in_float16_note,
                                   reading_cache_type)
from kvcli.drivers.reselect_bounded import Origins
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.generate import Generation, Sampler, generate
from kvcli.planning.planner import Compression
from kvcli.templating import build_prompt


@dataclass
class RunResult:
    answer: str
    model: str
    policy: str
    budget: int | None
    stats: dict = field(default_factory=dict)
    stopped: str = "eog"
    citations: Citations | None = None   # where the answer came from (kvcli/citations.py), when asked

    def as_json(self) -> dict:
        out = {"answer": self.answer, "model": self.model, "policy": self.policy, "budget": self.budget,
               "stopped": self.stopped, "stats": self.stats}
        if self.citations is not None:
            out["citations"] = self.citations.as_json()
            if self.citations.note:
                out["citations_note"] = self.citations.note
        return out


class Progress:
    """A tqdm bar over the prompt on stderr (only on a terminal, unless forced): tokens/s and, while a long
    document is read in chunks, the cells the cache holds."""

    def __init__(self, total: int, enabled: bool, desc: str = "prefill"):
        self.bar = None
        if enabled and total > 0:
            from tqdm import tqdm  # noqa: PLC0415
            self.bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    __call__ = update   # a Progress is the `progress` callable the readers take (and they find its skip)

    def skip(self, n: int) -> None:
        """`n` tokens done before this bar started (a resumed read): shown as done, left out of the rate and the
        time left."""
        if self.bar is not None:
            self.bar.n += n
            self.bar.initial += n
            self.bar.refresh()

    def cache(self, cells: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"cache {cells} cells", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(total: int, enabled: bool, desc: str = "prefill"):
    """(update callable or None, closer): the bar of `Progress` for callers that only count tokens."""
    p = Progress(total, enabled, desc)
    return (p.update if p.bar is not None else None), p.close


def check_instruction(session, instruction: str, system: str | None, max_cache: int | None = None) -> None:
    """Refuse at once an instruction that alone does not fit the context: a document is read in chunks, the
    instruction cannot be (it is the question every chunk is scored and answered with)."""
    limit = max_cache or session.n_ctx_train
    n = len(session.tokenize(build_prompt(session, None, instruction, system)))
    if n >= limit:
        raise KvcliError(f"the instruction is {n} tokens (templated), more than "
                         f"{f'--max-cache ({limit} cells)' if max_cache else f'the model context ({limit} tokens)'}: "
                         "put long text in --doc")


def run_document(session, document: str | Document | None, instruction: str, *, compression: Compression,
                 max_tokens: int = 256, sampler: Sampler | None = None,
                 system: str | None = None, on_text=None, show_progress: bool = False, chunk: int | None = None,
                 max_cache: int | None = None, chunk_scoring: str = "question", template: bool = True,
                 cite_answer: bool = False, announce: bool = False) -> RunResult:
    """Prefill the templated prompt, compress it with `compression` (the kvcli.planning.planner.Compression the
    command resolved: policy, budget and arguments), and generate the answer.

    A prompt longer than the model's context (or than `max_cache` cells) is read in chunks and compressed
    after each (kvcli/drivers/chunked.py); `chunk` = 0 turns that off, N sets the chunk length; `chunk_scoring` picks
    the
    queries that score each chunk. `cite_answer`: name the passages of the document the answer came from
    (kvcli/citations.py; `document` may be a Document, whose pages and sections name them; a read in chunks follows
    its kept entries to their prompt tokens for them, FollowOrigins).
    `announce`: a read estimated to take doc_formats.READ_NOTICE_S or longer says so first, on stderr (kvcli run)."""
    policy, budget = compression.policy, compression.budget
    source = document
    document = document.text if isinstance(document, Document) else document
    prompt = build_prompt(session, document, instruction, system, template)
    tokens = session.tokenize(prompt)
    check_instruction(session, instruction, system, max_cache)
    chunking = plan_chunking(len(tokens), max_tokens, session.n_ctx_train, compression, chunk, max_cache,
                             cell_bytes=session.bytes_per_cell())
    asked = session.cache_type   # None: the reference engine holds float32
    reading = reading_cache_type(session.info, asked) if chunking.chunk else asked
    if reading != asked:
        session.use_cache_type(reading)   # frees the (empty) context; made again below
    if session.ctx is None:
        session.create_context(chunking.n_ctx)
    # a re-indexed read's kept entries lose their place in the document: followed for the citations
    follow = FollowOrigins(session, 0, Origins.start(session.info, tokens)) \
        if cite_answer and source is not None and chunking.chunk and not keeps_positions(session.info) else None
    key = doc_formats.announce_read(session, tokens, "chunked" if chunking.chunk else "prefill",
                                    f"reading it in chunks of {chunking.chunk}" if chunking.chunk else
                                    "reading it in one prefill", probe_seq=0) if announce else None
    progress = Progress(len(tokens), show_progress and len(tokens) > session.n_batch)
    t0 = time.perf_counter()
    try:
        report = compress.prefill_and_compress(session, tokens, compression, seq=0, progress=progress.update,
                                               instruction=instruction, chunk=chunking.chunk, cap=chunking.cap,
                                               on_cache=progress.cache, scoring=chunk_scoring, on_step=follow)
    finally:
        progress.close()
    if key is not None:
        doc_formats.record_read_speed(key, len(tokens), time.perf_counter() - t0)
    origins = follow.done() if follow is not None else None
    gen: Generation = generate(session, max_tokens, sampler, seq=0, on_text=on_text)
    citations = None
    if cite_answer and source is not None and gen.stopped != "interrupted":
        citations = cite(session, 0, gen.tokens, prompt_text=prompt, prompt_tokens=tokens, document=source,
                         question=instruction, origins=origins)
    stats = {"prompt_tokens": len(tokens), "generated_tokens": len(gen.tokens)}
    stats.update(session.stats(0))
    stats.update(report.as_stats())
    stats.update({"prefill_s": round(report.prefill_s, 4), "compress_s": round(report.compress_s, 4),
                  "decode_s": round(gen.decode_s, 4),
                  "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None})
    stats["peak_rss_bytes"] = peak_rss_bytes()   # the process's peak, from the OS (VmHWM)
    notes = [report.note] if report.note else []
    if asked is not None and session.cache_type != asked:
        stats["cache_type"] = session.cache_type
        notes.append(read_in_float16_note(asked))
    if notes:
        stats["note"] = "; ".join(notes)
    if report.params and "task" in report.params:
        stats["task"] = report.params["task"]  # what a task=auto (resolve_instruction) picked
    if citations is not None:
        stats["cite_s"] = round(citations.seconds, 4)
    return RunResult(answer=gen.text, model=str(session.model_path), policy=policy, budget=budget, stats=stats,
                     stopped=gen.stopped, citations=citations)
