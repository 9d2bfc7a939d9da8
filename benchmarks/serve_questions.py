#!/usr/bin/env python3
"""kvcli serve on one document and six questions (issue #47's measurement; docs/serve.md).

    python benchmarks/serve_questions.py --model qwen2.5-coder-0.5b --policy snapkv --budget 256 \
        -o benchmarks/results/serve-six-questions-qwen.json

A station logbook with six planted facts (kvcli.evaluation.logbook.make_document, --words words, --seed) is the
document; a real `kvcli serve` process answers six requests one after another, each carrying the whole document and
one fact's question in its user message (as a client that knows nothing of kvcli sends them), then two more at
once from two threads (the first two questions again). Recorded per request: the client's wall seconds, the
answer, right or not (the planted number in it), and the server's kvcli stats (tokens restored, prefilled, read);
at the end the server's peak RSS (VmHWM of its process) and `uptime` before and after. The machine may be shared:
the ratios of one run (later requests / the first) are what to quote. benchmarks/llama_server.py runs the same
requests (`ask_six`) against llama-server.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.evaluation.logbook import make_document  # noqa: E402


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int) -> float:
    """Seconds until the server at `port` answers /health with 200 (llama-server answers 503 while it loads)."""
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return time.time() - t0
        except OSError:
            time.sleep(0.5)


def peak_rss(pid: int) -> int | None:
    """VmHWM of a running process, in bytes (read before it is stopped)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def post(port: int, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def row(i: int, fact: dict, secs: float, out: dict) -> dict:
    """One request's record: the answer, right or not, the seconds; and what the server says it did (kvcli's stats,
    or llama-server's `timings`: prompt_n is the tokens it prefilled, cache_n those its cache_prompt reused)."""
    text = out["choices"][0]["message"]["content"]
    r = {"request": i, "question": fact["question"], "expected": fact["answer"], "answer": text.strip(),
         "right": fact["answer"] in text, "seconds": round(secs, 2),
         "prompt_tokens": out["usage"]["prompt_tokens"], "completion_tokens": out["usage"]["completion_tokens"]}
    if "kvcli" in out:
        s = out["kvcli"]
        r.update({k: s[k] for k in ("document_read_tokens", "prefix_reused_tokens", "prefilled_tokens", "reselect_s",
                                    "decode_s", "kv_bytes", "kv_bytes_full", "peak_rss_bytes")})
        r.update({k: s[k] for k in ("window", "reselect_restore_s", "reselect_plan_s", "reselect_prefill_s",
                                    "reselect_keep_s", "prompt_s", "queued_s", "decoded_with", "decoded_with_most")
                  if k in s})
    elif "timings" in out:
        t = out["timings"]
        r.update({"prefix_reused_tokens": t.get("cache_n"), "prefilled_tokens": t.get("prompt_n"),
                  "prompt_s": round(t["prompt_ms"] / 1000, 4) if "prompt_ms" in t else None,
                  "decode_s": round(t["predicted_ms"] / 1000, 4) if "predicted_ms" in t else None})
    return r


def ask_six(port: int, text: str, facts: list[dict], model: str, max_tokens: int, suffix: str = "",
            extra: dict | None = None) -> dict:
    """The six requests one after another, then the first two again from two clients at once; each carries the
    whole document and its question in its user message (plus `extra` fields in the body). Printed as they come."""
    def body(fact):
        content = f"{text}\n\n{fact['question']}{suffix}"
        return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                **(extra or {})}

    rows = []
    for i, fact in enumerate(facts, 1):
        secs, out = post(port, body(fact))
        rows.append(row(i, fact, secs, out))
        print(json.dumps(rows[-1]), flush=True)
    together: list = [None, None]

    def ask(k):
        secs, out = post(port, body(facts[k]))
        together[k] = row(len(facts) + 1 + k, facts[k], secs, out)

    t1 = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    both_s = time.perf_counter() - t1
    for r in together:
        print(json.dumps(r), flush=True)
    first = rows[0]["seconds"]
    return {"requests": rows, "two_clients": together, "two_clients_wall_s": round(both_s, 2),
            "right": sum(r["right"] for r in rows), "first_s": first,
            "later_s": [r["seconds"] for r in rows[1:]],
            "later_max_ratio": round(max(r["seconds"] for r in rows[1:]) / first, 4)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of the measurement (model, kvcli's policy, the document, threads, the questions' phrasing), shared
    with benchmarks/llama_server.py."""
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--words", type=int, default=4200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--suffix", default="", help="text after each question, e.g. ' Answer with the number only.' "
                    "(kvcli eval chat's phrasing)")
    ap.add_argument("-o", "--out", default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="more flags for kvcli serve, e.g. --server-arg=--dry-multiplier --server-arg=0")
    a = ap.parse_args()

    text, facts = make_document(a.words, facts=6, seed=a.seed)
    result = run_kvcli(a, text, facts)
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests", "two_clients")}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


def run_kvcli(a, text: str, facts: list[dict]) -> dict:
    """A `kvcli serve` process with a's flags answering `ask_six`; its record. Its document store is a fresh
    temporary one (KVCLI_CACHE), removed after: the first request reads the document whatever an earlier run stored."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvcli.cli", "serve", "--model", a.model, "--policy", a.policy, "--budget",
           str(a.budget), "--threads", str(a.threads), "--max-tokens", str(a.max_tokens), "--port", str(port),
           *a.server_arg]
    before = uptime()
    store = tempfile.mkdtemp(prefix="kvcli-serve-bench-")
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "KVCLI_CACHE": store})
    try:
        load_s = wait_healthy(proc, port)
        got = ask_six(port, text, facts, a.model, a.max_tokens, a.suffix)
        rss = peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(store, ignore_errors=True)
    return {"server": "kvcli serve", "command": " ".join(cmd[2:]), "document_words": a.words, "seed": a.seed,
            "suffix": a.suffix, "server_load_s": round(load_s, 2), "uptime_before": before, "uptime_after": uptime(),
            **got, "peak_rss_bytes": rss}


if __name__ == "__main__":
    main()
