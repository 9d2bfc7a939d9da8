"""Small measuring helpers shared by `kvcli bench` and `kvcli eval`: peak RSS, machine description,
list parsing, distribution distances. (Rolling back and restoring a sequence are NativeSession methods.)

Everything here measures or parses; nothing estimates a figure it could measure.
"""
from __future__ import annotations

import os
import platform
import re
import resource
import statistics

import numpy as np

from kvcli.errors import KvcliError
from kvcli.engines import build_info, default_threads


# ------------------------------------------------------------------------------ memory
M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter


def return_freed_memory(threshold: int = 256 << 10) -> bool:
    """Have glibc give blocks of `threshold` bytes or more back to the system when they are freed: by default it
    raises its mmap threshold after the first large free (up to 32 MB), and a store's pieces, an observation's
    arrays and llama.cpp's buffers freed after a request then stay in the heap, counted in RSS. A long-running
    server (kvcli serve) sets it once (measured: 9 MB off the peak and the steady RSS on a 1.5k-token document).
    False where the C library is not glibc (nothing changed)."""
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process since it started (VmHWM; getrusage where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB, never reset
    except Exception:
        return None


def machine(threads: int | None = None) -> dict:
    """Where the numbers come from: CPU model, cores, threads used, OS, Python, library build."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "os": platform.platform(),
           "python": platform.python_version(),
           "threads": threads or default_threads()}
    try:
        info = build_info()
        out["native_build"] = {k: info[k] for k in ("commit", "flags", "key", "kvcli_version") if k in info} or info
    except Exception as e:  # the report still says what it could not read
        out["native_build"] = f"unknown ({e})"
    try:
        load = os.getloadavg()
        out["load_avg_1m_at_start"] = round(load[0], 2)
    except OSError:
        pass
    return out


# ------------------------------------------------------------------------------ parsing
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_size(text: str, what: str) -> int:
    """'4096', '4k' (= 4096), '1.5k' (= 1536): token counts as the papers write them."""
    m = _SIZE.match(str(text))
    if not m:
        raise KvcliError(f"{what}: '{text}' is not a token count (examples: 512, 4k, 1.5k)")
    val = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
    if val < 1 or not val.is_integer():
        raise KvcliError(f"{what}: '{text}' must be a whole number of tokens >= 1")
    return int(val)


def parse_list(text: str | None, what: str, conv=str) -> list:
    """Comma-separated list, empty items refused, duplicates removed in order."""
    if text is None:
        return []
    items = [x.strip() for x in str(text).split(",")]
    if not items or any(not x for x in items):
        raise KvcliError(f"{what}: '{text}' is not a comma-separated list (empty item)")
    out = []
    for x in items:
        v = conv(x)
        if v not in out:
            out.append(v)
    return out


def parse_int_list(text: str | None, what: str, minimum: int = 1) -> list[int]:
    def conv(x):
        try:
            v = int(x, 10)
        except ValueError:
            raise KvcliError(f"{what}: '{x}' is not an integer") from None
        if v < minimum:
            raise KvcliError(f"{what}: {v} must be >= {minimum}")
        return v
    return parse_list(text, what, conv)


def parse_float_list(text: str | None, what: str, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    def conv(x):
        try:
            v = float(x)
        except ValueError:
            raise KvcliError(f"{what}: '{x}' is not a number") from None
        if not lo <= v <= hi:
            raise KvcliError(f"{what}: {v} must lie in [{lo}, {hi}]")
        return v
    return parse_list(text, what, conv)


# ------------------------------------------------------------------------------ distributions
def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def kl(logp_ref: np.ndarray, logp: np.ndarray) -> float:
    """KL(ref || other) in nats, from two log-probability vectors."""
    p = np.exp(logp_ref)
    return float(max(0.0, np.sum(p * (logp_ref - logp))))


def spread(values: list[float]) -> dict:
    """median with min and max: how every repeated timing is reported."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def held(session, seq: int = 0) -> dict:
    """What a sequence's cache holds now: cells, the K/V bytes held (each layer from its front: the ragged layout)
    and the live entries' bytes, so a score can be read against the memory it cost (issue #45)."""
    st = session.stats(seq)
    return {"kv_cells": int(st["kv_cells"]), "kv_bytes": int(st["kv_bytes"]), "kv_bytes_live": int(st["kv_bytes_live"])}
