"""Decode speed of the native engine after compression, side by side with full caches.

    python benchmarks/native_decode.py [--tokens 7500] [--budget 256] [--decode 32] [--rounds 5] [--threads N]
                                       [--json] [--json-out FILE]

On the default model with flash attention: a ~7.5k-token prompt
  - compressed to --budget with snapkv (f16 cache),
  - full cache of the same prompt (f16, q8_0, q4_0),
  - full cache of a 512-token prompt (f16), the speed a 256-entry cache should approach,
reports decode tok/s, prefill time and, for snapkv, the share of observation + planning +
compaction in the prefill time (observation = prefill with the window armed minus the same
prefill unarmed). All five contexts are prefilled first and stay open; their decode speeds are then
measured round after round, interleaved (median, min-max), so that a change of load on a shared
machine hits every configuration alike. The 1-minute load average is recorded with every figure.
Numbers are measured, on whatever machine runs this (2 cores in CI).
"""
from __future__ import annotations

import argparse
import json
import os
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


def decode_speed(s: NativeSession, n: int, first: int) -> float:
    """n tokens decoded greedily after `first` (the prompt's next token; its step is the untimed warm-up that
    builds the decode graph)."""
    s.step({0: first})
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(np.argmax(s.logits()))
        s.step({0: t})
    return n / (time.perf_counter() - t0)


def _stats_row(s, label, cache_type, n_prompt) -> dict:
    st = cache.stats(s.ctx, 0, s.info.n_layer, s.info.n_head_kv)
    return {"config": label, "cache_type": cache_type, "prompt_tokens": n_prompt, "kv_cells": st["n_cells"],
            "kv_MiB": round((st["k_bytes"] + st["v_bytes"] + st["bias_bytes"]) / 2**20, 2)}


def _window_decode_s(s, toks, w, armed: bool, repeat: int = 3) -> tuple[float, float | None]:
    """The last w tokens decoded `repeat` times (removed and decoded again): fastest unarmed time and, when
    `armed`, fastest time with the observation armed, the two alternating in the same session so that their
    difference (what observation costs) is not a difference of load. The last decode is the armed one."""
    n = len(toks)
    best = {False: float("inf"), True: float("inf")}
    modes = [m for _ in range(repeat) for m in ((False, True) if armed else (False,))]
    for i, on in enumerate(modes):
        if i:
            s.rollback(0, w)
        if on:
            cache.observe_begin(s.ctx, 0, ("window",), window_pos0=n - w)
        t0 = time.perf_counter()
        s.prefill(toks[n - w:])
        best[on] = min(best[on], time.perf_counter() - t0)
        if on:
            cache.observe_end(s.ctx)
    return best[False], (best[True] if armed else None)


def setup(label: str, model, toks, cache_type="f16", budget=None, window=0, threads=None):
    """Prefill (the last `window` tokens in a decode of their own) and, when budget is set, snapkv; returns the
    row and the open session, whose decode speed is measured later, interleaved with the other sessions'."""
    load0 = os.getloadavg()[0]
    s = NativeSession(model, n_ctx=8192, flash_attn=True, cache_type=cache_type, n_threads=threads)
    try:
        n = len(toks)
        t0 = time.perf_counter()
        s.prefill(toks[:n - window])
        head_s = time.perf_counter() - t0
        extra = {}
        if window:
            win_s, armed_s = _window_decode_s(s, toks, window, armed=budget is not None)
            extra["window_decode_s"] = round(win_s, 4)
            if armed_s is not None:
                extra["window_decode_armed_s"] = round(armed_s, 4)
        if budget is not None:
            from kvcli import policies  # noqa: PLC0415
            from kvcli.native.lib import native_plan  # noqa: PLC0415
            spec, params, _ = policies.prepare("snapkv", {}, budget)
            t1 = time.perf_counter()
            obs = cache.read_observation(s.ctx, 0, s.info, ("window",), windows=(window,))
            t2 = time.perf_counter()
            plan = native_plan(spec.name, params, budget, obs)
            t3 = time.perf_counter()
            s.apply_plan(plan)
            t4 = time.perf_counter()
            extra.update(read_obs_s=round(t2 - t1, 4), plan_s=round(t3 - t2, 4), apply_s=round(t4 - t3, 4))
        row = _stats_row(s, label, cache_type, n)
        row["prefill_s"] = round(head_s + extra.get("window_decode_s", 0.0), 2)
        row.update(extra)
        row["prefill_load_1m"] = f"{load0:.2f}-{os.getloadavg()[0]:.2f}"  # before - after: how shared the machine was
        print(f"[native_decode] {label}: {row}", file=sys.stderr, flush=True)
        return row, s
    except BaseException:
        s.close()
        raise


