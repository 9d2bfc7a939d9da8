"""Pool `kvcli eval fidelity` JSON files (issue #63's real-text sample) into markdown tables: the pooled one
(kvcli/evaluation/fidelity.py `summarise`: KL mean +- s.e. over positions, top-1 agreement, perplexity ratio, held
K/V), the same pooled per genre where the documents have several, and one per document (KL and top-1 per
configuration, pooled over its positions). A document counts only where
every configuration of its run was scored (a run stopped by Ctrl-C mid-document leaves that document out). Runs of
`--form reselect` (kvcli/evaluation/fidelity_reselect.py) have several probes a document: a probe counts where every
configuration scored it, and a table per probe kind and the paired differences between configurations follow.
Files of both probe forms (`--form reselect` and `--form aware`, the same documents and probes) give each form's
tables, then re-selected minus compressed-once per configuration, paired over the same positions of the same
continuations (a summary probe only where both forms' full caches gave the same greedy answer).

`--plot PNG` draws the pooled table as README's figure: top-1 agreement and KL against the K/V MiB held, a line per
policy through its budgets, the full cache as the reference (docs/score-vs-bytes-real-text.png from
benchmarks/results/real-text-fidelity-256.json, which holds budgets 256 and 1024).

Usage: .venv/bin/python benchmarks/real_text_table.py A.json [B.json ...] [--plot PNG]
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from kvcli.evaluation.fidelity import summarise  # noqa: E402


def complete_records(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        try:
            res = json.loads(Path(p).read_text())
            res["records"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            sys.exit(f"real_text_table: {p}: not a kvcli eval fidelity JSON ({type(e).__name__}: {e})")
        n_cfg = len({(r["policy"], r["budget"]) for r in res["records"]})
        by_doc: dict[tuple, list] = {}
        for r in res["records"]:
            by_doc.setdefault((r["doc"], r["length"], r.get("probe")), []).append(r)
        for rs in by_doc.values():
            if len(rs) == n_cfg and all(r["status"] == "ok" for r in rs):
                out += rs
    if len({r.get("reference", "full") for r in out}) > 1:   # two references' KL would be pooled as one
        sys.exit("real_text_table: the records mix documents within the context (against the full cache) and past "
                 "it (against the full cache of what fits): table them apart")
    return out


def name(r: dict) -> str:
    return r["policy"] if r["budget"] is None else f"{r['policy']} @ {r['budget']}"


def tables(recs: list[dict]) -> str:
    docs = list(dict.fromkeys(r["doc"] for r in recs))
    genre = {r["doc"]: r.get("genre", "") for r in recs}
    lines = [f"Pooled over {len(docs)} documents ({', '.join(docs)}):", "",
             "| policy @ budget | positions | KL to full (nats), mean +- s.e. | top-1 agreement | ppl / full | "
             "K/V held (MiB) |", "|---|---:|---|---|---:|---:|"]
    lines += _pooled(summarise(recs))
    genres = list(dict.fromkeys(genre[d] for d in docs))
    if len(genres) > 1:   # the "per genre": each genre's documents pooled apart
        for g in genres:
            gd = [d for d in docs if genre[d] == g]
            many = "s" * (len(gd) != 1)
            lines += ["", f"Genre {g or '(none)'}, pooled over {len(gd)} document{many} ({', '.join(gd)}):", "",
                      "| policy @ budget | positions | KL to full (nats), mean +- s.e. | top-1 agreement | "
                      "ppl / full | K/V held (MiB) |", "|---|---:|---|---|---:|---:|"]
            lines += _pooled(summarise([r for r in recs if genre[r["doc"]] == g]))
    lines += ["", "Per document, KL mean (top-1 agreement):", "",
              "| policy @ budget | " + " | ".join(f"{d} ({genre[d]})" for d in docs) + " |",
              "|---|" + "---|" * len(docs)]
    for cfg in dict.fromkeys(name(r) for r in recs):
        cells = []
        for d in docs:
            r = summarise([x for x in recs if x["doc"] == d and name(x) == cfg])[0]
            cells.append(f"{r['kl_mean']:.3f} ({100 * r['top1']:.0f}%)")
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    if any(r.get("probe_kind") for r in recs):
        for kind in dict.fromkeys(r["probe_kind"] for r in recs):
            lines += ["", f"Probe {kind} ({len({(r['doc'], r['probe']) for r in recs if r['probe_kind'] == kind})} "
                      "probes):", "", "| policy @ budget | positions | KL to full (nats), mean +- s.e. | "
                      "top-1 agreement | ppl / full | K/V held (MiB) |", "|---|---:|---|---|---:|---:|"]
            lines += _pooled(summarise([r for r in recs if r["probe_kind"] == kind]))
        lines += ["", "Paired over the same positions (A minus B: KL mean +- s.e., top-1 points +- s.e.):", ""]
        cfgs = [c for c in dict.fromkeys(name(r) for r in recs) if c != "full"]
        for i, a in enumerate(cfgs):
            for b in cfgs[i + 1:]:
                dk, dt = paired(recs, a, b)
                lines.append(f"- {a} minus {b}: {np.mean(dk):+.3f} +- {_se(dk):.3f} nats, "
                             f"{100 * np.mean(dt):+.1f} +- {100 * _se(dt):.1f} points ({len(dk)} positions)")
    return "\n".join(lines)


def _pooled(rows: list[dict]) -> list[str]:
    return [f"| {name(s)} | {s['positions']} | {s['kl_mean']:.4f} +- {(s['kl_se'] or 0):.4f} | "
            f"{100 * s['top1']:.1f}% +- {100 * s['top1_se']:.1f} | {s['ratio_to_full']:.3f} | "
            f"{s['kv_bytes'] / 2 ** 20:.2f} |" for s in rows]


def paired(recs: list[dict], a: str, b: str) -> tuple[list[float], list[int]]:
    """Per-position differences of KL and top-1 between configurations a and b on the same documents and probes."""
    by = {(r["doc"], r["length"], r.get("probe"), name(r)): r for r in recs}
    dk, dt = [], []
    for (doc, length, probe, cfg), ra in by.items():
        rb = by.get((doc, length, probe, b))
        if cfg == a and rb is not None:
            dk += [x - y for x, y in zip(ra["kl_positions"], rb["kl_positions"])]
            dt += [x - y for x, y in zip(ra["top1_positions"], rb["top1_positions"])]
    return dk, dt


def across_forms(recs: list[dict]) -> str:
    """Per configuration (not full): --form reselect minus --form aware, per position of the same document, probe
    and continuation tokens."""
    by = {(r["doc"], r["length"], r["probe"], name(r), r["form"]): r for r in recs}
    lines = ["Re-selected minus compressed once for the probe (--form reselect minus --form aware), paired over the "
             "same positions (KL mean +- s.e., top-1 points +- s.e.):", ""]
    for cfg in [c for c in dict.fromkeys(name(r) for r in recs) if c != "full"]:
        dk, dt, left = [], [], set()
        for (doc, length, probe, c, form), ra in by.items():
            rb = by.get((doc, length, probe, c, "aware"))
            if c != cfg or form != "reselect" or rb is None:
                continue
            if ra["target_tokens"] != rb["target_tokens"]:
                left.add((doc, probe))
                continue
            dk += [x - y for x, y in zip(ra["kl_positions"], rb["kl_positions"])]
            dt += [x - y for x, y in zip(ra["top1_positions"], rb["top1_positions"])]
        gone = f"left out, continuations differ: {', '.join(sorted(f'{d} {p}' for d, p in left))}" if left else ""
        if dk:
            lines.append(f"- {cfg}: {np.mean(dk):+.3f} +- {_se(dk):.3f} nats, {100 * np.mean(dt):+.1f} +- "
                         f"{100 * _se(dt):.1f} points ({len(dk)} positions" + (f"; {gone}" if gone else "") + ")")
        elif gone:
            lines.append(f"- {cfg}: no probe with the same continuation in both forms ({gone})")
        else:
            only = sorted({f for (*_, c, f) in by if c == cfg})
            lines.append(f"- {cfg}: only in --form {', '.join(only)}, not paired")
    return "\n".join(lines)


def _se(xs) -> float:
    return float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0


def plot(recs: list[dict], path: str) -> None:
    """The pooled rows as two panels against the K/V MiB held (log): top-1 agreement and KL to the full cache."""
    from kvcli.evaluation.report import pyplot, save_png  # noqa: PLC0415
    plt = pyplot()
    rows = summarise(recs)
    docs = list(dict.fromkeys(r["doc"] for r in recs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    policies = [p for p in dict.fromkeys(s["policy"] for s in rows) if p != "full"]
    for i, pol in enumerate(policies):
        pts = sorted((s["budget"], s) for s in rows if s["policy"] == pol)
        xs = [s["kv_bytes"] / 2 ** 20 for _, s in pts]
        for ax, key, se, scale in ((axes[0], "top1", "top1_se", 100), (axes[1], "kl_mean", "kl_se", 1)):
            ax.errorbar(xs, [scale * s[key] for _, s in pts], yerr=[scale * (s[se] or 0) for _, s in pts], fmt="o-",
                        color=colors[i % len(colors)], capsize=3, label=pol)
            for x, (b, s) in zip(xs, pts):
                ax.annotate(str(b), (x, scale * s[key]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    full = next((s for s in rows if s["policy"] == "full"), None)
    for ax, label in ((axes[0], "top-1 agreement with the full cache (%)"), (axes[1], "KL to the full cache (nats)")):
        if full:
            ax.axvline(full["kv_bytes"] / 2 ** 20, color="gray", ls="--", lw=1, label="full cache's K/V")
        ax.set(xscale="log", xlabel="K/V MiB held", ylabel=label)
        ticks = [3, 6, 12, 30]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"qwen2.5-coder-0.5b on real documents ({', '.join(docs)}), compressed once at budgets 256 and "
                 "1024:\nnext-token agreement with the full cache against the memory held", fontsize=10)
    save_png(fig, path)


if __name__ == "__main__":
    args = sys.argv[1:]
    png = None
    if "--plot" in args:
        i = args.index("--plot")
        if i + 1 >= len(args):
            sys.exit("real_text_table: --plot needs a PNG path")
        png = args[i + 1]
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    records = complete_records(args)
    if png:
        plot(records, png)
    forms = list(dict.fromkeys(r.get("form", "once") for r in records))
    if len(forms) == 1:
        print(tables(records))
    else:
        for f in forms:
            print(f"## --form {f}\n\n" + tables([r for r in records if r.get("form", "once") == f]) + "\n")
        if {"reselect", "aware"} <= set(forms):
            print(across_forms([r for r in records if r.get("form") in ("reselect", "aware")]))
