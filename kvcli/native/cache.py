"""The compressed KV cache of a llama.cpp context, from Python: observation, compaction, stats,
headers and compressed state files. Functions over a raw `llama_context` pointer (what
`llama_init_from_model` returned) and the model's shapes; `NativeSession` calls them.

Order of calls for one compressed prompt (one sequence `seq`, next position `p` before it):

1. `observe_begin(ctx, seq, kinds, window_pos0=[p + len(tokens) - w for w in windows])` before the
   first `llama_decode` of the prompt (kinds: "window" and/or "colsum"; "kv" needs no arming). The
   graph sums, per window length, the attention rows of the queries at positions >= its first
   position (NativeSession decodes the longest window in calls of its own).
2. the prompt's `llama_decode` calls, then `observe_end(ctx)`.
3. `read_observation(ctx, seq, info, kinds, windows)` -> `kvcli.planning.formats.Observation`.
4. a plan (`kvcli.native.lib.native_plan` or a torch policy), then `apply_plan(ctx, seq, plan, head_dim)`:
   the sequence now holds `plan.max_kept` cells; keep decoding it at position `p + len(tokens)`.
   With `reindex_p0=0` the kept entries get positions B-k..B-1 instead (right-aligned in the B cells, K
   re-rotated) and decoding continues at B = `plan.max_kept`; repeating 1-4 chunk after chunk reads a document of any
   length
   (kvcli/drivers/chunked.py). Observation of a compacted sequence covers its cells (compacted + new).
5. `set_header(...)` to label it, `get_state`/`set_state` to copy it out / back in (kvcli/kvc.py writes
   it into a .kvc file).

The context must have a unified KV cache (`kv_unified=True`) when it holds several sequences.
"""
from __future__ import annotations

import ctypes

import numpy as np

from kvcli.errors import KvcliError
from kvcli.native import load_llama_cpp
from kvcli.native.lib import F32P, I32P, Memory, StateHeader, Stats, lib, plan_view
from kvcli.planning.formats import CAPTURED, OBS_BITS, Observation, Plan, check_kinds, kind_bits

# the C API's KVCLI_OBS_* bits (kvcli.planning.formats: the kinds both engines share; CAPTURED: those the graph
# captures, the others are positions and a K/V reader)
OBS_WINDOW, OBS_COLSUM, OBS_COLMAX, OBS_QUERY = (OBS_BITS[k] for k in ("window", "colsum", "colmax", "query"))


def _ctx(ctx):
    if not ctx:
        raise KvcliError("no llama.cpp context")
    return ctx


# ------------------------------------------------------------------------------ observation
def observe_begin(ctx, seq: int, kinds, window_pos0=()) -> None:
    """Arm observation of `seq` for the following llama_decode calls (clears earlier captures).
    With "window": one sum per first position in `window_pos0` (an int or several), over the queries at
    positions >= it."""
    bits = kind_bits(kinds)
    if not bits:
        return
    pos0 = np.asarray([window_pos0] if np.isscalar(window_pos0) else list(window_pos0), np.int32)
    if not bits & (OBS_WINDOW | OBS_QUERY):
        pos0 = pos0[:0]
    L = lib()
    L.check(L.kvcli_observe_begin(_ctx(ctx), int(seq), bits, int(pos0.size), pos0.ctypes.data_as(I32P)), "observe")


def observe_end(ctx) -> None:
    L = lib()
    L.check(L.kvcli_observe_end(_ctx(ctx)), "observe_end")


def kv_layer_ids(shapes) -> list[int]:
    """The model index of each of the `shapes.n_layer` layers kvcli compresses (ModelInfo.kv_layers; every
    layer when the shapes do not say)."""
    ids = list(getattr(shapes, "kv_layers", None) or range(int(shapes.n_layer)))
    if len(ids) != int(shapes.n_layer):
        raise KvcliError(f"{len(ids)} compressed layers listed for {shapes.n_layer}")
    return ids


def model_kv_layers(model, n_layer_model: int) -> tuple:
    """The model layers llama.cpp keeps in the cache kvcli compresses (kvcli_model_kv_layers)."""
    L = lib()
    out = np.zeros(max(1, int(n_layer_model)), np.int32)
    n = L.check(L.kvcli_model_kv_layers(model, out.ctypes.data_as(I32P)), "reading the model's layers")
    return tuple(int(x) for x in out[:n])


