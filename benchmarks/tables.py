#!/usr/bin/env python3
"""Markdown tables for docs/results.md from the JSON that kvcli bench / kvcli eval wrote.

    python benchmarks/tables.py benchmarks/results/bench.json [more.json ...]
    python benchmarks/tables.py --merge eval-r0.json eval-r1.json ...   # eval runs of one setting, pooled
    python benchmarks/tables.py --merge ruler-4k-r*.json ruler-8k-r*.json --plot ruler.png   # and a figure

Prints the tables; numbers are copied from the measurements, only rounded. --merge pools the per-prompt
records of several `kvcli eval niah/ruler` runs (e.g. rounds with other seeds or depths) into one table per task
and one over all tasks: policy x budget, mean score with its standard error over the prompts, the prompt count,
and the fraction of the full cache's score on the same prompts. Fidelity runs (`kvcli eval fidelity`, e.g. one
per document) pool the same way: per length, policy x budget, mean perplexity over the documents as a ratio to
the full cache's mean on the same documents (as `kvcli eval fidelity` summarises several --docs), the lowest and
highest single-document ratio, and the mean KL to full.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _f(v, fmt):
    return "–" if v is None else fmt.format(v)


def bench_tables(res: dict) -> str:
    out = [f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, "
           f"{res['machine']['threads']} threads; load average at start {res['machine'].get('load_avg_1m_at_start')}.",
           f"Settings: {res['settings']['gen']} tokens decoded per configuration, "
           f"{res['settings']['repeat']} repeats.", ""]
    for doc in dict.fromkeys(r["doc"] for r in res["rows"]):
        rows = [r for r in res["rows"] if r["doc"] == doc]
        out.append(f"**{doc}** ({rows[0]['prompt_tokens']} prompt tokens)\n")
        out.append("| config | prefill tok/s | compress s (share) | decode tok/s median (min–max) | x full | cells | "
                   "KV MB "
                   "| KV vs full | peak RSS MB | agreement | KL |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.get("status") != "ok":
                out.append(f"| {r['config']} | {r.get('status')} |||||||||")
                continue
            out.append(
                f"| {r['config']} | {r['prefill_tok_s']:.0f} | {r['compress_s']:.3f} "
                f"({100 * r['compress_share']:.1f}%) | "
                f"{r['decode_tok_s']:.1f} ({r['decode_tok_s_min']:.1f}–{r['decode_tok_s_max']:.1f}) | "
                f"{_f(r.get('decode_speedup_vs_full'), '{:.2f}')} | {r['kv_cells']} | {r['kv_bytes'] / 1e6:.2f} | "
                f"{_f(r.get('kv_bytes_vs_full'), '{:.3f}')} | "
                f"{_f(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 1e6, '{:.0f}')} | "
                f"{100 * r['agreement']:.0f}% | {r['kl_mean']:.3f} |")
        out.append("")
    if res.get("batch"):
        s = res["settings"]
        out.append(f"**Batch at equal memory**: {s['ctx']} cells, up to {s['batch']} documents, {s['gen']} tokens "
                   "each, "
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
                m = [s for s in res["summary"] if (s["task"], s["policy"], s["budget"], s["length"]) == (task, pol,
                                                                                                         bud, L)]
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


def pool_scores(results: list[dict]) -> tuple[dict, dict]:
    """Per (length, task or "all tasks", policy, budget): mean score, standard error, prompt count and fraction of
    the full cache's mean on the same prompts (or a status string when some prompt failed); and the full cache's
    scores per (length, task)."""
    recs = [dict(r, run=i) for i, res in enumerate(results) for r in res["records"]]
    full = {(r["run"], r["task"], r["length"], r.get("depth"), r["sample"]): r["score"]
            for r in recs if r["policy"] == "full" and r["score"] is not None}
    cells, full_scores = {}, {}
    for L in sorted({r["length"] for r in recs}):
        for task in [*sorted({r["task"] for r in recs}), "all tasks"]:
            rs = [r for r in recs if r["length"] == L and task in (r["task"], "all tasks")]
            full_scores[(L, task)] = [v for k, v in full.items() if k[2] == L and task in (k[1], "all tasks")]
            for pol, b in dict.fromkeys((r["policy"], r["budget"]) for r in rs if r["policy"] != "full"):
                m = [r for r in rs if r["policy"] == pol and r["budget"] == b]
                ok = [r for r in m if r["score"] is not None]
                if len(ok) < len(m):
                    cells[(L, task, pol, b)] = f"{len(m) - len(ok)} of {len(m)}: {m[0]['status']}"[:60]
                    continue
                sc = [r["score"] for r in ok]
                mean = sum(sc) / len(sc)
                se = (sum((x - mean) ** 2 for x in sc) / (len(sc) - 1) / len(sc)) ** 0.5 if len(sc) > 1 else 0.0
                base = [full.get((r["run"], r["task"], r["length"], r.get("depth"), r["sample"])) for r in ok]
                frac = (mean / (sum(base) / len(base))) if all(v is not None for v in base) and sum(base) else None
                cells[(L, task, pol, b)] = (mean, se, len(sc), frac)
    return cells, full_scores


def merged_eval_tables(results: list[dict]) -> str:
    cells, full_scores = pool_scores(results)
    budgets = sorted({k[3] for k in cells if k[3] is not None})
    out = []
    for L, task in full_scores:
        n_full = full_scores[(L, task)]
        out.append(f"**{task}, {L} tokens**: full cache {sum(n_full) / max(1, len(n_full)):.0f}% over "
                   f"{len(n_full)} prompts; cells: mean score % +- standard error (fraction of full)\n")
        out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for pol in dict.fromkeys(k[2] for k in cells if k[:2] == (L, task)):
            row = []
            for b in budgets:
                c = cells.get((L, task, pol, b), "")
                row.append(c if isinstance(c, str) else f"{c[0]:.0f} +- {c[1]:.0f} ({_f(c[3], '{:.2f}')})")
            out.append(f"| {pol} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def plot_panels(series: dict, reference: dict, path: str, *, title: str, ylabel: str, log_y: bool = False) -> None:
    """One panel per length (the keys of `reference`: length -> (y of the full cache, panel title)). `series` maps
    (length, policy, budget) -> (y, y_below, y_above): a line per policy over the budgets with those error bars."""
    from kvcli.evaluation.report import pyplot, save_png  # noqa: PLC0415
    policies = list(dict.fromkeys(k[1] for k in series))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(reference), figsize=(4.6 * len(reference), 4), squeeze=False)
    for ax, (L, (full_y, panel)) in zip(axes.flat, sorted(reference.items())):
        ax.axhline(full_y, color="k", ls="--", lw=1, label="full")
        for i, pol in enumerate(policies):
            pts = sorted((k[2], v) for k, v in series.items() if k[:2] == (L, pol))
            if pts:  # ten colours, the eleventh policy dotted; each policy nudged sideways so error bars stay apart
                nudge = 2 ** (0.015 * (i - len(policies) / 2))
                ax.errorbar([b * nudge for b, _ in pts], [v[0] for _, v in pts],
                            yerr=[[v[1] for _, v in pts], [v[2] for _, v in pts]], marker="o", ms=3, capsize=2, lw=1,
                            color=f"C{i % 10}", ls="-" if i < 10 else ":", label=pol)
        ax.set(title=panel, xlabel="budget (cells per layer)", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        budgets = sorted({k[2] for k in series if k[0] == L})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.xaxis.set_minor_locator(plt.NullLocator())
    legend = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}  # every panel's
    fig.legend(legend.values(), legend.keys(), loc="center left", bbox_to_anchor=(0.905, 0.5), fontsize=8)
    fig.subplots_adjust(right=0.9)
    fig.suptitle(title)
    save_png(fig, path)
    plt.close(fig)


def plot_merged_eval(results: list[dict], path: str) -> None:
    """Mean score over all tasks vs budget, standard error as bars, the full cache's mean on the same prompts."""
    cells, full_scores = pool_scores(results)
    series = {(L, pol, b): (v[0], v[1], v[1]) for (L, task, pol, b), v in cells.items()
              if task == "all tasks" and not isinstance(v, str)}
    reference = {L: (sum(f) / len(f), f"{L} tokens, {len(f)} prompts")
                 for (L, task), f in full_scores.items() if task == "all tasks"}
    agnostic = results[0].get("settings", {}).get("mode") == "agnostic"   # kvcli eval ... --agnostic
    plot_panels(series, reference, path, ylabel="score % (mean +- s.e.)",
                title=f"{Path(results[0]['model']).stem}: RULER-style tasks, "
                      + ("compressed before the question" if agnostic else "prompts pooled over rounds"))


