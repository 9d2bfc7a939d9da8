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


def provenance(script: str) -> dict:
    """The command that wrote a result (this script's arguments), when (UTC) and under what load."""
    import time  # noqa: PLC0415
    return {"command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
            "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "uptime": uptime()}


def fact_chunk_rank(scores, where: list[int], n_chunks: int) -> int | None:
    """The best rank (1 = best) that `scores` (one per chunk between a store's first and last) give the chunks
    `where` (indices among all n_chunks) holding a planted fact; 0 when the first or last holds it (always streamed),
    None when none does (its digits straddle two chunks)."""
    order = [int(j) + 1 for j in (-scores).argsort(kind="stable")]
    return min((0 if j in (0, n_chunks - 1) else order.index(j) + 1 for j in where), default=None)


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


def native_plans(model, text: str, configs, instruction: str, threads: int | None = None):
    """One prefill of `text` (templated with `instruction`) on the native engine, observing what every (policy,
    budget) of `configs` needs, and each one's native plan made from it right away (while the cache is the full one).
    Returns (session, prompt tokens, the context's cells, {(policy, budget): Plan}, prefill seconds); the session
    holds the full cache in sequence 0."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import time  # noqa: PLC0415

    from kvcli.native.session import NativeSession  # noqa: PLC0415
    from kvcli.planning.planner import make_plan, resolve_for_model  # noqa: PLC0415
    from kvcli.templating import build_prompt  # noqa: PLC0415

    s = NativeSession(model, n_ctx=0, cache_type="f16", **({"n_threads": threads} if threads else {}))
    tokens = s.tokenize(build_prompt(s, text, instruction))
    n_ctx = -(-(len(tokens) + 16) // 256) * 256
    s.create_context(n_ctx)
    specs = {}
    for name, b in configs:
        spec, params = resolve_for_model(model, name, {}, b, instruction)
        specs[name, b] = (spec, params, *spec.observe(params))
    kinds = tuple(sorted({k for *_, ks, _ in specs.values() for k in ks}))
    windows = sorted({w for *_, w in specs.values() if w})   # every window length, from one prefill
    t0 = time.time()
    obs = s.prefill(tokens, seq=0, observe=kinds, window=windows)
    prefill_s = time.time() - t0
    plans = {key: make_plan(spec, params, key[1], obs.restrict(ks, w), "native")
             for key, (spec, params, ks, w) in specs.items()}
    return s, tokens, n_ctx, plans, prefill_s


def compact_under(session, full_state, n_ctx: int, plan, layout: str, room: int = 16) -> None:
    """Sequence 0 = the saved full cache, compacted by `plan` under KVCLI_LAYOUT=`layout` (ragged | cells), the
    context then reallocated for what it holds + `room` cells (as a long-lived chat does)."""
    import os  # noqa: PLC0415

    os.environ["KVCLI_LAYOUT"] = layout
    session.resize_context(n_ctx)
    session.clear(0)
    session.restore_seq(full_state, 0)
    session.apply_plan(plan)
    session.resize_context(plan.max_kept + room)