def read_observation(ctx, seq: int, shapes, kinds, windows=()) -> Observation:
    """The Observation of `seq` (docs/internals.md) for the kinds asked: window sums (of the window
    lengths `windows`, in the order observe_begin got their first positions) / colsum from the armed
    decodes (read once: the engine frees its copy as they are read), kv as a reader of the cache's rows
    (`KvReader`), positions always. Its layers are the ones kvcli compresses (kv_layer_ids)."""
    kinds = set(kinds)
    check_kinds(kinds)
    L = lib()
    n_layer, n_head = int(shapes.n_layer), int(shapes.n_head)
    n = L.check(L.kvcli_seq_n_slots(_ctx(ctx), int(seq)), "reading the sequence")
    obs = Observation(n_layer=n_layer, n_head=n_head, n_head_kv=int(shapes.n_head_kv),
                      head_dim=int(shapes.head_dim), n=n, positions=seq_positions(ctx, seq))
    if kinds & CAPTURED:
        n_obs = L.check(L.kvcli_observe_n_slots(ctx), "observation")
        if n_obs != n:
            raise KvcliError(f"the observation covers {n_obs} slots but sequence {seq} has {n}: "
                             "was another sequence observed?")
    if "window" in kinds:
        windows = tuple(int(w) for w in windows)
        for iw, w in enumerate(windows):
            got = L.check(L.kvcli_observe_n_window(ctx, iw), "observation")
            if got != w:
                raise KvcliError(f"window {w}: {got} window queries were observed (its first position lies "
                                 "outside the decoded tokens?)")
        obs.window_sums, obs.windows = np.empty((len(windows), n_layer, n_head, n), np.float32), windows
    if "colsum" in kinds:
        obs.colsum = np.empty((n_layer, n_head, n), np.float32)
    if "colmax" in kinds:
        obs.colmax = np.empty((n_layer, n_head, n), np.float32)
    if "query" in kinds:   # the Q rows of the queries at positions >= the first window position, in decode order
        rows = L.check(L.kvcli_observe_n_queries(ctx, None), "observation")
        obs.query_positions = np.empty(rows, np.int32)
        L.check(L.kvcli_observe_n_queries(ctx, obs.query_positions.ctypes.data_as(I32P)), "observation")
        obs.queries = np.empty((n_layer, n_head, rows, int(shapes.head_dim)), np.float32)
    if kinds & CAPTURED:
        # layer by layer, each layer's accumulators released once copied: the host never holds both copies
        for i, il in enumerate(kv_layer_ids(shapes)):
            for iw in range(len(obs.windows)):
                L.check(L.kvcli_observe_read_window_sum(ctx, il, iw, obs.window_sums[iw, i].ctypes.data_as(F32P)),
                        "reading window sums")
            if obs.colsum is not None:
                L.check(L.kvcli_observe_read_colsum(ctx, il, obs.colsum[i].ctypes.data_as(F32P)),
                        "reading column sums")
            if obs.colmax is not None:
                L.check(L.kvcli_observe_read_colmax(ctx, il, obs.colmax[i].ctypes.data_as(F32P)),
                        "reading column maxima")
            if obs.queries is not None:
                L.check(L.kvcli_observe_read_queries(ctx, il, obs.queries[i].ctypes.data_as(F32P)), "reading queries")
            L.check(L.kvcli_observe_release(ctx, il), "releasing the observation")
    if "kv" in kinds:   # read one layer at a time, when a planner asks (Observation.kv_reader)
        obs.kv_reader = KvReader(ctx, seq, shapes, obs.positions)
    obs.validate()
    return obs


class KvReader:
    """Observation.kv_reader of a native sequence: reads one layer's K/V rows from the cache when asked, so no
    all-layer copy of the rows is ever made for planning. Refuses once the sequence no longer holds the
    observed slots (compacted, rolled back, extended)."""

    def __init__(self, ctx, seq: int, shapes, positions: np.ndarray):
        self.ctx, self.seq, self.shapes, self.positions = ctx, int(seq), shapes, positions

    def __call__(self, il: int, keys: np.ndarray, values: np.ndarray) -> None:
        if not np.array_equal(seq_positions(self.ctx, self.seq), self.positions):
            raise KvcliError(f"sequence {self.seq} changed since it was observed: its K/V rows can no longer be read")
        read_kv_layer(self.ctx, self.seq, self.shapes, il, keys, values)


