"""Why a book is read in float16 even for a q8_0 store (issue #46; kvcli/drivers/reselect_bounded.py store_types).

    python benchmarks/requantise_drift.py [--model qwen2.5-coder-0.5b] [--tokens 512] [--json-out F]

Bounded reading re-indexes the entries it carries at every chunk: their K is turned (RoPE) to new positions, and
llama.cpp turns a quantised K by dequantising, turning and quantising it again. This prefills `--tokens` tokens of
the README, re-indexes the whole sequence back and forth (to a far position and back to its own, so the keys should
come back unchanged) and prints the relative error of K (all layers; the worst layer) after N re-indexings, for a
float16 and a q8_0 cache; then the error of a q8_0 store's chunk file (kvcli/native/state.py convert_chunk: each row
quantised once, from float16) put back into float16.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import machine, provenance

from kvcli.models import resolve_model
from kvcli.native import cache
from kvcli.native.session import NativeSession, SeqSnapshot
from kvcli.native.state import F16, Q8_0, cells_from, convert_chunk
from kvcli.planning.formats import Plan

ROOT = Path(__file__).resolve().parents[1]
TURNS = (2, 4, 10, 20, 40, 80)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def drift(model, tokens: int, cache_type: str) -> list[dict]:
    s = NativeSession(model, n_ctx=4096, cache_type=cache_type, n_threads=2)
    try:
        toks = s.tokenize((ROOT / "README.md").read_text())[:tokens]
        s.prefill(toks)
        k0, _ = cache.read_kv(s.ctx, 0, s.info)
        keep = Plan.keep_all(s.info.n_layer, s.info.n_head_kv, len(toks))
        out = []
        for turn in range(1, max(TURNS) // 2 + 1):
            cache.apply_plan(s.ctx, 0, keep, s.info.head_dim, reindex_p0=700 + 37 * turn)
            cache.apply_plan(s.ctx, 0, keep, s.info.head_dim, reindex_p0=0)
            if 2 * turn in TURNS:
                k, _ = cache.read_kv(s.ctx, 0, s.info)
                out.append({"reindexings": 2 * turn, "k_error": round(rel(k, k0), 5),
                            "worst_layer": round(max(rel(k[i], k0[i]) for i in range(len(k))), 5)})
        return out
    finally:
        s.close()


def store_error(model, tokens: int) -> dict:
    s = NativeSession(model, n_ctx=2048, cache_type="f16", n_threads=2, n_seq=2)
    try:
        toks = s.tokenize((ROOT / "README.md").read_text())[:tokens]
        s.prefill(toks)
        k0, v0 = cache.read_kv(s.ctx, 0, s.info)
        state, cells, end = cells_from(s.save_seq(0).state, 0)
        q8 = convert_chunk(state, Q8_0)
        back = convert_chunk(q8, F16)
        s.restore_seq(SeqSnapshot(state=back, next_pos=end, cells=cells, prompt_tokens=cells), 1)
        k1, v1 = cache.read_kv(s.ctx, 1, s.info)
        return {"k_error": round(rel(k1, k0), 5), "v_error": round(rel(v1, v0), 5),
                "file_bytes_ratio": round(len(q8) / len(state), 4)}
    finally:
        s.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    model = resolve_model(a.model)
    t0 = time.time()
    result = {"model": Path(model).name, "tokens": a.tokens, "machine": machine(2), **provenance("requantise_drift.py"),
              "cache": {ct: drift(model, a.tokens, ct) for ct in ("f16", "q8_0")},
              "q8_0_store_once": store_error(model, a.tokens)}
    result["seconds"] = round(time.time() - t0, 1)
    for ct, rows in result["cache"].items():
        print(f"{ct:5} cache, K error after N re-indexings: " +
              ", ".join(f"{r['reindexings']}: {100 * r['k_error']:.2f}%" for r in rows))
    st = result["q8_0_store_once"]
    print(f"q8_0 store (quantised once from float16): K {100 * st['k_error']:.2f}%, V {100 * st['v_error']:.2f}%, "
          f"file {st['file_bytes_ratio']:.2f}x the float16 chunk")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
