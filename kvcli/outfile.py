"""Writing the user's output files (--out, compress -o, /save): a temporary file next to the target, fsynced,
then renamed over it, or linked to it to refuse a target that appeared meanwhile. Every failure is one line
(KvcliError, exit 2) and leaves no temporary behind; temporaries a killed kvcli left are removed."""
from __future__ import annotations

import errno
import glob
import hashlib
import os
from pathlib import Path

from kvcli.errors import KvcliError

NAME_MAX = 255   # bytes in one path component (Linux, macOS)


def check_names(path, what: str = "") -> None:
    """Refuse a path one of whose components is longer than the file system allows, before any work."""
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise KvcliError(f"{what}{' ' if what else ''}{str(path)[:60]}...: a path component is "
                             f"{len(os.fsencode(part))} bytes long, the file system allows {NAME_MAX}")


def check_target(path, force: bool = True) -> Path:
    """The checks a write makes, made early (before minutes of work): a writable name in an existing directory,
    not a directory, not an existing file unless `force`."""
    path = Path(path).expanduser()
    check_names(path, "cannot write")
    if path.is_dir():
        raise KvcliError(f"{path} is a directory")
    if not path.parent.is_dir():
        raise KvcliError(f"cannot write {path}: directory {path.parent} does not exist")
    if not force and path.exists():
        raise KvcliError(f"{path} exists: pass --force to overwrite it")
    return path


def _temp_prefix(path: Path) -> str:
    name = f".{path.name}.tmp"
    if len(os.fsencode(name)) + 10 > NAME_MAX:   # room for the pid: a long legal name gets a short temporary
        name = f".{hashlib.sha256(os.fsencode(path.name)).hexdigest()[:16]}.tmp"
    return name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(path: Path) -> None:
    """Remove the temporaries of writes to `path` whose process is gone (a kill -9 in the middle)."""
    prefix = _temp_prefix(path)
    for p in path.parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix):]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            p.unlink(missing_ok=True)


def write(path, chunks, force: bool = True) -> int:
    """Write the byte strings `chunks` to `path` atomically; returns the file size. force=False refuses an
    existing target, checked again at the moment the file appears (a link: rename without replace)."""
    path = check_target(path, force)
    clean_stale(path)
    tmp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        return path.stat().st_size
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror or e}") from None
    finally:  # renamed: gone already; linked, failed or interrupted: removed
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise KvcliError(f"{path} exists (it appeared while this ran): pass --force to overwrite it") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        # a file system without hard links: claim the name exclusively, then rename over the claim
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            raise KvcliError(f"{path} exists (it appeared while this ran): pass --force to overwrite it") from None
        os.replace(tmp, path)
