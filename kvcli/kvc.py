"""`.kvc` files: a compressed document (and the conversation on it so far), saved once, loaded fast; a stored
document's full cache (kvcli/drivers/reselect.py), written from the context and read back into it a piece at a time.

Layout (little endian), formats 1 and 2 (`write`):

    b"KVCLIKVC"  u32 format  u32 0  u64 meta_len  meta (JSON, UTF-8)  blob...  sha256 (32 bytes)

`meta["blobs"]` lists the blobs that follow, in order, as [name, dtype, n_bytes]:

    prefix_tokens   int32    the templated prompt that was prefilled and compressed
    kept_counts     int32    [n_layer * n_head_kv] entries kept per (layer, KV head) (compressed only)
    kept_positions  int32    their original positions, concatenated in (layer, head) order
    prefix_logits   float32  logits after the prompt's last token (only when an answer to it is still due)
    colsum          float32  [n_layer * n_head * split] attention column sums of the stored queries (a stored
                             document read for a column-sum policy: kvcli/drivers/reselect.py)
    state           zblocks  llama_state_seq_get_data of the sequence: cells, K/V rows, and (our
                             native patch) the slot bias and header of a compressed sequence, its all-zero
                             64-byte blocks left out (format 2; format 1 stored it whole, as uint8)

zblocks: u64 n_bytes, one bit per 64-byte block (numpy.packbits order; the last block zero-padded), then the
blocks whose bit is set. A compacted sequence's dead slots (a (layer, KV head) keeping fewer entries than the
widest) are zero rows in the state: the file holds the live entries, whatever the memory layout holds
(native/src/README.md, "The ragged layout").

Format 3 (`write_pieces`): an uncompressed sequence's state as pieces, each written as it comes (streamed from the
context by NativeSession.save_seq_pieces, kvcli/native/pieces.py), so the metadata, which lists them, comes last:

    b"KVCLIKVC"  u32 3  u32 0  u64 0  blob...  meta (JSON, UTF-8)  u64 meta_len  b"KVCLIEND"  sha256 (32 bytes)

Its blobs: prefix_tokens, then prefix_logits and colsum when present, then one `state_piece` (uint8) per piece: the
sequence state of a range of its positions (llama_state_seq_get_data of a scratch sequence sharing those cells),
stored raw (the zero blocks of an uncompressed cache are ~0%: packing a piece grew it by 0.2% on SmolLM2).
`read` of a format-3 file checks its digest reading 1 MB at a time and leaves the state on disk (KvcFile.state is
None, KvcFile.pieces their places); `iter_state_pieces` reads them one at a time (NativeSession.restore_seq_pieces).

The digest covers every byte before it, so truncation and corruption are both caught (a format-3 file cut short has
no end marker). The meta records everything needed to refuse a file that does not fit (kvc format, kvcli version,
native state format, model hash) and to continue the conversation (document, system message,
question, policy, budget, parameters, positions). Writes go to a temporary file in the same
directory, fsynced, then renamed over the target (kvcli/outfile.py): an interrupted save leaves no half file.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import __version__, outfile
from kvcli.errors import KvcliError
from kvcli.models import model_hash
from kvcli.engines import CACHE_TYPES, StateReader, identity

MAGIC = b"KVCLIKVC"
FORMAT = 2           # `write`: the state whole, one zblocks blob
FORMAT_PIECES = 3    # `write_pieces`: the state in pieces, written as they come; the meta at the end
READS = (1, 2, 3)    # format 1: the state stored whole (uint8); it loads as it did
_HEAD = struct.Struct("<8sIIQ")
_TAIL = struct.Struct("<Q8s")    # format 3: meta_len, end marker (before the digest)
_END = b"KVCLIEND"
_DIGEST = 32
_DTYPES = {"int32": np.int32, "float32": np.float32, "uint8": np.uint8, "zblocks": np.uint8}
_ZBLOCK = 64
_CHUNK = 1 << 20     # format 3: the digest is checked reading this much at a time


def pack_zero_blocks(data) -> bytes:
    """`data` without its all-zero 64-byte blocks: u64 length, a bit per block, the other blocks (zblocks)."""
    raw = np.frombuffer(data, np.uint8)
    n = raw.size
    blocks = np.zeros(-(-n // _ZBLOCK) * _ZBLOCK, np.uint8)
    blocks[:n] = raw
    blocks = blocks.reshape(-1, _ZBLOCK)
    keep = blocks.any(axis=1)
    return struct.pack("<Q", n) + np.packbits(keep).tobytes() + blocks[keep].tobytes()


def unpack_zero_blocks(packed, where="") -> bytes:
    """The bytes pack_zero_blocks left out put back; a clear error when the block list does not add up."""
    if len(packed) < 8:
        raise KvcliError(f"{where} is corrupted (zero-block state shorter than its header)")
    n = struct.unpack_from("<Q", packed)[0]
    n_blocks = -(-n // _ZBLOCK)
    bits = (n_blocks + 7) // 8
    if len(packed) < 8 + bits:
        raise KvcliError(f"{where} is corrupted (zero-block state without its block map)")
    keep = np.unpackbits(np.frombuffer(packed, np.uint8, bits, 8))[:n_blocks].astype(bool)
    body = np.frombuffer(packed, np.uint8, offset=8 + bits)
    if body.size != int(keep.sum()) * _ZBLOCK:
        raise KvcliError(f"{where} is corrupted (zero-block state: {body.size} bytes for {int(keep.sum())} blocks)")
    out = np.zeros((n_blocks, _ZBLOCK), np.uint8)
    out[keep] = body.reshape(-1, _ZBLOCK)
    return out.reshape(-1)[:n].tobytes()


@dataclass
class KvcFile:
    meta: dict
    prefix_tokens: np.ndarray
    state: bytes | None    # None: a format-3 file's state, left on disk (`pieces`, `iter_state_pieces`)
    kept_positions: list[list[np.ndarray]] | None = None
    prefix_logits: np.ndarray | None = None
    colsum: np.ndarray | None = None     # a stored document's column sums [n_layer, n_head, split]
    path: Path | None = field(default=None, compare=False)
    pieces: list[tuple[int, int]] | None = field(default=None, compare=False)   # format 3: (offset, bytes) each
    stamp: tuple | None = field(default=None, compare=False, repr=False)   # format 3: the file as it was read

    @property
    def state_nbytes(self) -> int:
        """The bytes of the sequence state, in memory or (format 3) in the file's pieces."""
        return sum(n for _, n in self.pieces) if self.pieces is not None else len(self.state or b"")

    # ---------------------------------------------------------------- encoding
    def blobs(self) -> list[tuple[str, str, bytes]]:
        out = [("prefix_tokens", "int32", np.ascontiguousarray(self.prefix_tokens, np.int32).tobytes())]
        if self.kept_positions is not None:
            counts = np.array([len(h) for layer in self.kept_positions for h in layer], np.int32)
            flat = [np.asarray(h, np.int32) for layer in self.kept_positions for h in layer]
            out.append(("kept_counts", "int32", counts.tobytes()))
            out.append(("kept_positions", "int32", (np.concatenate(flat) if flat else np.zeros(0, np.int32))
                        .astype(np.int32).tobytes()))
        out += _small_blobs(self.prefix_logits, self.colsum)
        out.append(("state", "zblocks", pack_zero_blocks(self.state)))
        return out