def read_kv_layer(ctx, seq: int, shapes, il: int, keys: np.ndarray, values: np.ndarray) -> None:
    """Compressed layer `il`'s (kv_layer_ids) K and V rows of `seq` into keys and values (float32 C-order
    [n_head_kv, n_slots, head_dim]), dequantised and in the model's space (any Hadamard rotation of a quantised
    cache undone); K is post-RoPE."""
    L = lib()
    n = L.check(L.kvcli_seq_n_slots(_ctx(ctx), int(seq)), "reading the sequence")
    want = (int(shapes.n_head_kv), n, int(shapes.head_dim))
    model_il = kv_layer_ids(shapes)[il]
    for which, out in ((0, keys), (1, values)):
        if out.shape != want or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise KvcliError(f"K/V rows are read into float32 C-order arrays {list(want)}")
        L.check(L.kvcli_seq_read_kv(_ctx(ctx), int(seq), model_il, which, out.ctypes.data_as(F32P)),
                "reading K/V rows")


def read_kv(ctx, seq: int, shapes) -> tuple[np.ndarray, np.ndarray]:
    """K and V rows of `seq`, float32 [n_layer, n_head_kv, n_slots, head_dim] (read_kv_layer of every layer)."""
    L = lib()
    n = L.check(L.kvcli_seq_n_slots(_ctx(ctx), int(seq)), "reading the sequence")
    keys = np.empty((int(shapes.n_layer), int(shapes.n_head_kv), n, int(shapes.head_dim)), np.float32)
    values = np.empty_like(keys)
    for il in range(int(shapes.n_layer)):
        read_kv_layer(ctx, seq, shapes, il, keys[il], values[il])
    return keys, values


def seq_positions(ctx, seq: int) -> np.ndarray:
    """Position of each slot (cell, in cell order) of `seq`."""
    L = lib()
    n = L.check(L.kvcli_seq_n_slots(_ctx(ctx), int(seq)), "reading the sequence")
    pos = np.empty(n, np.int32)
    L.check(L.kvcli_seq_positions(ctx, int(seq), pos.ctypes.data_as(I32P)), "reading positions")
    return pos


# ------------------------------------------------------------------------------ compaction
def _checked_view(ctx, seq: int, plan: Plan, head_dim: int):
    """The plan's C view (and what keeps its arrays alive), after checking it against `seq`'s slots."""
    L = lib()
    n = L.check(L.kvcli_seq_n_slots(_ctx(ctx), int(seq)), "reading the sequence")
    try:
        plan.validate(n, head_dim)
    except ValueError as e:
        raise KvcliError(str(e)) from None
    return plan_view(plan, head_dim)


def apply_plan(ctx, seq: int, plan: Plan, head_dim: int, reindex_p0: int | None = None) -> int:
    """Compact `seq` as the plan says; returns the cells it holds now (plan.max_kept).

    The sequence may be compacted already (slots are its cells now, in cell order; the slot bias
    composes). `reindex_p0=None`: kept entries keep their positions, decoding continues at the same
    next position. `reindex_p0=p0`: the k kept entries of every (layer, KV head) get positions
    p0+B-k, ..., p0+B-1 (B = plan.max_kept; right-aligned, K re-rotated in the cache's backend), decoding
    continues at p0 + B;
    refused for a sequence once compacted without re-indexing (`is_reindexable`)."""
    L = lib()
    view, _keep = _checked_view(ctx, seq, plan, head_dim)
    if reindex_p0 is None:
        return L.check(L.kvcli_apply_plan(ctx, int(seq), ctypes.byref(view)), "applying the plan")
    if int(reindex_p0) < 0:
        raise KvcliError(f"re-indexing needs a first position >= 0 (got {reindex_p0})")
    return L.check(L.kvcli_apply_plan_reindexed(ctx, int(seq), ctypes.byref(view), int(reindex_p0)),
                   "applying the plan with re-indexing")


def gather_plan(ctx, src: int, dst: int, plan: Plan, head_dim: int) -> int:
    """Copy the entries `plan` keeps of `src`'s slots into new cells of the empty sequence `dst`, as `apply_plan`
    would compact `src`, leaving `src` (and every cell it shares with a resident document) untouched; returns
    the cells `dst` holds (plan.max_kept). Decoding `dst` continues at `src`'s next position."""
    L = lib()
    view, _keep = _checked_view(ctx, src, plan, head_dim)
    return L.check(L.kvcli_gather_plan(ctx, int(src), int(dst), ctypes.byref(view)), "gathering the plan")


def is_compressed(ctx, seq: int) -> bool:
    L = lib()
    return bool(L.check(L.kvcli_seq_is_compressed(_ctx(ctx), int(seq)), "kvcli_seq_is_compressed"))


