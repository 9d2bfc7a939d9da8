"""Issue #46's quality-at-length table from benchmarks/book_quality.sh's results.

    python benchmarks/book_quality_table.py [benchmarks/results/book-quality-qwen-*.json]

One row per length and budget: the six questions' right answers and seconds per question for the bounded form as
kvcli chat serves it (`bounded`: the block index's chosen chunks) and the form before the index (`bounded_all`: every
chunk, a probe each), how the index chose (the page bounds alone, before 2026-11-29, or the bounds' candidates
re-scored by their real keys), the read's seconds, the K/V bytes held, the store on disk per 1k tokens (results
that record it), and the machine the seconds are from (its CPU's maker); at 31k also the full cache and exact
re-selection. A quantised store (`--cache-type q8_0`) gets rows of its own: "q8_0 chunks" (read in float16, the chunk
files q8_0: what kvcli does) or, for results before that, "q8_0 cache" (read in a q8_0 cache).
"""
from __future__ import annotations

import glob
import json
import sys


def rows(paths: list[str]) -> list[dict]:
    out: dict = {}
    for p in paths:
        d = json.load(open(p))
        ctype = d.get("cache_type", "f16")   # results before it was recorded are f16
        chunks = {r.get("chunk_type") for r in d["records"] if r["mode"] != "full"}
        if ctype != "f16" and chunks == {None}:   # before 2026-11-29: the store read in a cache of that type
            ctype += " cache"
        elif ctype != "f16":                      # read in f16, only the chunk files of that type (store_types)
            ctype += " chunks"
        # how the index chose its chunks: the page bounds alone (results before 2026-11-29 record no candidates),
        # or the bounds' best candidates re-scored by their real keys
        chooser = "bounds, then keys" if any(r.get("index_candidates", 1) > 1 for r in d["records"]) else "bounds"
        cpu = (d.get("machine") or {}).get("cpu", "?")
        host = "Intel" if "Intel" in cpu else "AMD" if "AMD" in cpu else cpu
        for r in d["records"]:
            key = (r["length"], r["budget"], ctype, chooser, host)   # one machine's seconds per row, never merged
            if r["mode"] == "full":
                continue
            row = out.setdefault(key, {"length": r["length"], "doc_tokens": r["doc_tokens"], "budget": r["budget"],
                                        "cache_type": ctype, "chooser": chooser, "host": host})
            m = row.setdefault(r["mode"], {"right": 0, "n": 0, "s": []})
            m["right"] += r["score"] == 100.0
            m["n"] += 1
            if "reselect_s" in r:
                # a question's seconds: choosing its chunks (the block index), re-selecting them, answering
                m["s"].append(r.get("index_s", 0.0) + r["reselect_s"] + r.get("answer_s", 0.0))
            if "read_s" in r:
                row["read_s"] = r["read_s"]
            if r.get("read_resumed_tokens"):   # a read an earlier process began: its seconds are two processes'
                row["resumed"] = True
            row["kv_bytes"] = r["kv_bytes"]
            if "store_bytes" in r:
                row["store_per_1k"] = r["store_bytes"] / r["doc_tokens"] * 1000
        for r in d["records"]:
            if r["mode"] == "full":
                for key, row in out.items():
                    if key[0] == r["length"] and key[2:] == (ctype, chooser, host):
                        f = row.setdefault("full", {"right": 0, "n": 0, "s": []})
                        f["right"] += r["score"] == 100.0
                        f["n"] += 1
    return [out[k] for k in sorted(out)]


def cell(m: dict | None) -> str:
    if not m:
        return "-"
    s = f"{m['right']}/{m['n']}"
    if m["s"]:
        s += f", {min(m['s']):.1f}-{max(m['s']):.1f} s"
    return s


def main(argv: list[str]) -> int:
    paths = argv or sorted(glob.glob("benchmarks/results/book-quality-qwen-*.json"))
    print("| tokens | budget | cache | index chooses by | index (kvcli chat) | every chunk (before) | "
          "exact re-selection | full cache | read | held | store per 1k tokens | machine |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows(paths):
        store = f"{r['store_per_1k'] / 1e6:.1f} MB" if "store_per_1k" in r else "-"
        print(f"| {r['doc_tokens']:,} | {r['budget']} | {r['cache_type']} | {r['chooser']} | "
              f"{cell(r.get('bounded'))} | {cell(r.get('bounded_all'))} | {cell(r.get('reselect'))} | "
              f"{cell(r.get('full'))} | "
              f"{r.get('read_s', 0):.0f} s{' (resumed)' if r.get('resumed') else ''} | "
              f"{r['kv_bytes'] / 1e6:.1f} MB | {store} | {r['host']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
