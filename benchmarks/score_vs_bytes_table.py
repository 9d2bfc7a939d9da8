"""Issue #45's comparison at equal memory, from benchmarks/score_vs_bytes.sh's results: each policy's score against
the K/V bytes its cache holds, qwen2.5-coder-0.5b at 8k.

    python benchmarks/score_vs_bytes_table.py [--plot docs/score-vs-bytes-qwen-8k.png]

One row per policy and budget: the multi-question chat's score (re-selected per question; kvzip compressed once) with
its standard error (questions as the unit), RULER's (question-aware, string_match_all, mean over the samples), and
the bytes: held (`kv_bytes`: each layer's K/V rows from its front, the ragged layout, plus the slot bias of the
compacted cells, 192 B a cell on qwen), live (the kept entries' K/V), and the K/V rows the shared cells held before
the ragged layout, computed: kv_cells x the K/V bytes of a cell in every layer (12,288 B, the full cache's kv_bytes /
kv_cells; the cells layout allocates every layer as wide as its widest, benchmarks/results/ragged-held-qwen-station-
log.json measured it so), without the slot bias, so it understates that layout by about 1.6%. Bytes are means over
the questions (chat) and samples (RULER); the chat's are the table's. Numbers are the JSONs', only rounded.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"
CHAT = ["score-bytes-chat-qwen-8k.json", "score-bytes-chat-qwen-8k-kvzip-head.json",
        "score-bytes-chat-qwen-8k-kvzip-global.json"]
RULER = "score-bytes-ruler-qwen-8k.json"
ORDER = ("full", "snapkv", "pyramidkv", "dynamickv", "compresskv", "windowkv", "d2o", "spindlekv", "kvzip",
         "kvzip alloc=global")


def _label(policy: str, path: str) -> str:
    return "kvzip alloc=global" if policy == "kvzip" and "global" in path else policy


def _mean(xs):
    return sum(xs) / len(xs)


def chat_rows(paths: list[Path]) -> dict:
    """(policy label, budget) -> {score, se, n, kv_bytes, kv_bytes_live, cells_bytes} from the chat records."""
    out: dict = {}
    per_cell = None
    groups: dict = {}
    for p in paths:
        for r in json.loads(p.read_text())["records"]:
            if r["mode"] == "full" and r.get("kv_cells"):
                per_cell = r["kv_bytes"] / r["kv_cells"]
            groups.setdefault((_label(r["policy"], p.name), r["budget"]), []).append(r)
    for key, rs in groups.items():
        s = [r["score"] for r in rs]
        m = _mean(s)
        se = math.sqrt(sum((x - m) ** 2 for x in s) / (len(s) - 1) / len(s)) if len(s) > 1 else None
        row = {"score": m, "se": se, "n": len(s)}
        if all("kv_bytes" in r for r in rs):
            row["kv_bytes"] = _mean([r["kv_bytes"] for r in rs])
            row["kv_bytes_live"] = _mean([r["kv_bytes_live"] for r in rs])
            if per_cell:
                row["cells_bytes"] = _mean([r["kv_cells"] for r in rs]) * per_cell
        out[key] = row
    return out


def ruler_rows(path: Path) -> dict:
    """(policy, budget) -> {score, n, kv_bytes, cells_bytes} from the RULER records (bytes as in chat_rows)."""
    out: dict = {}
    groups: dict = {}
    per_cell = None
    for r in json.loads(path.read_text())["records"]:
        if r["status"] == "ok":
            groups.setdefault((r["policy"], r["budget"]), []).append(r)
            if r["policy"] == "full" and r.get("kv_cells") and "kv_bytes" in r:
                per_cell = r["kv_bytes"] / r["kv_cells"]
    for key, rs in groups.items():
        row = {"score": _mean([r["score"] for r in rs]), "n": len(rs)}
        if all("kv_bytes" in r for r in rs):
            row["kv_bytes"] = _mean([r["kv_bytes"] for r in rs])
            if per_cell:
                row["cells_bytes"] = _mean([r["kv_cells"] for r in rs]) * per_cell
        out[key] = row
    return out


def table(chat: dict, ruler: dict) -> str:
    lines = ["| policy | budget | chat (% right) | RULER (%) | MB held | MB live | MB in shared cells (before) |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted(set(chat) | set(ruler), key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else 99, k[1] or 0))
    for k in keys:
        c, r = chat.get(k, {}), ruler.get(k, {})
        score = f"{c['score']:.1f} +- {c['se']:.1f} ({c['n']})" if c.get("se") is not None else \
            (f"{c['score']:.1f} ({c['n']})" if c else "-")
        rs = f"{r['score']:.1f} ({r['n']})" if r else "-"
        mb = lambda v: f"{v / 1e6:.2f}" if v is not None else "-"  # noqa: E731
        held = c.get("kv_bytes", r.get("kv_bytes"))
        lines.append(f"| {k[0]} | {k[1] or '-'} | {score} | {rs} | {mb(held)} | {mb(c.get('kv_bytes_live'))} | "
                     f"{mb(c.get('cells_bytes')) if k[0] not in ('full',) else '-'} |")
    return "\n".join(lines)


def plot(chat: dict, ruler: dict, path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvcli.evaluation.report import pyplot, save_png  # noqa: PLC0415
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    policies = [p for p in ORDER if p != "full" and any(k[0] == p for k in chat)]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, rows, title in ((axes[0], chat, "multi-question chat (12 questions, re-selected)"),
                            (axes[1], ruler, "RULER: 2 needle tasks x 2 depths + variable tracking")):
        for i, pol in enumerate(policies):
            pts = sorted((b, r) for (p, b), r in rows.items() if p == pol and b is not None and "kv_bytes" in r)
            if not pts:
                continue
            col = colors[i % len(colors)]
            xs = [r["kv_bytes"] / 1e6 for _, r in pts]
            ys = [r["score"] for _, r in pts]
            ax.plot(xs, ys, "o-", color=col, label=pol)
            cx = [r.get("cells_bytes", 0) / 1e6 for _, r in pts]
            ax.plot(cx, ys, "o", mfc="none", color=col, alpha=0.7)
            for x0, x1, y in zip(xs, cx, ys):
                if x1 > x0 * 1.02:
                    ax.plot([x0, x1], [y, y], ":", color=col, alpha=0.5)
        full = rows.get(("full", None))
        if full:
            ax.axhline(full["score"], color="gray", ls="--", lw=1, label="full cache")
        ax.set(xscale="log", xlabel="K/V MB held (filled: ragged layout; hollow: the shared cells before)",
               ylabel="score (%)", title=title, ylim=(-3, 103))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("qwen2.5-coder-0.5b, 8k tokens, budgets 64 / 256 / 1024: score against the memory held")
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot", default=None)
    a = ap.parse_args()
    chat = chat_rows([RES / p for p in CHAT if (RES / p).exists()])
    ruler = ruler_rows(RES / RULER) if (RES / RULER).exists() else {}
    print(table(chat, ruler))
    if a.plot:
        plot(chat, ruler, a.plot)


if __name__ == "__main__":
    main()
