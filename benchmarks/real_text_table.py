"""Pool `kvcli eval fidelity` JSON files (issue #63's real-text sample) into markdown tables: the pooled one
(kvcli/evaluation/fidelity.py `summarise`: KL mean +- s.e. over positions, top-1 agreement, perplexity ratio, held
K/V) and one per document (KL and top-1 per configuration). A document counts only where every configuration of
its run was scored (a run stopped by Ctrl-C mid-document leaves that document out).

Usage: .venv/bin/python benchmarks/real_text_table.py A.json [B.json ...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcli.evaluation.fidelity import summarise  # noqa: E402


def complete_records(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        res = json.loads(Path(p).read_text())
        n_cfg = len({(r["policy"], r["budget"]) for r in res["records"]})
        by_doc: dict[tuple, list] = {}
        for r in res["records"]:
            by_doc.setdefault((r["doc"], r["length"]), []).append(r)
        for rs in by_doc.values():
            if len(rs) == n_cfg and all(r["status"] == "ok" for r in rs):
                out += rs
    return out


def name(r: dict) -> str:
    return r["policy"] if r["budget"] is None else f"{r['policy']} @ {r['budget']}"


def tables(recs: list[dict]) -> str:
    docs = list(dict.fromkeys(r["doc"] for r in recs))
    genre = {r["doc"]: r.get("genre", "") for r in recs}
    lines = [f"Pooled over {len(docs)} documents ({', '.join(docs)}):", "",
             "| policy @ budget | positions | KL to full (nats), mean +- s.e. | top-1 agreement | ppl / full | "
             "K/V held (MiB) |", "|---|---:|---|---|---:|---:|"]
    for s in summarise(recs):
        lines.append(f"| {name(s)} | {s['positions']} | {s['kl_mean']:.4f} +- {(s['kl_se'] or 0):.4f} | "
                     f"{100 * s['top1']:.1f}% +- {100 * s['top1_se']:.1f} | {s['ratio_to_full']:.3f} | "
                     f"{s['kv_bytes'] / 2 ** 20:.2f} |")
    lines += ["", "Per document, KL mean (top-1 agreement):", "",
              "| policy @ budget | " + " | ".join(f"{d} ({genre[d]})" for d in docs) + " |",
              "|---|" + "---|" * len(docs)]
    for cfg in dict.fromkeys(name(r) for r in recs):
        cells = []
        for d in docs:
            r = next(x for x in recs if x["doc"] == d and name(x) == cfg)
            cells.append(f"{r['kl_mean']:.3f} ({100 * r['top1']:.0f}%)")
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(tables(complete_records(sys.argv[1:])))
