#!/usr/bin/env python3
"""What a question of a re-selected chat costs against reading its document (issue #30's latency requirement).

    python benchmarks/chat_reselect.py --tokens 8000 --seed 21 -o benchmarks/results/chat-reselect-turns-qwen-8k.json

1. `kvcli chat --model M --doc D --policy snapkv --budget 256 --threads 2 -n 24 --chunk 0 --json`, the document's
   planted facts' questions piped one per line (what benchmarks/results/chat-reselect-quiet-qwen-{8k,16k}.json
   recorded; `--chunk 0` keeps the exact form, the document's full cache in the context, where a full cache above
   the bounded-reading threshold would otherwise be re-selected in bounded chunks), in its own process: the summary
   line, every answer's JSON row, `uptime` before and after. --no-chat leaves it out.
2. With --compare (in this process, after 1): the document read once more, then each question re-selected twice on
   the same load, alternately: from the stored document with the whole conversation prefilled again (kvcli before
   the conversation's turns were kept in the stored cache), then as `kvcli chat` does now (the turns restored,
   only the last answer and the new question prefilled). Both answer greedily; the answers must agree. Besides
   seconds, the process's CPU seconds (time.process_time) of the read, of each re-selection and of each answer:
   with --threads 1 they hardly depend on what else the machine runs (no thread waits at a barrier for a
   descheduled sibling), so their ratios stand in for a quiet machine's on a busy one.

The machine may be shared: seconds depend on the load, ratios within one process less so; `uptime` is recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ROOT, machine, uptime


def busy() -> list[str]:
    """The processes using the CPU besides this one (the load the seconds were measured under)."""
    ps = subprocess.run(["ps", "-eo", "pid,pcpu,ni,etime,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    rows = [ln.split(None, 1) for ln in ps.splitlines()[1:]]
    return [rest[:160] for pid, rest in rows if int(pid) != os.getpid() and float(rest.split()[0]) >= 5.0][:8]


def cli_run(model, doc, questions, policy, budget, threads, max_tokens) -> dict:
    cmd = [sys.executable, "-m", "kvcli.cli", "chat", "--model", model, "--doc", str(doc), "--policy", policy,
           "--budget", str(budget), "--threads", str(threads), "-n", str(max_tokens), "--chunk", "0", "--json"]
    before = uptime()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, input="".join(q + "\n" for q in questions), capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"kvcli chat failed ({r.returncode}): {r.stderr.strip()}")
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    summary = next((x for x in r.stderr.splitlines() if "re-selected per question" in x), None)
    read_s = float(summary.split(" tokens read in ")[1].split("s;")[0]) if summary else None
    for row in rows:
        per_q = row["reselect_s"] + row["generated_tokens"] / row["decode_tok_s"] if row["decode_tok_s"] else None
        row["question_s"] = round(per_q, 3) if per_q else None
        row["share_of_read"] = round(per_q / read_s, 4) if per_q and read_s else None
    return {"uptime": [before, uptime()], "command": " ".join(["kvcli", *cmd[3:]]) + " < questions",
            "summary_line": summary, "read_s": read_s, "wall_s": round(wall, 2), "answers": rows}


def compare(model, doc, questions, policy, budget, threads, max_tokens) -> dict:
    """The old and the new way on one read and one load, question by question."""
    from kvcli.apps.chat import Conversation
    from kvcli.generate import generate
    from kvcli.native.session import NativeSession
    from kvcli.models import resolve_model
    from kvcli.planning.planner import resolve
    before = uptime()
    session = NativeSession(resolve_model(model), n_ctx=0, n_threads=threads)
    conv = Conversation(session, doc.read_text(), compression=resolve(session.model_path, policy, budget),
                        reselect=True, chunk=0)   # exact
    c0 = time.process_time()
    conv.compress()
    read_cpu = time.process_time() - c0
    store = conv.store
    rows = []
    try:
        for q in questions:
            prompt = session.tokenize(conv.conversation_text(q))
            cfg = conv._cfg(q)
            kept, store.extension = store.extension, None   # before: from the document, every turn prefilled again
            c0 = time.process_time()
            old = store.reselect(session, prompt, cfg, seq=conv.seq)
            c1 = time.process_time()
            g_old = generate(session, max_tokens, seq=conv.seq)
            c2 = time.process_time()
            store.extension = kept
            del kept
            cpu = {"old": (c1 - c0, c2 - c1)}
            c0 = time.process_time()
            g_new = conv.ask(q, max_tokens)                 # now: the turns restored from the stored cache
            cpu["new"] = (time.process_time() - c0, None)   # conv.ask: tokenizing, re-selection and answer
            new = conv.last_reselection
            row = {"question": q}
            for name, key, r, g in (("whole_conversation_prefilled", "old", old, g_old), ("turns_kept", "new", new,
                                                                                          g_new)):
                per_q = r.total_s + g.decode_s
                row[name] = {"answer": g.text, "from": r.source, "restored": r.restored, "prefilled": r.prefilled,
                             "reselect_s": round(r.total_s, 3), "restore_s": round(r.restore_s, 3),
                             "prefill_s": round(r.prefill_s, 3), "keep_s": round(r.keep_s, 3),
                             "answer_s": round(g.decode_s, 3), "generated_tokens": len(g.tokens),
                             "question_s": round(per_q, 3), "share_of_read": round(per_q / store.read_s, 4)}
                if key == "old":
                    row[name].update(reselect_cpu_s=round(cpu["old"][0], 3), answer_cpu_s=round(cpu["old"][1], 3))
                row[name]["question_cpu_s"] = round(sum(x for x in cpu[key] if x is not None), 3)
                row[name]["cpu_share_of_read"] = round(row[name]["question_cpu_s"] / read_cpu, 4)
            row["same_answer"] = g_old.text == g_new.text
            rows.append(row)
            o, w = row["whole_conversation_prefilled"], row["turns_kept"]
            print(f"  {q[:50]}: old {o['share_of_read']:.1%} (CPU {o['cpu_share_of_read']:.1%}, {old.prefilled} "
                  f"tokens), new {w['share_of_read']:.1%} (CPU {w['cpu_share_of_read']:.1%}, {new.prefilled} tokens)",
                  file=sys.stderr, flush=True)
        s = conv.stats()
    finally:
        conv.close()
        session.close()
    return {"uptime": [before, uptime()], "threads": threads, "read_s": round(store.read_s, 3),
            "read_cpu_s": round(read_cpu, 3), "store_bytes": store.nbytes,
            "peak_rss_bytes": s["peak_rss_bytes"], "questions": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--facts", type=int, default=3)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=24)
    ap.add_argument("--compare", action="store_true", help="also the old way against the new, in this process")
    ap.add_argument("--no-chat", action="store_true", help="leave out the kvcli chat run (1.)")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chat-reselect-"))
    doc, facts = work / "doc.txt", work / "facts.json"
    make = [sys.executable, str(ROOT / "examples" / "make_docs.py"), "--tokens", str(a.tokens), "--facts",
            str(a.facts), "--seed", str(a.seed), "-o", str(doc), "--facts-json", str(facts)]
    subprocess.run(make, check=True, cwd=ROOT)
    planted = json.loads(facts.read_text())
    try:
        run(a, doc, planted)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(a, doc: Path, planted: list[dict]) -> None:
    questions = [f["question"] for f in planted]
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "busy_at_start": busy(),
           "document": f"python examples/make_docs.py --tokens {a.tokens} --facts {a.facts} --seed {a.seed}",
           "expected": [str(f["answer"]) for f in planted]}
    if not a.no_chat:
        print(f"[{uptime()}] kvcli chat ...", file=sys.stderr, flush=True)
        out["chat"] = cli_run(a.model, doc, questions, a.policy, a.budget, a.threads, a.max_tokens)
        out["chat"]["correct"] = [e in r["answer"] for e, r in zip(out["expected"], out["chat"]["answers"])]
        out["chat"]["busy_at_end"] = busy()
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.compare:
        print(f"[{uptime()}] old against new, one process ...", file=sys.stderr, flush=True)
        out["compare"] = compare(a.model, doc, questions, a.policy, a.budget, a.threads, a.max_tokens)
        out["compare"]["busy_at_end"] = busy()
        out["compare"]["correct"] = [e in q["turns_kept"]["answer"] for e, q in
                                     zip(out["expected"], out["compare"]["questions"])]
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in out.get("chat", {}).get("answers", []):
        print(f"{r['question']}: {r['answer']!r} {r['share_of_read']:.1%} of the read "
              f"(prefilled {r['reselect_prefilled_tokens']}, from the {r['reselect_from']})", file=sys.stderr)


if __name__ == "__main__":
    main()