def _small_blobs(prefix_logits, colsum) -> list[tuple[str, str, bytes]]:
    out = []
    if prefix_logits is not None:
        out.append(("prefix_logits", "float32", np.ascontiguousarray(prefix_logits, np.float32).tobytes()))
    if colsum is not None:
        out.append(("colsum", "float32", np.ascontiguousarray(colsum, np.float32).tobytes()))
    return out


def write(path, kvc: KvcFile, force: bool = True) -> int:
    """Write atomically (kvcli.outfile: temporary file + fsync + rename; force=False refuses an existing
    file, also one that appears while this runs); returns the file size. A format-3 file read (state on disk) is
    written in format 3 again, its pieces read one at a time."""
    if kvc.state is None and kvc.pieces is not None:
        return write_pieces(path, kvc.meta, kvc.prefix_tokens, kvc.colsum, iter_state_pieces(kvc), force=force,
                            prefix_logits=kvc.prefix_logits)
    blobs = kvc.blobs()
    meta = dict(kvc.meta, blobs=[[n, t, len(b)] for n, t, b in blobs])
    meta_b = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
    chunks = [_HEAD.pack(MAGIC, FORMAT, 0, len(meta_b)), meta_b, *(b for _, _, b in blobs)]
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return outfile.write(path, [*chunks, h.digest()], force=force)


