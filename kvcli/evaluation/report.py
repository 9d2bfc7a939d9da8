"""Writing results: atomic files and matplotlib plots (Agg backend, PNG) for bench and eval."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvcli.errors import KvcliError


def write_text(path: str, text: str) -> None:
    """Through a temporary file and a rename: an interrupted run never leaves half a file."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise KvcliError(f"{path} is a directory")
    if not p.parent.exists():
        raise KvcliError(f"cannot write {path}: the folder {p.parent} does not exist")
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, p)
    except OSError as e:
        raise KvcliError(f"cannot write {path}: {e.strerror}") from None


PLOT_HINT = "pip install 'kvcli[plot]'"


def require_matplotlib() -> None:
    """--plot without matplotlib (the `plot` extra): one line, exit 2, before any measuring starts."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        raise KvcliError(f"--plot needs matplotlib, which is not installed: {PLOT_HINT}") from None


def check_png(path: str | None) -> None:
    """Refuse a bad --plot before any measuring starts."""
    if path is None:
        return
    require_matplotlib()
    p = Path(path).expanduser()
    if p.suffix.lower() != ".png":
        raise KvcliError(f"--plot must name a .png file (got {path})")
    if not p.parent.exists():
        raise KvcliError(f"cannot write {path}: the folder {p.parent} does not exist")


def pyplot():
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        raise KvcliError(f"plots need matplotlib, which is not installed: {PLOT_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt


def save_png(fig, path: str) -> None:
    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, p)


# ------------------------------------------------------------------------------ bench
def plot_bench(result: dict, path: str) -> None:
    """Three panels: decode tok/s vs budget, greedy agreement vs budget (one line per policy and cache
    type, full caches as horizontal lines), and KV bytes per configuration as bars. One document:
    the longest benchmarked (figures of several documents are not averaged into one line)."""
    plt = pyplot()
    rows = [r for r in result["rows"] if r.get("status") == "ok"]
    if not rows:
        raise KvcliError("nothing to plot: no configuration was measured")
    doc = max(rows, key=lambda r: r["prompt_tokens"])["doc"]
    rows = [r for r in rows if r["doc"] == doc]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["cache_type"]), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((pol, ct), rs) in enumerate(sorted(groups.items())):
        c = colors[i % len(colors)]
        label = f"{pol} ({ct})"
        for ax, key, scale in ((axes[0], "decode_tok_s", 1), (axes[1], "agreement", 100)):
            if pol == "full":
                ax.axhline(rs[0][key] * scale, color=c, ls="--", label=label)
            else:
                rs = sorted(rs, key=lambda r: r["budget"])
                ax.plot([r["budget"] for r in rs], [r[key] * scale for r in rs], "o-", color=c, label=label)
    axes[0].set(title=f"decode (median of repeats), {doc}", xlabel="budget (entries per layer and KV head)",
                ylabel="tok/s")
    axes[1].set(title="greedy agreement with full f16 cache", xlabel="budget", ylabel="% of steps", ylim=(-3, 103))
    for ax in axes[:2]:
        if any(r["budget"] for r in rows):
            ax.set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    labels = [r["config"] for r in rows]
    axes[2].barh(range(len(rows)), [r["kv_bytes"] / 1e6 for r in rows], color=colors[0])
    axes[2].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[2].invert_yaxis()
    axes[2].set(title="KV bytes measured in the cache", xlabel="MB")
    fig.suptitle(f"kvcli bench: {Path(result['model']).name}, {rows[0]['prompt_tokens']}-token prompt, "
                 f"{rows[0]['gen_tokens']} generated tokens")
    save_png(fig, path)
    plt.close(fig)
    if result.get("batch") and any("aggregate_tok_s" in b for b in result["batch"]):
        plot_batch(result, str(Path(path).with_name(Path(path).stem + "-batch.png")))


def plot_batch(result: dict, path: str) -> None:
    plt = pyplot()
    bs = [b for b in result["batch"] if "aggregate_tok_s" in b]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(bs) + 1.8))
    y = range(len(bs))
    axes[0].barh(y, [b["docs_held"] for b in bs])
    axes[0].set_yticks(y, [b["config"] for b in bs], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set(title=f"documents held in {result['settings']['ctx']} cells (max {result['settings']['batch']})",
                xlabel="documents")
    axes[1].barh(y, [b["aggregate_tok_s"] for b in bs], color="tab:orange")
    axes[1].set_yticks(y, [""] * len(bs))
    axes[1].invert_yaxis()
    axes[1].set(title="aggregate decode, all held decoded in one batch", xlabel="tok/s")
    save_png(fig, path)
    plt.close(fig)


# ------------------------------------------------------------------------------ eval
def plot_niah(result: dict, path: str) -> None:
    """One heat map (length x depth, colour = score) per policy x budget."""
    plt = pyplot()
    cells = result["cells"]
    keys = []
    for c in cells:
        k = (c["policy"], c["budget"])
        if k not in keys:
            keys.append(k)
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    ncol = min(4, len(keys))
    nrow = -(-len(keys) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol, 2.9 * nrow), squeeze=False, constrained_layout=True)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    im = None
    for ax, (pol, bud) in zip(axes.flat, keys):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            if (c["policy"], c["budget"]) == (pol, bud) and c.get("score") is not None:
                grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["score"]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(pol if bud is None else f"{pol} @ {bud}", fontsize=9)
        ax.set_xlabel("tokens", fontsize=7)
        ax.set_ylabel("depth", fontsize=7)
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6)
        if np.isnan(grid).all():  # say why the panel is empty
            why = next((c.get("status", "") for c in cells if (c["policy"], c["budget"]) == (pol, bud)), "")
            ax.text(0.5, 0.5, "\n".join(why[i:i + 28] for i in range(0, min(len(why), 84), 28)),
                    transform=ax.transAxes, ha="center", va="center", fontsize=6)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.8, label="score (%)")
    fig.suptitle(f"needle in a haystack: {Path(result['model']).name}")
    save_png(fig, path)
    plt.close(fig)


def plot_scores(result: dict, path: str, metric: str = "score", ylabel: str = "score (%)") -> None:
    """score (or another metric) vs budget, one line per policy x length; full cache as dashed lines."""
    plt = pyplot()
    summary = [s for s in result["summary"] if s.get(metric) is not None]
    if not summary:
        raise KvcliError("nothing to plot: no score was measured")
    tasks = sorted({s.get("task", result["task"]) for s in summary})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, task in zip(axes.flat, tasks):
        ss = [s for s in summary if s.get("task", result["task"]) == task]
        lines: dict[tuple, list] = {}
        for s in ss:
            lines.setdefault((s["policy"], s["length"], s.get("form") or ""), []).append(s)
        for i, ((pol, length, form), pts) in enumerate(sorted(lines.items())):
            c = colors[i % len(colors)]
            if pol == "full":
                ax.axhline(pts[0][metric], color=c, ls="--", label=f"full, {length}")
            else:
                pts = sorted(pts, key=lambda s: s["budget"])
                label = f"{pol}, {length}" + (f", {form}" if form else "")
                ax.plot([s["budget"] for s in pts], [s[metric] for s in pts], "o-", color=c, label=label)
        ax.set(title=task, xlabel="budget", ylabel=ylabel)
        if any(s["budget"] for s in ss):
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=6)
    fig.suptitle(f"kvcli eval {result['task']}: {Path(result['model']).name}")
    save_png(fig, path)
    plt.close(fig)
