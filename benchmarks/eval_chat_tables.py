#!/usr/bin/env python3
"""Pool several `kvcli eval chat` JSONs (other policies, budgets, modes or documents of one setting) into one
markdown table per length and one figure, for docs/results/chat-and-reselection.md ("Many questions over one document").

    python benchmarks/eval_chat_tables.py benchmarks/results/eval-chat-qwen-8k*.json --plot
    docs/eval-chat-qwen-8k-budgets.png

A document is known by its length and its planted answers (runs with other seeds or --documents pool as other
documents); a record found in two files (the same document, mode, policy, budget and question: e.g. `full` in
each run) is counted once, and must have the same score in both. Rows: policy x budget; columns: the modes; a
cell: mean score over the questions (%) +- its standard error (questions as the unit), the question count in
brackets where it differs from the table's. Numbers are the JSONs', only rounded.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

MODES = ("once", "alone", "context", "reselect", "bounded", "run", "reread")
ORDER = ("snapkv", "compresskv", "pyramidkv", "windowkv", "dynamickv", "spindlekv", "d2o", "h2o", "streamingllm",
         "kvzip", "expected_attention")


def planted_answers(records: list[dict], by=("length", "doc")) -> dict:
    """A document's identity across files: (its records' `by` fields) -> its planted answers in question order."""
    answers: dict = {}
    for r in records:
        answers.setdefault(tuple(r[k] for k in by), {})[r["question"]] = r["answer_expected"]
    return {d: tuple(a[q] for q in sorted(a)) for d, a in answers.items()}


def pool(paths: list[str]) -> tuple[dict, dict]:
    """(cells: (length, mode, policy, budget) -> [scores], docs: length -> {doc id: tokens})."""
    by_doc: dict = {}
    for p in paths:
        res = json.loads(Path(p).read_text())
        answers = planted_answers(res["records"])
        for r in res["records"]:
            doc = (r["doc_tokens"], answers[(r["length"], r["doc"])])
            key = (r["length"], doc, r["mode"], r["policy"], r["budget"], r["question"])
            if key in by_doc:
                if by_doc[key] != r["score"]:
                    raise SystemExit(f"{p}: {key[2:]} scores {r['score']} here, {by_doc[key]} in an earlier file")
                continue
            by_doc[key] = r["score"]
    cells: dict = {}
    docs: dict = {}
    for (L, doc, mode, pol, bud, _q), s in by_doc.items():
        cells.setdefault((L, mode, pol, bud), []).append(s)
        docs.setdefault(L, {})[doc] = doc[0]
    return cells, docs


def stat(xs: list[float]) -> tuple[float, float | None]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def cell(xs, n_table) -> str:
    if not xs:
        return ""
    m, se = stat(xs)
    out = f"{m:.0f} +- {se:.0f}" if se is not None else f"{m:.0f}"
    return out + ("" if len(xs) == n_table else f" ({len(xs)})")


def tables(cells: dict, docs: dict) -> str:
    out = []
    for L in sorted(docs):
        modes = [m for m in MODES if any(k[0] == L and k[1] == m for k in cells)]
        keys = sorted({(k[2], k[3]) for k in cells if k[0] == L and k[1] in modes},
                      key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0], k[1]))
        counts = [len(v) for k, v in cells.items() if k[0] == L]
        n_table = max(set(counts), key=counts.count)
        out.append(f"**{L} tokens**: {len(docs[L])} documents "
                   f"({', '.join(f'{t:,}' for t in sorted(docs[L].values()))} tokens); "
                   f"{n_table} questions per cell unless bracketed")
        full = cells.get((L, "full", "full", None))
        if full:
            out[-1] += f"; full cache (no compression, the conversation appended): {cell(full, n_table)}"
        out.append("")
        out.append("| policy | budget | " + " | ".join(modes) + " |")
        out.append("|---|---|" + "---|" * len(modes))
        for pol, bud in keys:
            out.append(f"| {pol} | {'-' if bud is None else bud} | " +
                       " | ".join(cell(cells.get((L, m, pol, bud), []), n_table) for m in modes) + " |")
        out.append("")
    return "\n".join(out)


def plot(cells: dict, docs: dict, path: str) -> None:
    from kvcli.evaluation.report import pyplot, save_png  # noqa: PLC0415
    plt = pyplot()
    import numpy as np  # noqa: PLC0415
    for L in sorted(docs):
        budgets = sorted({k[3] for k in cells if k[0] == L and k[3] is not None})
        fig, axes = plt.subplots(len(budgets), 1, figsize=(11, 2.8 * len(budgets)), squeeze=False, sharex=True)
        pols = sorted({k[2] for k in cells if k[0] == L and k[3] is not None},
                      key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER))
        modes = [m for m in MODES if any(k[0] == L and k[1] == m for k in cells)]
        width = 0.8 / max(1, len(modes))
        full = cells.get((L, "full", "full", None))
        for ax, b in zip(axes[:, 0], budgets):
            for j, m in enumerate(modes):
                st = [stat(cells[(L, m, p, b)]) if (L, m, p, b) in cells else (np.nan, 0) for p in pols]
                ax.bar(np.arange(len(pols)) + j * width, [s[0] for s in st], width,
                       yerr=[s[1] or 0 for s in st], label=m, capsize=2)
            for i, p in enumerate(pols):
                if not any((L, m, p, b) in cells for m in modes):
                    ax.text(i + 0.4 - width / 2, 4, "not run", ha="center", fontsize=8, color="grey")
            if full:
                ax.axhline(stat(full)[0], color="k", linestyle="--", linewidth=1, label="full cache")
            ax.set_ylim(0, 120)
            ax.set_yticks([0, 20, 40, 60, 80, 100])
            ax.set_ylabel(f"budget {b}\ncorrect (%)")
            ax.legend(fontsize=7, loc="upper right", ncol=len(modes) + 1)
        axes[-1, 0].set_xticks(np.arange(len(pols)) + 0.4 - width / 2)
        axes[-1, 0].set_xticklabels(pols, fontsize=8)
        axes[0, 0].set_title(f"qwen2.5-coder-0.5b, {L} tokens, {len(docs[L])} documents x 6 questions "
                             "(mean +- standard error)")
        save_png(fig, path if len(docs) == 1 else str(Path(path).with_stem(f"{Path(path).stem}-{L}")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--plot")
    a = ap.parse_args()
    cells, docs = pool(a.json)
    print(tables(cells, docs))
    if a.plot:
        plot(cells, docs, a.plot)


if __name__ == "__main__":
    main()