def is_reindexable(ctx, seq: int) -> bool:
    """Whether every entry of `seq` sits at its cell's position (never compacted, or only with
    re-indexing), so `apply_plan(..., reindex_p0=...)` accepts it."""
    L = lib()
    return bool(L.check(L.kvcli_seq_is_reindexable(_ctx(ctx), int(seq)), "kvcli_seq_is_reindexable"))


def shift_positions(ctx, seq: int, p0: int, p1: int, delta: int) -> None:
    """llama_memory_seq_add, refused with a clear error on a compressed sequence (its entries
    carry per-head positions that a shift would corrupt)."""
    if is_compressed(ctx, seq):
        raise KvcliError(f"sequence {seq} is compressed: shifting its positions (context shift) is not possible")
    llama = load_llama_cpp()
    llama.llama_memory_seq_add(llama.llama_get_memory(ctx), int(seq), int(p0), int(p1), int(delta))


# ------------------------------------------------------------------------------ stats
def stats(ctx, seq: int, n_layer_model: int, n_head_kv: int) -> dict:
    """Measured from the live cache kvcli compresses (seq = -1: the whole cache): cells, K/V/bias bytes held,
    live (layer, kv head, cell) entries, cells per model layer and entries per (model layer, kv head) (0 for
    a sliding-window layer: its cells are in llama.cpp's other cache). `n_layer_model`: all the model's
    layers (ModelInfo.n_layer_model)."""
    L = lib()
    s = Stats()
    plc = np.zeros(int(n_layer_model), np.int32)
    phe = np.zeros((int(n_layer_model), int(n_head_kv)), np.int32)
    L.check(L.kvcli_stats_get(_ctx(ctx), int(seq), ctypes.byref(s), plc.ctypes.data_as(I32P),
                              phe.ctypes.data_as(I32P)), "reading cache stats")
    return {"n_cells": int(s.n_cells), "k_bytes": int(s.k_bytes), "v_bytes": int(s.v_bytes),
            "bias_bytes": int(s.bias_bytes), "live_entries": int(s.live_entries),
            "per_layer_cells": plc.tolist(), "per_head_entries": phe.tolist()}


def cells_with_bias(ctx) -> int:
    """Cells of the whole cache that carry a slot-bias row (kvcli_cells_with_bias): all held by a sequence."""
    L = lib()
    return int(L.check(L.kvcli_cells_with_bias(_ctx(ctx)), "kvcli_cells_with_bias"))


def memory(ctx) -> dict:
    """What the context's KV cache has allocated, whatever it holds (kvcli_memory_get): the cells it was
    sized for, its K/V buffer bytes and kvcli's slot-bias buffer bytes, as the backend buffers report them."""
    L = lib()
    m = Memory()
    L.check(L.kvcli_memory_get(_ctx(ctx), ctypes.byref(m)), "reading the cache's allocation")
    return {"kv_size": int(m.kv_size), "kv_bytes": int(m.kv_bytes), "bias_bytes": int(m.bias_bytes)}


def release_compute(ctx) -> int:
    """Give the context's host compute-buffer pages back to the kernel (kvcli_release_compute): scratch between
    graphs, resident for the context's life once a long prefill touched them. Returns the bytes given back."""
    L = lib()
    n = ctypes.c_int64(0)
    L.check(L.kvcli_release_compute(_ctx(ctx), ctypes.byref(n)), "releasing the compute buffer")
    return int(n.value)


def last_graph_count(ctx, prefix: str) -> int:
    """Nodes of the last graph built over the cache named with `prefix` (which path a ubatch took; tests)."""
    L = lib()
    return L.check(L.kvcli_last_graph_count(_ctx(ctx), prefix.encode()), "reading the last graph")


# ------------------------------------------------------------------------------ headers
def set_header(ctx, seq: int, policy: str, budget: int, original_tokens: int) -> None:
    """Label a compressed sequence (saved with its state); kvcli's version is filled in."""
    pol = policy.encode()
    if len(pol) >= 32:
        raise KvcliError(f"policy name '{policy}' is too long for the state header (31 bytes)")
    h = StateHeader(pol, int(budget), int(original_tokens), b"")
    L = lib()
    L.check(L.kvcli_seq_set_header(_ctx(ctx), int(seq), ctypes.byref(h)), "setting the header")


