"""kvzip's context reconstruction pass (Kim et al., NeurIPS 2025; kvpress KVzipPress), for either engine: the policy's
`second_pass` hook (kvcli.policies.base.SecondPass), which the drivers call without knowing the policy.

After the prompt has been prefilled into a sequence, the model is asked to repeat it and is fed the prompt again
(teacher forcing), `repeat_chunk` tokens per pass: pass i prefills, after the prompt,

    pass 0:   tokens(REPEAT_FIRST)                                + prompt[0 : c]
    pass i:   tokens(REPEAT_NEXT) + prompt[a - REPEAT_OVERLAP : a] + prompt[a : a + c]

observing the column maxima (`Observation.colmax`: for every slot, the largest attention probability any query of
the pass gave it, per query head), and is rolled back. The prompt's slots keep, per query head, the largest
maximum of all passes. The reconstruction tokens never stay in the cache: each pass holds the prompt + the pass's
tokens, then goes. The prompt's last token is decoded again after the last pass, so that the sequence ends with the
logits of the prompt (a rollback forgets them), at its own position and cell.

The chunk length is `repeat_chunk`, or less when the context has less room (the same for every pass, so that both
engines, given the same context, feed the same passes). The maxima are float32 in both engines; a maximum adds no
rounding, so both engines' observations differ only by their attention arithmetic (kvcli check's L2).

Bounded reading (kvcli/drivers/chunked.py) runs the passes of one chunk of the document at a time (`start`, `end`):
the chunk's tokens fed again, introduced as pass i above (the first chunk by REPEAT_FIRST, a later one by REPEAT_NEXT
and the REPEAT_OVERLAP tokens before it), scoring every slot the sequence holds (the entries kept from earlier
chunks and the chunk's own); a pass holds at most `pass_cells` cells beyond them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvcli.errors import KvcliError
from kvcli.policies.base import PassResult, SecondPass
from kvcli.session import Session

# The pass feeds, after the prompt, this instruction and then the prompt's own tokens again (teacher forcing),
# `repeat_chunk` tokens at a time; later chunks are introduced by the second text followed by the last
# REPEAT_OVERLAP tokens of the chunk before (kvpress's prompts and overlap).
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
REPEAT_OVERLAP = 8
REPEAT_CHUNK = 2048   # prompt tokens per pass by default (kvpress's chunk_size)

MIN_REPEAT = 16   # fewer free cells than this for a pass's prompt tokens: refused (the context has no room)
REPEAT_MARGIN = 64   # cells kept for a pass's instruction and overlap (they tokenise to about 20)
# In bounded reading a pass is decoded in calls of `pass_rows` tokens: observing column maxima, the native graph
# holds the softmax rows of a call (tokens x cells x query heads, float32) in its compute buffer, which keeps its
# largest size. 512 rows over qwen2.5-coder-0.5b's 2,560 cells (budget 256, chunk 1024) and 14 heads are 73 MB, more
# than the whole KV cache; 16 MiB of rows keep the pass near bounded reading's memory (docs/results.md, kvzip). The
# maxima are the same (a max over calls; each query's attention does not depend on the split). The one-prefill pass
# keeps the session's batch (its memory is the whole prompt's cache anyway, and 32-token calls over a long prompt
# cost time).
PASS_ROWS_BYTES = 16 << 20
MIN_PASS_ROWS = 32


def pass_rows(session: Session) -> int:
    """Tokens per decode call of a reconstruction pass: PASS_ROWS_BYTES of softmax rows over the context's cells."""
    row = max(1, session.n_ctx) * session.info.n_head * 4
    return max(MIN_PASS_ROWS, min(512, PASS_ROWS_BYTES // row))


def repeat_room(n_prompt: int, repeat_chunk: int) -> int:
    """Cells a reconstruction pass needs beyond the prompt (or, in bounded reading, beyond the kept entries and the
    chunk: n_prompt = the chunk): its chunk and its instruction (with margin)."""
    return min(int(n_prompt), int(repeat_chunk)) + REPEAT_MARGIN


def _heads(session: Session) -> tuple[list[int], list[int]]:
    return session.tokenize(REPEAT_FIRST), session.tokenize(REPEAT_NEXT)


def pass_cells(session: Session, repeat_chunk: int, chunk: int) -> int:
    """The most cells one pass over a chunk of `chunk` tokens holds: its share of the chunk and the longest
    instruction (REPEAT_NEXT + the overlap)."""
    first, nxt = _heads(session)
    return min(int(repeat_chunk), int(chunk)) + max(len(first), len(nxt) + REPEAT_OVERLAP)


def passes(session: Session, tokens: list[int], repeat_chunk: int, start: int = 0,
           end: int | None = None) -> list[list[int]]:
    """The token lists of the reconstruction passes over `tokens[start:end]` (a later chunk's passes are introduced
    by the tokens before `start`), given the room the session's context has now."""
    end = len(tokens) if end is None else end
    first, nxt = _heads(session)
    free = session.n_ctx - session.cells_used()
    c = min(int(repeat_chunk), end - start, free - max(len(first), len(nxt) + REPEAT_OVERLAP))
    if c < min(MIN_REPEAT, end - start):
        raise KvcliError(f"policy 'kvzip': the context has {free} free cells after the prompt, too few for its "
                         f"reconstruction pass (at least {MIN_REPEAT} prompt tokens + the instruction); give it a "
                         "larger context")
    out = []
    for a in range(start, end, c):
        head = first if a == 0 else nxt + list(tokens[max(0, a - REPEAT_OVERLAP):a])
        out.append(list(head) + list(tokens[a:min(a + c, end)]))
    return out


@dataclass
class Reconstruction:
    colmax: np.ndarray   # [n_layer, n_head, slots of the sequence] float32
    seconds: float
    longest: int         # tokens of the longest pass (cells it held beyond the sequence)


def reconstruct(session: Session, tokens: list[int], seq: int = 0, repeat_chunk: int = 2048,
                progress=None) -> tuple[np.ndarray, float]:
    """Run the reconstruction passes over `tokens` (the prompt just prefilled into `seq`) and return
    (colmax [n_layer, n_head, slots of seq] float32, seconds). The sequence is left as it was, its logits
    those of the prompt's last token."""
    r = reconstruct_scores(session, tokens, seq, repeat_chunk, progress)
    return r.colmax, r.seconds


def reconstruct_scores(session: Session, tokens: list[int], seq: int = 0, repeat_chunk: int = 2048,
                       progress=None, *, start: int = 0, end: int | None = None,
                       restore_logits: bool = True, rows: int | None = None) -> Reconstruction:
    """`reconstruct` over `tokens[start:end]`, the last tokens prefilled into `seq` (bounded reading: one chunk, the
    sequence holding the entries kept from earlier chunks before it); every slot of the sequence is scored.
    `restore_logits`: decode `tokens[end - 1]` again after the passes (a chunk before the last needs no logits).
    `rows`: tokens per decode call of a pass (bounded reading: `pass_rows`); None: the session's batch."""
    end = len(tokens) if end is None else end
    if end <= start:
        raise KvcliError("policy 'kvzip': nothing to reconstruct (empty prompt)")
    t0 = time.perf_counter()
    st = session.seq(seq)
    held = st.next_pos                       # positions >= held are a pass's tokens
    acc, longest = None, 0
    for ids in passes(session, tokens, repeat_chunk, start, end):
        step = rows or len(ids)
        for a in range(0, len(ids), step):
            obs = session.prefill(ids[a:a + step], seq=seq, observe=("colmax",))
            keep = np.flatnonzero(obs.positions < held)
            m = obs.colmax[..., keep]
            acc = m if acc is None else np.maximum(acc, m)
            del obs
        session.rollback(seq, len(ids))
        longest = max(longest, len(ids))
        if progress is not None:
            progress(len(ids))
    if restore_logits:   # a rollback forgets the logits: the prompt's last token again, at its own position
        session.rollback(seq, 1)
        session.prefill([tokens[end - 1]], seq=seq)
    if acc.shape[-1] != session.seq(seq).cells:
        raise KvcliError(f"policy 'kvzip': the reconstruction scored {acc.shape[-1]} slots, the sequence holds "
                         f"{session.seq(seq).cells}")
    return Reconstruction(np.ascontiguousarray(acc, dtype=np.float32), time.perf_counter() - t0, longest)


class ReconstructionPass(SecondPass):
    """The hooks of `PolicySpec.second_pass` (kvcli.policies.base.SecondPass) for the reconstruction pass above:
    column maxima, `repeat_chunk` prompt tokens per pass."""

    kind = "colmax"
    name = "reconstruction pass"
    scoring = "reconstruction"

    def run(self, session: Session, tokens: list[int], seq: int, params: dict, *, start: int = 0,
            end: int | None = None, restore_logits: bool = True, bounded: bool = False) -> PassResult:
        r = reconstruct_scores(session, tokens, seq, params["repeat_chunk"], start=start, end=end,
                               restore_logits=restore_logits, rows=pass_rows(session) if bounded else None)
        return PassResult(r.colmax, r.seconds, r.longest)

    def shared(self, params_list) -> dict:
        """One pass serves every configuration: the largest chunk asked (the default without any)."""
        return {"repeat_chunk": max((p["repeat_chunk"] for p in params_list), default=REPEAT_CHUNK)}

    def room(self, n_prompt: int, params: dict) -> int:
        return repeat_room(n_prompt, params["repeat_chunk"])

    def held(self, session: Session, params: dict, chunk: int) -> int:
        return pass_cells(session, params["repeat_chunk"], chunk)

    def merge(self, scores: np.ndarray, carried: np.ndarray) -> np.ndarray:
        """A kept entry keeps the larger of the maximum it carries from earlier chunks and the new one."""
        k = carried.shape[2]
        scores[:, :, :k] = np.maximum(scores[:, :, :k], carried)
        return scores

    def refusal(self, info) -> str | None:
        if info.sliding_layers:
            return ("does not support models with sliding-window layers: its reconstruction pass is rolled back "
                    "after the prompt, which their window cache cannot follow (kvpress refuses Gemma 3 too)")
        return None


RECONSTRUCTION = ReconstructionPass()