def write_pieces(path, meta: dict, prefix_tokens, colsum, pieces: Iterable, *, force: bool = True,
                 prefix_logits=None) -> int:
    """Write a format-3 file (the module docstring): the state of an uncompressed sequence as `pieces` (byte
    strings, e.g. NativeSession.save_seq_pieces), each written and hashed as it comes and not held after (at most
    the one being written is in memory here), the meta (`meta` with its blob list) after them. Atomic as `write`:
    a temporary file in the same folder, fsynced, renamed; an error or an interrupt, in the pieces too, leaves no
    file (and an existing one as it was). The target is checked before the first piece is asked for. Returns the
    file size."""
    if meta.get("compressed") or "kept_positions" in meta:
        raise KvcliError("a compressed cache is written whole (kvc.write), not in pieces")
    blobs = [("prefix_tokens", "int32", np.ascontiguousarray(prefix_tokens, np.int32).tobytes()),
             *_small_blobs(prefix_logits, colsum)]
    listed = [[n, t, len(b)] for n, t, b in blobs]
    h = hashlib.sha256()

    def chunks():
        head = [_HEAD.pack(MAGIC, FORMAT_PIECES, 0, 0), *(b for _, _, b in blobs)]
        for chunk in head:
            h.update(chunk)
            yield chunk
        for piece in pieces:
            view = memoryview(piece).cast("B")
            listed.append(["state_piece", "uint8", view.nbytes])
            h.update(view)
            yield view
            # outfile's loop still names the view while the next piece is made: released, it holds no piece
            view.release()
            del view, piece
        meta_b = json.dumps(dict(meta, blobs=listed), ensure_ascii=False, sort_keys=True).encode("utf-8")
        tail = meta_b + _TAIL.pack(len(meta_b), _END)
        h.update(tail)
        yield tail
        yield h.digest()

    return outfile.write(path, chunks(), force=force)


def _open(path: Path):
    if not path.exists():
        raise KvcliError(f"cache file not found: {path}")
    if path.is_dir():
        raise KvcliError(f"{path} is a directory, neither a .kvc file nor a store folder (no store.json)")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise KvcliError(f"{path} is not a regular file, not a .kvc file")
    try:
        return open(path, "rb")
    except OSError as e:
        raise KvcliError(f"cannot read {path}: {e.strerror}") from None


def read(path) -> KvcFile:
    """Read and check a .kvc file: magic, format, lengths, digest. Says in one line what is wrong. A format-3 file's
    state is not read (KvcFile.state None; `iter_state_pieces`), its digest is checked 1 MB at a time."""
    path = Path(path)
    with _open(path) as fh:
        try:
            head = fh.read(_HEAD.size)
            if len(head) < len(MAGIC) or head[:len(MAGIC)] != MAGIC:
                raise KvcliError(f"{path} is not a kvcli .kvc file")
            if len(head) < _HEAD.size:
                raise KvcliError(f"{path} is truncated ({len(head)} bytes)")
            _, fmt, _, meta_len = _HEAD.unpack(head)
            if fmt not in READS:
                raise KvcliError(f"{path} is a .kvc file of format {fmt}; this kvcli reads formats "
                                 f"{', '.join(map(str, READS))}: compress the document again")
            if fmt == FORMAT_PIECES:
                return _read_pieces(path, fh)
            fh.seek(0)
            raw = fh.read()   # formats 1 and 2: whole, as before
        except OSError as e:
            raise KvcliError(f"cannot read {path}: {e.strerror}") from None
    p = _HEAD.size
    if len(raw) < p + meta_len + _DIGEST:
        raise KvcliError(f"{path} is truncated ({len(raw)} bytes)")
    meta, blob_list = _parse_meta(path, raw[p:p + meta_len])
    p += meta_len
    expected = p + sum(k for _, _, k in blob_list) + _DIGEST
    if len(raw) < expected:
        raise KvcliError(f"{path} is truncated ({len(raw)} bytes, expected {expected})")
    if len(raw) > expected:
        raise KvcliError(f"{path} is corrupted ({len(raw) - expected} unexpected trailing bytes)")
    if hashlib.sha256(memoryview(raw)[:expected - _DIGEST]).digest() != raw[expected - _DIGEST:]:
        raise KvcliError(f"{path} is corrupted (checksum mismatch)")
    blobs = {}
    for name, dtype, k in blob_list:
        if dtype == "zblocks":
            blobs[name] = unpack_zero_blocks(memoryview(raw)[p:p + k], str(path))
        else:
            blobs[name] = raw[p:p + k] if dtype == "uint8" else _array(raw[p:p + k], dtype)
        p += k
    if "state" not in blobs or "prefix_tokens" not in blobs:
        raise KvcliError(f"{path} is corrupted (no cache state)")
    return _kvc_file(path, meta, blobs, state=bytes(blobs["state"]))


