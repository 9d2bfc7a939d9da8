"""Decode speed after each policy's compaction, ragged layout against llama.cpp's cells, at equal live bytes.

    python benchmarks/ragged_decode.py [DOC] --model qwen2.5-coder-0.5b [--configs snapkv@64,dynamickv@64]
        [--steps 48] [--rounds 3] [--threads 1] [-o OUT.json]

Prefills DOC once (observing what the policies need) and keeps the full cache's state; then, round after round, for
each configuration and layout (KVCLI_LAYOUT=ragged, =cells) restores the state, applies the plan, reallocates the
context for what it holds, and decodes --steps tokens (greedy, one token per llama_decode) timed. The layouts and
configurations alternate within every round, so what the machine does beside it falls on all of them alike: compare
the medians as ratios within one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import provenance, compact_under, native_plans  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402

INSTRUCTION = "What happened at the station? Answer in one sentence."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("doc", nargs="?", default="examples/station-log.txt")
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default="snapkv@64,dynamickv@64,pyramidkv@64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args()
    model = resolve_model(a.model)
    configs = [(c.split("@")[0], int(c.split("@")[1])) for c in a.configs.split(",")]
    s, tokens, n_ctx, plans, _ = native_plans(model, Path(a.doc).read_text(encoding="utf-8"), configs, INSTRUCTION,
                                              threads=a.threads)
    full = s.save_seq(0)
    times: dict[tuple, list[float]] = {}
    held: dict[tuple, dict] = {}
    for _ in range(a.rounds):
        for (name, b), plan in plans.items():
            for layout in ("cells", "ragged"):
                compact_under(s, full, n_ctx, plan, layout, room=a.steps + 16)
                tok = int(np.argmax(s.logits()))
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    s.step({0: tok})
                    tok = int(np.argmax(s.logits()))
                times.setdefault((name, b, layout), []).append(a.steps / (time.perf_counter() - t0))
                st = s.stats(0)
                held[name, b, layout] = {"kv_bytes": st["kv_bytes"], "kv_bytes_live": st["kv_bytes_live"],
                                         "kv_bytes_allocated": st["kv_bytes_allocated"]}
    os.environ.pop("KVCLI_LAYOUT", None)
    s.close()
    rows = []
    for (name, b, layout), ts in times.items():
        rows.append({"policy": name, "budget": b, "layout": layout, "decode_tok_s": round(statistics.median(ts), 2),
                     "decode_tok_s_all": [round(t, 2) for t in ts], **held[name, b, layout]})
        print(f"{name:10s} {b:5d} {layout:6s} {rows[-1]['decode_tok_s']:7.2f} tok/s (median of {len(ts)}), "
              f"held {held[name, b, layout]['kv_bytes'] / 1e6:.2f} MB, live "
              f"{held[name, b, layout]['kv_bytes_live'] / 1e6:.2f} MB", flush=True)
    res = {"model": model.name, "doc": Path(a.doc).name, "prompt_tokens": len(tokens), "threads": a.threads,
           "steps": a.steps, "rounds": a.rounds,
           **provenance("ragged_decode.py"),
           "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
