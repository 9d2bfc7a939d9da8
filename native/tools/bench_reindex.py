"""Cost of the re-indexing apply on the default model: compaction with and without re-indexing of a
sequence of N cells (30 layers), the same plan each time, from the same prefilled state.

    KVCLI_LIB_DIR=... python native/tools/bench_reindex.py [--cells 8000] [--cache-type f16] [--repeat 3]

The plan drops the first cell of every (layer, KV head) and keeps the rest, so every kept entry
moves by -1 and every K row of every layer is re-rotated (the worst case for a given cell count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=8000)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()

    from kvcli.models import default_model_path
    from kvcli.native import cache
    from kvcli.native.session import NativeSession
    from kvcli.planning.formats import Plan

    s = NativeSession(default_model_path(), n_ctx=a.cells + 256, cache_type=a.cache_type, n_threads=a.threads)
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(100, 40000, a.cells)]
    t0 = time.perf_counter()
    s.prefill(toks)
    prefill_s = time.perf_counter() - t0
    snap = s.save_seq(0)
    i = s.info
    keep = np.arange(1, a.cells, dtype=np.int32)
    plan = Plan.from_lists([[keep] * i.n_head_kv for _ in range(i.n_layer)])
    res = {}
    for mode in ("plain", "reindex"):
        times = []
        for _ in range(a.repeat):
            s.restore_seq(snap, 0)
            t = time.perf_counter()
            s.apply_plan(plan, reindex=mode == "reindex")
            times.append(time.perf_counter() - t)
            assert cache.stats(s.ctx, 0, i.n_layer, i.n_head_kv)["n_cells"] == a.cells - 1
        res[mode] = statistics.median(times) * 1000
    print(json.dumps({"cells": a.cells, "layers": i.n_layer, "cache_type": a.cache_type,
                      "prefill_s": round(prefill_s, 2), "apply_plain_ms": round(res["plain"], 1),
                      "apply_reindex_ms": round(res["reindex"], 1),
                      "rerotation_ms": round(res["reindex"] - res["plain"], 1)}))


if __name__ == "__main__":
    main()
