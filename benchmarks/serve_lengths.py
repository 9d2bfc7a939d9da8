#!/usr/bin/env python3
"""kvcli serve against llama-server on documents of several lengths, back to back in one run (issue #62;
docs/results/serve.md, "Resident documents against llama-server").

    nice -n 19 python benchmarks/build_stock_llama.py --server --jobs 2     # once: llama-server
    python benchmarks/serve_lengths.py --words 4200,12000 --threads 2 --suffix " Answer with the number only." \
        -o benchmarks/results/serve-lengths-qwen.json

Per document (a station logbook with six planted facts, kvcli.evaluation.logbook.make_document, --words words each),
each server is started afresh with the same context (--ctx: the document's tokens + 2048, rounded up to 1024) and the
same threads, and answers, one request after another, each carrying the whole document and one question in its user
message: the six questions with answers of --max-tokens (24), then --long of them again with answers of
--long-tokens (256); then --clients questions sent at once from as many threads. llama-server keeps the full cache
and reuses its slot's prefix (`cache_prompt`), one slot (-np 1) for the requests one after another; for the clients
at once a second llama-server with -np N over one unified cache (-kvu, N times the context), whose slots each read
the document first (a first round of N requests at once, not timed as the clients' wall) as a stored document would
be. kvcli serve answers every request from its resident document (kvcli/drivers/resident.py), --policy at --budget.
Recorded per server: every request's seconds, answer and right or not, the tokens it prefilled, the peak RSS of the
server process (VmHWM, read before it stops) and `uptime` before and after. Compare ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import machine  # noqa: E402
from build_stock_llama import build_server  # noqa: E402
from serve_questions import free_port, peak_rss, post, row, uptime, wait_healthy  # noqa: E402

from kvcli.evaluation.logbook import make_document  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402


def body(a, text: str, fact: dict, max_tokens: int, extra: dict) -> dict:
    return {"model": a.model, "max_tokens": max_tokens, "temperature": 0, **extra,
            **({"ignore_eos": True} if a.ignore_eos else {}),
            "messages": [{"role": "user", "content": f"{text}\n\n{fact['question']}{a.suffix}"}]}


# what the -np N slots are warmed with: the document and a question none of the timed clients asks, so each timed
# request prefills its own question, as it would have to in use
WARM_QUESTION = {"question": "What was the weather on day 1?", "answer": ""}


def at_once(port: int, bodies: list[tuple[dict, dict]]) -> tuple[float, list[dict]]:
    """The requests sent together from one thread each; (wall seconds, their rows)."""
    out: list = [None] * len(bodies)

    def ask(k):
        fact, b = bodies[k]
        secs, got = post(port, b)
        out[k] = row(k + 1, fact, secs, got)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def session(a, port: int, text: str, facts: list[dict], extra: dict, clients: bool, pid: int | None = None) -> dict:
    """The requests one after another (six short answers, then `a.long` long ones), and the clients at once (the
    server's peak RSS read before them too, where `pid` is given: the one-after-another requests' peak)."""
    seq = []
    for i, fact in enumerate(facts, 1):
        secs, out = post(port, body(a, text, fact, a.max_tokens, extra))
        seq.append(row(i, fact, secs, out))
        print(json.dumps(seq[-1]), flush=True)
    long = []
    for i, fact in enumerate(facts[:a.long], 1):
        secs, out = post(port, body(a, text, fact, a.long_tokens, extra))
        long.append(row(i, fact, secs, out))
        print(json.dumps(long[-1]), flush=True)
    got = {"requests": seq, "long_requests": long, "right": sum(r["right"] for r in seq)}
    if clients:
        if pid is not None:
            got["peak_rss_before_clients_bytes"] = peak_rss(pid)
        wall, rows = at_once(port, [(f, body(a, text, f, a.max_tokens, extra)) for f in facts[:a.clients]])
        got.update(clients=rows, clients_wall_s=round(wall, 2))
        print(json.dumps({"clients_wall_s": wall, "right": [r["right"] for r in rows]}), flush=True)
    return got


def start(cmd: list[str], env=None) -> tuple[subprocess.Popen, int]:
    port = int(cmd[cmd.index("--port") + 1])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_healthy(proc, port)
    return proc, port


def stop(proc: subprocess.Popen) -> int | None:
    rss = peak_rss(proc.pid)
    proc.terminate()
    proc.wait(timeout=120)
    return rss


def run_kvcli(a, ctx: int, text: str, facts: list[dict], clients: bool) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "kvcli.cli", "serve", "--model", a.model, "--policy", a.policy, "--budget",
           str(a.budget), "--threads", str(a.threads), "--ctx", str(ctx), "--port", str(port),
           "--dry-multiplier", "0", "--window-from", a.window_from]
    before, store = uptime(), tempfile.mkdtemp(prefix="kvcli-serve-lengths-")
    proc, port = start(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), "KVCLI_CACHE": store})
    try:
        got = session(a, port, text, facts, {}, clients=clients, pid=proc.pid)
    finally:
        rss = stop(proc)
        shutil.rmtree(store, ignore_errors=True)
    return {"server": "kvcli serve", "command": " ".join(cmd[2:]), "uptime_before": before, "uptime_after": uptime(),
            **got, "peak_rss_bytes": rss}


def llama_cmd(binary: Path, a, ctx: int, parallel: int) -> list[str]:
    return [str(binary), "-m", str(resolve_model(a.model)), "--host", "127.0.0.1", "--port", str(free_port()),
            "-c", str(ctx * parallel), "-np", str(parallel), "-t", str(a.threads), "-tb", str(a.threads),
            "-fa", "on", "-b", "512", "-ub", "512", "--no-warmup",
            # -np N over one unified cache; --no-cache-idle-slots: by default llama-server saves every idle slot to
            # its host-memory prompt cache and clears it from the KV cache when a new task starts (unified KV only),
            # so the warmed slots lost their documents and read them again (the 201.8 s and 531.7 s walls of
            # docs/results/serve.md); off, each slot keeps its document as a stored one is held
            *(["-kvu", "--no-cache-idle-slots"] if parallel > 1 else [])]


def run_llama(binary: Path, a, ctx: int, text: str, facts: list[dict], clients: bool) -> dict:
    extra = {"cache_prompt": True}
    cmd = llama_cmd(binary, a, ctx, 1)
    before = uptime()
    proc, port = start(cmd)
    try:
        got = session(a, port, text, facts, extra, clients=False)
    finally:
        rss = stop(proc)
    out = {"server": "llama-server", "command": " ".join(cmd[1:]), "uptime_before": before, "uptime_after": uptime(),
           **got, "peak_rss_bytes": rss}
    if clients:
        cmd = llama_cmd(binary, a, ctx, a.clients)
        proc, port = start(cmd)
        try:   # every slot reads the document first, as a stored one would be held; then the clients at once
            # each request pinned to its slot (llama-server's id_slot): unpinned, two of four timed requests found
            # slots without the document and read it again (188 s of a wall otherwise 7 s)
            warm = [(WARM_QUESTION, body(a, text, WARM_QUESTION, a.max_tokens, {**extra, "id_slot": k}))
                    for k in range(a.clients)]
            warm_s, _ = at_once(port, warm)
            bodies = [(f, body(a, text, f, a.max_tokens, {**extra, "id_slot": k}))
                      for k, f in enumerate(facts[:a.clients])]
            wall, rows = at_once(port, bodies)
            print(json.dumps({"clients_wall_s": wall, "right": [r["right"] for r in rows]}), flush=True)
        finally:
            rss_np = stop(proc)
        out.update(clients_command=" ".join(cmd[1:]), clients_warmup_s=round(warm_s, 2), clients=rows,
                   clients_wall_s=round(wall, 2), clients_peak_rss_bytes=rss_np)
    return out


def table(runs: list[dict]) -> str:
    lines = ["| document | server | right (of 6) | requests 2-6, 24 tokens | long answers | "
             "clients at once (wall) | peak RSS |", "|---|---|---|---|---|---|---|"]
    for d in runs:
        for r in d["results"]:
            later = [x["seconds"] for x in r["requests"][1:]]
            long = [x["seconds"] for x in r["long_requests"]]
            cl = r.get("clients") or []
            clients = (f"{r['clients_wall_s']:.1f} s ({sum(x['right'] for x in cl)} of {len(cl)} right)"
                       if cl else "-")
            rss = f"{(r['peak_rss_bytes'] or 0) / 2**20:.0f} MiB"
            if r.get("peak_rss_before_clients_bytes"):
                rss += f" ({r['peak_rss_before_clients_bytes'] / 2**20:.0f} before the clients)"
            if r.get("clients_peak_rss_bytes"):
                rss += f" (-np {len(cl)}: {r['clients_peak_rss_bytes'] / 2**20:.0f} MiB)"
            lines.append(f"| {d['prompt_tokens']} tokens | {r['server']} | {r['right']} | {min(later):.2f}-"
                         f"{max(later):.2f} s | {', '.join(f'{s:.1f}' for s in long) or '-'} s | {clients} | {rss} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--words", default="4200,12000,22500", help="document lengths in words, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--long", type=int, default=2, help="questions asked again with long answers")
    ap.add_argument("--long-tokens", type=int, default=256)
    ap.add_argument("--clients", type=int, default=4, help="questions sent at once (0: none)")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="both servers' ignore_eos: every answer runs to its max tokens (fixed answer lengths)")
    ap.add_argument("--window-from", default="question", choices=("question", "policy"),
                    help="kvcli serve's --window-from")
    ap.add_argument("--servers", default="kvcli,llama", help="which servers to run (kvcli, llama)")
    ap.add_argument("--clients-upto", type=int, default=1 << 30,
                    help="the clients at once only for documents of at most this many words (-np N reads the "
                         "document N times first)")
    ap.add_argument("--clients-of", default="kvcli,llama",
                    help="the servers whose clients at once are run (llama-server -np N takes N document reads first: "
                         "leave it out where an earlier run of the same build measured it)")
    ap.add_argument("--binary", type=Path, help="a llama-server (default: build_stock_llama.py --server's)")
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args()
    binary = a.binary or build_server()
    out = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(a.threads),
           "argv": sys.argv[1:], "documents": []}
    from kvcli.native.session import NativeSession   # the prompt's length, as the servers count it
    tok = NativeSession(resolve_model(a.model), n_ctx=0)
    for words in (int(w) for w in a.words.split(",")):
        text, facts = make_document(words, facts=6, seed=a.seed)
        n = len(tok.tokenize(tok.apply_chat_template([{"role": "user", "content": text + "\n\n" + facts[0]["question"]
                                                       + a.suffix}])))
        ctx = -(-(n + 2048) // 1024) * 1024
        d = {"words": words, "prompt_tokens": n, "ctx": ctx, "results": []}
        out["documents"].append(d)
        clients = a.clients > 0 and words <= a.clients_upto
        if "kvcli" in a.servers:
            d["results"].append(run_kvcli(a, ctx, text, facts, clients and "kvcli" in a.clients_of))
        if "llama" in a.servers:
            d["results"].append(run_llama(binary, a, ctx, text, facts, clients and "llama" in a.clients_of))
        print(table(out["documents"]), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(table(out["documents"]))


if __name__ == "__main__":
    main()
