"""What the benchmark scripts share: where a figure was measured (`machine`, `uptime`) and a command's peak
resident set (`run_max_rss`). `python benchmarks/X.py` puts this folder first on sys.path:
`from bench_common import ...` (benchmarks/gpu/ scripts add it themselves).

kvcli is imported from this checkout, so the scripts that run in a peer's venv without kvcli installed
(benchmarks/kvpress_chat.py peer, in the venv of benchmarks/setup_kvpress.sh) describe the machine the same way.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def uptime() -> str:
    """`uptime`'s line: the load the seconds beside it were measured under."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def machine(threads: int | None = None, **extra) -> dict:
    """kvcli.evaluation.measure.machine (CPU model, cores, memory, OS, Python, threads, native build, load average)
    and `extra` (a script's own fields: torch's version, the GPU)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from kvcli.evaluation.measure import machine as describe  # noqa: PLC0415

    return {**describe(threads), **extra}


def run_max_rss(cmd: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, int | None]:
    """Run `cmd` under `/usr/bin/time -f %M`: its result (output captured as text) and the kernel's maximum resident
    set of the process in bytes (None when time wrote none). RSS does not depend on the machine's load."""
    with tempfile.NamedTemporaryFile(suffix=".time") as t:
        r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", t.name, *cmd], capture_output=True, text=True,
                           **kwargs)
        words = Path(t.name).read_text().split()
    return r, int(words[-1]) * 1024 if words and words[-1].isdigit() else None
