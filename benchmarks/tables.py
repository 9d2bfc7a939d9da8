#!/usr/bin/env python3
"""Markdown tables for docs/results.md from the JSON that kvcli bench / kvcli eval wrote.

    python benchmarks/tables.py benchmarks/results/bench.json [more.json ...]
    python benchmarks/tables.py --merge eval-r0.json eval-r1.json ...   # eval runs of one setting, pooled

Prints the tables; numbers are copied from the measurements, only rounded. --merge pools the per-prompt
records of several `kvcli eval niah/ruler` runs (e.g. rounds with other seeds or depths) into one table per task
and one over all tasks: policy x budget, mean score with its standard error over the prompts, the prompt count,
and the fraction of the full cache's score on the same prompts. Fidelity runs (`kvcli eval fidelity`, e.g. one
per document) pool the same way: per length, policy x budget, mean perplexity over the documents as a ratio to
the full cache's mean on the same documents (as `kvcli eval fidelity` summarises several --docs), the lowest and
highest single-document ratio, and the mean KL to full.
"""
from __future__ import annotations

import json
import sys


def _f(v, fmt):
    return "–" if v is None else fmt.format(v)


def bench_tables(res: dict) -> str:
    out = [f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, "
           f"{res['machine']['threads']} threads; load average at start {res['machine'].get('load_avg_1m_at_start')}.",
           f"Settings: {res['settings']['gen']} tokens decoded per configuration, {res['settings']['repeat']} repeats.", ""]
    for doc in dict.fromkeys(r["doc"] for r in res["rows"]):
        rows = [r for r in res["rows"] if r["doc"] == doc]
        out.append(f"**{doc}** ({rows[0]['prompt_tokens']} prompt tokens)\n")
        out.append("| config | prefill tok/s | compress s (share) | decode tok/s median (min–max) | x full | cells | KV MB "
                   "| KV vs full | peak RSS MB | agreement | KL |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.get("status") != "ok":
                out.append(f"| {r['config']} | {r.get('status')} |||||||||")
                continue
            out.append(
                f"| {r['config']} | {r['prefill_tok_s']:.0f} | {r['compress_s']:.3f} ({100 * r['compress_share']:.1f}%) | "
                f"{r['decode_tok_s']:.1f} ({r['decode_tok_s_min']:.1f}–{r['decode_tok_s_max']:.1f}) | "
                f"{_f(r.get('decode_speedup_vs_full'), '{:.2f}')} | {r['kv_cells']} | {r['kv_bytes'] / 1e6:.2f} | "
                f"{_f(r.get('kv_bytes_vs_full'), '{:.3f}')} | {_f(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 1e6, '{:.0f}')} | "
                f"{100 * r['agreement']:.0f}% | {r['kl_mean']:.3f} |")
        out.append("")
    if res.get("batch"):
        s = res["settings"]
        out.append(f"**Batch at equal memory**: {s['ctx']} cells, up to {s['batch']} documents, {s['gen']} tokens each, "
                   "all decoded together\n")
        out.append("| config | documents held | cells | KV MB | aggregate tok/s | x full | status |")
        out.append("|---|---|---|---|---|---|---|")
        for b in res["batch"]:
            if "aggregate_tok_s" not in b:
                out.append(f"| {b['config']} ||||||{b.get('status')} |")
                continue
            out.append(f"| {b['config']} | {b['docs_held']} | {b['cells_held']} | {b['kv_bytes_held'] / 1e6:.2f} | "
                       f"{b['aggregate_tok_s']:.1f} | {_f(b.get('throughput_vs_full'), '{:.2f}')} | {b['status']} |")
        out.append("")
    return "\n".join(out)


def eval_tables(res: dict) -> str:
    fid = res["task"] == "fidelity"
    metric = "ppl" if fid else "score"
    lengths = sorted({s["length"] for s in res["summary"]})
    out = []
    for task in sorted({s["task"] for s in res["summary"]}):
        out.append(f"**{task}** — " + ("perplexity of the continuation (ratio to full) [mean KL to full]" if fid else
                                       "score % (fraction of the full cache's score on the same samples)") + "\n")
        out.append("| policy | " + " | ".join(f"{L} tokens" for L in lengths) + " |")
        out.append("|---|" + "---|" * len(lengths))
        keys = list(dict.fromkeys((s["policy"], s["budget"]) for s in res["summary"] if s["task"] == task))
        for pol, bud in keys:
            cells = []
            for L in lengths:
                m = [s for s in res["summary"] if (s["task"], s["policy"], s["budget"], s["length"]) == (task, pol, bud, L)]
                if not m:
                    cells.append("")
                elif m[0].get(metric) is None:
                    cells.append(str(m[0].get("status")))
                elif fid:
                    cells.append(f"{m[0]['ppl']:.2f} ({_f(m[0].get('ratio_to_full'), '{:.3f}')}) "
                                 f"[{_f(m[0].get('kl_mean'), '{:.3f}')}]")
                else:
                    cells.append(f"{m[0]['score']:.0f} ({_f(m[0].get('frac_of_full'), '{:.2f}')})")
            out.append(f"| {pol if bud is None else f'{pol} @ {bud}'} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def merged_eval_tables(results: list[dict]) -> str:
    recs = [dict(r, run=i) for i, res in enumerate(results) for r in res["records"]]
    lengths = sorted({r["length"] for r in recs})
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None})
    full = {(r["run"], r["task"], r["length"], r.get("depth"), r["sample"]): r["score"]
            for r in recs if r["policy"] == "full" and r["score"] is not None}
    out = []
    for L in lengths:
        for task in [*sorted({r["task"] for r in recs}), "all tasks"]:
            rs = [r for r in recs if r["length"] == L and task in (r["task"], "all tasks")]
            n_full = [v for k, v in full.items() if k[2] == L and task in (k[1], "all tasks")]
            out.append(f"**{task}, {L} tokens**: full cache {sum(n_full) / max(1, len(n_full)):.0f}% over "
                       f"{len(n_full)} prompts; cells: mean score % +- standard error (fraction of full)\n")
            out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
            out.append("|---|" + "---|" * len(budgets))
            for pol in dict.fromkeys(r["policy"] for r in rs if r["policy"] != "full"):
                cells = []
                for b in budgets:
                    m = [r for r in rs if r["policy"] == pol and r["budget"] == b]
                    ok = [r for r in m if r["score"] is not None]
                    if not m:
                        cells.append("")
                        continue
                    if len(ok) < len(m):
                        cells.append(f"{len(m) - len(ok)} of {len(m)}: {m[0]['status']}"[:60])
                        continue
                    sc = [r["score"] for r in ok]
                    mean = sum(sc) / len(sc)
                    se = (sum((x - mean) ** 2 for x in sc) / (len(sc) - 1) / len(sc)) ** 0.5 if len(sc) > 1 else 0.0
                    base = [full.get((r["run"], r["task"], r["length"], r.get("depth"), r["sample"])) for r in ok]
                    frac = (mean / (sum(base) / len(base))) if all(v is not None for v in base) and sum(base) else None
                    cells.append(f"{mean:.0f} +- {se:.0f} ({_f(frac, '{:.2f}')})")
                out.append(f"| {pol} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def merged_fidelity_tables(results: list[dict]) -> str:
    recs = [dict(r, run=i) for i, res in enumerate(results) for r in res["records"]]
    full = {(r["run"], r["doc"], r["length"]): r["ppl"] for r in recs if r["policy"] == "full" and r["ppl"] is not None}
    budgets = sorted({r["budget"] for r in recs if r["budget"] is not None})
    out = []
    for L in sorted({r["length"] for r in recs}):
        docs = sorted({(r["run"], r["doc"]) for r in recs if r["length"] == L})
        base = [full.get((run, doc, L)) for run, doc in docs]
        out.append(f"**fidelity, {L} tokens + continuation, {len(docs)} document{'s' if len(docs) > 1 else ''}**: full cache perplexity "
                   + ", ".join(_f(b, "{:.2f}") for b in base)
                   + "; cells: ratio of mean perplexity to full's (lowest–highest single document) [mean KL]\n")
        out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for pol in dict.fromkeys(r["policy"] for r in recs if r["length"] == L and r["policy"] != "full"):
            cells = []
            for b in budgets:
                m = [r for r in recs if (r["length"], r["policy"], r["budget"]) == (L, pol, b)]
                ok = [r for r in m if r["ppl"] is not None and full.get((r["run"], r["doc"], L))]
                if not m:
                    cells.append("")
                elif len(ok) < len(m):
                    cells.append(f"{len(m) - len(ok)} of {len(m)}: {m[0]['status']}"[:60])
                else:
                    bases = [full[(r["run"], r["doc"], L)] for r in ok]
                    ratio = sum(r["ppl"] for r in ok) / sum(bases)
                    each = [r["ppl"] / f for r, f in zip(ok, bases)]
                    kl = [r["kl_mean"] for r in ok if r.get("kl_mean") is not None]
                    cells.append(f"{ratio:.2f} ({min(each):.2f}–{max(each):.2f}) "
                                 f"[{_f(sum(kl) / len(kl) if kl else None, '{:.2f}')}]")
            out.append(f"| {pol} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--merge":
        results = [json.load(open(p)) for p in sys.argv[2:]]
        kinds = {res["task"] == "fidelity" for res in results}
        if len(kinds) > 1:
            sys.exit("tables.py --merge: give either fidelity runs or niah/ruler runs, not both")
        print(merged_fidelity_tables(results) if kinds == {True} else merged_eval_tables(results))
        return
    for path in sys.argv[1:]:
        res = json.load(open(path))
        print(f"<!-- {path} -->")
        print(bench_tables(res) if res["kind"] == "bench" else eval_tables(res))


if __name__ == "__main__":
    main()