def _parse_meta(path: Path, meta_b: bytes) -> tuple[dict, list[tuple[str, str, int]]]:
    try:
        meta = json.loads(meta_b.decode("utf-8"))
        blob_list = [(str(n), str(t), int(k)) for n, t, k in meta["blobs"]]
    except (ValueError, KeyError, TypeError):
        raise KvcliError(f"{path} is corrupted (unreadable metadata)") from None
    for _, dtype, k in blob_list:
        if dtype not in _DTYPES:
            raise KvcliError(f"{path} is corrupted (unknown blob type {dtype})")
        if k < 0 or k % np.dtype(_DTYPES[dtype]).itemsize:
            raise KvcliError(f"{path} is corrupted (a blob of {k} bytes of {dtype})")
    return meta, blob_list


def _array(raw: bytes, dtype: str) -> np.ndarray:
    return np.frombuffer(raw, _DTYPES[dtype]).copy()


def _read_pieces(path: Path, fh) -> KvcFile:
    """The rest of `read` for a format-3 file: end marker, digest (streamed), meta, small blobs; pieces located."""
    st = os.fstat(fh.fileno())
    size = st.st_size
    if size < _HEAD.size + _TAIL.size + _DIGEST:
        raise KvcliError(f"{path} is truncated ({size} bytes)")
    end = size - _DIGEST - _TAIL.size
    fh.seek(end)
    meta_len, marker = _TAIL.unpack(fh.read(_TAIL.size))
    if marker != _END:
        back = min(size, 1 << 16)   # bytes appended after a whole file: its end marker lies a little before
        fh.seek(size - back)
        at = fh.read(back).rfind(_END)
        extra = back - at - len(_END) - _DIGEST if at >= 0 else -1
        if extra > 0:
            raise KvcliError(f"{path} is corrupted ({extra} unexpected trailing bytes)")
        raise KvcliError(f"{path} is truncated ({size} bytes, no end marker)")
    if meta_len > end - _HEAD.size:
        raise KvcliError(f"{path} is corrupted (metadata of {meta_len} bytes in a file of {size})")
    fh.seek(0)
    h, left = hashlib.sha256(), size - _DIGEST
    while left:
        chunk = fh.read(min(_CHUNK, left))
        if not chunk:
            raise KvcliError(f"{path} is truncated (it shrank while being read)")
        h.update(chunk)
        left -= len(chunk)
    if h.digest() != fh.read(_DIGEST):
        raise KvcliError(f"{path} is corrupted (checksum mismatch)")
    meta_at = end - meta_len
    fh.seek(meta_at)
    meta, blob_list = _parse_meta(path, fh.read(meta_len))
    if _HEAD.size + sum(k for _, _, k in blob_list) != meta_at:
        raise KvcliError(f"{path} is corrupted (its blobs do not add up to its length)")
    blobs, pieces, p = {}, [], _HEAD.size
    for name, dtype, k in blob_list:
        if name == "state_piece" and dtype == "uint8":
            pieces.append((p, k))
        elif name in ("prefix_tokens", "prefix_logits", "colsum") and dtype != "uint8" and name not in blobs:
            fh.seek(p)
            blobs[name] = _array(fh.read(k), dtype)
        else:
            raise KvcliError(f"{path} is corrupted (blob {name} of {dtype} in a file of pieces)")
        p += k
    if not pieces or "prefix_tokens" not in blobs:
        raise KvcliError(f"{path} is corrupted (no cache state)")
    return _kvc_file(path, meta, blobs, state=None, pieces=pieces,
                     stamp=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))


