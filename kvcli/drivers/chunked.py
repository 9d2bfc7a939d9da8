"""Documents longer than the context: chunked prefill, compression after each chunk, re-indexed positions.

The prompt is read in chunks. After each chunk the sequence (the entries kept so far + the new
chunk) is observed, planned with the chosen policy to `budget` and compacted with re-indexing: the
k kept entries of every (layer, KV head) get the positions B-k..B-1 again (B: the widest one's count;
right-aligned, so the latest entry of every layer and head is next to the next token; K rows re-rotated
by the engine), so positions never grow past budget + chunk and the model never sees a position beyond
what it was trained on. The last chunk holds the question, so the last compression is the usual
one, driven by the question's window.

Models with sliding-window layers (gemma2/gemma3) are read in chunks WITHOUT re-indexing: llama.cpp's window
cache keeps the sliding layers' positions (re-indexing the global layers would leave them behind, and shifting
the window cache back could not keep positions >= 0 once the budget is below the window), so every compaction
keeps the entries' own positions, as the one-go read does, and the document must fit the model's trained
context (`keeps_positions`). The memory bound holds all the same: the global layers' cache never holds more than
budget + chunk cells, and llama.cpp bounds the window cache by the window (it reuses the cells of positions no
query can see any more).

Which queries score a chunk (`scoring`), for the policies that observe a window:
- "question" (default): the prompt's last tokens (`probe_length`: the window, and at least PROBE_MIN_TOKENS where
  the chunk is 256 tokens or more: the question and the assistant turn's start, in the question-aware layout) are
  prefilled after the chunk as a probe, its
  last window observed, and rolled back before the plan is applied: every chunk is scored by the queries the
  final compression will use, as FINCH (Corallo & Papotti 2024; kvpress's FinchPress) does. It costs a
  probe-length prefill per chunk, and its cells come out of the chunk: a chunk before the last reads that
  many tokens fewer, so the cache still never holds more than budget + chunk.
- "chunk": the chunk's own last window (plain SnapKV applied chunk by chunk). On a document that
  does not end in its question this is the only meaningful choice; with a question at the end it
  lets entries the question needs go before the question arrives (docs/long-documents.md).
Column-sum policies and those that observe nothing are not probed: their scores are not a window's. Nor is a policy
that observes queries (question-agnostic): each chunk is scored by the statistics of its own last `window` queries
(all of a shorter chunk's) and the rotation of the positions after it, the most recent queries as in one prefill.

A policy with a second pass (`PolicySpec.second_pass`, kvcli.policies.base.SecondPass) is scored by that pass run
chunk by chunk (`start`/`end`, `bounded`): after a chunk is prefilled the pass scores every held slot (the kept
entries and the chunk), then is rolled back; a kept entry's score is the one it carries from earlier chunks combined
with the new chunk's (`SecondPass.merge`, the carried scores moved with `_carry`). Reported as the pass's
chunk_scoring (`SecondPass.scoring`); its seconds are `reconstruct_s` (part of compress_s).

Memory bound: the cache never holds more than `cap` = budget + chunk cells (+ the answer). A
policy whose widest layer keeps more than `budget` entries (a layer schedule: `PolicySpec.widest`)
gets shorter chunks, never a bigger cache. A second pass adds its own cells while it runs: at most
budget + chunk + `SecondPass.held`; the report's `cap` (stats `cache_cap`) is that bound, and the context is sized
for it (`plan_chunking`, `SecondPass.room`).

What each policy carries across chunks is stated in `kvcli.policies.notes.chunked_note` (and `kvcli policies
--explain`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvcli.config import env_bytes
from kvcli.errors import KvcliError
from kvcli.planning.planner import CompressReport, Compression, make_plan, session_cells, shape_observation
from kvcli.session import Session

DEFAULT_CHUNK = 1024     # tokens per chunk when chunking turns on by itself
# Bounded reading turns on by itself only when the prompt's full cache would pass this many bytes: below it
# the memory saved is small next to the weights and the runtime, and one prefill keeps more (a short document
# read in chunks is scored chunk by chunk; docs/results/memory.md "What bounded reading costs"). KVCLI_BOUNDED_ABOVE_MB
# moves it (0: bound every prompt longer than budget + chunk).
BOUNDED_ABOVE_BYTES = 64 << 20


def bounded_above_bytes() -> int:
    return env_bytes("KVCLI_BOUNDED_ABOVE_MB", BOUNDED_ABOVE_BYTES)

MIN_ROOM = 64            # cells a chunked prompt leaves at least for the answer
MIN_CHUNK = 64           # fewer free cells than this after a compaction: the budget leaves no room to read on
CTX_PAD = 256
TURN_ROOM = 2048         # cells (and positions) a chat keeps free for the conversation after the document
SCORINGS = ("question", "chunk")


def check_chunk(chunk: int) -> None:
    """An asked chunk of fewer than MIN_CHUNK tokens refused, in its one message (plan_chunking, kvcli check and
    kvcli eval alike; plan_chunking's --chunk 0, chunked prefill off, is taken before)."""
    if chunk < MIN_CHUNK:
        raise KvcliError(f"--chunk must be at least {MIN_CHUNK} tokens (got {chunk})")


def check_fits(budget: int, chunk: int, after: int, limit: int, where: str, extra_name: str | None = None) -> None:
    """The budget, one chunk and the `after` cells that follow it (the answer's, or a second pass's over the chunk)
    refused where they exceed `limit` cells (`where` names them), in their one message (plan_chunking and kvcli eval
    alike)."""
    if budget + chunk + after > limit:
        raise KvcliError(f"budget {budget} + chunk {chunk} + {after} cells for the answer"
                         f"{f' and the {extra_name} over a chunk' if extra_name else ''} do not fit {where}")


@dataclass(frozen=True)
class Chunking:
    """How a prompt will be prefilled: in chunks of `chunk` tokens (None: in one go) into `n_ctx` cells."""

    chunk: int | None
    n_ctx: int
    cap: int | None = None   # most cells the prompt may occupy while it is read (budget + chunk)
    why: str = ""


def pad_cells(n: int) -> int:
    """n cells rounded up to the context's granularity."""
    return -(-n // CTX_PAD) * CTX_PAD


def plan_chunking(n_prompt: int, reserve: int, n_ctx_train: int, compression: Compression,
                  chunk: int | None = None, max_cache: int | None = None, *, cell_bytes: int,
                  limit_name: str | None = None) -> Chunking:
    """Decide chunked or not, and the context size.

    `compression`: the command's (kvcli.planning.planner.Compression), resolved already: its policy and budget
    (kvcli.planning.planner.resolve refuses a compressing policy without a budget, in its one message).
    `reserve`: cells kept free for what follows the prompt (the answer, a conversation).
    `chunk`: None = automatic, 0 = off, N = chunks of N tokens. `max_cache`: most cells the cache may hold.
    `cell_bytes`: K + V bytes of one uncompressed cell (the session's bytes_per_cell()). `limit_name`: how
    the errors name `n_ctx_train` when it stands for another limit (kvcli batch: the cells one document may use).
    Automatic (bounded reading by default): a compressing policy reads in chunks of DEFAULT_CHUNK whenever
    the prompt is longer than budget + DEFAULT_CHUNK and its full cache would take more than
    BOUNDED_ABOVE_BYTES, so the cache never holds more than budget + DEFAULT_CHUNK cells, whatever the
    document's length; and any policy reads in chunks when the prompt does not fit the model's context or
    `max_cache`. Any other prompt is read in one go.
    """
    if chunk is not None and chunk < 0:
        raise KvcliError(f"--chunk must be >= 0 (got {chunk}); 0 turns chunked prefill off")
    if max_cache is not None:
        if max_cache < 1:
            raise KvcliError(f"--max-cache must be >= 1 (got {max_cache})")
        if max_cache > n_ctx_train:
            raise KvcliError(f"--max-cache {max_cache} is larger than the model's context ({n_ctx_train} tokens)")
    spec, budget = compression.spec, compression.budget
    policy = spec.name
    limit = max_cache or n_ctx_train
    where = f"--max-cache ({max_cache} cells)" if max_cache else \
        limit_name or f"the model's context ({n_ctx_train} tokens)"
    if policy == "full":
        if chunk:
            raise KvcliError("chunked prefill compresses after every chunk: choose a compressing policy and --budget")
        if n_prompt >= limit:
            raise KvcliError(f"the prompt is {n_prompt} tokens, more than {where}: choose a compressing policy "
                             "and --budget to read it in chunks")
        return Chunking(None, min(pad_cells(n_prompt + reserve), limit))
    fits = n_prompt < limit   # as before chunking existed: the answer gets what room is left
    asked = reserve
    extra = spec.second_pass   # a second pass needs room after the prompt (its defaults: SecondPass.room)
    defaults = spec.defaults() if extra is not None else None
    if extra is not None:
        reserve = max(reserve, extra.room(n_prompt, defaults))
    # bounded reading by default; not for the question-agnostic policies, whose quality figures (docs/results.md)
    # are their one-prefill scores': they read in chunks when asked (--chunk N, --max-cache) or when the prompt does
    # not fit the context
    bounded = (n_prompt > budget + DEFAULT_CHUNK
               and n_prompt * cell_bytes > bounded_above_bytes() and not spec.agnostic)
    if chunk == 0 or (chunk is None and fits and not bounded):
        if not fits:
            raise KvcliError(f"the prompt is {n_prompt} tokens, more than {where}: drop --chunk 0 to read it "
                             "in chunks")
        return Chunking(None, min(pad_cells(n_prompt + reserve), limit))
    room = min(asked, MIN_ROOM)   # the least room left for the answer / conversation

    def after(c: int) -> int:   # cells after budget + chunk: the answer's, or a second pass's over the chunk (more)
        return max(room, extra.room(c, defaults)) if extra is not None else room
    if chunk is None:
        chunk = min((max_cache - budget) if max_cache else DEFAULT_CHUNK + after(DEFAULT_CHUNK),
                    n_ctx_train - budget)
        chunk = _fit_chunk(chunk, after)
        if chunk < MIN_CHUNK:
            raise KvcliError(f"{where} leaves {max(chunk, 0)} cells to read the document through "
                             f"(budget {budget} + {after(max(chunk, 0))} for the answer"
                             f"{f' and the {extra.name}' if extra is not None else ''}): lower --budget")
    check_chunk(chunk)
    check_fits(budget, chunk, after(chunk), limit, where, extra.name if extra is not None else None)
    if chunk >= n_prompt:  # one chunk: the plain prefill, in a context sized for it
        return Chunking(None, min(pad_cells(n_prompt + reserve), limit))
    if extra is not None:   # the pass runs over one chunk, not the prompt: the context holds budget + chunk + it
        reserve = max(asked, extra.room(chunk, defaults))
    n_ctx = max_cache if max_cache else min(pad_cells(budget + chunk + reserve), n_ctx_train)
    why = "the prompt does not fit the context" if not fits else "bounded reading (the default with a budget)" \
        if bounded and not max_cache else f"--chunk {chunk}"
    return Chunking(chunk, n_ctx, cap=budget + chunk, why=why)


def _fit_chunk(space: int, after) -> int:
    """The longest chunk c with c + after(c) <= space (after(c) grows by at most c: a second pass over the chunk)."""
    lo, hi = 0, max(space, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if mid + after(mid) <= space else (lo, mid - 1)
    return lo if lo + after(lo) <= space else space - after(0)


@dataclass
class ChunkStep:
    start: int             # first prompt token of the chunk
    tokens: int            # tokens in the chunk
    cells_before: int      # cells held when the chunk had been prefilled (before compaction)
    cells_after: int       # cells after compaction


def chunk_sizes(n: int, cap: int, cells: int, chunk: int, min_tail: int) -> int:
    """Tokens of the next chunk: up to `chunk`, never past `cap` cells, leaving the last chunk at least
    `min_tail` tokens (it holds the question and the final observation window)."""
    take = min(chunk, cap - cells, n)
    if 0 < n - take < min_tail:
        take = max(n - min_tail, 1)
    return take


def next_chunk(left: int, cap: int, cells: int, chunk: int, window: int, probe: int, policy: str,
               budget: int) -> tuple[int, int]:
    """(tokens, spare) of the next chunk of a prompt with `left` tokens to read while the sequence holds
    `cells`: a chunk before the last leaves `probe` cells of the cap (`spare`) to the question probe. A
    chunk too short to read on (the widest layer took the room) is refused."""
    take = chunk_sizes(left, cap, cells, chunk, max(window, 1))
    spare = 0
    if probe and take < left:
        spare = probe
        take = chunk_sizes(left, cap - spare, cells, chunk, max(window, 1))
    if take < 1 or (take + spare < MIN_CHUNK and take < left):
        raise KvcliError(f"policy '{policy}' keeps {cells} cells in its widest layer at budget {budget}, "
                         f"leaving {cap - cells} of --max-cache/chunk room to read on: lower --budget or "
                         "raise --chunk / --max-cache")
    return take, spare


def check_room(spec, params: dict, n_layer: int, n_tokens: int, budget: int, chunk: int, cap: int, window: int,
               probe: int, cells: int = 0) -> list[tuple[int, int]] | None:
    """Replay the reading of `read_in_chunks` on the policy's layer schedule (`PolicySpec.widest`), before any
    prefill: a policy whose widest layer leaves no room to read on is refused here, not after minutes of
    prefill. Returns the (tokens, cells after) of every chunk (the last one's cells None where the scores decide
    them: nothing is read after it), or None where the scores decide a width before the last chunk (the
    reading then checks each chunk as it goes)."""
    if spec.widest is None:
        return None
    steps, pos = [], 0
    while pos < n_tokens:
        take, _ = next_chunk(n_tokens - pos, cap, cells, chunk, window, probe, spec.name, budget)
        pos += take
        cells += take
        if spec.compresses(cells, budget):
            cells = spec.widest(params, n_layer, cells, budget)
            if cells is None and pos < n_tokens:
                return None
        steps.append((take, cells))
    return steps


def read_in_chunks(session: Session, tokens: list[int], cfg: Compression, chunk: int, *, cap: int | None = None,
                   seq: int = 0, progress=None, planner: str | None = None, on_step=None, on_cache=None,
                   scoring: str = "question", on_prefilled=None) -> CompressReport:
    """The chunked form of the driver (kvcli.drivers.compress.prefill_and_compress, the one caller): read `tokens` into
    `seq` in chunks, compressing to `cfg.budget` after each one (see the module doc).

    `scoring`: "question" scores every chunk with the prompt's last window (a probe prefilled and rolled
    back), "chunk" with the chunk's own last window. `on_step(step, obs, plan)` is called after each
    planning step (kvcli check compares the planners there); `on_cache(cells)` after each compaction
    (progress display); `on_prefilled(first_pos, n)` after each chunk's prefill, before its compaction, while
    the sequence holds the chunk's n entries from position first_pos (bounded re-selection stores them). Returns a
    kvcli.planning.planner.CompressReport with `chunks`, `steps` and `peak_cells`.
    """
    if scoring not in SCORINGS:
        raise KvcliError(f"unknown chunk scoring '{scoring}' (choose from {', '.join(SCORINGS)})")
    reindex = not keeps_positions(session.info)
    held = session.cache_type
    if reading_cache_type(session.info, held) != held:   # the callers switch to float16 before they read
        raise KvcliError(f"{requantises(session.cache_type)}: read it with --cache-type f16")
    first_pos = session.seqs[seq].next_pos if seq in session.seqs else 0
    if not reindex and first_pos + len(tokens) >= session.n_ctx_train:
        raise KvcliError(f"the prompt is {len(tokens)} tokens, more than the model's context ({session.n_ctx_train} "
                         f"tokens) allows: a model with sliding-window layers ({session.info.architecture}) is read "
                         "in chunks without re-indexing its positions")
    policy, budget, spec, params = cfg.policy, cfg.budget, cfg.spec, cfg.params
    cap = cap or budget + chunk
    _, window = spec.observe(params)
    extra = spec.second_pass             # a second pass after every chunk (see the module doc)
    observe = spec.prefill_kinds(params)   # the second pass's kind comes from the pass, not the chunk's prefill
    # the last chunk holds at least `tail` tokens: a window policy's whole window; for a policy observing queries,
    # whose window is a most (the statistics of the chunk's last `window` queries, all of a shorter chunk's), at most a
    # quarter of a chunk, so that a window longer than the chunk leaves the chunks their length
    tail = window
    if "query" in observe:
        tail = min(window, chunk // 4)
    elif window > chunk:
        raise KvcliError(f"policy '{policy}': its observation window ({window}) is longer than --chunk {chunk}")
    probe = question_probe(tokens, window, chunk) if scoring == "question" and "window" in observe else []
    chunk_observe = tuple(k for k in observe if k != "window") if probe else observe
    carry_colsum = "colsum" in observe
    i = session.info
    group = i.n_head // i.n_head_kv
    carried = None                      # [n_layer, n_head, cells] accumulated column sums of held slots
    maxima = None                       # [n_layer, n_head, cells] the held slots' second-pass scores
    report_cap, recon_s = cap, None
    if extra is not None:
        report_cap = cap + extra.held(session, params, chunk)
        recon_s = 0.0
    prefill_s = compress_s = 0.0
    steps: list[ChunkStep] = []
    plan = None
    pos, cells, peak = 0, (session_cells(session, seq) if seq in session.seqs else 0), 0
    check_room(spec, params, i.n_layer, len(tokens), budget, chunk, cap, tail, len(probe), cells)
    while pos < len(tokens):
        take, _ = next_chunk(len(tokens) - pos, cap, cells, chunk, tail, len(probe), policy, budget)
        piece = tokens[pos: pos + take]
        last = pos + take == len(tokens)
        t1 = time.perf_counter()
        first_pos = session.seq(seq).next_pos
        obs = session.prefill(piece, seq=seq, observe=observe if last else chunk_observe, window=min(window, take),
                              progress=progress)
        before = session_cells(session, seq)
        probed = bool(probe) and not last
        if probed:
            obs = probe_window(session, seq, probe, obs, window)
        prefill_s += time.perf_counter() - t1
        if on_prefilled is not None:
            on_prefilled(first_pos, take)
        peak = max(peak, before + (len(probe) if probed else 0))   # the probe's cells while it was held
        if obs is None:  # a policy that observes nothing plans from the shapes alone
            obs = shape_observation(i, before)
        if carry_colsum and carried is not None:
            obs.colsum = obs.colsum.copy()
            obs.colsum[:, :, :carried.shape[2]] += carried
        t2 = time.perf_counter()
        if extra is not None:   # the chunk's second pass scores every held slot, merged with what kept ones carry
            r = extra.run(session, tokens, seq, params, start=pos, end=pos + take, restore_logits=last, bounded=True)
            recon_s += r.seconds
            peak = max(peak, before + r.longest)
            maxima = r.scores if maxima is None else extra.merge(r.scores, maxima)
            setattr(obs, extra.kind, maxima)
        if spec.compresses(obs.n, budget):
            plan = make_plan(spec, params, budget, obs, planner or session.engine)
            if on_step is not None:
                on_step(len(steps), obs, plan)
            session.apply_plan(plan, seq=seq, reindex=reindex)
            if carry_colsum:
                carried = _carry(obs.colsum, plan, group, reindex)
            if extra is not None:
                maxima = _carry(maxima, plan, group, reindex)
        compress_s += time.perf_counter() - t2
        cells = session_cells(session, seq)
        steps.append(ChunkStep(pos, take, before, cells))
        if on_cache is not None:
            on_cache(cells)
        pos += take
    return CompressReport(policy, budget, len(tokens), prefill_s, compress_s, plan, params=params, chunk=chunk,
                          cap=report_cap, steps=steps, peak_cells=peak,
                          scoring=extra.scoring if extra is not None else scoring if probe else "chunk",
                          reconstruct_s=recon_s)


class FollowOrigins:
    """The prompt token each entry of a chunked read holds, followed through the read (`kvcli run --cite` of a
    document read in chunks): a re-indexing compaction gives the kept entries new positions, so the sequence alone no
    longer knows their place in the document (kvcli/citations.py). `origins`: an empty reselect_bounded.Origins of the
    prompt's tokens, which chat's bounded form follows its re-selections with. Pass this as read_in_chunks's
    `on_step` (called before each compaction, while the sequence holds the entries kept so far and the chunks read
    since, the observation's `positions` those of the plan's slots), then call `done()` after the read."""

    def __init__(self, session: Session, seq: int, origins, on_step=None):
        self.session, self.seq, self.origins, self.on_step = session, seq, origins, on_step
        self.read = 0    # prompt tokens placed so far

    def _place(self) -> None:
        """The tokens read since the last call hold the positions after the kept entries, in order."""
        width = self.origins.of.shape[2]
        n = self.session.seq(self.seq).next_pos - width
        if n > 0:
            self.origins.append(width, self.read, n)
            self.read += n

    def __call__(self, step: int, obs, plan) -> None:
        self._place()
        self.origins.compact(np.asarray(obs.positions), plan)
        if self.on_step is not None:
            self.on_step(step, obs, plan)

    def done(self):
        """The origins once the whole prompt is read (refused where the positions did not add up to the prompt)."""
        self._place()
        if self.read != len(self.origins.tokens):
            raise KvcliError(f"following the chunked read's entries: {self.read} positions for a prompt of "
                             f"{len(self.origins.tokens)} tokens")
        return self.origins


# A question probe holds at least this many of the prompt's last tokens, of which the policy's `window` last are
# observed. A policy's window alone (8 tokens for several policies) is the chat
# template's closing tokens, and prefilled after a chunk without the question before them it scores the chunk for
# no question at all (bounded re-selection, 8k, 24 questions at budget 256: two 8-token-window policies answered
# 17% and 33% against 96% exact; with this probe 88% and 79%: docs/results/chat-and-reselection.md, "Exact against
# bounded re-selection"). In a one-go
# read the window's queries come after
# the whole question; 32 tokens hold a short question and cost a 32-token prefill per chunk. Beyond the window the
# probe takes at most an eighth of a chunk, so that a small --chunk keeps its room to read on.
PROBE_MIN_TOKENS = 32


def probe_length(window: int, chunk: int) -> int:
    return max(window, min(PROBE_MIN_TOKENS, chunk // 8))


def question_probe(tokens: list[int], window: int, chunk: int) -> list[int]:
    """The prompt's last `probe_length` tokens: what is prefilled after a chunk to score it."""
    return list(tokens[-probe_length(window, chunk):])


def probe_window(session: Session, seq: int, probe: list[int], obs, window: int):
    """Prefill `probe` after what `seq` holds, observe its last `window` queries, roll it back; return `obs` (the
    chunk's own observation of the other kinds, or None) with the probe's window sums over the slots held before
    it (its own columns dropped: they are gone once it is rolled back)."""
    held = session.seq(seq).next_pos                 # positions >= held are the probe's
    pobs = session.prefill(probe, seq=seq, observe=("window",), window=min(window, len(probe)))
    session.rollback(seq, len(probe))
    keep = np.flatnonzero(pobs.positions < held)
    sums = pobs.window_sums[..., keep]               # [1, n_layer, n_head, held slots]
    if obs is None:
        obs = pobs
        obs.positions = pobs.positions[keep]
        obs.n = keep.size
    elif obs.n != keep.size:
        raise KvcliError(f"the probe saw {keep.size} held slots, the chunk's observation {obs.n}")
    obs.window_sums, obs.windows = sums, pobs.windows
    obs.validate()
    return obs


def requantises(cache_type: str) -> str | None:
    """Why bounded reading cannot hold its cells in a cache of this type (None where it can): it re-indexes the
    entries it carries at every chunk, and llama.cpp turns a quantised K by dequantising, turning and quantising it
    again, so a kept key is re-quantised at every chunk (benchmarks/requantise_drift.py: a q8_0 K 0.46% off after 2
    re-indexings, 2.0% after 40; a 31k-token book read in a q8_0 cache answered 1 of 6 where float16 answered 6)."""
    if cache_type in ("f32", "f16", "bf16"):
        return None
    return f"bounded reading in a {cache_type} cache would quantise its kept keys again at every chunk"


def reading_cache_type(info, asked: str | None) -> str | None:
    """The cache type bounded reading holds its budget + chunk cells in when `asked` (--cache-type; None: the
    reference engine's float32) is asked for: that one, or float16 where it would be re-quantised at every chunk
    (a quantised type on a model whose positions are re-indexed). The cache is budget + a chunk of cells either
    way: after a read at budget 1024 qwen2.5-coder-0.5b holds 12.8 MB in float16, 6.9 MB in q8_0 (kv_bytes)."""
    if asked is None or keeps_positions(info) or requantises(asked) is None:
        return asked
    return "f16"


def read_in_float16_note(asked: str) -> str:
    return (f"read in a float16 cache, not {asked}: bounded reading re-indexes the entries it keeps at every chunk, "
            f"which would quantise a {asked} cache's keys again each time")


def keeps_positions(info) -> bool:
    """Whether chunked reading keeps the entries' positions (no re-indexing): models with sliding-window layers,
    whose window cache llama.cpp keeps at the document's own positions (see the module doc)."""
    return bool(info.sliding_layers)


def _carry(colsum: np.ndarray, plan, group: int, reindexed: bool) -> np.ndarray:
    """The accumulated column sums of the entries the plan kept, in their new slots (Plan.first_slot: right-aligned
    after a re-indexing compaction, from slot 0 after one without; query head q reads the entries of KV head
    q // group; the other slots carry 0: they are dead)."""
    n_layer, n_head = colsum.shape[:2]
    out = np.zeros((n_layer, n_head, plan.max_kept), dtype=np.float32)
    for l in range(n_layer):
        for q in range(n_head):
            kept = plan.kept(l, q // group)
            start = plan.first_slot(l, q // group, reindexed)
            out[l, q, start: start + kept.size] = colsum[l, q, kept]
    return out
