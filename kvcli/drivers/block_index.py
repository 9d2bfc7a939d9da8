"""A block index of a bounded store: which stored chunks a question needs, decided without streaming every chunk.

Bounded re-selection (kvcli/drivers/reselect_bounded.py) puts every stored chunk back for every question and scores it
with a probe prefill: a question costs a probe per chunk, a share of a re-read that grows with the document (128
probes at 128k tokens). The index makes a question's cost close to independent of the length:

    reading (once): after each chunk's prefill its K rows are cut into pages of PAGE tokens and the element-wise
        minimum and maximum of every page's keys are stored per (layer, KV head) (Quest, Tang et al. 2024: per-page
        key bounds), float16, one small file per chunk (6% of the chunk's state on qwen2.5-coder-0.5b at 16 tokens a
        page). The reading's last kept cache (the whole document read with each chunk scored by its own last window:
        a question-agnostic summary) is stored too.
    per question: the summary is restored and the question (the prompt's tokens after the stored document, at most
        QUESTION_TOKENS of them) prefilled after it with the queries of its last PROBE_ROWS tokens observed (post-RoPE;
        `query` observation), then rolled back: the question's queries, computed once, attending to a summary of the
        whole document and to the whole question (a probe of the prompt's last 32 tokens alone held the chat
        template's end and the question's last words, and its queries never saw the question's start). Only the
        middle half of the layers is scored (`layers`): on the corpus's tuning part their keys found a question's
        chunk more often than every layer's, and the second half's less (docs/results/real-text.md).
        Every page's upper bound on a query's logit (sum over dimensions of max(q_d min_d, q_d max_d): no key of the
        page scores more) is computed from the index alone and the chunk's best page per (layer, query head, query)
        taken; a chunk's score is how far it stands out in those rows (`chunk_scores`: each row's maxima
        standardised over the chunks, the excess over Z_CUT standard deviations summed), not its softmax share
        of them: rows that attend alike whatever the question (the template's tokens, the sink-like keys of
        some chunks) gave the same few chunks to every question.
    then (the second step): the page bounds' best CANDIDATES x `select` chunks have their real keys read from their
        files, one at a time, and are scored the same way with each row's largest real logit in place of its bound
        (`key_maxima`); their `select` best, with the first (the attention sink, the document's start) and the last
        (the document's end, joined to the prompt), are streamed, in document order, and re-selected exactly. The
        bounds alone ranked a planted fact's chunk as low as 19th of 131 at 131k tokens (budget 256), where its real
        keys ranked it 1st (benchmarks/book_select.py; docs/long-documents.md); on real text they miss more
        (benchmarks/index_recall.py), hence twice the candidates of the first form.

The queries are turned (RoPE) to the position `cap` + their offset, past every stored key (the stored chunks sit at
the positions bounded reading gave them, below budget + chunk), as they would be after a chunk in a re-selection.
Models whose RoPE kvcli cannot turn (`rope.refusal`) get no index: every chunk is streamed.
"""
from __future__ import annotations

import io
import math

import numpy as np

from kvcli.errors import KvcliError
from kvcli.engines import read_kv_layer, seq_positions
from kvcli.planning import rope as ropes

PAGE = 16          # tokens per page (Quest's page size)
CANDIDATES = 8     # chunks scored by their real keys per chunk streamed: the page bounds' best CANDIDATES x select
QUESTION_TOKENS = 256   # the most tokens of the question prefilled to compute its queries
PROBE_ROWS = 64    # the question's last tokens whose queries score the chunks
Z_CUT = 3.0        # a row counts for a chunk by how many standard deviations past this its logit stands out


def usable(info) -> str | None:
    """Why this model's stores get no block index (None when they do)."""
    return ropes.refusal(info)


