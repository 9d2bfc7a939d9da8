"""The default thread count of a NativeSession: $KVCLI_THREADS, else the CPUs this process may use and other
tasks leave idle (kvcli/native/session.py re-exports default_threads)."""
from __future__ import annotations

import os
import time

from kvcli.errors import KvcliError


def default_threads() -> int:
    """$KVCLI_THREADS, else the CPUs this process may actually use: its affinity mask (taskset, cpusets),
    capped by a cgroup CPU quota (a container limited to 2 CPUs on a 64-core host sees 64 in os.cpu_count()),
    and, when the process may use the whole machine, only the cores the other runnable tasks leave idle now
    (at least one; _busy_cpus). ggml's threads meet at a barrier after every graph node and spin there: a thread that
    has to wait for a core stalls the others at each of the ~1,000 nodes of a decode, so threads beyond
    the idle cores make a run slower, never faster. The count changes the speed, and with flash attention from
    512 cache cells the rounding of a decoded token's attention (llama.cpp splits its KV range per thread)."""
    env = os.environ.get("KVCLI_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise KvcliError(f"KVCLI_THREADS must be a whole number >= 1 (got '{env}')")
        return n
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota:
        return max(1, min(n, quota))
    if n == os.cpu_count():   # the machine's runnable tasks: only comparable with all of its CPUs
        busy = _busy_cpus()
        if busy is not None:
            n = min(n, int(n - busy + 0.5))
    return max(1, n)


def _busy_cpus(path: str = "/proc/stat", samples: int = 5) -> float | None:
    """CPUs other tasks keep busy now: the kernel's count of runnable tasks (procs_running, this process
    included, so minus one), the least of a few samples 2 ms apart so a passing task does not count. Not the
    1-minute load average: it still holds the previous run of kvcli for a minute or two, so back-to-back
    runs on an idle 2-core machine took one thread. Without /proc (not Linux), the load average."""
    seen = []
    for i in range(samples):
        try:
            with open(path) as f:
                line = next(x for x in f if x.startswith("procs_running "))
            seen.append(max(0, int(line.split()[1]) - 1))
        except (OSError, StopIteration, ValueError, IndexError):
            break
        if i + 1 < samples:
            time.sleep(0.002)
    if seen:
        return float(min(seen))
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """CPUs a cgroup v2 quota allows (rounded up), None without a quota."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None
