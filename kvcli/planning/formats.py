"""The two data formats every part of kvcli shares: what a policy observes, what it decides.

See docs/internals.md for the full contract. Both engines produce an `Observation` and
consume a `Plan`; both planners (C++ and torch) map the first to the second.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

import numpy as np

from kvcli.errors import KvcliError

MAX_WINDOWS = 16   # window lengths one observation may hold (KVCLI_OBS_MAX_WINDOWS)

# The observation kinds: what a policy needs (PolicySpec.needs) and an engine's prefill observes, one set for both
# engines and the C API. The attention graph captures the first four, each a bit of native/include/kvcli.h's
# `enum kvcli_obs_kind` (KVCLI_OBS_*; tests/test_observation_kinds.py holds them equal); "kv", the cache's K/V rows,
# is read on demand and has no bit.
Kind = Literal["window", "colsum", "colmax", "query", "kv"]
KINDS: frozenset[str] = frozenset(get_args(Kind))
OBS_BITS: dict[str, int] = {"window": 1, "colsum": 2, "colmax": 4, "query": 8}   # KVCLI_OBS_WINDOW ... _QUERY
CAPTURED: frozenset[str] = frozenset(OBS_BITS)   # the kinds the attention graph captures (armed prefill)


def check_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    """`kinds` as a tuple, each one of KINDS: an unknown one refused in one line, the same in both engines."""
    kinds = tuple(kinds)
    for k in kinds:
        if k not in KINDS:
            raise KvcliError(f"unknown observation kind '{k}' (choose from {', '.join(get_args(Kind))})")
    return kinds


def kind_bits(kinds: Iterable[str]) -> int:
    """The KVCLI_OBS_* bits of `kinds` (kvcli_observe_begin's `kinds`): 0 when none is captured by the graph."""
    bits = 0
    for k in check_kinds(kinds):
        bits |= OBS_BITS.get(k, 0)
    return bits

# kv_reader(layer, keys_out, values_out): fills two float32 C-order arrays [n_head_kv, n, head_dim] with that
# layer's K and V rows (kvcli_kv_reader in native/include/kvcli.h)
KvReader = Callable[[int, np.ndarray, np.ndarray], None]


@dataclass
class Observation:
    """Attention statistics and cache rows of one prefilled sequence (float32, C order)."""

    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n: int                                  # slots in the sequence
    window_sums: np.ndarray | None = None   # [len(windows), n_layer, n_head, n]
    windows: tuple[int, ...] = ()           # the window lengths of window_sums, ascending
    colsum: np.ndarray | None = None        # [n_layer, n_head, n]
    keys: np.ndarray | None = None          # [n_layer, n_head_kv, n, head_dim]
    values: np.ndarray | None = None        # [n_layer, n_head_kv, n, head_dim]
    positions: np.ndarray | None = None     # [n] int32
    # instead of keys/values (the native engine): reads one layer's K/V rows on demand from the live cache,
    # valid until the sequence changes; the planners hold one layer's rows at a time (`layer_kv`)
    kv_reader: KvReader | None = None
    # [n_layer, n_head, n]: the largest attention probability any observed query gave each slot (kvzip's
    # reconstruction pass, kvcli/policies/reconstruction.py: its second_pass)
    colmax: np.ndarray | None = None
    # [n_layer, n_head, w, head_dim]: the Q rows of the last w prompt queries, exactly as attention uses them
    # (post-RoPE, llama.cpp's dimension order), per query head; their positions [w] int32; and how positions rotate
    # Q/K rows (kvcli.planning.rope.Rope): expected attention's query statistics
    queries: np.ndarray | None = None
    query_positions: np.ndarray | None = None
    rope: object | None = None

    @property
    def has_kv(self) -> bool:
        return (self.keys is not None and self.values is not None) or self.kv_reader is not None

    def layer_kv(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer `layer`'s K and V rows, [n_head_kv, n, head_dim] float32 each: views of keys/values, or read
        now by kv_reader."""
        if self.keys is not None and self.values is not None:
            return self.keys[layer], self.values[layer]
        if self.kv_reader is None:
            raise KvcliError("the observation holds no K/V rows (observe \"kv\")")
        k = np.empty((self.n_head_kv, self.n, self.head_dim), np.float32)
        v = np.empty_like(k)
        self.kv_reader(int(layer), k, v)
        return k, v

    def with_kv_arrays(self) -> "Observation":
        """This observation with keys/values as whole arrays, every layer read now (kvcli check's L2, tests):
        n_layer times the memory a planner holds."""
        if self.kv_reader is None or (self.keys is not None and self.values is not None):
            return self
        k = np.empty((self.n_layer, self.n_head_kv, self.n, self.head_dim), np.float32)
        v = np.empty_like(k)
        for il in range(self.n_layer):
            self.kv_reader(il, k[il], v[il])
        return replace(self, keys=k, values=v, kv_reader=None)

    def window_sum(self, w: int) -> np.ndarray | None:
        """[n_layer, n_head, n]: the attention each slot received from the last `w` prompt queries (a view),
        None when window `w` was not observed."""
        if self.window_sums is None or w not in self.windows:
            return None
        return self.window_sums[self.windows.index(w)]

    def restrict(self, kinds, window: int = 0) -> "Observation":
        """What a prefill observing `kinds` (with "window": window length `window`, which this observation
        must hold) would have returned, cut out of this richer one. No array is copied."""
        kinds = set(kinds)
        out = replace(self, window_sums=None, windows=(),
                      colsum=self.colsum if "colsum" in kinds else None,
                      colmax=self.colmax if "colmax" in kinds else None,
                      queries=None, query_positions=None, rope=self.rope if "query" in kinds else None,
                      keys=self.keys if "kv" in kinds else None, values=self.values if "kv" in kinds else None,
                      kv_reader=self.kv_reader if "kv" in kinds else None)
        if "query" in kinds:   # the last `window` query rows (all of them when fewer were observed)
            if self.queries is None:
                raise KvcliError("no query rows were observed (observe \"query\")")
            rows = min(int(window), self.queries.shape[2])
            out.queries, out.query_positions = self.queries[:, :, -rows:], self.query_positions[-rows:]
        if "window" in kinds:
            if window not in self.windows:
                raise KvcliError(f"window {window} was not observed (the observation has {list(self.windows)})")
            i = self.windows.index(window)
            out.window_sums, out.windows = self.window_sums[i:i + 1], (window,)
        return out

    def validate(self) -> None:
        if (self.window_sums is None) != (not self.windows) or list(self.windows) != sorted(set(self.windows)):
            raise ValueError(f"observation.windows {self.windows} must be ascending, distinct, and given with "
                             "window_sums")
        shapes = {
            "window_sums": (len(self.windows), self.n_layer, self.n_head, self.n),
            "colsum": (self.n_layer, self.n_head, self.n),
            "colmax": (self.n_layer, self.n_head, self.n),
            "keys": (self.n_layer, self.n_head_kv, self.n, self.head_dim),
            "values": (self.n_layer, self.n_head_kv, self.n, self.head_dim),
            "positions": (self.n,),
            "queries": (self.n_layer, self.n_head, None, self.head_dim),
            "query_positions": (None,),
        }
        for name, want in shapes.items():
            arr = getattr(self, name)
            if arr is None:
                continue
            if arr.ndim != len(want) or any(w is not None and w != s for w, s in zip(want, arr.shape)):
                raise ValueError(f"observation.{name} has shape {arr.shape}, expected {want}")
        if (self.queries is None) != (self.query_positions is None) or (
                self.queries is not None and self.queries.shape[2] != self.query_positions.shape[0]):
            raise ValueError("observation.queries and query_positions must come together, one position per row")


def sum_window_rows(rows: np.ndarray, windows) -> np.ndarray:
    """Window sums from window attention rows [..., w, n] (the last row is the last query): for each length
    in `windows`, its last rows added in float64, rounded to float32 (the reference engine's arithmetic).
    Returns [len(windows), ..., n]; for hand-made observations (tests, calibration)."""
    w = rows.shape[-2]
    return np.stack([rows[..., w - x:, :].astype(np.float64).sum(axis=-2) for x in windows]).astype(np.float32)


def window_lengths(window, n_tokens: int) -> tuple[int, ...]:
    """The window lengths a prefill observes (`window`: one length or several), ascending and distinct,
    each in [1, n_tokens] (the prefilled tokens) and at most MAX_WINDOWS of them."""
    ws = tuple(sorted({int(w) for w in ((window,) if np.isscalar(window) else window)}))
    if not ws or len(ws) > MAX_WINDOWS:
        raise KvcliError(f"observe 1 to {MAX_WINDOWS} window lengths (got {len(ws)})")
    bad = [w for w in ws if not 0 < w <= n_tokens]
    if bad:
        raise KvcliError(f"observation window {bad[0]} must be in [1, {n_tokens}] (the prefilled tokens)")
    return ws


def observed_windows(observe, window, n_tokens: int) -> tuple[int, ...]:
    """The window lengths a prefill observing `observe` arms: those of `window` with "window" (window_lengths);
    with "query" alone, the longest of `window` cut to the prefilled tokens (a query window longer than the prompt
    takes every prompt query); () otherwise. The query rows are the longest window's."""
    if "window" in observe:
        return window_lengths(window, n_tokens)
    if "query" in observe:
        ws = (window,) if np.isscalar(window) else tuple(window)
        return window_lengths(max(1, min(max(int(w) for w in ws), int(n_tokens))), n_tokens)
    return ()


@dataclass
class Plan:
    """Per (layer, KV head): the kept slots, optional merged rows and log-multiplicity bias."""

    n_kept: np.ndarray                              # int32 [n_layer, n_head_kv]
    slots: np.ndarray                               # int32 [sum(n_kept)], ascending per (l, h)
    log_mult: np.ndarray | None = None              # float32 [sum(n_kept)]
    replace_entry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    replace_k: np.ndarray | None = None             # float32 [R, head_dim]
    replace_v: np.ndarray | None = None             # float32 [R, head_dim]

    @property
    def n_layer(self) -> int:
        return int(self.n_kept.shape[0])

    @property
    def n_head_kv(self) -> int:
        return int(self.n_kept.shape[1])

    @property
    def max_kept(self) -> int:
        return int(self.n_kept.max()) if self.n_kept.size else 0

    def first_slot(self, layer: int, head: int, reindexed: bool) -> int:
        """The slot where the kept entries of (layer, head) start after this plan's compaction: the one owner
        of the layout. Every layer is rewritten into B = max_kept slots; a (layer, head) keeping k entries holds
        them right-aligned in B-k..B-1, dead padding first. With re-indexing their positions then equal their
        slots, so the latest entry of every head sits next to the next token; in every compaction a layer's
        dead slots lead its block, which the native cache's ragged layout does not store
        (native/src/kvcli_layout.cpp). The native compaction (kvcli_moves.cpp) lays cells out the same way.
        `reindexed` is kept for the callers that name the compaction they mean; both align alike."""
        return self.max_kept - int(self.n_kept[layer, head])

    def offsets(self) -> np.ndarray:
        """Start of each (l, h) in `slots`, shape [n_layer, n_head_kv]."""
        flat = np.concatenate([[0], np.cumsum(self.n_kept.reshape(-1))[:-1]])
        return flat.reshape(self.n_kept.shape).astype(np.int64)

    def kept(self, layer: int, head: int) -> np.ndarray:
        off = self.offsets()[layer, head]
        return self.slots[off: off + self.n_kept[layer, head]]

    def kept_lists(self) -> list[list[np.ndarray]]:
        return [[self.kept(l, h) for h in range(self.n_head_kv)] for l in range(self.n_layer)]

    @classmethod
    def from_lists(cls, kept: list[list[np.ndarray]], log_mult: list[list[np.ndarray]] | None = None) -> "Plan":
        n_kept = np.array([[len(k) for k in layer] for layer in kept], dtype=np.int32)
        slots = np.concatenate([np.asarray(k, dtype=np.int32) for layer in kept for k in layer]) \
            if n_kept.sum() else np.zeros(0, np.int32)
        lm = None
        if log_mult is not None:
            lm = np.concatenate([np.asarray(b, dtype=np.float32) for layer in log_mult for b in layer])
        return cls(n_kept=n_kept, slots=slots.astype(np.int32), log_mult=lm)

    @classmethod
    def keep_all(cls, n_layer: int, n_head_kv: int, n: int) -> "Plan":
        return cls.from_lists([[np.arange(n, dtype=np.int32)] * n_head_kv for _ in range(n_layer)])

    def validate(self, n_slots: int, head_dim: int | None = None) -> None:
        if self.n_kept.ndim != 2 or self.slots.ndim != 1 or int(self.n_kept.sum()) != self.slots.size:
            raise ValueError("plan: n_kept and slots disagree")
        if self.n_kept.min(initial=0) < 0:
            raise ValueError("plan: negative n_kept")
        for l in range(self.n_layer):
            for h in range(self.n_head_kv):
                k = self.kept(l, h)
                if k.size and (k.min() < 0 or k.max() >= n_slots):
                    raise ValueError(f"plan: layer {l} head {h} keeps a slot outside [0, {n_slots})")
                if k.size > 1 and np.any(np.diff(k) <= 0):
                    raise ValueError(f"plan: layer {l} head {h} slots are not strictly ascending")
        if self.log_mult is not None and self.log_mult.shape != self.slots.shape:
            raise ValueError("plan: log_mult must have one value per kept entry")
        r = self.replace_entry.size
        if r:
            for name in ("replace_k", "replace_v"):
                arr = getattr(self, name)
                if arr is None or arr.shape[0] != r or (head_dim is not None and arr.shape[1] != head_dim):
                    raise ValueError(f"plan: {name} must be [{r}, head_dim]")
            if self.replace_entry.min() < 0 or self.replace_entry.max() >= self.slots.size:
                raise ValueError("plan: replace_entry out of range")

    def cells_per_layer(self) -> list[int]:
        """Cells each layer occupies after compaction (its widest head)."""
        return [int(x) for x in self.n_kept.max(axis=1)]

    def entries(self) -> int:
        return int(self.n_kept.sum())
