"""The bytes the native cache holds after each policy's compaction, ragged layout against llama.cpp's cells.

    python benchmarks/ragged_held.py [DOC] --model qwen2.5-coder-0.5b [--budgets 64,256,1024] [-o OUT.json]

Prefills DOC once (observing what every policy needs), keeps the full cache's state, and for each policy and budget
restores it, applies the policy's native plan (one compaction, as `kvcli compress` and a re-selected chat do) and
reallocates the context for what it holds (`resize_context`, as a long-lived chat does), under KVCLI_LAYOUT=ragged and
=cells. Reports from the live cache: kv_bytes (K/V rows held, bias excluded), kv_bytes_live (the live entries'
rows), their ratio, and kv_bytes_allocated (the context's KV buffers, what llama.cpp allocated). kvzip is left out:
its scores come from a second (reconstruction) pass that this single prefill does not run (`kvcli compress` does).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import provenance, compact_under, native_plans  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402
from kvcli.native import cache  # noqa: E402

POLICIES = ("snapkv", "pyramidkv", "windowkv", "dynamickv", "compresskv", "d2o", "spindlekv")
INSTRUCTION = "What happened at the station? Answer in one sentence."


def measure(doc: Path, model: Path, budgets: list[int], names=POLICIES) -> dict:
    s, tokens, n_ctx, plans, prefill_s = native_plans(model, doc.read_text(encoding="utf-8"),
                                                      [(n, b) for n in names for b in budgets], INSTRUCTION)
    full = s.save_seq(0)
    rows = []
    for (name, b), plan in plans.items():
        for layout in ("cells", "ragged"):
            compact_under(s, full, n_ctx, plan, layout)
            st = s.stats(0)
            live = cache.stats(s.ctx, 0, s.info.n_layer_model, s.info.n_head_kv)
            rows.append({"policy": name, "budget": b, "layout": layout, "cells": st["kv_cells"],
                         "kv_bytes": live["k_bytes"] + live["v_bytes"], "kv_bytes_live": st["kv_bytes_live"],
                         "held_over_live": round((live["k_bytes"] + live["v_bytes"]) / st["kv_bytes_live"], 4),
                         "kv_bytes_allocated": st["kv_bytes_allocated"], "bias_bytes": live["bias_bytes"],
                         "fronts": cache.layout_fronts(s.ctx)})
            print(f"{name:11s} {b:5d} {layout:6s} held/live {rows[-1]['held_over_live']:.3f} "
                  f"held {rows[-1]['kv_bytes'] / 1e6:7.2f} MB allocated {st['kv_bytes_allocated'] / 1e6:7.2f} MB",
                  flush=True)
    os.environ.pop("KVCLI_LAYOUT", None)
    s.close()
    return {"model": model.name, "doc": doc.name, "prompt_tokens": len(tokens), "cache_type": "f16",
            "prefill_s": round(prefill_s, 1), **provenance("ragged_held.py"),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("doc", nargs="?", default="examples/station-log.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--budgets", default="64,256,1024")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args()
    res = measure(Path(a.doc), resolve_model(a.model), [int(x) for x in a.budgets.split(",")], a.policies.split(","))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
