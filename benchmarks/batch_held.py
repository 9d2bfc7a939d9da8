"""The bytes a cache of several compressed documents holds (`kvcli batch`, `kvcli bench --batch`): packed, as batch
holds them now, against the ragged layout unpacked (only the block at the start of the cache trimmed: before) and
llama.cpp's cells layout (every layer as wide as the widest).

    python benchmarks/batch_held.py --model qwen2.5-coder-0.5b --docs 4 --budgets 64,256 [-o OUT.json]

Documents: station logbooks of about 1.5-2.5k tokens (kvcli.evaluation.logbook, seeds 0..), one prefill each
observing what every policy needs; each policy's native plan compacts it and the compressed sequence is saved. Then,
per policy, budget and layout, one context of `docs` sequences restores them all (as batch admits documents) and the
whole cache is measured: K/V bytes held (each layer from its front) against the live entries' bytes, and what the
context allocated. kvzip is left out (its scores come from a reconstruction pass this prefill does not run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import provenance, native_plans  # noqa: E402
from kvcli.evaluation.logbook import make_document  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402
from kvcli.native import cache  # noqa: E402
from kvcli.native.session import NativeSession  # noqa: E402

POLICIES = ("snapkv", "pyramidkv", "windowkv", "dynamickv", "compresskv", "d2o", "spindlekv")
INSTRUCTION = "What happened at the station? Answer in one sentence."
LAYOUTS = ("cells", "unpacked", "packed")


def snapshots(model: Path, n_docs: int, configs) -> tuple[dict, list[int]]:
    """{(policy, budget): [compressed snapshot per document]}, and the documents' prompt tokens."""
    out: dict = {}
    tokens = []
    os.environ["KVCLI_LAYOUT"] = "ragged"
    for d in range(n_docs):
        text, _ = make_document(1100 + 250 * d, 0, seed=d)
        s, toks, n_ctx, plans, _ = native_plans(model, text, configs, INSTRUCTION)
        tokens.append(len(toks))
        full = s.save_seq(0)
        for key, plan in plans.items():
            s.clear(0)
            s.restore_seq(full, 0)
            s.apply_plan(plan)
            out.setdefault(key, []).append(s.save_seq(0))
        s.close()
        print(f"document {d}: {len(toks)} tokens", flush=True)
    return out, tokens


def held(model: Path, snaps: list, layout: str) -> dict:
    """One context holding every snapshot, each in its own sequence, under `layout`; the whole cache measured."""
    os.environ["KVCLI_LAYOUT"] = "cells" if layout == "cells" else "ragged"
    n_ctx = -(-(sum(x.cells for x in snaps) + 64) // 256) * 256
    s = NativeSession(model, n_ctx=n_ctx, n_seq=len(snaps), cache_type="f16")
    try:
        for i, snap in enumerate(snaps):
            s.restore_seq(snap, i)
            if layout == "packed":
                s.pack_cells()
        whole = cache.stats(s.ctx, -1, s.info.n_layer_model, s.info.n_head_kv)
        live = sum(s.stats(i)["kv_bytes_live"] for i in range(len(snaps)))
        kv = whole["k_bytes"] + whole["v_bytes"]
        return {"layout": layout, "cells": sum(x.cells for x in snaps), "kv_bytes": kv, "kv_bytes_live": live,
                "held_over_live": round(kv / live, 4), "kv_bytes_allocated": s.stats(0)["kv_bytes_allocated"],
                "fronts": cache.layout_fronts(s.ctx)}
    finally:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args()
    model = resolve_model(a.model)
    configs = [(p, int(b)) for p in a.policies.split(",") for b in a.budgets.split(",")]
    t0 = time.time()
    snaps, tokens = snapshots(model, a.docs, configs)
    rows = []
    for (p, b), ss in snaps.items():
        for layout in LAYOUTS:
            r = {"policy": p, "budget": b, **held(model, ss, layout)}
            rows.append(r)
            print(f"{p:11s} {b:5d} {layout:8s} held/live {r['held_over_live']:.3f} held {r['kv_bytes'] / 1e6:7.2f} MB "
                  f"allocated {r['kv_bytes_allocated'] / 1e6:7.2f} MB", flush=True)
    os.environ.pop("KVCLI_LAYOUT", None)
    res = {"model": model.name, "documents": a.docs, "prompt_tokens": tokens, "cache_type": "f16",
           **provenance("batch_held.py"), "seconds": round(time.time() - t0),
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
