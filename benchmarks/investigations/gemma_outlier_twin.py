"""gemma-3-270m's L2 rows beyond the threshold on a venv text (issue #31): for each K/V row `kvcli check` finds
beyond l2_kv_rtol, its distances between the check's native setting (f16 cache, flash attention), the precision
twin (f32, no flash attention), the reference (float32 torch) and the reference with llama.cpp's activation
arithmetic; and how far the twin lies from the reference over the whole layer (does the same engine at f32 agree
with the reference?). The check's settings: 1 thread, default cache, budget 64 prompt, 16 tokens of room.

    python benchmarks/investigations/gemma_outlier_twin.py [SITE_PACKAGES_RELATIVE_TEXT] [DOC_TOKENS] > result.json

Default: diskcache's METADATA at 1000 tokens (the corpus sweep's one unexplained row, slot 398). Each row also
has L2's other sources: the batch-64 twin and the emulated reference against the native row (rule (3)), and the
row's context; `explained` says whether one of L2's three sources would allow it alone (the count limit aside)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvcli.models import resolve_model
from kvcli.drivers.check import (CheckSettings, NativeTwin, Thresholds, build_tokens, compare_arrays, compare_kv_rows,
                                 emulated_reference)
from kvcli.native.session import NativeSession
from kvcli.reference.session import ReferenceSession
text = sys.argv[1] if len(sys.argv) > 1 else "diskcache-5.6.3.dist-info/METADATA"
length = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
SITE = Path(".venv/lib/python3.11/site-packages")
doc = (SITE / text).read_text()
path = resolve_model("gemma-3-270m")
st = CheckSettings(budget=64, n_tokens=16, doc_tokens=length, threads=1)
nat = NativeSession(path, n_ctx=0, cache_type=st.cache_type, flash_attn=st.flash_attn, n_threads=1)
toks = build_tokens(nat, doc, st)
n_ctx = -(-(len(toks) + 24) // 256) * 256
nat.create_context(n_ctx)
a = nat.prefill(toks, seq=0, observe=("kv",)).with_kv_arrays()
twin = NativeTwin(path, toks, st, n_ctx, "precision")()
ub = NativeTwin(path, toks, st, n_ctx, "ubatch")()   # L2's second source, batch 64
ref = ReferenceSession(path, n_ctx=n_ctx, n_threads=1)
r = ref.prefill(toks, seq=0, observe=("kv",)).with_kv_arrays()
emu = emulated_reference(ref, toks)()
th = Thresholds()
out = {"command": "python benchmarks/investigations/gemma_outlier_twin.py " + " ".join(sys.argv[1:]), "text": text,
       "doc_tokens": length, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), "tokens": len(toks),
       "rows": []}
for name in ("keys", "values"):
    A, T, R, E, U = (getattr(o, name).astype(np.float64) for o in (a, twin, r, emu, ub))
    scale = compare_arrays(getattr(a, name), getattr(r, name))["scale"]
    limit = th.l2_kv_rtol * scale
    d = lambda x, y: np.abs(x - y).max(axis=-1)
    eng, mv, tr, er, et = d(A, R), d(A, T), d(T, R), d(E, R), d(E, T)
    en, un, ur = d(E, A), d(U, A), d(U, R)   # L2's rule (3) reads the emulation against the native row
    # which rows L2's own per-row test would allow (its three sources; every row consulted, the count limit aside)
    l2 = compare_kv_rows(getattr(a, name), getattr(r, name), Thresholds(l2_kv_sensitive_rows=1.0),
                         [("native_precision", "native", lambda T=T: T), ("native_ubatch", "native", lambda U=U: U),
                          ("reference_llamacpp_arithmetic", "reference", lambda E=E: E)])
    allowed = {(x["layer"], x["kv_head"], x["slot"]) for x in l2.get("rows_over_detail", []) if x["explained_by"]}
    for il, h, p in np.argwhere(eng > limit):
        row = {"kind": name, "layer": int(il),
               "model_layer": int(nat.info.kv_layers[il]) if nat.info.kv_layers else int(il),
               "kv_head": int(h), "slot": int(p), "token": nat.detokenize([toks[p]]), "threshold": round(limit, 3),
               "native_vs_reference": round(float(eng[il, h, p]), 3), "native_vs_twin": round(float(mv[il, h, p]), 3),
               "twin_vs_reference": round(float(tr[il, h, p]), 3), "emulated_vs_reference": round(float(er[il, h,
                                                                                                           p]), 3),
               "emulated_vs_twin": round(float(et[il, h, p]), 3), "emulated_vs_native": round(float(en[il, h, p]), 3),
               "ubatch_vs_native": round(float(un[il, h, p]), 3), "ubatch_vs_reference": round(float(ur[il, h, p]), 3),
               "context": nat.detokenize(toks[max(0, p - 10): p + 4]),
               "row_max_abs_native": round(float(np.abs(A[il, h, p]).max()), 2)}
        row["explained"] = (int(il), int(h), int(p)) in allowed
        # how this row's twin-vs-reference distance compares with all rows of its layer
        row["twin_vs_reference_layer_p99"] = round(float(np.quantile(tr[il], 0.99)), 3)
        row["twin_vs_reference_layer_max"] = round(float(tr[il].max()), 3)
        out["rows"].append(row)
    out[name] = {"threshold": limit, "twin_vs_reference_max": float(tr.max()),
                 "twin_rows_over": int((tr > limit).sum()),
                 "native_vs_reference_max": float(eng.max()), "rows_over": int((eng > limit).sum()),
                 "rows": int(eng.size),
                 # the other settings' own rows beyond the threshold: (model layer, slot, token, distance)
                 **{f"{k}_rows_over": [[int(nat.info.kv_layers[il]) if nat.info.kv_layers else int(il), int(p),
                                        nat.detokenize([toks[p]]), round(float(x[il, h, p]), 3)]
                                       for il, h, p in np.argwhere(x > limit)]
                    for k, x in (("twin_vs_reference", tr), ("ubatch_vs_native", un), ("emulated_vs_native", en))}}
print(json.dumps(out, indent=1))
