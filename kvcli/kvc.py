"""`.kvc` files: a compressed document (and the conversation on it so far), saved once, loaded fast.

Layout (little endian):

    b"KVCLIKVC"  u32 format  u32 0  u64 meta_len  meta (JSON, UTF-8)  blob...  sha256 (32 bytes)

`meta["blobs"]` lists the blobs that follow, in order, as [name, dtype, n_bytes]:

    prefix_tokens   int32    the templated prompt that was prefilled and compressed
    kept_counts     int32    [n_layer * n_head_kv] entries kept per (layer, KV head) (compressed only)
    kept_positions  int32    their original positions, concatenated in (layer, head) order
    prefix_logits   float32  logits after the prompt's last token (only when an answer to it is still due)
    state           uint8    llama_state_seq_get_data of the sequence: cells, K/V rows, and (our
                             native patch) the slot bias and header of a compressed sequence

The digest covers every byte before it, so truncation and corruption are both caught. The
meta records everything needed to refuse a file that does not fit (kvc format, kvcli version,
native state format, model hash) and to continue the conversation (document, system message,
question, policy, budget, parameters, positions). Writes go to a temporary file in the same
directory, fsynced, then renamed over the target (kvcli/outfile.py): an interrupted save leaves no half file.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli.errors import KvcliError

MAGIC = b"KVCLIKVC"
FORMAT = 1
_HEAD = struct.Struct("<8sIIQ")
_DIGEST = 32
_DTYPES = {"int32": np.int32, "float32": np.float32, "uint8": np.uint8}


@dataclass
class KvcFile:
    meta: dict
    prefix_tokens: np.ndarray
    state: bytes
    kept_positions: list[list[np.ndarray]] | None = None
    prefix_logits: np.ndarray | None = None
    path: Path | None = field(default=None, compare=False)

    # ---------------------------------------------------------------- encoding
    def blobs(self) -> list[tuple[str, str, bytes]]:
        out = [("prefix_tokens", "int32", np.ascontiguousarray(self.prefix_tokens, np.int32).tobytes())]
        if self.kept_positions is not None:
            counts = np.array([len(h) for layer in self.kept_positions for h in layer], np.int32)
            flat = [np.asarray(h, np.int32) for layer in self.kept_positions for h in layer]
            out.append(("kept_counts", "int32", counts.tobytes()))
            out.append(("kept_positions", "int32", (np.concatenate(flat) if flat else np.zeros(0, np.int32))
                        .astype(np.int32).tobytes()))
        if self.prefix_logits is not None:
            out.append(("prefix_logits", "float32", np.ascontiguousarray(self.prefix_logits, np.float32).tobytes()))
        out.append(("state", "uint8", bytes(self.state)))
        return out


def write(path, kvc: KvcFile, force: bool = True) -> int:
    """Write atomically (kvcli.outfile: temporary file + fsync + rename; force=False refuses an existing
    file, also one that appears while this runs); returns the file size."""
    from kvcli import outfile  # noqa: PLC0415
    blobs = kvc.blobs()
    meta = dict(kvc.meta, blobs=[[n, t, len(b)] for n, t, b in blobs])
    meta_b = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
    chunks = [_HEAD.pack(MAGIC, FORMAT, 0, len(meta_b)), meta_b, *(b for _, _, b in blobs)]
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return outfile.write(path, [*chunks, h.digest()], force=force)


def read(path) -> KvcFile:
    """Read and check a .kvc file: magic, format, lengths, digest. Says in one line what is wrong."""
    path = Path(path)
    if not path.exists():
        raise KvcliError(f"cache file not found: {path}")
    if path.is_dir():
        raise KvcliError(f"{path} is a directory, not a .kvc file")
    if not path.is_file():  # a FIFO or a device would block or never end
        raise KvcliError(f"{path} is not a regular file, not a .kvc file")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise KvcliError(f"cannot read {path}: {e.strerror}") from None
    if len(raw) < len(MAGIC) or raw[:len(MAGIC)] != MAGIC:
        raise KvcliError(f"{path} is not a kvcli .kvc file")
    if len(raw) < _HEAD.size:
        raise KvcliError(f"{path} is truncated ({len(raw)} bytes)")
    _, fmt, _, meta_len = _HEAD.unpack_from(raw)
    if fmt != FORMAT:
        raise KvcliError(f"{path} is a .kvc file of format {fmt}; this kvcli reads format {FORMAT}: "
                         "compress the document again")
    p = _HEAD.size
    if len(raw) < p + meta_len + _DIGEST:
        raise KvcliError(f"{path} is truncated ({len(raw)} bytes)")
    try:
        meta = json.loads(raw[p:p + meta_len].decode("utf-8"))
        blob_list = [(str(n), str(t), int(k)) for n, t, k in meta["blobs"]]
    except (ValueError, KeyError, TypeError):
        raise KvcliError(f"{path} is corrupted (unreadable metadata)") from None
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
        if dtype not in _DTYPES:
            raise KvcliError(f"{path} is corrupted (unknown blob type {dtype})")
        blobs[name] = raw[p:p + k] if dtype == "uint8" else np.frombuffer(raw, _DTYPES[dtype], k // np.dtype(
            _DTYPES[dtype]).itemsize, p).copy()
        p += k
    if "state" not in blobs or "prefix_tokens" not in blobs:
        raise KvcliError(f"{path} is corrupted (no cache state)")
    kept = None
    if "kept_counts" in blobs:
        counts, flat = blobs["kept_counts"], blobs.get("kept_positions")
        n_layer, n_head_kv = int(meta["model"]["n_layer"]), int(meta["model"]["n_head_kv"])
        if flat is None or counts.size != n_layer * n_head_kv or int(counts.sum()) != flat.size:
            raise KvcliError(f"{path} is corrupted (kept positions do not match the model's shape)")
        offs = np.concatenate([[0], np.cumsum(counts)])
        kept = [[flat[offs[l * n_head_kv + h]:offs[l * n_head_kv + h + 1]] for h in range(n_head_kv)]
                for l in range(n_layer)]
    meta.pop("blobs")
    return KvcFile(meta=meta, prefix_tokens=blobs["prefix_tokens"], state=bytes(blobs["state"]),
                   kept_positions=kept, prefix_logits=blobs.get("prefix_logits"), path=path)


def check_versions(kvc: KvcFile) -> None:
    """Refuse a file another kvcli version or native state format wrote (the state bytes are
    llama.cpp's internal layout plus our patch's: they are only valid for the same build)."""
    from kvcli import __version__  # noqa: PLC0415
    from kvcli.native.lib import identity  # noqa: PLC0415
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
    from kvcli.models import model_hash  # noqa: PLC0415
    want = kvc.meta["model"]
    got = model_hash(Path(model_path))
    if got != want["hash"]:
        raise KvcliError(f"{kvc.path or 'the cache file'} was compressed for model {want['name']} "
                         f"(hash {want['hash']}, {want['path']}), not {Path(model_path).name} (hash {got}): "
                         "pass --model with the model it was made with")