def _kvc_file(path: Path, meta: dict, blobs: dict, **kw) -> KvcFile:
    """The KvcFile of a read file's meta and blobs (kept positions and column sums shaped as the meta says)."""
    kept = None
    if "kept_counts" in blobs:
        counts, flat = blobs["kept_counts"], blobs.get("kept_positions")
        model = meta.get("model")
        n_layer, n_head_kv = (model.get(k) if isinstance(model, dict) else None for k in ("n_layer", "n_head_kv"))
        if not (_count(n_layer) and n_layer and _count(n_head_kv) and n_head_kv):
            raise KvcliError(f"{path} is corrupted "
                             "(metadata model.n_layer / model.n_head_kv are not positive integers)")
        if flat is None or counts.size != n_layer * n_head_kv or int(counts.sum()) != flat.size:
            raise KvcliError(f"{path} is corrupted (kept positions do not match the model's shape)")
        offs = np.concatenate([[0], np.cumsum(counts)])
        kept = [[flat[offs[l * n_head_kv + h]:offs[l * n_head_kv + h + 1]] for h in range(n_head_kv)]
                for l in range(n_layer)]
    colsum = blobs.get("colsum")
    if colsum is not None:
        st, model = meta.get("store"), meta.get("model")
        try:
            shape = (int(model["n_layer"]), int(st["n_head"]), int(st["split"]))
        except (TypeError, KeyError, ValueError):
            raise KvcliError(f"{path} is corrupted (column sums without their shape)") from None
        if colsum.size != shape[0] * shape[1] * shape[2]:
            raise KvcliError(f"{path} is corrupted (column sums do not match the model's shape)")
        colsum = colsum.reshape(shape)
    meta.pop("blobs")
    return KvcFile(meta=meta, prefix_tokens=blobs["prefix_tokens"], kept_positions=kept,
                   prefix_logits=blobs.get("prefix_logits"), colsum=colsum, path=path, **kw)


def iter_state_pieces(f: KvcFile) -> Iterator[bytes]:
    """The sequence state of `f` a piece at a time: a format-3 file's pieces read from its file one by one (none
    held after the next is read), refused in one line when the file changed since `read` (replaced, cut, rewritten)
    or is gone; a format-1/2 file's whole state as one piece. For NativeSession.restore_seq_pieces."""
    if f.pieces is None:
        if f.state is None:
            raise KvcliError(f"{f.path or 'the cache file'} holds no cache state")
        yield f.state
        return
    try:
        fh = open(f.path, "rb")
    except OSError as e:
        raise KvcliError(f"cannot read {f.path}: {e.strerror}") from None
    with fh:
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != f.stamp:
            raise KvcliError(f"{f.path} changed since it was read: load it again")
        for offset, n in f.pieces:
            try:
                fh.seek(offset)
                data = fh.read(n)
            except OSError as e:
                raise KvcliError(f"cannot read {f.path}: {e.strerror}") from None
            if len(data) != n:
                raise KvcliError(f"{f.path} is truncated (it shrank since it was read)")
            yield data
            del data


def _peek_head(fh) -> tuple[int, dict | None]:
    """A .kvc file's format and meta, unchecked, from its head (formats 1, 2; the file is left at its first blob) or
    its end (format 3)."""
    magic, fmt, _, meta_len = _HEAD.unpack(fh.read(_HEAD.size))
    if magic != MAGIC:
        return fmt, None
    if fmt == FORMAT_PIECES:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(size - _DIGEST - _TAIL.size)
        meta_len, marker = _TAIL.unpack(fh.read(_TAIL.size))
        if marker != _END or meta_len > size:
            return fmt, None
        fh.seek(size - _DIGEST - _TAIL.size - meta_len)
    if meta_len > 1 << 30:
        return fmt, None
    meta = json.loads(fh.read(meta_len).decode("utf-8"))
    return fmt, meta if isinstance(meta, dict) else None


def peek_meta(path) -> dict | None:
    """The meta of a .kvc file from its head alone (a format-3 file's from its end), unchecked (None when it is not
    readable as one): what kind of file it is, before `read` checks the whole of it (kvcli run --cache: a stored
    document or a compressed one)."""
    try:
        if not Path(path).is_file():   # a FIFO would block: `read` says what it is
            return None
        with open(path, "rb") as fh:
            return _peek_head(fh)[1]
    except (OSError, struct.error, ValueError):
        return None


def peek_tokens(path) -> np.ndarray | None:
    """A .kvc file's prompt tokens (its first blob) without reading its state, unchecked (None when they cannot be
    read): which document a stored file holds, before `read` checks the whole of it."""
    try:
        with open(path, "rb") as fh:
            fmt, meta = _peek_head(fh)
            name, dtype, size = meta["blobs"][0]
            if name != "prefix_tokens" or dtype != "int32":
                return None
            if fmt == FORMAT_PIECES:
                fh.seek(_HEAD.size)   # its blobs follow the head
            raw = fh.read(int(size))
    except (OSError, struct.error, ValueError, KeyError, IndexError, TypeError):
        return None
    return np.frombuffer(raw, np.int32) if len(raw) == int(size) and len(raw) % 4 == 0 else None


