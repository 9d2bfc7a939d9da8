#!/usr/bin/env python3
"""A book, not a chapter (issue #46): six questions over a long document in one `kvcli chat`, bounded re-selection
with the block index (the default) against every stored chunk streamed per question (KVCLI_RESELECT_CHUNKS=all,
kvcli before the index), and a read stopped by SIGTERM halfway and started again.

    python benchmarks/book.py --tokens 30000 --facts 6 --budget 1024 -o benchmarks/results/book-qwen-30k.json
    python benchmarks/book.py --tokens 128000 --facts 6 --budget 1024 --modes index -o ...book-qwen-128k.json

Every mode runs `kvcli chat --model M --doc D --policy snapkv --budget B --threads T -n 24 --json` in its own process
with its own empty document store (KVCLI_CACHE), the planted facts' questions piped one per line, and stamps the
moment each answer's JSON row arrives: the time to the first answer (model load, the read, the first question) and
each later question's seconds (the gap between rows: tokenizing, re-selection, answer). Peak RSS by /usr/bin/time.
`stored`, `last` and `turn`: the index mode's command with the read kept (--store PATH by the first of them, which
reads; the others open it with --cache PATH: their first answer is the model's load and the first question), with
the bounded form's probe as it is and two others (benchmarks/ask_last_probe.py --probe last|turn), to compare a
conversation's questions by the probe alone; `keptall`: every chunk streamed from that read. `--prose FILE` sets the
facts into a real text instead of the logbook. A mode named twice is recorded twice (`stored`, `stored-2`).
`resume`: the same command, sent SIGTERM once the document store records half the document's tokens read, then
started again: its time to the first answer against the uninterrupted `index` run's, and its answers.
The document is examples/make_docs.py's station logbook. The machine may be shared: `uptime` is recorded, and the
ratios within a run (a question against the read) are what the issue asks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ask_last_probe import PROBES
from bench_common import ROOT, machine, uptime


def chat_cmd(a, doc: Path, probe: str | None = None, store: Path | None = None) -> list[str]:
    """`store`: the read kept there (--store) or, once it is, the chat opened on it (--cache); `probe`: another
    probe for the bounded form than kvcli's (benchmarks/ask_last_probe.py's PROBES)."""
    entry = ([str(ROOT / "benchmarks" / "ask_last_probe.py"), "--probe", probe] if probe else ["-m", "kvcli.cli"])
    source = (["--doc", str(doc)] if store is None else ["--cache", str(store)] if store.exists()
              else ["--doc", str(doc), "--store", str(store)])
    return [sys.executable, *entry, "chat", "--model", a.model, *source, "--policy", a.policy,
            "--budget", str(a.budget), "--threads", str(a.threads), "-n", str(a.max_tokens), "--json",
            *(["--chunk", str(a.chunk)] if a.chunk is not None else [])]


def run_chat(a, doc: Path, questions: list[str], env: dict, stop_at: int | None = None,
             probe: str | None = None, store: Path | None = None) -> dict:
    """One chat process; `stop_at`: SIGTERM it once the document store records that many tokens read; `probe`, `store`:
    as chat_cmd."""
    timing = None if stop_at else tempfile.NamedTemporaryFile(suffix=".time", delete=False).name
    cmd = chat_cmd(a, doc, probe, store)
    full = (["/usr/bin/time", "-f", "%M", "-o", timing] if timing else []) + cmd
    before = uptime()
    t0 = time.perf_counter()
    p = subprocess.Popen(full, env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdin.write("".join(q + "\n" for q in questions))
    p.stdin.close()
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    rows, stamps = [], []
    if stop_at is not None:
        store = Path(env["KVCLI_CACHE"]) / "documents"
        while p.poll() is None:
            done = 0
            for rec in store.glob("*/entry.json"):
                try:
                    done = max(done, sum(c["n"] for c in json.loads(rec.read_text()).get("chunks_done") or []))
                except (OSError, ValueError):
                    pass
            if done >= stop_at:
                p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        p.wait()
        return {"command": " ".join(["kvcli", *cmd[cmd.index("chat"):]]),
                "stopped_after_s": round(time.perf_counter() - t0, 2),
                "tokens_read_when_stopped": done, "exit": p.returncode, "uptime": [before, uptime()]}
    for line in p.stdout:
        stamps.append(time.perf_counter() - t0)
        rows.append(json.loads(line))
    p.wait()
    rss = Path(timing).read_text().split()
    os.unlink(timing)
    if p.returncode != 0:
        sys.exit(f"kvcli chat failed ({p.returncode}): {''.join(err)[-2000:]}")
    summary = next((x.strip() for x in err if "re-selected per question" in x), None)
    gaps = [round(b - a_, 2) for a_, b in zip(stamps, stamps[1:])]
    first = stamps[0]
    name = " ".join(cmd[1:4]) if probe else "kvcli"
    return {"command": " ".join([name, *cmd[cmd.index("chat"):]]) + " < questions", "uptime": [before, uptime()],
            "summary_line": summary, "said": [x.strip() for x in err if "resuming" in x or "partial" in x],
            "first_answer_s": round(first, 2), "later_question_s": gaps,
            "later_share_of_first": [round(g / first, 4) for g in gaps],
            "peak_rss_bytes": int(rss[-1]) * 1024 if rss and rss[-1].isdigit() else None,
            "answers": [{k: r.get(k) for k in ("question", "answer", "reselect_chunks", "stored_chunks", "index_s",
                                              "reselect_s", "reselect_prefilled_tokens", "kv_bytes", "kv_cells")}
                        for r in rows]}


def set_into(text: str, planted: list[dict]) -> str:
    """`text` with each planted fact's sentence on a line of its own before the first line at or after its depth
    that starts a paragraph or an indented line (a verse, a list item)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line[:1].isspace() or (i and not lines[i - 1].strip())]
    for f in sorted(planted, key=lambda f: -f["depth"]):
        at = next((i for i in starts if i >= f["depth"] * len(lines)), len(lines))
        lines.insert(at, f["sentence"])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=30000)
    ap.add_argument("--facts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=24)
    ap.add_argument("--chunk", type=int, help="kvcli chat --chunk N: the bounded form's chunk (default: kvcli's)")
    ap.add_argument("--modes", default="index,all,resume",
                    help="comma-separated: index, all, resume; stored, last, turn: the index on a read kept by the "
                         "first of them (--store, then --cache), with kvcli's probe and two others; keptall: every "
                         "chunk streamed from that read")
    ap.add_argument("--prose", type=Path, help="a real text to set the facts into, each on its own line at its "
                                               "depth, instead of the logbook (the facts' sentences come from "
                                               "make_docs.py all the same)")
    ap.add_argument("--work", type=Path, help="the folder of the document and its kept read (default: a new one): "
                                              "a second run with the same arguments reads nothing")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    if a.prose and "resume" in a.modes.split(","):   # its stop point is counted in the logbook's --tokens
        ap.error("the resume mode stops a read at half of --tokens: not with --prose")
    work = a.work or Path(tempfile.mkdtemp(prefix="book-"))
    work.mkdir(parents=True, exist_ok=True)
    doc, facts = work / "doc.txt", work / "facts.json"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_docs.py"), "--tokens", str(a.tokens), "--facts",
                    str(a.facts), "--seed", str(a.seed), "-o", str(doc), "--facts-json", str(facts)], check=True)
    planted = json.loads(facts.read_text())
    if a.prose:
        doc.write_text(set_into(a.prose.read_text(), planted))
    questions = [f["question"] for f in planted]
    expected = [str(f["answer"]) for f in planted]
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(a.threads),
           "document": f"python examples/make_docs.py --tokens {a.tokens} --facts {a.facts} --seed {a.seed}"
                       + (f", its facts set into {a.prose}" if a.prose else ""),
           "expected": expected, "runs": {}}

    def env_for(name: str, extra: dict | None = None) -> dict:
        return {**os.environ, "KVCLI_CACHE": str(work / f"cache-{name}"), **(extra or {})}

    def save():
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")

    for mode in a.modes.split(","):
        print(f"[{uptime()}] {mode} ...", file=sys.stderr, flush=True)
        if mode == "resume":
            env = env_for("resume")
            stopped = run_chat(a, doc, questions, env, stop_at=a.tokens // 2)
            r = run_chat(a, doc, questions, env)
            r["stopped"] = stopped
        elif mode in ("stored", "keptall", *PROBES):
            r = run_chat(a, doc, questions, env_for("kept", {"KVCLI_RESELECT_CHUNKS": "all"} if mode == "keptall"
                                                    else None),
                         probe=mode if mode in PROBES else None, store=work / "kept")
        else:
            r = run_chat(a, doc, questions, env_for(mode, {"KVCLI_RESELECT_CHUNKS": "all"} if mode == "all" else None))
        r["correct"] = [e in (x["answer"] or "") for e, x in zip(expected, r["answers"])]
        name = mode if mode not in out["runs"] else f"{mode}-{sum(k.split('-')[0] == mode for k in out['runs']) + 1}"
        out["runs"][name] = r
        save()
        print(f"  right {sum(r['correct'])}/{len(expected)}, first answer {r['first_answer_s']} s, later "
              f"{r['later_question_s']} s ({[f'{x:.1%}' for x in r['later_share_of_first']]})", file=sys.stderr)
    if "index" in out["runs"] and "resume" in out["runs"]:
        out["resume_share_of_uninterrupted"] = round(out["runs"]["resume"]["first_answer_s"]
                                                     / out["runs"]["index"]["first_answer_s"], 4)
        save()


if __name__ == "__main__":
    main()