def decode_rounds(sessions: list, n_decode: int, rounds: int) -> list[dict]:
    """Decode speed of every session, interleaved: round after round, each session decodes n tokens that are then
    rolled back, so a change of the machine's load hits every configuration alike. Median with min and max."""
    speeds = [[] for _ in sessions]
    loads = []
    firsts = [int(np.argmax(s.logits())) for s in sessions]  # a rollback drops the logits: keep the first token
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        for i, s in enumerate(sessions):
            speeds[i].append(decode_speed(s, n_decode, firsts[i]))
            s.rollback(0, n_decode + 1)  # the warm-up token too
        print(f"[native_decode] round {r + 1}/{rounds}: " + ", ".join(f"{v[-1]:.1f}" for v in speeds)
              + f" tok/s (load {loads[-1]:.2f})", file=sys.stderr, flush=True)
    return [{"decode_tok_s": round(float(np.median(v)), 1), "decode_tok_s_min": round(min(v), 1),
             "decode_tok_s_max": round(max(v), 1), "decode_rounds": rounds,
             "decode_load_1m": f"{min(loads):.2f}-{max(loads):.2f}"} for v in speeds]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=7500)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32, help="tokens per decode round")
    ap.add_argument("--rounds", type=int, default=5, help="decode rounds (interleaved over the configurations)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: KVCLI_THREADS or all cores)")
    ap.add_argument("--no-quantized", action="store_true",
                    help="skip the q8_0 / q4_0 full caches (their prefill is most of the run's time)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--json-out", type=Path, default=None, help="also write the rows and the machine to this file")
    a = ap.parse_args(argv)
    from kvcli.evaluation.measure import machine  # noqa: PLC0415
    mach = machine(a.threads)
    model = default_model_path()
    probe = NativeSession(model, n_ctx=0)
    long_toks = prompt_tokens(probe, a.tokens)
    short_toks = prompt_tokens(probe, 512)
    probe.close()

    from kvcli import policies  # noqa: PLC0415
    spec, params, _ = policies.prepare("snapkv", {}, a.budget)
    _, w = spec.observe(params)

    t = a.threads
    setups = [setup("full", model, long_toks, window=w, threads=t),
              setup(f"snapkv {a.budget}", model, long_toks, budget=a.budget, window=w, threads=t),
              setup("full 512", model, short_toks, threads=t)]
    if not a.no_quantized:
        setups += [setup(f"full {ct}", model, long_toks, cache_type=ct, threads=t) for ct in ("q8_0", "q4_0")]
    rows = [r for r, _ in setups]
    try:
        for r, d in zip(rows, decode_rounds([s for _, s in setups], a.decode, a.rounds)):
            r.update(d)
    finally:
        for _, s in setups:
            s.close()
    snap = rows[1]
    # observation: the armed window decode minus the unarmed one (same session), plus reading it out
    obs_s = max(0.0, snap["window_decode_armed_s"] - snap["window_decode_s"]) + snap["read_obs_s"]
    snap["observe_s"] = round(obs_s, 4)
    snap["overhead_pct_of_prefill"] = round(
        100 * (obs_s + snap["plan_s"] + snap["apply_s"]) / snap["prefill_s"], 2)  # its own unarmed prefill
    ref512 = rows[2]["decode_tok_s"]
    for r in rows:
        r["vs_full512"] = round(r["decode_tok_s"] / ref512, 3)

    if a.json_out:
        a.json_out.write_text(json.dumps({"machine": mach, "args": vars(a) | {"json_out": str(a.json_out)},
                                          "rows": rows}, indent=2))
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"machine: {mach['cpu']}, {mach['cores']} cores, {mach['threads']} threads, "
              f"load {mach.get('load_avg_1m_at_start')} at start")
        cols = ["config", "cache_type", "prompt_tokens", "kv_cells", "kv_MiB", "prefill_s", "prefill_load_1m",
                "decode_tok_s", "decode_tok_s_min", "decode_tok_s_max", "vs_full512", "decode_load_1m"]
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
        print(f"\nsnapkv (window {w}): observation {snap['observe_s']} s (window decode armed "
              f"{snap['window_decode_armed_s']} s vs {snap['window_decode_s']} s, read-out {snap['read_obs_s']} s) + "
              f"planning {snap['plan_s']} s + compaction {snap['apply_s']} s = "
              f"{snap['overhead_pct_of_prefill']}% of the unarmed prefill ({snap['prefill_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