def chunk_pages(session, seq: int, first_pos: int, n: int, page: int = PAGE) -> bytes:
    """The index entry of the chunk `seq` holds at positions [first_pos, first_pos + n): per (layer, KV head) each
    page's key minimum and maximum, [n_layer, n_head_kv, pages, head_dim] float16 each, as .npz bytes."""
    info = session.info
    pos = seq_positions(session, seq)
    order = np.argsort(pos, kind="stable")
    slots = order[(pos[order] >= first_pos) & (pos[order] < first_pos + n)]
    if slots.size != n:
        raise KvcliError(f"the chunk at position {first_pos}: {slots.size} cells held, {n} read")
    pages = -(-n // page)
    shape = (info.n_layer, info.n_head_kv, pages, info.head_dim)
    lo, hi = np.empty(shape, np.float16), np.empty(shape, np.float16)
    k = np.empty((info.n_head_kv, pos.size, info.head_dim), np.float32)
    v = np.empty_like(k)
    pad = pages * page - n
    for il in range(info.n_layer):
        read_kv_layer(session, seq, il, k, v)
        rows = k[:, slots]                                         # [n_head_kv, n, d]
        if pad:   # the last page repeats its last key: bounds of the keys there are
            rows = np.concatenate([rows, np.repeat(rows[:, -1:], pad, axis=1)], axis=1)
        rows = rows.reshape(info.n_head_kv, pages, page, info.head_dim)
        lo[il] = rows.min(axis=2)
        hi[il] = rows.max(axis=2)
    buf = io.BytesIO()
    np.savez(buf, lo=lo, hi=hi)
    return buf.getvalue()


def load_pages(data: bytes, info) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of an index entry, float32, checked against the model's shapes."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            lo, hi = z["lo"].astype(np.float32), z["hi"].astype(np.float32)
    except (ValueError, KeyError, OSError, EOFError) as e:
        raise KvcliError(f"a block index file is not readable ({e})") from None
    want = (info.n_layer, info.n_head_kv)
    if lo.shape != hi.shape or lo.ndim != 4 or lo.shape[:2] != want or lo.shape[3] != info.head_dim:
        raise KvcliError(f"a block index file has shape {list(lo.shape)}, this model's is {list(want)} x pages x "
                         f"{info.head_dim}")
    return lo, hi


def layers(n_layer: int) -> slice:
    """The layers whose keys the index scores: the middle half."""
    return slice(n_layer // 4, n_layer - n_layer // 4)


def question_tokens(prompt: list[int], split: int) -> list[int]:
    """The tokens of `prompt` after the stored document's `split` (the question, the chat template's end, in a
    conversation the turns before it), at most QUESTION_TOKENS, and PROBE_ROWS at least: what the index prefills."""
    return list(prompt[-max(min(len(prompt) - split, QUESTION_TOKENS), PROBE_ROWS):])


def question_queries(session, seq: int, probe: list[int], at: int, rows: int | None = None) -> np.ndarray:
    """The queries of the probe's last `rows` tokens (all by default), the probe prefilled after what `seq` holds and
    rolled back: [n_layer, n_head, rows, head_dim] float32, turned by RoPE so that the probe's first token sits at
    position `at` (past every stored key)."""
    rows = len(probe) if rows is None else min(rows, len(probe))
    obs = session.prefill(probe, seq=seq, observe=("query",), window=rows)
    session.rollback(seq, len(probe))
    q = np.asarray(obs.queries, np.float64)
    delta = float(at + len(probe) - rows - int(np.min(obs.query_positions)))
    ang = delta * obs.rope.freqs                                  # [d/2]: the same turn for every query
    return obs.rope.turn(q, np.cos(ang), np.sin(ang)).astype(np.float32)


def chunk_maxima(queries: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[n_layer, n_head, w]: per (layer, query head, query) the largest upper bound of a logit over the chunk's pages
    (query head h reads KV head h // group)."""
    n_layer, n_head, w, d = queries.shape
    group = n_head // lo.shape[1]
    qp = np.maximum(queries, 0.0).reshape(n_layer, lo.shape[1], group * w, d)
    qn = np.minimum(queries, 0.0).reshape(n_layer, lo.shape[1], group * w, d)
    bound = qp @ hi.transpose(0, 1, 3, 2) + qn @ lo.transpose(0, 1, 3, 2)     # [L, H_kv, group * w, pages]
    return bound.max(axis=3).reshape(n_layer, n_head, w) / math.sqrt(d)


def key_maxima(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[n_layer, n_head, w]: per (layer, query head, query) the largest real logit over a chunk's keys
    ([n_layer, n_head_kv, cells, head_dim], kvcli.native.state.chunk_keys): what chunk_maxima bounds."""
    n_layer, n_head, w, d = queries.shape
    n_kv = keys.shape[1]
    if keys.shape[0] != n_layer or keys.shape[3] != d or n_head % n_kv:
        raise KvcliError(f"a chunk's keys {list(keys.shape)} do not match the question's queries {list(queries.shape)}")
    q = queries.reshape(n_layer, n_kv, (n_head // n_kv) * w, d)
    out = np.empty(q.shape[:3], np.float32)
    for il in range(n_layer):   # a layer at a time: the logits of all layers at once would be ~44 MB on qwen
        # the keys transposed into a contiguous array: numpy's batched matmul of a transposed view is slower
        out[il] = (q[il] @ np.ascontiguousarray(keys[il].transpose(0, 2, 1))).max(axis=2)
    return out.reshape(n_layer, n_head, w) / math.sqrt(d)


def chunk_scores(maxima: list[np.ndarray]) -> np.ndarray:
    """[chunks]: how far each chunk stands out in the question's (layer, query head, query) rows: each row's
    maxima standardised over the chunks (z), the excess of z over `z_cut` summed. A chunk that every row finds about
    as well as the others scores (next to) 0; one that a few rows find far better than the rest (the passage the
    question quotes or names) scores high. A softmax share summed over the rows (the index's first scoring) let rows
    that attend alike whatever the question choose the same chunks for every question (benchmarks/index_recall.py).
    Ties (no chunk standing out) go to the chunk whose rows are the higher on average."""
    m = np.stack(maxima).reshape(len(maxima), -1).astype(np.float64)      # [chunks, rows]
    z = (m - m.mean(axis=0)) / (m.std(axis=0) + 1e-6)
    return np.maximum(z - z_cut(len(maxima)), 0.0).sum(axis=1) + 1e-6 * z.mean(axis=1)


def z_cut(chunks: int) -> float:
    """Z_CUT, or where fewer chunks are compared than let one stand out that far (among n values none is more than
    (n - 1) / sqrt(n) standard deviations above their mean: 1.8 among 5), 0.6 of that most."""
    return min(Z_CUT, 0.6 * (chunks - 1) / math.sqrt(max(chunks, 1)))


def choose(scores: np.ndarray, select: int) -> list[int]:
    """The indices (ascending) of the `select` best-scored of the chunks `scores` ranks."""
    best = np.argsort(-scores, kind="stable")[:select]
    return sorted(int(i) for i in best)


def default_select(budget: int, chunk: int) -> int:
    """Chunks streamed per question besides the first and the last: twice the budget's worth of tokens, and 6 at
    least (docs/long-documents.md, "A book": the chunk holding a planted fact ranked 1st to 6th of 27 at 29k tokens)."""
    return max(6, -(-2 * budget // chunk))