def plot_merged_fidelity(results: list[dict], path: str) -> None:
    """Perplexity ratio to full vs budget (log), bars from the lowest to the highest single-document ratio."""
    cells, full_ppl = pool_fidelity(results)
    series = {k: (v[0], v[0] - v[1], v[2] - v[0]) for k, v in cells.items() if not isinstance(v, str)}
    reference = {L: (1.0, f"{L} tokens + continuation, {len(f)} doc{'s' if len(f) > 1 else ''}")
                 for L, f in full_ppl.items()}
    plot_panels(series, reference, path, ylabel="continuation perplexity / full's", log_y=True,
                title=f"{Path(results[0]['model']).stem}: fidelity on raw text, documents pooled")


def pool_fidelity(results: list[dict]) -> tuple[dict, dict]:
    """Per (length, policy, budget): the mean perplexity over the documents divided by the full cache's mean on
    them (as `kvcli eval fidelity` summarises several --docs), the lowest and highest single-document ratio and the
    mean KL to full (or a status string when some document failed); and the full cache's perplexity per document
    for each length."""
    recs = [dict(r, run=i) for i, res in enumerate(results) for r in res["records"]]
    full = {(r["run"], r["doc"], r["length"]): r["ppl"] for r in recs if r["policy"] == "full" and r["ppl"] is not None}
    cells, full_ppl = {}, {}
    for L in sorted({r["length"] for r in recs}):
        docs = sorted({(r["run"], r["doc"]) for r in recs if r["length"] == L})
        full_ppl[L] = [full.get((run, doc, L)) for run, doc in docs]
        for pol, b in dict.fromkeys((r["policy"],
                                     r["budget"]) for r in recs if r["length"] == L and r["policy"] != "full"):
            m = [r for r in recs if (r["length"], r["policy"], r["budget"]) == (L, pol, b)]
            ok = [r for r in m if r["ppl"] is not None and full.get((r["run"], r["doc"], L))]
            if len(ok) < len(m):
                cells[(L, pol, b)] = f"{len(m) - len(ok)} of {len(m)}: {m[0]['status']}"[:60]
                continue
            bases = [full[(r["run"], r["doc"], L)] for r in ok]
            each = [r["ppl"] / f for r, f in zip(ok, bases)]
            kl = [r["kl_mean"] for r in ok if r.get("kl_mean") is not None]
            cells[(L, pol, b)] = (sum(r["ppl"] for r in ok) / sum(bases), min(each), max(each),
                                  sum(kl) / len(kl) if kl else None)
    return cells, full_ppl


