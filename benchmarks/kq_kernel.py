#!/usr/bin/env python3
"""A question's prefill over a resident document with each K^T Q product of the few-rows path (issue #62;
native/src/README.md, "The question's K^T Q, a kernel of ours").

    python benchmarks/kq_kernel.py --rounds 8 > benchmarks/results/kq-kernel-16k.txt

One process reads the logbook (--words words, kvcli.evaluation.logbook.make_document) into sequence 0 once; then, per
round and per product (KVCLI_KQ=ggml: ggml's tinyBLAS product; auto: the widest kernel this CPU runs; avx2: the AVX2
kernel), a question is prefilled, observed over its rows as kvcli serve's questions are, into sequence 1 sharing the
document's cells, and cleared. KVCLI_KQ is read when a graph is built, and every question's graph is built afresh
(the count of the kernel's nodes in the last graph is printed: 0 for ggml's). Prints each prefill's seconds and the
medians. Run it alone: the products alternate within one process, so the ratio is what to compare.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import machine  # noqa: E402

from kvcli.evaluation.logbook import make_document  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402
from kvcli.native import cache  # noqa: E402
from kvcli.native.session import NativeSession  # noqa: E402

PRODUCTS = ("ggml", "auto", "avx2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--words", type=int, default=12000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(machine(a.threads), flush=True)
    print(os.popen("uptime").read().strip(), flush=True)
    text, facts = make_document(a.words, facts=6, seed=0)
    s = NativeSession(resolve_model(a.model), n_ctx=-(-(a.words * 4 // 3 + 4096) // 1024) * 1024, n_seq=2,
                      n_threads=a.threads)
    doc = s.tokenize(s.apply_chat_template([{"role": "user", "content": text}], add_assistant=False))
    t = time.time()
    s.prefill(doc, seq=0)
    print(f"document: {len(doc)} tokens read in {time.time() - t:.1f} s", flush=True)
    seconds: dict[str, list[float]] = {p: [] for p in PRODUCTS}
    for rnd in range(a.rounds):
        fact = facts[rnd % len(facts)]
        q = s.tokenize(f"\n\n{fact['question']} Answer with the number only.<|im_end|>\n<|im_start|>assistant\n")
        for product in PRODUCTS:
            os.environ["KVCLI_KQ"] = product
            s.share(0, 1, len(doc))
            t = time.perf_counter()
            s.prefill(q, seq=1, observe=("window",), window=len(q))
            dt = time.perf_counter() - t
            nodes = cache.last_graph_count(s.ctx, "kvcli_kq")
            s.clear(1)
            seconds[product].append(dt)
            print(f"round {rnd} {product:5s} rows {len(q)} prefill {dt:.3f} s kernel nodes {nodes}", flush=True)
    for product, v in seconds.items():
        print(f"{product:5s} median {statistics.median(v):.3f} s, min {min(v):.3f} s")
    print(os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