def base_meta(session) -> dict:
    """The header fields every .kvc file of a native session starts with: versions and the model it is bound to."""
    info = session.info
    ident = identity()
    return {
        "kvcli_version": __version__, "native_state_format": ident["state_format"],
        "llama_commit": ident["llama_commit"], "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"hash": model_hash(Path(session.model_path)), "name": info.name, "path": str(session.model_path),
                  "n_layer": info.n_layer, "n_head_kv": info.n_head_kv, "head_dim": info.head_dim,
                  "sliding_layers": list(info.sliding_layers), "n_vocab": session.n_vocab},
        "cache_type": session.cache_type, "flash_attn": session.flash_attn,
    }


def load_checked(path, model_path) -> KvcFile:
    """Read a .kvc file and refuse it in one line unless it is whole, of this build, well formed and made for
    the model at `model_path`."""
    f = read(path)
    check_versions(f)
    check_meta(f)
    check_state(f)
    check_model(f, model_path)
    return f


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


_STR, _OPT_STR = (lambda v: isinstance(v, str)), (lambda v: v is None or isinstance(v, str))
_BOOL, _DICT = (lambda v: isinstance(v, bool)), (lambda v: isinstance(v, dict))
_POSITIVE = (lambda v: _count(v) and v > 0)


class _Optional:
    """A field that files written before it existed lack."""

    def __init__(self, rule):
        self.rule = rule

    def __call__(self, v) -> bool:
        return self.rule(v)


_TURN = {"question": _STR, "answer": _STR, "stopped": _STR, "tokens_in": _count, "tokens_out": _count}
# what Conversation.to_kvc writes (chat.py), field by field: a file is input, checked before any field is used
META_SCHEMA = {
    "kvcli_version": _STR, "native_state_format": _count, "llama_commit": _STR, "created": _STR,
    "model": {"hash": _STR, "name": _STR, "path": _STR, "n_layer": _POSITIVE, "n_head_kv": _POSITIVE,
              "head_dim": _POSITIVE, "n_vocab": _POSITIVE,
              "sliding_layers": lambda v: isinstance(v, list) and all(_count(x) for x in v)},
    "cache_type": _STR, "flash_attn": _BOOL, "policy": _STR, "budget": lambda v: v is None or _POSITIVE(v),
    "policy_args": _DICT, "resolved_params": lambda v: v is None or _DICT(v), "original_tokens": _POSITIVE,
    "mode": lambda v: v in ("question-aware", "question-agnostic"), "question": _OPT_STR, "system": _OPT_STR,
    "document": _STR, "generic_suffix": _OPT_STR, "compressed": _BOOL,
    "conversation": {"reset_pos": _count, "reset_cells": _count, "next_pos": _POSITIVE, "cells": _POSITIVE,
                     "reindexed": _count, "rope": _Optional(lambda v: v in (None, "short", "long")),
                     "tail": lambda v: v in ("user", "assistant"), "pending": _BOOL,
                     "turns": lambda v: isinstance(v, list) and all(_matches(t, _TURN) == "" for t in v)},
    # a stored document (kvcli/drivers/reselect.py): its cells are the prompt's first `split` tokens, uncompressed
    "store": _Optional(lambda v: _matches(v, {"split": _POSITIVE, "n_head": _POSITIVE, "colsum": _BOOL}) == ""),
}


def _matches(value, schema, where: str = "") -> str:
    """'' when `value` fits `schema` (a dict of fields -> schema or predicate), else the first field that does not."""
    if not isinstance(value, dict):
        return where or "the metadata"
    required = {k for k, rule in schema.items() if not isinstance(rule, _Optional)}
    odd = sorted(required - set(value)) or sorted(set(value) - set(schema))
    if odd:
        return f"{where}{'.' if where else ''}{odd[0]} ({'missing' if odd[0] in schema else 'unexpected'})"
    for key, rule in schema.items():
        if key not in value:
            continue
        name = f"{where}{'.' if where else ''}{key}"
        bad = _matches(value[key], rule, name) if isinstance(rule, dict) else ("" if rule(value[key]) else name)
        if bad:
            return bad
    return ""