def merged_fidelity_tables(results: list[dict]) -> str:
    cells, full_ppl = pool_fidelity(results)
    budgets = sorted({k[2] for k in cells if k[2] is not None})
    out = []
    for L, base in full_ppl.items():
        out.append(f"**fidelity, {L} tokens + continuation, {len(base)} document{'s' if len(base) > 1 else ''}**: "
                   "full cache perplexity " + ", ".join(_f(v, "{:.2f}") for v in base)
                   + "; cells: ratio of mean perplexity to full's (lowest–highest single document) [mean KL]\n")
        out.append("| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        out.append("|---|" + "---|" * len(budgets))
        for pol in dict.fromkeys(k[1] for k in cells if k[0] == L):
            row = []
            for b in budgets:
                c = cells.get((L, pol, b), "")
                row.append(c if isinstance(c, str) else f"{c[0]:.2f} ({c[1]:.2f}–{c[2]:.2f}) [{_f(c[3], '{:.2f}')}]")
            out.append(f"| {pol} | " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSON written by kvcli bench / kvcli eval --json-out")
    ap.add_argument("--merge", action="store_true", help="pool several eval runs into one table per setting")
    ap.add_argument("--plot", metavar="PNG", help="with --merge: score (or perplexity ratio) vs budget, one panel per "
                                                  "length")
    args = ap.parse_args()
    if args.plot:
        from kvcli.errors import KvcliError  # noqa: PLC0415
        from kvcli.evaluation.report import check_png  # noqa: PLC0415
        try:
            check_png(args.plot)
        except KvcliError as e:
            ap.error(str(e))
    results = [json.load(open(p)) for p in args.files]
    if not args.merge:
        if args.plot:
            ap.error("--plot needs --merge")
        for path, res in zip(args.files, results):
            print(f"<!-- {path} -->")
            print(bench_tables(res) if res["kind"] == "bench" else eval_tables(res))
        return
    kinds = {res["task"] == "fidelity" for res in results}
    if len(kinds) > 1 or any(res["kind"] != "eval" for res in results):
        ap.error("--merge takes either fidelity runs or niah/ruler runs of kvcli eval, not a mix")
    fidelity = kinds == {True}
    print(merged_fidelity_tables(results) if fidelity else merged_eval_tables(results))
    if args.plot:
        (plot_merged_fidelity if fidelity else plot_merged_eval)(results, args.plot)


if __name__ == "__main__":
    main()
