"""The document store: every document cache kvcli writes to disk (re-selection's stored full caches) is an entry here,
so nothing outlives its process unknown, unlisted or unbounded (issue #48). `kvcli documents` shows and prunes it.

Where: `root()` = $KVCLI_CACHE/documents (default ~/.cache/kvcli/documents). One folder per entry, named by its id:

    <root>/<id>/entry.json     what it is (below), rewritten atomically
    <root>/<id>/lock           held with flock(LOCK_SH) by every process using the entry, for its whole use
    <root>/<id>/cache.kvc      the payload of a temporary (or cached) exact store (kvcli/drivers/reselect.py), or
    <root>/<id>/chunks[.part]  that of a bounded one (kvcli/drivers/reselect_bounded.py; .part while it is read)

A kept store (`kvcli chat --store PATH`, `kvcli compress --store -o PATH`) lives at the user's PATH; its entry folder
holds only entry.json and the lock, so that it is listed and can be removed like the others.

States (entry.json "state"):
    reading     being read by its (live) owner
    temporary   a finished read used by its owner and removed when the owner is done (`Entry.release`)
    cached      a finished read kept in the store for reuse by key (`find`), under the cap and expiry
    kept        a finished read at a path the user named: not expired, not removed by the cap
    partial     a read stopped by Ctrl-C, SIGTERM or SIGHUP, or whose process died (kill -9, the OOM killer): its
                chunks are kept with what a resumed read needs (the model's hash and path, the document's SHA-256, the
                settings, the chunks done, the cache carried after the last): the same read continues it (`resume`)

Liveness is the lock, not a pid: flock locks go with their process, however it ends, so a process that finds an
entry's lock free knows nobody uses it, and one that holds it exclusively (only removal takes LOCK_EX) cannot remove
a store another process uses. Every process that opens the store (`create`, `entries`, `prune`, ...) first sweeps it
(`sweep`): a read whose owner died becomes `partial` (bounded, with chunks on disk) or goes (nothing resumable); a
temporary store whose owner died goes; temporary, cached and partial entries unused for longer than the expiry (a
day; KVCLI_STORE_EXPIRY_HOURS or `store_expiry_hours` in the config file) go; then the size cap (KVCLI_STORE_MAX_BYTES
or `store_max_bytes`; default 10 GiB) removes the least recently used entries not in use, and says so on stderr.
A store an older kvcli left in the root (`MODEL.DIGEST.PID.kvc`, `.chunks`, `.chunks.part`) is removed by the sweep
once its process is gone; anything else found there is listed as `unknown` and removed by `prune`.

The API (kvcli/drivers/reselect*.py use it; a server keeping documents by key would too):

    e = create(form="exact"|"bounded", model_path=..., tokens=[...], settings={...}, key=None, kept_path=None,
               reserve=bytes)   -> Entry, in state "reading", held by this process (the cap made room for `reserve`)
    e.payload                   where to write the store (a .kvc file or a chunk folder); e.part for a bounded one
    e.update(chunks_done=[...]) record progress (entry.json rewritten atomically)
    e.suspend()                 the read was stopped (Ctrl-C, SIGTERM): it stays `partial`, to be resumed
    resume(form=..., model_path=..., tokens=[...], settings={...}, key=None, kept_path=None)
                                -> Entry | None: a partial read of the same document taken over (state "reading")
    e.finish("temporary"|"cached"|"kept")   the read is complete (sizes recorded, the cap enforced)
    e.touch()                   last used = now
    e.release()                 this process is done: a temporary entry is removed, any other stays (touched)
    e.abandon()                 the read failed or was interrupted: its files go
    register_kept(path, form=..., model_path=..., tokens=[...])   list a store written whole at a user's path
    find(key) -> Entry | None   a finished cached/kept entry of this key, held by this process (touched)
    key_of(model_path, tokens, **settings)   such a key

    Keeping documents by key (a server): StoredDocument.read(..., key=k) / ChunkedStore.read(..., key=k) store as a
    `cached` entry that stays after close(); later `e = find(k)` holds it, StoredDocument.from_file(e.payload, s) or
    ChunkedStore.open(e.payload) reads it, and `e.release()` lets it go (the cap and expiry then govern it).
    use_path(path) -> Entry | None  the entry of a kept store at `path` (kvcli run/chat --cache PATH), held
    entries() -> [Info]         every entry, after a sweep; Info.as_json() is `kvcli documents list --json`'s
    remove(id) / prune(older_than=None, everything=False) / enforce_cap(reserve=0)
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcli import config, outfile
from kvcli.errors import KvcliError
from kvcli.models import model_hash

FORMAT = 1
RECORD, LOCK = "entry.json", "lock"
STATES = ("reading", "temporary", "cached", "kept", "partial")
DEFAULT_MAX_BYTES = 10 << 30
DEFAULT_EXPIRY_H = 24.0
_NEW = ".new-"                 # an entry being created: renamed to its id once its lock is held
CONVERTED = "converted"        # converted documents' text by their SHA-256 (kvcli/documents.py): no entry, not swept
_ID = re.compile(r"[0-9a-f]{8}")
_LEGACY_PID = re.compile(r"\.(\d+)\.(kvc|chunks)(\.part)?$")   # the names kvcli wrote before this store


def root() -> Path:
    """The store's folder: $KVCLI_CACHE/documents (~/.cache/kvcli/documents), created."""
    r = Path(os.environ.get("KVCLI_CACHE", Path.home() / ".cache" / "kvcli")) / "documents"
    r.mkdir(parents=True, exist_ok=True)
    return r