def check_meta(kvc: KvcFile) -> None:
    """Refuse a file whose metadata does not have every field of META_SCHEMA with the right type (one line)."""
    bad = _matches(kvc.meta, META_SCHEMA)
    if bad:
        raise KvcliError(f"{kvc.path or 'the cache file'} is corrupted (metadata field {bad} is not valid)")


def check_state(kvc: KvcFile) -> None:
    """Read the cache state's layout (llama.cpp's llama_kv_cache::state_write with kvcli's prefix and bias suffix,
    one stream; then, for a model with sliding-window layers, its window cache's) and check it against the
    metadata: cells, positions, layers, K/V row types and sizes, finite values, the bias block's shape, and
    nothing after it. The digest only says the file is as written; this says
    the state is one this file's header describes (a state rebuilt with a valid digest but damaged bytes).
    A format-3 file's pieces are read one at a time (iter_state_pieces), each an uncompressed range of cells (no
    header, no bias) whose window cells, if any, end where its cells do; together they hold the cells the header
    says."""
    def bad(what: str):
        return KvcliError(f"{kvc.path} is corrupted (cache state: {what})")

    if kvc.meta["cache_type"] not in CACHE_TYPES:
        raise KvcliError(f"{kvc.path} is corrupted (unknown cache type {kvc.meta['cache_type']!r})")
    layout = _StateLayout(kvc.meta, bad)
    if kvc.pieces is None:
        layout.check(kvc.state, whole=True)
    else:
        parts = []
        for piece in iter_state_pieces(kvc):   # not enumerate: its cached tuple would hold the last piece
            try:
                parts.append(layout.check(piece, whole=False))
            except KvcliError as e:
                where = f"(cache state, piece {len(parts) + 1}: "
                raise KvcliError(str(e).replace("(cache state: ", where, 1)) from None
            del piece
        pos = np.concatenate(parts)
        if pos.size != layout.cells:
            raise bad(f"{pos.size} cells in its pieces, the header says {layout.cells}")
        layout.check_cells(pos)


_STATE_MAGIC, _SUFFIX_MAGIC = 0x4C43564B, 0x4243564B
_GGML_FLOAT = {0: np.float32, 1: np.float16}    # the cache types whose rows are plain floats (checked finite)