def get_header(ctx, seq: int) -> dict | None:
    """The header of a compressed sequence, None for an uncompressed one."""
    h = StateHeader()
    L = lib()
    if not L.check(L.kvcli_seq_get_header(_ctx(ctx), int(seq), ctypes.byref(h)), "reading the header"):
        return None
    return {"policy": h.policy.decode(errors="replace"), "budget": int(h.budget),
            "original_tokens": int(h.original_tokens), "kvcli_version": h.kvcli_version.decode(errors="replace")}


# ------------------------------------------------------------------------------ layout
def layout_trim(ctx) -> None:
    """Trim the cache to the ragged layout (native/src/kvcli_layout.cpp) once llama.cpp's state I/O has moved its
    rows: a state is saved and restored through the full layout."""
    L = lib()
    L.check(L.kvcli_layout_trim(_ctx(ctx)), "kvcli_layout_trim")


def layout_pack(ctx) -> int:
    """Reorder the cache's used cells so that the dead slots of every compressed sequence lead (each sequence keeps
    its cells' order) and trim: several compressed sequences in one cache hold only their live entries. Returns the
    cells that moved (native/src/kvcli_layout.cpp, `pack`)."""
    L = lib()
    return L.check(L.kvcli_layout_pack(_ctx(ctx)), "kvcli_layout_pack")


def layout_fronts(ctx) -> list[int]:
    """Per cache layer, the first cell whose K/V row it stores (0: every cell; the ragged layout's dead prefix)."""
    L = lib()
    n = L.check(L.kvcli_layout_fronts(_ctx(ctx), None), "kvcli_layout_fronts")
    out = (ctypes.c_int32 * n)()
    L.check(L.kvcli_layout_fronts(_ctx(ctx), out), "kvcli_layout_fronts")
    return list(out)


def view_starts(ctx) -> list[int]:
    """Per cache layer, the first cell the last decoded ubatch's attention viewed (its front, or the first cell its
    sequences hold where later)."""
    L = lib()
    n = L.check(L.kvcli_view_starts(_ctx(ctx), None), "kvcli_view_starts")
    out = (ctypes.c_int32 * n)()
    L.check(L.kvcli_view_starts(_ctx(ctx), out), "kvcli_view_starts")
    return list(out)


# ------------------------------------------------------------------------------ state files
def get_state(ctx, seq: int) -> bytearray:
    """llama_state_seq_get_data of `seq`: cells, K/V rows, and (our patch) slot bias + header. Written by llama.cpp
    straight into the bytearray returned (no copy: a state is the size of the sequence's cache, 188 MB for a
    16k-token cache of qwen2.5-coder-0.5b, and a copy of it was a re-selected chat's peak)."""
    llama = load_llama_cpp()
    size = llama.llama_state_seq_get_size(_ctx(ctx), int(seq))
    if size == 0:
        raise KvcliError(f"could not size the state of sequence {seq}: {lib().last_error() or 'llama.cpp error'}")
    out = bytearray(size)
    buf = (ctypes.c_uint8 * size).from_buffer(out)
    got = llama.llama_state_seq_get_data(ctx, buf, size, int(seq))
    why = "" if got else lib().last_error() or "llama.cpp error"
    layout_trim(ctx)   # the state was written through the full layout (native/src/kvcli_layout.cpp)
    del buf   # the bytearray may be resized once nothing points into it
    if got == 0:
        raise KvcliError(f"could not save the state of sequence {seq}: {why}")
    del out[got:]
    return out


def set_state(ctx, seq: int, data: bytes | bytearray) -> None:
    """llama_state_seq_set_data into `seq` (which is cleared first); a clear error when llama.cpp
    or kvcli refuses it (another model, another kvcli state format, cache too small, corrupted). The bytes are
    read where they lie (not copied)."""
    llama = load_llama_cpp()
    L = lib()
    L.kvcli_seq_n_slots(_ctx(ctx), int(seq))  # any kvcli call clears kvcli_last_error
    if isinstance(data, bytearray):
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
    else:   # immutable bytes: a pointer to their buffer, which llama.cpp only reads
        buf = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))
    got = llama.llama_state_seq_set_data(ctx, buf, len(data), int(seq))
    why = "" if got else L.last_error() or ("llama.cpp refused it: the context's cache type, flash-attention "
                                            "setting or size differs from the one it was saved with (KVCLI_DEBUG=1 "
                                            "shows its log)")
    layout_trim(ctx)   # the state was read through the full layout (native/src/kvcli_layout.cpp)
    if got == 0:
        raise KvcliError(f"cannot load the cache state: {why}")
