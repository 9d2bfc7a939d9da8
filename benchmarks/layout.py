"""What a ragged per-layer KV layout would save for the layer-budget policies, measured from their plans.

    python benchmarks/layout.py [DOC] [--budgets 128,256,512] [-o kvcli/data/layout.json]

llama.cpp's cells are shared by all layers and KV heads, so a compacted sequence holds as many cells as
its widest (layer, KV head) keeps: a policy whose layers keep different counts (pyramidkv, windowkv,
dynamickv, compresskv, d2o, spindlekv) pays max(n_kept) cells in every layer. For each policy and budget
this prefills DOC once with the default model (observing what every policy needs), makes each policy's
native plan and reports, from the plan: the cells held (max n_kept) and their bytes, the live entries
(sum n_kept) and their bytes (what a ragged layout would hold), and the budget's bytes (budget cells).
Bytes per cell are the f16 cache's, as llama.cpp stores it. The JSON written with -o is what
`kvcli policies --explain` quotes (kvcli/data/layout.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import native_plans  # noqa: E402
from kvcli import policies  # noqa: E402
from kvcli.models import default_model_path  # noqa: E402

LAYER_POLICIES = ("pyramidkv", "windowkv", "dynamickv", "compresskv", "d2o", "spindlekv")
INSTRUCTION = "What happened at the station? Answer in one sentence."


def measure(doc: Path, budgets: list[int], names=LAYER_POLICIES, model=None) -> dict:
    model = model or default_model_path()
    s, tokens, _, plans, _ = native_plans(model, doc.read_text(encoding="utf-8"),
                                          [(n, b) for n in names for b in budgets], INSTRUCTION)
    per_cell = s.bytes_per_cell()
    i = s.info
    rows = []
    for (name, b), plan in plans.items():
        live = int(plan.n_kept.sum())
        cells = int(plan.max_kept)
        # a layer-ragged layout: every layer as wide as its own widest KV head
        layer_entries = int(plan.n_kept.max(axis=1).sum()) * i.n_head_kv
        per_entry = per_cell / (i.n_layer * i.n_head_kv)
        rows.append({"policy": name, "budget": b, "cells": cells, "live_entries": live,
                     "budget_entries": b * i.n_layer * i.n_head_kv,
                     "layer_ragged_entries": layer_entries,
                     "cells_bytes": cells * per_cell, "live_bytes": int(live * per_entry),
                     "layer_ragged_bytes": int(layer_entries * per_entry),
                     "budget_bytes": b * per_cell,
                     "layer_widest": int(plan.n_kept.max(axis=1).argmax()),
                     "ragged_saving": 1 - live / (cells * i.n_layer * i.n_head_kv),
                     "layer_ragged_over_live": layer_entries / live})
    s.close()
    return {"model": Path(model).name, "doc": doc.name, "prompt_tokens": len(tokens), "cache_type": "f16",
            "bytes_per_cell": per_cell, "command": "python benchmarks/layout.py " + " ".join(sys.argv[1:]),
            "measured": time.strftime("%Y-%m-%d"), "rows": rows}


def table(res: dict) -> str:
    out = [f"{res['model']}, {res['doc']} ({res['prompt_tokens']} tokens), f16 cache, "
           f"{res['bytes_per_cell']:,} bytes per cell",
           "| policy | budget | cells held | MB held | live entries MB (ragged) | layer-ragged MB "
           "| layer-ragged / live "
           "| budget MB | ragged saves |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['policy']} | {r['budget']} | {r['cells']} | {r['cells_bytes'] / 1e6:.2f} | "
                   f"{r['live_bytes'] / 1e6:.2f} | {r['layer_ragged_bytes'] / 1e6:.2f} | "
                   f"{r['layer_ragged_over_live']:.3f} | {r['budget_bytes'] / 1e6:.2f} | "
                   f"{100 * r['ragged_saving']:.0f}% |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("doc", nargs="?", default="examples/station-log.txt")
    ap.add_argument("--budgets", default="128,256,512")
    ap.add_argument("--policies", default=",".join(LAYER_POLICIES))
    ap.add_argument("--model", default=None, help="GGUF path or pulled model name (default: the bundled model).")
    ap.add_argument("-o", "--out", default=None, help="Write the JSON here (kvcli/data/layout.json).")
    a = ap.parse_args()
    for name in a.policies.split(","):
        policies.get(name)
    from kvcli.models import resolve_model  # noqa: PLC0415
    model = resolve_model(a.model) if a.model else None
    res = measure(Path(a.doc), [int(b) for b in a.budgets.split(",")], a.policies.split(","), model)
    print(table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