_MAX_BYTES: int | None = None   # this process's cap when set (`override_max_bytes`)


def max_bytes() -> int:
    return _MAX_BYTES if _MAX_BYTES is not None else int(config.get("store_max_bytes", DEFAULT_MAX_BYTES))


def override_max_bytes(n: int | None) -> None:
    """The cap this process enforces from now on (kvcli serve --store-max-bytes); None: the configured one."""
    global _MAX_BYTES
    _MAX_BYTES = n


def expiry_s() -> float:
    hours = float(config.get("store_expiry_hours", DEFAULT_EXPIRY_H))
    if not hours > 0:
        raise KvcliError(f"the store's expiry must be a number of hours > 0 (got {hours})")
    return hours * 3600


def key_of(model_path, tokens, **settings) -> str:
    """A key for a stored document (`find`, the drivers' `key=`): the model's hash, the tokens, the settings."""
    h = hashlib.sha256(f"{_model_hash(Path(model_path))}|{json.dumps(settings, sort_keys=True)}|".encode())
    h.update(np.asarray(tokens, np.int32).tobytes())
    return h.hexdigest()[:32]


def document_sha256(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()


def tree_bytes(path: Path) -> int:
    """What `du -sb` counts: the apparent sizes of the files and folders under `path` (0 when it is gone)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    total = st.st_size
    if path.is_dir() and not path.is_symlink():
        for base, dirs, files in os.walk(path):
            for name in dirs + files:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
    return total


def _now() -> float:
    return time.time()


def _process_start() -> str | None:
    """This process's start time (clock ticks since boot; Linux): with the pid, who owns an entry."""
    try:
        return Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _lock(folder: Path, mode: int, new: bool = False) -> int | None:
    """An fd of folder/lock holding flock `mode` (non-blocking), or None when another process holds it or the lock
    file is gone. Only `create` makes the file (`new`): a probe that re-created it in a folder its owner was removing
    (between the owner's unlinking the files and removing the folder) would leave that folder behind."""
    try:
        fd = os.open(folder / LOCK, os.O_RDWR | (os.O_CREAT if new else 0), 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _read_record(folder: Path) -> dict | None:
    try:
        rec = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("kvcli_document_store") == FORMAT and rec.get("state") in STATES \
        else None


def _write_record(folder: Path, rec: dict) -> None:
    outfile.write(folder / RECORD, [json.dumps(rec, ensure_ascii=False, indent=1).encode("utf-8")])


# ---------------------------------------------------------------------------------- an entry this process holds
class Entry:
    """A store entry held by this process (a shared lock on it until `release`/`abandon`)."""

    def __init__(self, folder: Path, record: dict, fd: int):
        self.folder, self.record, self._fd = folder, record, fd

    @property
    def id(self) -> str:
        return self.record["id"]

    @property
    def payload(self) -> Path:
        return Path(self.record["path"])

    @property
    def part(self) -> Path | None:
        return Path(self.record["part"]) if self.record.get("part") else None

    def update(self, **fields) -> None:
        self.record.update(fields)
        _write_record(self.folder, self.record)

    def touch(self) -> None:
        self.update(last_used=_now())

    def finish(self, state: str) -> None:
        """The read is complete: `state` temporary, cached or kept; its size recorded, then the cap enforced."""
        if state not in ("temporary", "cached", "kept"):
            raise ValueError(state)
        self.update(state=state, bytes=tree_bytes(self.payload), chunks_done=None, pages_done=None, carry=None,
                    last_used=_now(), owner=_owner())
        if state == "kept":   # it replaced any store registered at the same path: one entry per path
            for info in entries(sweep_first=False):
                if info.id != self.id and info.kept_path == self.record["kept_path"]:
                    forget(info.id)
        enforce_cap()

    def release(self) -> None:
        """This process is done with the entry: a temporary one is removed, any other stays (last used now)."""
        if self._fd is None:
            return
        if self.record["state"] in ("temporary", "reading"):
            self._remove()
        else:
            if self.folder.exists():
                self.touch()
            self._unlock()

    def suspend(self) -> None:
        """The read was stopped (Ctrl-C, SIGTERM, SIGHUP) after some whole chunks: the entry stays, `partial`, for a
        later read of the same document to continue (`resume`); the cap and expiry govern it meanwhile."""
        if self._fd is None:
            return
        self.update(state="partial", bytes=tree_bytes(self.part) if self.part else 0, owner=None, last_used=_now())
        self._unlock()

    def abandon(self) -> None:
        """The read failed or was interrupted: what it wrote goes, and the entry (a kept store at the user's path
        that it was to replace stays, as does its own entry)."""
        if self._fd is not None:
            self._remove()

    def _remove(self, payload: bool = True) -> None:
        """Remove with the lock upgraded to exclusive (nobody else may hold it: a temporary entry is this process's)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:   # another process uses it (a cached entry found by key): it stays for them
            self._unlock()
            return
        _delete(self.folder, self.record, payload=payload)
        self._unlock()

    def _unlock(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):   # an entry dropped without release keeps no fd open (its lock free: the next sweep decides)
        try:
            self._unlock()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone; the fd closes with the process
            pass


def _owner() -> dict:
    return {"pid": os.getpid(), "started": _process_start()}


def _delete(folder: Path, rec: dict | None, payload: bool = True) -> None:
    """Remove an entry's files: its payload (and .part) unless `payload` is False (a kept store that stays), then its
    folder. Only a payload kvcli wrote is removed: a .kvc file, or a folder that is a store or a .part."""
    if rec is not None and payload:
        # a kept read that did not finish: its path may hold the store it was to replace, which stays
        keys = ("part",) if rec.get("kept_path") and rec.get("state") != "kept" else ("part", "path")
        for key in keys:
            p = rec.get(key)
            if p:
                _remove_path(Path(p), inside=folder)
    shutil.rmtree(folder, ignore_errors=True)


def _remove_path(p: Path, inside: Path) -> None:
    try:
        if p.is_dir() and not p.is_symlink():
            if p.parent == inside or p.name.endswith(".part") or (p / "store.json").exists():
                shutil.rmtree(p, ignore_errors=True)
        elif p.exists() or p.is_symlink():
            if p.parent == inside or p.suffix == ".kvc":
                p.unlink(missing_ok=True)
    except OSError:
        pass


# ---------------------------------------------------------------------------------- creating and finding
def create(*, form: str, model_path, tokens, settings: dict | None = None, key: str | None = None,
           kept_path=None, reserve: int = 0) -> Entry:
    """A new entry in state "reading", held by this process. Its payload is `kept_path` (a kept store, at the user's
    path) or a file/folder inside its entry folder. The store is swept first, and the cap makes room for `reserve`
    bytes (the store's expected size)."""
    if form not in ("exact", "bounded"):
        raise ValueError(form)
    r = root()
    sweep()
    enforce_cap(reserve)
    for _ in range(8):
        ident = secrets.token_hex(4)
        if not (r / ident).exists():
            break
    new = r / f"{_NEW}{ident}"
    new.mkdir()
    fd = _lock(new, fcntl.LOCK_SH, new=True)
    if fd is None:
        shutil.rmtree(new, ignore_errors=True)
        raise KvcliError(f"cannot lock a new entry in the document store {r}")
    folder = r / ident
    if kept_path is not None:
        path = Path(kept_path).expanduser().resolve()
    else:
        path = folder / ("cache.kvc" if form == "exact" else "chunks")
    model_path = Path(model_path)
    now = _now()
    rec = {"kvcli_document_store": FORMAT, "id": ident, "state": "reading", "form": form, "path": str(path),
           "part": str(path.with_name(path.name + ".part")) if form == "bounded" else None,
           "kept_path": str(path) if kept_path is not None else None,
           "model": {"name": model_path.stem, "path": str(model_path), "hash": _model_hash(model_path)},
           "tokens": len(tokens), "document_sha256": document_sha256(tokens), "key": key,
           "settings": dict(settings or {}), "chunks_done": [] if form == "bounded" else None, "bytes": 0,
           "created": now, "last_used": now, "owner": _owner()}
    try:
        _write_record(new, rec)
        new.rename(folder)
    except BaseException:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    return Entry(folder, rec, fd)


def resume(*, form: str, model_path, tokens, settings: dict, key: str | None = None, kept_path=None) -> Entry | None:
    """A partial read of this document (the same model file, tokens, settings, key and target path) that no process
    holds, taken over by this one: held, in state "reading" again, owned by it; None when there is none. The
    caller checks its files (what the read recorded after its last whole chunk) before it continues."""
    sweep()
    want = {"hash": _model_hash(Path(model_path)), "doc": document_sha256(tokens), "key": key,
            "kept": str(Path(kept_path).expanduser().resolve()) if kept_path is not None else None,
            "settings": json.loads(json.dumps(settings, sort_keys=True))}
    for info in entries(sweep_first=False):
        r = info.record
        if info.state != "partial" or r.get("form") != form or info.in_use:
            continue
        if {"hash": (r.get("model") or {}).get("hash"), "doc": r.get("document_sha256"), "key": r.get("key"),
                "kept": r.get("kept_path"), "settings": r.get("settings")} != want:
            continue
        e = _hold_exclusive(info.folder)
        if e is None:
            continue
        if e.record.get("state") != "partial":
            e._unlock()
            continue
        e.update(state="reading", owner=_owner(), last_used=_now())
        fcntl.flock(e._fd, fcntl.LOCK_SH)   # held as any user holds an entry from now on
        return e
    return None


def register_kept(path, *, form: str, model_path, tokens, settings: dict | None = None) -> None:
    """List a store written whole at the user's `path` (/save of a re-selected chat) as kept (one entry per path:
    one listed there already is marked used now)."""
    p = str(Path(path).expanduser().resolve())
    if any(i.kept_path == p and i.state == "kept" for i in entries()):
        e = use_path(p)
        if e is not None:
            e.update(bytes=tree_bytes(e.payload))
            e.release()
        return
    e = create(form=form, model_path=model_path, tokens=tokens, settings=settings, kept_path=path)
    try:
        e.finish("kept")
    finally:
        e.release()


def _model_hash(path: Path) -> str | None:
    try:
        return model_hash(path)
    except OSError:
        return None


def find(key: str) -> Entry | None:
    """A finished entry (cached or kept) stored under `key`, held by this process and touched; None when there is
    none (or its payload is gone)."""
    sweep()
    for info in entries(sweep_first=False):
        if info.record.get("key") == key and info.state in ("cached", "kept"):
            e = _hold(info.folder)
            if e is not None and e.payload.exists():
                e.touch()
                return e
            if e is not None:
                e._unlock()
    return None


def use_path(path) -> Entry | None:
    """The entry of the kept store at `path` (kvcli run/chat --cache PATH), held by this process and touched, or
    None when the store does not list it."""
    p = str(Path(path).expanduser().resolve())
    for info in entries():
        if info.kept_path == p:
            e = _hold(info.folder)
            if e is not None:
                e.touch()
            return e
    return None


def _hold(folder: Path) -> Entry | None:
    fd = _lock(folder, fcntl.LOCK_SH)
    if fd is None:
        return None
    rec = _read_record(folder)   # read again under the lock: it may have been removed meanwhile
    if rec is None:
        os.close(fd)
        return None
    return Entry(folder, rec, fd)


# ---------------------------------------------------------------------------------- listing and pruning
@dataclass
class Info:
    """One entry as listed (not held)."""
    id: str
    folder: Path
    record: dict
    state: str
    in_use: bool
    bytes: int            # on disk: the payload (wherever it is) and the entry folder
    store_bytes: int      # of those, under root(): what the cap counts

    @property
    def kept_path(self) -> str | None:
        return self.record.get("kept_path")

    @property
    def last_used(self) -> float:
        return float(self.record.get("last_used") or 0)

    def as_json(self) -> dict:
        r = self.record
        model = r.get("model") or {}
        used = self.last_used
        where = r.get("part") if self.state == "partial" else r.get("path")   # a partial read is in its .part
        return {"id": self.id, "state": self.state, "in_use": self.in_use, "path": where or str(self.folder),
                "entry": str(self.folder), "bytes": self.bytes, "store_bytes": self.store_bytes,
                "form": r.get("form"), "model": model.get("name"), "model_path": model.get("path"),
                "model_hash": model.get("hash"), "tokens": r.get("tokens"),
                "document_sha256": r.get("document_sha256"), "settings": r.get("settings"),
                "chunks_done": len(r["chunks_done"]) if isinstance(r.get("chunks_done"), list) else None,
                "created": _iso(r.get("created")), "last_used": _iso(used) if used else None,
                "owner_pid": (r.get("owner") or {}).get("pid") if self.in_use else None}


def _iso(t) -> str | None:
    return None if not t else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(t)))


def _in_use(folder: Path) -> bool:
    fd = _lock(folder, fcntl.LOCK_EX)
    if fd is None:
        return True
    os.close(fd)
    return False


def _info(child: Path) -> Info:
    rec = _read_record(child) if child.is_dir() else None
    if rec is None:   # not an entry: a store an older kvcli left, or a folder being created
        return Info(child.name, child, {"path": str(child), "last_used": _mtime(child)}, "unknown",
                    _unknown_in_use(child), tree_bytes(child), tree_bytes(child))
    inside = tree_bytes(child)
    outside = 0
    for key in ("path", "part"):
        p = rec.get(key)
        if p and not Path(p).is_relative_to(child):
            outside += tree_bytes(Path(p))
    return Info(rec["id"], child, rec, rec["state"], _in_use(child), inside + outside, inside)


def _mtime(p: Path) -> float:
    try:
        return p.lstat().st_mtime
    except OSError:
        return 0.0


def _removal_left(p: Path) -> bool:
    """An entry folder (named by its id) without its record: a removal that stopped between the files and the folder
    (its process killed there), when it has not changed for a minute (a removal under way takes milliseconds)."""
    return p.is_dir() and not p.is_symlink() and _ID.fullmatch(p.name) is not None and _now() - _mtime(p) > 60


def _unknown_in_use(p: Path) -> bool:
    """An item that is no entry: in use while its process lives (the pid in an old store's name), or while it is an
    entry being created (a minute at most: its lock is taken at once)."""
    if p.name.startswith(_NEW):
        return _in_use(p) or _now() - _mtime(p) < 60
    m = _LEGACY_PID.search(p.name)
    return bool(m) and int(m[1]) != os.getpid() and outfile._alive(int(m[1]))


def entries(sweep_first: bool = True) -> list[Info]:
    """Every entry (and unknown item) of the store, least recently used first; swept first unless told not to."""
    if sweep_first:
        sweep()
    r = root()
    return sorted((_info(c) for c in r.iterdir() if c.name != CONVERTED), key=lambda i: i.last_used)


def sweep() -> None:
    """What dead processes left, and what expired: a read whose owner died becomes partial (chunks on disk) or goes;
    a temporary entry whose owner died goes; cached and partial entries unused past the expiry go; a kept or cached
    entry whose payload is gone is forgotten; an older kvcli's store whose process is gone goes."""
    expiry = expiry_s()
    r = root()
    for child in list(r.iterdir()):
        if child.name == CONVERTED:
            continue
        rec = _read_record(child) if child.is_dir() else None
        if rec is None:   # an entry whose creation or removal died, or a store an older kvcli left (pid in its name)
            if (child.name.startswith(_NEW) or _LEGACY_PID.search(child.name) or _removal_left(child)) \
                    and not _unknown_in_use(child):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            continue
        e = _hold_exclusive(child)
        if e is None:
            continue
        rec = e.record
        try:
            state = rec["state"]
            if state == "reading":
                part = Path(rec["part"]) if rec.get("part") else None
                if part is not None and part.is_dir() and any(part.iterdir()):
                    e.update(state="partial", bytes=tree_bytes(part), owner=None)
                else:
                    _delete(child, rec)
            elif state == "temporary":
                _delete(child, rec)
            elif state in ("cached", "kept") and not Path(rec["path"]).exists():
                _delete(child, rec, payload=False)
            elif state in ("cached", "partial") and _now() - float(rec.get("last_used") or 0) > expiry:
                _delete(child, rec)
        finally:
            e._unlock()


def _hold_exclusive(folder: Path) -> Entry | None:
    fd = _lock(folder, fcntl.LOCK_EX)
    if fd is None:
        return None
    rec = _read_record(folder)
    if rec is None:
        os.close(fd)
        return None
    return Entry(folder, rec, fd)


def resolve_id(ident: str) -> Info:
    """The entry whose id is `ident` or starts with it (unique), or an unknown item of that name."""
    items = entries()
    hits = [i for i in items if i.id == ident] or [i for i in items if i.id.startswith(ident)]
    if not ident or not hits:
        raise KvcliError(f"no stored document '{ident}' (kvcli documents list shows them)")
    if len(hits) > 1:
        raise KvcliError(f"'{ident}' names {len(hits)} stored documents: give more of the id")
    return hits[0]


def remove(ident: str) -> Info:
    """Remove one entry (and its files; a kept store's too) unless a process uses it."""
    info = resolve_id(ident)
    if not _remove_info(info):
        raise KvcliError(f"stored document {info.id} is in use by a running kvcli "
                         f"(pid {(info.record.get('owner') or {}).get('pid')}): not removed")
    return info


def forget(ident: str) -> None:
    """Drop a kept store's entry without touching its files (a newer store registered at its path)."""
    e = _hold_exclusive(root() / ident)
    if e is not None:
        _delete(e.folder, e.record, payload=False)
        e._unlock()


def _remove_info(info: Info) -> bool:
    if info.state == "unknown":
        if info.in_use:
            return False
        if info.folder.is_dir() and not info.folder.is_symlink():
            shutil.rmtree(info.folder, ignore_errors=True)
        else:
            info.folder.unlink(missing_ok=True)
        return True
    e = _hold_exclusive(info.folder)
    if e is None:
        return False
    _delete(e.folder, e.record)
    e._unlock()
    return True


def prune(older_than: float | None = None, everything: bool = False) -> tuple[list[Info], list[Info]]:
    """(removed, left in use). Without arguments the sweep's work (expired and dead entries) and unknown items whose
    process is gone; `older_than` seconds: also any entry (kept ones too) unused for that long; `everything`: every
    entry and item not in use."""
    removed, busy = [], []
    before = {i.folder: i for i in entries(sweep_first=False)}
    sweep()
    now_there = {i.folder for i in entries(sweep_first=False)}
    removed += [i for f, i in before.items() if f not in now_there]
    for info in entries(sweep_first=False):
        chosen = everything or info.state == "unknown" or (
            older_than is not None and _now() - info.last_used > older_than)
        if not chosen:
            continue
        (removed if _remove_info(info) else busy).append(info)
    return removed, busy


def enforce_cap(reserve: int = 0) -> list[Info]:
    """Past the cap (with `reserve` bytes to come), remove the least recently used entries not in use (kept stores
    live at the user's path and are not counted); says on stderr what it removed. Returns the removed."""
    cap = max_bytes()
    items = entries(sweep_first=False)
    total = sum(i.store_bytes for i in items)
    if total + reserve <= cap:
        return []
    removed = []
    for info in items:   # least recently used first
        if total + reserve <= cap:
            break
        if info.in_use or info.state == "kept" or info.state == "unknown":
            continue
        if _remove_info(info):
            removed.append(info)
            total -= info.store_bytes
    if removed:
        freed = sum(i.store_bytes for i in removed)
        print(f"kvcli: the document store ({root()}) was past its cap of {cap / 1e6:.0f} MB (KVCLI_STORE_MAX_BYTES or "
              f"store_max_bytes in the config file): removed {len(removed)} least recently used stored document(s), "
              f"{freed / 1e6:.1f} MB: {', '.join(i.id for i in removed)}", file=sys.stderr, flush=True)
    if total + reserve > cap:
        print(f"kvcli: the document store holds {total / 1e6:.1f} MB" + (f" and {reserve / 1e6:.1f} MB to come" if
              reserve else "") + f", past its cap of {cap / 1e6:.0f} MB: the rest is in use or kept "
              "(kvcli documents list)", file=sys.stderr, flush=True)
    return removed


_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '2d', '1w' (or plain seconds) -> seconds."""
    m = _DURATION.fullmatch(text or "")
    if not m:
        raise KvcliError(f"--older-than expects a duration such as 30m, 12h, 2d or 1w (got '{text}')")
    return float(m[1]) * _UNIT[m[2]]
