"""The layout of a saved sequence state (llama_state_seq_get_data with kvcli's prefix and bias suffix), read
into its parts so that some of its cells can be written out as a state of their own.

Bounded re-selection (kvcli/drivers/reselect_bounded.py) stores each chunk of a document as it is read: the
sequence then holds the entries kept so far (compressed: a kvcli header and per-head slot bias) and the chunk
just prefilled; `cells_from` keeps the chunk's cells only, as an uncompressed state (no header, no bias) that
restores into a sequence of its own. One stream, no sliding-window cache (kvc.check_state reads the same layout).
"""
from __future__ import annotations

import functools
import struct

import numpy as np

from kvcli.errors import KvcliError

STATE_MAGIC, SUFFIX_MAGIC = 0x4C43564B, 0x4243564B
_HEADER_BYTES = 4 + 56 + 4          # seq id, kvcli_state_header, flags (native/src/kvcli_state.cpp)
_BLOCK = {0: (1, 4), 1: (1, 2), 8: (32, 34)}   # ggml type -> (block, bytes): f32, f16, q8_0


class Reader:
    """Fields read one after the other from a byte string; ValueError where it ends inside one."""

    def __init__(self, data: bytes):
        self.data, self.p = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.p + n > len(self.data):
            raise ValueError(f"{len(self.data)} bytes end inside a field at byte {self.p}")
        out = self.data[self.p:self.p + n]
        self.p += n
        return out

    def u(self, fmt: str) -> int:
        (v,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return v


def cells_from(state: bytes, first_pos: int) -> tuple[bytes, int, int]:
    """The cells of a saved sequence at positions >= first_pos, as an uncompressed sequence state of their own;
    returns (state, cells, last position + 1). Their K/V rows are copied as they are (their positions too)."""
    try:
        return _cells_from(Reader(state), state, first_pos)
    except ValueError as e:
        raise KvcliError(f"the cache state is cut short: {e}") from None


def _opening(r: Reader) -> tuple[bytes, bytes, int, np.ndarray, list[bytes]]:
    """A state read up to its K/V rows: (what llama.cpp writes before the cache's part, kvcli state format and model
    fingerprint, the compressed sequence's header count (its headers skipped), each cell's position, each cell's
    bytes)."""
    lead = bytes(r.take(8))
    if r.u("<I") != STATE_MAGIC:
        raise KvcliError("not a kvcli cache state")
    fmt_fp = bytes(r.take(12))
    headers = r.u("<I")
    r.take(headers * _HEADER_BYTES)
    if r.u("<I") != 1:
        raise KvcliError("a cache state of several streams cannot be cut into cells")
    n = r.u("<I")
    pos = np.empty(n, np.int64)
    meta = []
    for i in range(n):
        start = r.p
        pos[i] = r.u("<i")
        n_seq = r.u("<I")
        r.take(4 * n_seq)
        meta.append(bytes(r.data[start:r.p]))
    return lead, fmt_fp, headers, pos, meta


def _cells_from(r: Reader, state: bytes, first_pos: int) -> tuple[bytes, int, int]:
    lead, fmt_fp, _, pos, meta = _opening(r)             # the compressed sequence's header is dropped
    n = pos.size
    keep = np.flatnonzero(pos >= first_pos)
    if keep.size == 0:
        raise KvcliError(f"the sequence holds no cell at position {first_pos} or later")
    out = [lead, struct.pack("<I", STATE_MAGIC), fmt_fp, struct.pack("<I", 0), struct.pack("<II", 1, keep.size)]
    out += [meta[i] for i in keep]
    v_trans, n_layer = r.u("<I"), r.u("<I")
    out.append(struct.pack("<II", v_trans, n_layer))
    for kind in ("K", "V"):
        for _ in range(n_layer):
            t = r.u("<i")
            if kind == "V" and v_trans:
                el, width = r.u("<I"), r.u("<I")
                data = np.frombuffer(r.take(width * n * el), np.uint8).reshape(width, n, el)
                out += [struct.pack("<iII", t, el, width), np.ascontiguousarray(data[:, keep]).tobytes()]
            else:
                row = r.u("<Q")
                data = np.frombuffer(r.take(n * row), np.uint8).reshape(n, row)
                out += [struct.pack("<iQ", t, row), np.ascontiguousarray(data[keep]).tobytes()]
    if r.u("<I") != SUFFIX_MAGIC:
        raise KvcliError("the cache state has no kvcli bias block (a model with sliding-window layers?)")
    if r.u("<I"):                                       # the slot bias: the chunk's cells have none
        n_l, n_h, n_c = r.u("<I"), r.u("<I"), r.u("<I")
        bias = np.frombuffer(r.take(4 * n_l * n_h * n_c), np.float32).reshape(n_l, n_h, n_c)
        if n_c != n or not (bias[:, :, keep] == 0).all():
            raise KvcliError("the cells to cut out are compacted already (they carry slot bias)")
    if r.p != len(state):
        raise KvcliError("the cache state holds more than one cache (a model with sliding-window layers?)")
    out.append(struct.pack("<II", SUFFIX_MAGIC, 0))
    return b"".join(out), int(keep.size), int(pos[keep].max()) + 1


def chunk_keys(state: bytes, n_head_kv: int, layers: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """A stored chunk's K rows and positions (a state as cells_from writes it, float16 or q8_0 rows):
    ([layers, n_head_kv, cells, head_dim] float32, [cells] positions). The V rows, and the K rows of the layers
    not asked for, are not converted."""
    try:
        r = Reader(state)
        _, _, headers, pos, _ = _opening(r)
        if headers:
            raise KvcliError("only a stored chunk's state (uncompressed) has its keys read")
        n = pos.size
        _, n_layer = r.u("<I"), r.u("<I")
        wanted = range(n_layer)[layers]
        out = None
        for il in range(n_layer):
            t, row = r.u("<i"), r.u("<Q")
            if t not in (F16, Q8_0):
                raise KvcliError(f"a chunk's K rows of ggml type {t} cannot be read")
            block, size = _BLOCK[t]
            width = row // size * block
            if width % n_head_kv:
                raise KvcliError(f"a chunk's K rows of {width} values are not {n_head_kv} heads' keys")
            data = r.take(n * row)
            if il not in wanted:
                continue
            rows = np.frombuffer(data, "<f2").reshape(n, width) if t == F16 else _from_q8_0(data, n, width)
            if out is None:
                out = np.empty((len(wanted), n_head_kv, n, width // n_head_kv), np.float32)
            out[wanted.index(il)] = rows.reshape(n, n_head_kv, -1).transpose(1, 0, 2)
        return out, pos
    except ValueError as e:
        raise KvcliError(f"the chunk state is cut short: {e}") from None


# ---------------------------------------------------------------------------------- a quantised chunk file
F16, Q8_0 = 1, 8
_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("q", "i1", 32)])   # ggml's block_q8_0
ROT = 32            # values per Hadamard block turned before quantising (as llama.cpp turns a quantised cache's rows)


@functools.cache
def _hadamard(n: int = ROT) -> np.ndarray:
    """The orthonormal n x n Hadamard matrix (Sylvester's; symmetric, its own inverse)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(np.float32(n))


def _q8_0(x: np.ndarray) -> bytes:
    """float32 rows [n, width] (width a multiple of 32) as q8_0 blocks: per 32 values a float16 scale
    max|x| / 127 and 32 int8 (ggml's block_q8_0, rounded to nearest)."""
    b = (x.reshape(-1, ROT) @ _hadamard()).reshape(-1, 32)
    d = np.abs(b).max(axis=1) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.rint(b * inv[:, None]).astype(np.int8)
    out = np.empty(b.shape[0], _Q8_0_BLOCK)
    out["d"], out["q"] = d.astype(np.float16), q
    return out.tobytes()


def _from_q8_0(data, n: int, width: int) -> np.ndarray:
    blocks = np.frombuffer(data, _Q8_0_BLOCK)
    rows = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    return (rows.reshape(-1, ROT) @ _hadamard()).reshape(n, width)


def convert_chunk(state: bytes, to: int) -> bytes:
    """A chunk's state (as cells_from writes it: uncompressed, flash-attention layout) with every K and V row
    converted between float16 (F16) and q8_0 (Q8_0). The q8_0 rows are in the model's space: a store's file
    format, not a q8_0 cache's (llama.cpp Hadamard-rotates those), so a chunk is converted back before a restore."""
    try:
        return _convert_chunk(Reader(state), state, to)
    except ValueError as e:
        raise KvcliError(f"the chunk state is cut short: {e}") from None


def _convert_chunk(r: Reader, state: bytes, to: int) -> bytes:
    if to not in (F16, Q8_0):
        raise KvcliError(f"a chunk is stored as float16 or q8_0, not ggml type {to}")
    _, _, headers, pos, _ = _opening(r)
    if headers:
        raise KvcliError("only a stored chunk's state (uncompressed) is converted")
    n, start = pos.size, r.p
    v_trans, n_layer = r.u("<I"), r.u("<I")
    if v_trans:
        raise KvcliError("a quantised store needs flash attention (its V rows are not transposed)")
    out = [state[:start], struct.pack("<II", v_trans, n_layer)]
    for _ in range(2 * n_layer):
        t, row = r.u("<i"), r.u("<Q")
        data = r.take(n * row)
        if t == to:
            out += [struct.pack("<iQ", t, row), data]
            continue
        if (t, to) not in ((F16, Q8_0), (Q8_0, F16)):
            raise KvcliError(f"a chunk's rows of ggml type {t} cannot be converted to type {to}")
        block, size = _BLOCK[t]
        width = row // size * block
        if width % _BLOCK[Q8_0][0]:
            raise KvcliError(f"a q8_0 store needs rows of a multiple of 32 values (this model's: {width})")
        rows = np.frombuffer(data, "<f2").astype(np.float32).reshape(n, width) if t == F16 else \
            _from_q8_0(data, n, width)
        new = _q8_0(rows) if to == Q8_0 else rows.astype("<f2").tobytes()
        out += [struct.pack("<iQ", to, width // _BLOCK[to][0] * _BLOCK[to][1]), new]
    rest = bytes(r.take(len(state) - r.p))
    return b"".join(out) + rest