class _StateLayout:
    """check_state's reading of one sequence state (a whole one, or a format-3 file's piece)."""

    def __init__(self, meta: dict, bad):
        import gguf  # noqa: PLC0415

        m = meta["model"]
        self.meta, self.bad = meta, bad
        self.n_layer, self.n_head_kv, self.head_dim = m["n_layer"], m["n_head_kv"], m["head_dim"]
        self.n_sliding = len(m["sliding_layers"])
        self.ggml_type = CACHE_TYPES[meta["cache_type"]]
        self.block, self.size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        self.row = self.n_head_kv * self.head_dim // self.block * self.size
        self.cells, self.next_pos = meta["conversation"]["cells"], meta["conversation"]["next_pos"]

    def check_cells(self, pos: np.ndarray) -> None:
        """The sequence's cell positions: distinct, ending at next_pos - 1."""
        if pos.size and (pos.min() < 0 or pos.max() != self.next_pos - 1 or np.unique(pos).size != pos.size):
            raise self.bad(f"cell positions are not distinct positions ending at {self.next_pos - 1}")

    def check(self, state, whole: bool) -> np.ndarray:
        """The positions of the cells of `state`'s compressed cache, its layout checked (a piece: uncompressed,
        its window cells consecutive and ending where its cells do)."""
        r = StateReader(state)
        try:
            r.take(8)                                       # llama.cpp's io magic and the saved sequence's id
            pos = self._cache(r, self.n_layer, window=False, whole=whole)
            if self.n_sliding:                              # llama_kv_cache_iswa writes its window cache next
                win = self._cache(r, self.n_sliding, window=True, whole=whole)
                if not whole and win.size and (not pos.size or win.max() != pos.max()):
                    raise self.bad("the sliding-window cache's positions end elsewhere than its cells'")
        except ValueError as e:
            raise self.bad(str(e)) from None
        if r.p != len(state):
            raise self.bad(f"{len(state) - r.p} bytes after its end")
        return pos

    def _cache(self, r: StateReader, n_layer: int, window: bool, whole: bool) -> np.ndarray:
        """One llama_kv_cache's part: the compressed cache's (its cells are the header's, with its headers and
        bias), or (window) the sliding-window layers' cache of a model with them (consecutive positions ending
        where the sequence does, no header, no bias)."""
        bad, n_head_kv, ggml_type = self.bad, self.n_head_kv, self.ggml_type
        if r.u("<I") != _STATE_MAGIC:
            raise bad("not a kvcli state")
        r.take(12)                                          # format, model fingerprint: the native load checks them
        n_headers = r.u("<I")
        if n_headers > (1 if whole and not window else 0):
            raise bad(f"{n_headers} sequence headers for {'one sequence' if whole else 'a piece'}")
        r.take(n_headers * (4 + 56 + 4))                    # seq id, kvcli_state_header, flags
        if r.u("<I") != 1:
            raise bad("not one stream")
        cells = r.u("<I")
        if whole and not window and cells != self.cells:
            raise bad(f"{cells} cells, the header says {self.cells}")
        meta = np.frombuffer(r.take(12 * cells), np.int32).reshape(cells, 3) if cells else np.zeros((0, 3), np.int32)
        if (meta[:, 1] != 1).any():   # pos, n_seq (1), seq id: a cell of several would have several ids
            i = int(np.flatnonzero(meta[:, 1] != 1)[0])
            raise bad(f"cell {i} belongs to {int(meta[i, 1]) & 0xFFFFFFFF} sequences")
        pos = meta[:, 0].astype(np.int64)
        if whole:
            self.check_cells(pos)
        if window and cells and pos.max() - pos.min() + 1 != cells:
            raise bad("the sliding-window cache's positions are not consecutive")
        v_trans, layers = r.u("<I"), r.u("<I")
        if layers != n_layer:
            raise bad(f"{layers} layers, the model has {n_layer}")
        for kind in ("K", "V"):
            for il in range(n_layer):
                t = r.u("<i")
                if t != ggml_type:
                    raise bad(f"layer {il} {kind} type {t}, the header says {self.meta['cache_type']}")
                if kind == "V" and v_trans:
                    el, width = r.u("<I"), r.u("<I")
                    ok = el * self.block == self.size and width == n_head_kv * self.head_dim
                    nbytes = width * cells * el
                else:
                    got = r.u("<Q")
                    ok, nbytes = got == self.row, cells * self.row
                if not ok:
                    raise bad(f"layer {il} {kind} rows do not have the model's size")
                data = r.take(nbytes)
                if ggml_type in _GGML_FLOAT and not np.isfinite(np.frombuffer(data, _GGML_FLOAT[ggml_type])).all():
                    raise bad(f"layer {il} {kind} holds values that are not finite")
        if r.u("<I") != _SUFFIX_MAGIC:
            raise bad("no bias block")
        if r.u("<I"):
            dims = (r.u("<I"), r.u("<I"), r.u("<I"))
            if window or not whole or dims != (n_layer, n_head_kv, cells):
                raise bad(f"bias block of shape {dims}, expected {(n_layer, n_head_kv, cells) if whole else 'none'}")
            bias = np.frombuffer(r.take(4 * n_layer * n_head_kv * cells), np.float32)
            if np.isnan(bias).any() or (bias == np.inf).any():
                raise bad("bias values that are not numbers")
        return pos


def check_versions(kvc: KvcFile) -> None:
    """Refuse a file another kvcli version or native state format wrote (the state bytes are
    llama.cpp's internal layout plus our patch's: they are only valid for the same build)."""
    name = kvc.path or "the cache file"
    if kvc.meta.get("kvcli_version") != __version__:
        raise KvcliError(f"{name} was written by kvcli {kvc.meta.get('kvcli_version')}; this is kvcli {__version__}: "
                         "compress the document again")
    fmt = identity()["state_format"]
    if kvc.meta.get("native_state_format") != fmt:
        raise KvcliError(f"{name} holds native state format {kvc.meta.get('native_state_format')}; this build "
                         f"reads format {fmt}: compress the document again")


def check_model(kvc: KvcFile, model_path) -> None:
    """Refuse a file compressed for another model (compared by kvcli.models.model_hash)."""
    want = kvc.meta["model"]
    got = model_hash(Path(model_path))
    if got != want["hash"]:
        raise KvcliError(f"{kvc.path or 'the cache file'} was compressed for model {want['name']} "
                         f"(hash {want['hash']}, {want['path']}), not {Path(model_path).name} (hash {got}): "
                         "pass --model with the model it was made with")
