"""kvpress's own pipeline on `kvcli eval chat`'s documents and questions (issue #32): compress once, question-agnostic,
then answer every question from the one compressed context; scored as kvcli scores.

Three steps, each in its own venv (kvpress is never a kvcli dependency; benchmarks/setup_kvpress.sh makes its venv):

    .venv/bin/python benchmarks/kvpress_chat.py export --model qwen2.5-coder-0.5b --length 8192 --documents 2 \\
        --facts 6 --check benchmarks/results/eval-chat-qwen-8k-kvzip-1024.json --out /tmp/chat-docs.json
    nice -n 10 /work/kvpress-venv/bin/python benchmarks/kvpress_chat.py peer --model M.gguf --docs /tmp/chat-docs.json
    \\
        --budget 1024 --presses kvzip,none,snapkv --out /tmp/chat-peer.json      # resumes; saved after each document
    .venv/bin/python benchmarks/kvpress_chat.py score --peer /tmp/chat-peer.json --docs /tmp/chat-docs.json \\
        --json-out benchmarks/results/kvpress-chat-qwen-8k-1024.json
    .venv/bin/python benchmarks/kvpress_chat.py compare --kvcli EVAL.json ... \\
        --peer benchmarks/results/kvpress-chat-*.json --mode context --policy kvzip --budget 1024 --press kvzip
                                        # paired per question, on the documents both have
    .venv/bin/python benchmarks/kvpress_chat.py figure --rows ROW.json ... --out FIG.png   # compare's rows (--json-out)

export regenerates exactly the documents `run_chat_eval` builds (make_chat_document with the seed seed * 1000 + d) and
checks them against an eval's records (doc_tokens, n_tokens, expected answers). peer runs kvpress's
"kv-press-text-generation" pipeline with context = the document and questions = the questions as kvcli asks them
(kvcli.evaluation.chat.ask), each prefixed with "\\n\\n" (kvcli's own document/instruction separator; the pipeline
puts the question right after the context, in the same user turn), greedy. The press compresses the context before
any question is seen; the pipeline answers each question alone from that cache (its answer is dropped before the
next). Budget: compression_ratio = 1 - budget / n_context, n_context the tokens the pipeline prefills as context
(the chat template's head + the document). score scores each answer with kvcli.evaluation.tasks.string_match_all
and the standard error of kvcli.evaluation.chat.summarise (questions as the unit, ddof=1).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_common import machine


def export(args) -> None:
    from kvcli.evaluation.chat import ask, make_chat_document, prefix_text
    from kvcli.models import resolve_model
    from kvcli.native.session import NativeSession

    path = resolve_model(args.model)
    tok = NativeSession(path, n_ctx=0)
    docs = []
    for d in range(args.documents):
        seed = args.seed * 1000 + d          # as run_chat_eval seeds document d
        text, planted, n_tok = make_chat_document(tok, args.length, args.facts, seed)
        n_prefix = len(tok.tokenize(prefix_text(tok, text, agnostic=True)))
        docs.append({"doc": d, "seed": seed, "doc_tokens": n_tok, "agnostic_prefix_tokens": n_prefix, "text": text,
                     "facts": [{"question": f["question"], "asked": ask(f["question"]), "answer": f["answer"],
                                "depth": f["depth"]} for f in planted]})
    tok.close()
    if args.check:
        recs = json.loads(Path(args.check).read_text())["records"]
        for doc in docs:
            rs = [r for r in recs if r["doc"] == doc["doc"] and r["length"] == args.length and r["mode"] == "once"]
            if not rs:
                sys.exit(f"error: {args.check} has no record of document {doc['doc']} at {args.length}")
            for r in rs:
                f = doc["facts"][r["question"]]
                if (r["doc_tokens"], r["n_tokens"], r["answer_expected"], r["depth"]) != \
                        (doc["doc_tokens"], doc["agnostic_prefix_tokens"], f["answer"], f["depth"]):
                    sys.exit(f"error: document {doc['doc']} question {r['question']} differs from {args.check}")
        print(f"checked against {args.check}: " + ", ".join(
            f"document {x['doc']}: {x['doc_tokens']} tokens, answers {[f['answer'] for f in x['facts']]}"
            for x in docs))
    Path(args.out).write_text(json.dumps({"model": str(path), "length": args.length, "facts": args.facts,
                                          "seed": args.seed, "documents": docs}, indent=1))


def peer(args) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    import kvpress
    import kvpress.presses.kvzip_press as kz
    from kvpress import KVzipPress, SnapKVPress

    torch.set_num_threads(args.threads)
    path = Path(args.model)
    docs = json.loads(Path(args.docs).read_text())
    out_path = Path(args.out)
    out = json.loads(out_path.read_text()) if out_path.exists() else {"runs": []}
    done = {(r["press"], r["doc"]) for r in out["runs"]}
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    load_s = time.perf_counter() - t_load

    class _Tok:   # KVzipPress loads the tokenizer by the model's name; a GGUF model's is in the file
        @staticmethod
        def from_pretrained(*_a, **_k):
            return tok
    kz.AutoTokenizer = _Tok

    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    out.update(model=str(path), kvpress=getattr(kvpress, "__version__", "0.5.5"), transformers=transformers.__version__,
               budget=args.budget, max_new_tokens=args.max_new_tokens, question_prefix="\\n\\n",
               machine=machine(args.threads, torch=torch.__version__, torch_threads=args.threads),
               model_load_s=round(load_s, 1))
    for press_name in args.presses.split(","):
        for doc in docs["documents"]:
            if (press_name, doc["doc"]) in done:
                continue
            context = doc["text"].strip()
            questions = ["\n\n" + f["asked"] for f in doc["facts"]]
            n_context = pipe.preprocess(context, questions, "", int(1e10))["context_ids"].shape[1]
            ratio = 1.0 - args.budget / n_context
            press = {"kvzip": lambda ratio=ratio: KVzipPress(compression_ratio=ratio),
                     "snapkv": lambda ratio=ratio: SnapKVPress(compression_ratio=ratio),
                     "keydiff": lambda ratio=ratio: kvpress.KeyDiffPress(compression_ratio=ratio),
                     "tova": lambda ratio=ratio: kvpress.TOVAPress(compression_ratio=ratio),
                     "none": lambda: None}[press_name]()
            load0 = os.getloadavg()[0]
            started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            t0 = time.perf_counter()
            with torch.no_grad():
                answers = pipe(context, questions=questions, press=press, max_new_tokens=args.max_new_tokens)["answers"]
            secs = time.perf_counter() - t0
            out["runs"].append({"press": press_name, "doc": doc["doc"], "n_context": n_context,
                                "compression_ratio": None if press is None else ratio,
                                "answers": answers, "seconds": round(secs, 1), "started_utc": started,
                                "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0]})
            out_path.write_text(json.dumps(out, indent=1))   # a partial run keeps every finished document
            print(f"{press_name} document {doc['doc']}: n_context {n_context}, {secs:.0f}s, answers {answers}",
                  file=sys.stderr, flush=True)


def score(args) -> None:
    import numpy as np

    from kvcli.evaluation.tasks import string_match_all

    p = json.loads(Path(args.peer).read_text())
    docs = {d["doc"]: d for d in json.loads(Path(args.docs).read_text())["documents"]}
    records, summary = [], []
    for run in p["runs"]:
        doc = docs[run["doc"]]
        for i, (fact, ans) in enumerate(zip(doc["facts"], run["answers"])):
            records.append({"press": run["press"], "doc": run["doc"], "question": i, "depth": fact["depth"],
                            "answer_expected": fact["answer"], "prediction": ans.strip()[:80],
                            "score": 100.0 * string_match_all(ans, [fact["answer"]])})
    for press in dict.fromkeys(r["press"] for r in records):
        s = np.array([r["score"] for r in records if r["press"] == press], np.float64)
        runs = [r for r in p["runs"] if r["press"] == press]
        summary.append({"press": press, "questions": len(s), "documents": len(runs), "score": round(float(s.mean()), 1),
                        "stderr": round(float(s.std(ddof=1) / math.sqrt(len(s))), 1) if len(s) > 1 else None,
                        "per_document": {str(r["doc"]): round(float(np.mean(
                            [x["score"] for x in records if x["press"] == press and x["doc"] == r["doc"]])), 1)
                            for r in runs},
                        "seconds_per_document": [r["seconds"] for r in runs]})
        print(f"{press:>7}: {summary[-1]['score']:.1f} +- {summary[-1]['stderr']} over {len(s)} questions, "
              f"{len(runs)} documents, per document {summary[-1]['per_document']}")
    result = {k: v for k, v in p.items() if k != "runs"}
    result.update(kind="kvpress-chat", documents_from=args.docs_source or args.docs,
                  length=json.loads(Path(args.docs).read_text())["length"], runs=[
                      {k: v for k, v in r.items() if k != "answers"} for r in p["runs"]],
                  records=records, summary=summary)
    Path(args.json_out).write_text(json.dumps(result, indent=1))


def _by_document(records: list[dict], where: str) -> dict:
    """(document's planted answers, question) -> score; a document is known by its answers, as
    benchmarks/eval_chat_tables.py knows it."""
    from eval_chat_tables import planted_answers   # (benchmarks/ is the script's folder, first on sys.path)

    answers = planted_answers(records, by=("doc",))
    out = {}
    for r in records:
        key = (answers[(r["doc"],)], r["question"])
        if key in out:
            raise SystemExit(f"{where}: question {r['question']} of document {r['doc']} is there twice")
        out[key] = r["score"]
    return out


def compare(args) -> None:
    """kvcli's scores (one mode, policy and budget of eval-chat JSONs) beside kvpress's (one press of scored peer
    JSONs) on the questions both answered, paired per question."""
    import numpy as np

    ours, theirs = {}, {}
    for f in args.kvcli:
        recs = [r for r in json.loads(Path(f).read_text())["records"] if r["mode"] == args.mode and
                r["policy"] == args.policy and (args.policy == "full" or r["budget"] == args.budget)]
        ours.update(_by_document(recs, f))
    for f in args.peer:
        recs = [r for r in json.loads(Path(f).read_text())["records"] if r["press"] == args.press]
        theirs.update(_by_document(recs, f))
    both = sorted(set(ours) & set(theirs))
    if not both:
        sys.exit("error: no question answered on both sides")
    a, b = (np.array([d[k] for k in both], np.float64) for d in (ours, theirs))

    def ms(x):
        return round(float(x.mean()), 1), round(float(x.std(ddof=1) / math.sqrt(len(x))), 1)

    budget = None if args.policy == "full" else args.budget
    row = {"label": args.label, "mode": args.mode, "policy": args.policy, "budget": budget, "press": args.press,
           "questions": len(both), "documents": len({k[0] for k in both}), "kvcli": ms(a), "kvpress": ms(b),
           "paired_difference": ms(a - b), "both_right": int(((a > 0) & (b > 0)).sum()),
           "only_kvcli": int(((a > 0) & (b == 0)).sum()), "only_kvpress": int(((a == 0) & (b > 0)).sum()),
           "kvcli_files": args.kvcli, "kvpress_files": args.peer}
    print(f"{args.mode} {args.policy}{'' if budget is None else f'@{budget}'} vs {args.press}: {row['questions']} "
          "questions, "
          f"{row['documents']} documents: kvcli {row['kvcli'][0]} +- {row['kvcli'][1]}, kvpress {row['kvpress'][0]} "
          f"+- {row['kvpress'][1]}, paired {row['paired_difference'][0]:+} +- {row['paired_difference'][1]} "
          f"(both right {row['both_right']}, only kvcli {row['only_kvcli']}, only kvpress {row['only_kvpress']})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, indent=1))


def figure(args) -> None:
    """compare's rows side by side: each configuration's score and the peer's on the same questions."""
    import numpy as np

    from kvcli.evaluation.report import pyplot, save_png
    rows = [json.loads(Path(f).read_text()) for f in args.rows]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(rows), 3.6))
    x = np.arange(len(rows))
    for off, side, label in ((-0.2, "kvcli", "kvcli"), (0.2, "kvpress", "kvpress 0.5.5")):
        ax.bar(x + off, [r[side][0] for r in rows], 0.4, yerr=[r[side][1] for r in rows], capsize=2, label=label)
    for i, r in enumerate(rows):
        d, se = r["paired_difference"]
        ax.text(i, 103, f"{d:+.0f} +- {se:.0f}", ha="center", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels([r.get("label") or f"{r['mode']} {r['policy']}" for r in rows], fontsize=7)
    ax.set_ylim(0, 112)
    ax.set_ylabel("correct answers (%)")
    ax.set_title(args.title, fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    save_png(fig, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    a = sub.add_parser("export", help="kvcli's chat documents and questions (kvcli's venv)")
    a.add_argument("--model", default="qwen2.5-coder-0.5b")
    a.add_argument("--length", type=int, default=8192)
    a.add_argument("--documents", type=int, default=2)
    a.add_argument("--facts", type=int, default=6)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--check", help="an eval-chat JSON whose records the documents must match")
    a.add_argument("--out", required=True)
    b = sub.add_parser("peer", help="kvpress's pipeline (kvpress's venv)")
    b.add_argument("--model", required=True, help="the GGUF file")
    b.add_argument("--docs", required=True)
    b.add_argument("--budget", type=int, default=1024)
    b.add_argument("--presses", default="kvzip,none,snapkv", help="comma-separated: kvzip, none, snapkv, keydiff, tova")
    b.add_argument("--max-new-tokens", type=int, default=16)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--out", required=True)
    c = sub.add_parser("score", help="score kvpress's answers as kvcli does (kvcli's venv)")
    c.add_argument("--peer", required=True)
    c.add_argument("--docs", required=True)
    c.add_argument("--docs-source", help="how the documents were made, for the record")
    c.add_argument("--json-out", required=True)
    d = sub.add_parser("compare", help="kvcli's scores beside kvpress's, paired per question (kvcli's venv)")
    d.add_argument("--kvcli", nargs="+", required=True, help="eval-chat JSONs")
    d.add_argument("--peer", nargs="+", required=True, help="JSONs written by score")
    d.add_argument("--mode", default="once")
    d.add_argument("--policy", default="kvzip")
    d.add_argument("--budget", type=int, default=1024, help="(not for --policy full)")
    d.add_argument("--press", default="kvzip")
    d.add_argument("--label", help="the configuration's name in figure")
    d.add_argument("--json-out")
    e = sub.add_parser("figure", help="compare's rows as bars, kvcli beside kvpress (kvcli's venv)")
    e.add_argument("--rows", nargs="+", required=True, help="JSONs written by compare")
    e.add_argument("--title", default="")
    e.add_argument("--out", required=True)
    args = ap.parse_args()
    {"export": export, "peer": peer, "score": score, "compare": compare, "figure": figure}[args.step](args)


if __name__ == "__main__":
    main()
