"""Compressed attention's split vs mask path (issue #17) on 1 and 2 threads, against the uncompressed
cache and against attention without flash attention (f32 soft_max_ext): max |logit difference| over
forced decode steps. Not a timing. Usage: python benchmarks/investigations/attn_path_threads.py [MODEL.gguf]
(default model; env N=prompt tokens, B=budget, STEPS, POLICY, CT=cache type)."""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from kvcli import models
from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.native.session import NativeSession


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else models.default_model_path()
    n, budget, steps = (int(os.environ.get(k, d)) for k, d in (("N", 623), ("B", 256), ("STEPS", 10)))
    policy, ctype = os.environ.get("POLICY", "snapkv"), os.environ.get("CT", "f16")
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 40000, n)]
    forced = [int(t) for t in np.random.default_rng(9).integers(100, 40000, steps)]

    def run(pol, fa, threads, path):
        os.environ["KVCLI_ATTN_PATH"] = path
        s = NativeSession(model, n_ctx=max(1024, n + 64), flash_attn=fa, cache_type=ctype, n_threads=threads)
        try:
            prefill_and_compress(s, prompt, resolve(s.model_path, pol, None if pol == "full" else budget, {}))
            out = []
            for t in forced:
                s.step({0: t})
                out.append(s.logits().copy())
            print(pol, "fa" if fa else "no-fa", threads, "threads", path, "cells", s.stats()["kv_cells"],
                  "taken", sorted({str(p) for p in s.attn_paths_taken()}), file=sys.stderr)
            return np.array(out)
        finally:
            s.close()

    r = {(pol, fa, th, path): run(pol, fa, th, path)
         for pol in (policy, "full") for fa in (True, False) for th in (1, 2)
         for path in (("mask", "split") if fa and pol != "full" else ("mask",))}

    def d(a, b):
        return float(np.abs(r[a] - r[b]).max())

    p = policy
    print(json.dumps({
        "model": os.path.basename(model), "N": n, "budget": budget, "policy": p, "cache_type": ctype,
        "split1_vs_mask1": d((p, True, 1, "split"), (p, True, 1, "mask")),
        "split1_vs_split2": d((p, True, 1, "split"), (p, True, 2, "split")),
        "split2_vs_mask1": d((p, True, 2, "split"), (p, True, 1, "mask")),
        "split2_vs_mask2": d((p, True, 2, "split"), (p, True, 2, "mask")),
        "mask1_vs_mask2": d((p, True, 1, "mask"), (p, True, 2, "mask")),
        "full_fa1_vs_fa2": d(("full", True, 1, "mask"), ("full", True, 2, "mask")),
        "nofa1_vs_nofa2": d((p, False, 1, "mask"), (p, False, 2, "mask")),
        "mask1_vs_nofa": d((p, True, 1, "mask"), (p, False, 1, "mask")),
        "split1_vs_nofa": d((p, True, 1, "split"), (p, False, 1, "mask")),
        "mask2_vs_nofa": d((p, True, 2, "mask"), (p, False, 1, "mask")),
        "full_fa1_vs_nofa": d(("full", True, 1, "mask"), ("full", False, 1, "mask")),
        "full_fa2_vs_nofa": d(("full", True, 2, "mask"), ("full", False, 1, "mask")),
    }, indent=1))


if __name__ == "__main__":
    main()
