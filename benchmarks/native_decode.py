"""Decode speed of the native engine after compression, side by side with full caches.

    python benchmarks/native_decode.py [--tokens 7500] [--budget 256] [--decode 32] [--json]

On the default model with flash attention: a ~7.5k-token prompt
  - compressed to --budget with snapkv (f16 cache),
  - full cache of the same prompt (f16, q8_0, q4_0),
  - full cache of a 512-token prompt (f16), the speed a 256-entry cache should approach,
reports decode tok/s, prefill time and, for snapkv, the share of observation + planning +
compaction in the prefill time (observation = prefill with the window armed minus the same
prefill unarmed). Numbers are measured, on whatever machine runs this (2 cores in CI).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcli.models import default_model_path  # noqa: E402
from kvcli.native import cache  # noqa: E402
from kvcli.native.session import NativeSession  # noqa: E402


def prompt_tokens(s: NativeSession, n: int) -> list[int]:
    text = ""
    docs = [(ROOT / "examples" / f).read_text() for f in ("station-log.txt", "solar-garden.txt")]
    toks: list[int] = []
    i = 0
    while len(toks) < n + 32:
        text += docs[i % len(docs)] + "\n\n"
        i += 1
        toks = s.tokenize(s.apply_chat_template([{"role": "user", "content": text + "Summarise."}]))
    return toks[-n:]


def decode_speed(s: NativeSession, n: int) -> float:
    t = int(np.argmax(s.logits()))
    s.step({0: t})  # warm-up: builds the decode graph
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(np.argmax(s.logits()))
        s.step({0: t})
    return n / (time.perf_counter() - t0)


def _stats_row(s, label, cache_type, n_prompt) -> dict:
    st = cache.stats(s.ctx, 0, s.info.n_layer, s.info.n_head_kv)
    return {"config": label, "cache_type": cache_type, "prompt_tokens": n_prompt, "kv_cells": st["n_cells"],
            "kv_MiB": round((st["k_bytes"] + st["v_bytes"] + st["bias_bytes"]) / 2**20, 2)}


def _window_decode_s(s, toks, w, armed: bool, repeat: int = 3) -> float:
    """Fastest of `repeat` decodes of the last w tokens (removed and decoded again), observation
    armed or not: their difference is what observation costs."""
    n = len(toks)
    best = float("inf")
    for i in range(repeat):
        if i:
            s.rollback(0, w)
        if armed:
            cache.observe_begin(s.ctx, 0, ("window",), window_pos0=n - w)
        t0 = time.perf_counter()
        s.prefill(toks[n - w:])
        best = min(best, time.perf_counter() - t0)
        if armed:
            cache.observe_end(s.ctx)
    return best


def run(label: str, model, toks, n_decode: int, cache_type="f16", budget=None, window=0) -> dict:
    """Prefill (the last `window` tokens in a decode of their own), snapkv when budget is set, decode."""
    s = NativeSession(model, n_ctx=8192, flash_attn=True, cache_type=cache_type)
    try:
        n = len(toks)
        t0 = time.perf_counter()
        s.prefill(toks[:n - window])
        head_s = time.perf_counter() - t0
        extra = {}
        if window:
            win_s = _window_decode_s(s, toks, window, armed=budget is not None)
            extra["window_decode_s"] = round(win_s, 3)
        if budget is not None:
            from kvcli import policies  # noqa: PLC0415
            from kvcli.native.lib import native_plan  # noqa: PLC0415
            spec, params, _ = policies.prepare("snapkv", {}, budget)
            t1 = time.perf_counter()
            obs = cache.read_observation(s.ctx, 0, s.info, ("window",))
            t2 = time.perf_counter()
            plan = native_plan(spec.name, spec.render(params), budget, obs)
            t3 = time.perf_counter()
            s.apply_plan(plan)
            t4 = time.perf_counter()
            extra.update(read_obs_s=round(t2 - t1, 3), plan_s=round(t3 - t2, 3), apply_s=round(t4 - t3, 3))
        row = _stats_row(s, label, cache_type, n)
        row["prefill_s"] = round(head_s + extra.get("window_decode_s", 0.0), 2)
        row.update(extra)
        row["decode_tok_s"] = round(decode_speed(s, n_decode), 1)
        return row
    finally:
        s.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=7500)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = default_model_path()
    probe = NativeSession(model, n_ctx=0)
    long_toks = prompt_tokens(probe, a.tokens)
    short_toks = prompt_tokens(probe, 512)
    probe.close()

    from kvcli import policies  # noqa: PLC0415
    spec, params, _ = policies.prepare("snapkv", {}, a.budget)
    _, w = spec.observe(params)

    rows = []
    full = run("full", model, long_toks, a.decode, window=w)
    rows.append(full)
    snap = run(f"snapkv {a.budget}", model, long_toks, a.decode, budget=a.budget, window=w)
    # observation: the armed window decode minus the unarmed one, plus reading it out
    obs_s = max(0.0, snap["window_decode_s"] - full["window_decode_s"]) + snap["read_obs_s"]
    snap["observe_s"] = round(obs_s, 3)
    snap["overhead_pct_of_prefill"] = round(
        100 * (obs_s + snap["plan_s"] + snap["apply_s"]) / full["prefill_s"], 2)
    rows.append(snap)
    rows.append(run("full 512", model, short_toks, a.decode))
    rows.append(run("full q8_0", model, long_toks, a.decode, cache_type="q8_0"))
    rows.append(run("full q4_0", model, long_toks, a.decode, cache_type="q4_0"))
    ref512 = rows[2]["decode_tok_s"]
    for r in rows:
        r["vs_full512"] = round(r["decode_tok_s"] / ref512, 3)

    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        cols = ["config", "cache_type", "prompt_tokens", "kv_cells", "kv_MiB", "prefill_s", "decode_tok_s",
                "vs_full512"]
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
        print(f"\nsnapkv (window {w}): observation {snap['observe_s']} s (window decode armed "
              f"{snap['window_decode_s']} s vs {full['window_decode_s']} s, read-out {snap['read_obs_s']} s) + "
              f"planning {snap['plan_s']} s + compaction {snap['apply_s']} s = "
              f"{snap['overhead_pct_of_prefill']}% of the unarmed prefill ({full['prefill_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
