#!/usr/bin/env python3
"""kvcli serve against llama-server on the same document and six questions (issue #47; docs/results/serve.md).

    nice -n 19 python benchmarks/build_stock_llama.py --server --jobs 2     # once: llama-server, several minutes
    python benchmarks/llama_server.py --threads 2 --suffix " Answer with the number only." \
        -o benchmarks/results/serve-vs-llama-server-qwen.json

Back to back in one run: a `kvcli serve` process (--policy snapkv --budget 256, greedy: --dry-multiplier 0), then
llama-server, each answering the requests of benchmarks/serve_questions.py (`ask_six`: six questions about one
5.6k-token logbook, each a separate request carrying the whole document in its user message, then the first two
again from two clients at once). llama-server is built from the same llama.cpp commit kvcli builds, WITHOUT kvcli's
patches (build_stock_llama.py --server); it keeps the full cache and reuses the longest common prefix of its slot's
cache (`"cache_prompt": true` in every request), one slot (-np 1: concurrent requests queue, as kvcli's do), with
kvcli's own settings where they differ from its defaults: flash attention on, batch = ubatch = 512, the context
kvcli serve takes (16384), the same threads, greedy (temperature 0). Its other defaults stay (the host-RAM prompt
cache, --cache-ram 8 GiB, is not used with one slot that keeps its prefix). Recorded per server: every request's
seconds and answer, the prompt tokens each prefilled, the peak RSS of the server process (VmHWM, read before it
stops) and `uptime` before and after. The machine may be shared: compare ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine  # noqa: E402
from build_stock_llama import build_server  # noqa: E402
from serve_questions import add_arguments, ask_six, free_port, peak_rss, run_kvcli, uptime, wait_healthy  # noqa: E402

from kvcli.evaluation.logbook import make_document  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402

CTX = 16384   # kvcli serve's default context (the model's training context, at most 16384)


def run_llama_server(binary: Path, model: str, a, text: str, facts: list[dict]) -> dict:
    port = free_port()
    cmd = [str(binary), "-m", str(resolve_model(model)), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(CTX), "-np", "1", "-t", str(a.threads), "-tb", str(a.threads), "-fa", "on",
           "-b", "512", "-ub", "512", "--no-warmup"]
    before = uptime()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        load_s = wait_healthy(proc, port)
        got = ask_six(port, text, facts, model, a.max_tokens, a.suffix,
                      extra={"cache_prompt": True, "temperature": 0})
        rss = peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"server": "llama-server", "command": " ".join(cmd[1:]), "binary": str(binary),
            "server_load_s": round(load_s, 2), "uptime_before": before, "uptime_after": uptime(), **got,
            "peak_rss_bytes": rss}


def table(results: list[dict]) -> str:
    lines = ["| server | right (of 6) | request 1 | requests 2-6, each | worst of 2-6 / request 1 "
             "| two clients at once "
             "(each; both right) | peak RSS |", "|---|---|---|---|---|---|---|"]
    for r in results:
        label = r["server"] + (f" {r['policy']} @ {r['budget']}" if r["server"] == "kvcli serve" else
                               " (full cache, cache_prompt)")
        both = r["two_clients"]
        lines.append(f"| {label} | {r['right']} | {r['first_s']:.1f} s | {min(r['later_s']):.2f}-"
                     f"{max(r['later_s']):.2f} s | {100 * r['later_max_ratio']:.1f} % | "
                     f"{both[0]['seconds']:.2f} s and {both[1]['seconds']:.2f} s "
                     f"({'yes' if all(b['right'] for b in both) else 'no'}) | "
                     f"{(r['peak_rss_bytes'] or 0) / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--binary", type=Path, help="a llama-server to use (default: build_stock_llama.py --server's)")
    ap.add_argument("--only", choices=["kvcli", "llama-server"], help="run one server only")
    a = ap.parse_args()
    a.server_arg = ["--dry-multiplier", "0"]   # greedy, as llama-server at temperature 0
    binary = a.binary or build_server()        # cached after the first build
    text, facts = make_document(a.words, facts=6, seed=a.seed)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    host = machine(a.threads)   # its load average: before the servers run
    results = []
    if a.only != "llama-server":
        r = run_kvcli(a, text, facts)
        results.append({**r, "policy": a.policy, "budget": a.budget})
    if a.only != "kvcli":
        results.append(run_llama_server(binary, a.model, a, text, facts))
    out = {"started": started, "machine": host, "model": a.model, "document_words": a.words,
           "seed": a.seed, "suffix": a.suffix, "threads": a.threads, "max_tokens": a.max_tokens, "results": results}
    print(table(results))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
