"""gemma-3-270m's K outlier, second step (after benchmarks/investigations/gemma_outlier_k.py): how far llama.cpp's own
settings move
the row, and whether the reference's sliding window or GELU account for it. K/V of the same prompt under named
settings, every pair compared at SLOT (per global layer: the distance, its rank among the layer's rows, the largest
other row):
  nb512, nb2048, nb64  native engine, f16 cache + flash attention (kvcli check's setting), ubatch of 512 (check's),
                       2048 (the whole prompt in one) or 64 tokens
  f32                  native engine, f32 cache, no flash attention (the precision twin L2 consults), ubatch 512
  ref                  reference engine as shipped (float32)
  refw511, refw513     reference with every sliding layer's window one shorter / longer than the file's 512
  refgelu              reference with ggml's f16 GELU table (kvcli.reference.llamacpp_arithmetic)
  refgeluq8            that and llama.cpp's 8-bit matmul inputs emulated (as
                       benchmarks/investigations/gemma_outlier_k.py: Q8_0 for
                       Q5_0/Q8_0 weights, Q8_K for the K-quants)
Each setting's K/V are saved as CACHE/K_<name>.npy, V_<name>.npy and reused when present (a run resumes).

Usage: DOC SLOT DOC_TOKENS CACHE_DIR OUT.json [SETTING,...]. 1 thread (set OMP_NUM_THREADS=1 too)."""
import itertools
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import torch

from kvcli.drivers.check import CheckSettings, Thresholds, build_tokens
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.reference.model import load
from kvcli.reference.session import ReferenceSession
from kvcli.reference.llamacpp_arithmetic import quantise_rows as quant, use_ggml_cpu_gelu

doc, slot, doc_tokens, cache, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
ALL = ["nb512", "nb2048", "nb64", "f32", "ref", "refw511", "refw513", "refgelu", "refgeluq8"]
settings = sys.argv[6].split(",") if len(sys.argv) > 6 else ALL
torch.set_num_threads(1)
os.makedirs(cache, exist_ok=True)
path = resolve_model("gemma-3-270m")
uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
out = {"doc": doc, "doc_tokens": doc_tokens, "slot": slot, "uptime_before": uptime(),
       "command": "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python " + " ".join(sys.argv)}
probe = NativeSession(path, n_ctx=0, cache_type="f16", flash_attn=True, n_threads=1)
toks = build_tokens(probe, open(doc).read(), CheckSettings(doc_tokens=doc_tokens))
n = len(toks)
n_ctx = -(-(n + 24) // 256) * 256
window = probe.info.sliding_window
kv_layers = list(probe.info.kv_layers)
out.update(n=n, sliding_window=window, kv_layers=kv_layers, slot_token=[toks[slot], probe.detokenize([toks[slot]])],
           context=probe.detokenize(toks[max(0, slot - 12): slot + 4]),
           window_edge={str(p): [toks[p], probe.detokenize([toks[p]])] for p in (slot - window, slot - window + 1)})
probe.close()


def save(name, obs):
    obs = obs.with_kv_arrays()
    np.save(f"{cache}/K_{name}.npy", obs.keys)
    np.save(f"{cache}/V_{name}.npy", obs.values)
    print(name, flush=True)


ref, gelu = None, False
for name in settings:
    if os.path.exists(f"{cache}/K_{name}.npy"):
        continue
    if name.startswith("nb") or name == "f32":
        s = NativeSession(path, n_ctx=0, cache_type="f32" if name == "f32" else "f16", flash_attn=name != "f32",
                          n_threads=1, n_batch=int(name[2:]) if name.startswith("nb") else 512)
        s.create_context(n_ctx)
        save(name, s.prefill(toks, seq=0, observe=("kv",)))
        s.close()
        continue
    if ref is None:
        ref = ReferenceSession(path, n_ctx=n_ctx, n_threads=1)
    ref.clear(0)
    st = ref.seq(0)
    if name.startswith("refw"):
        for sl in st.slots:
            if sl.sliding_window:
                sl.sliding_window = int(name[4:])
    model = load(path).model
    hooks = []
    if gelu and not name.startswith("refgelu"):
        raise SystemExit("the GELU table stays in the loaded model: list the refgelu settings last")
    if name.startswith("refgelu") and not gelu:
        use_ggml_cpu_gelu(model)
        gelu = True
    if name == "refgeluq8":
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
        for il, layer in enumerate(model.model.layers):
            for hf, gg in names.items():
                ty = types[f"blk.{il}.{gg}.weight"]
                if ty in ("F32", "F16", "BF16"):
                    continue
                b, f16 = (256, False) if ty.endswith("_K") else (32, True)
                hooks.append(layer.get_submodule(hf).register_forward_pre_hook(
                    lambda m, a, b=b, f16=f16: (quant(a[0], b, f16),)))
    save(name, ref.prefill(toks, seq=0, observe=("kv",)))
    for h in hooks:
        h.remove()

th = Thresholds()
have = [x for x in ALL if os.path.exists(f"{cache}/K_{x}.npy")]
K = {x: np.load(f"{cache}/K_{x}.npy").astype(np.float64) for x in have}
V = {x: np.load(f"{cache}/V_{x}.npy").astype(np.float64) for x in have}
out["pairs"] = {}
for a, b in itertools.combinations(have, 2):
    r = {}
    for what, A, B in (("K", K[a], K[b]), ("V", V[a], V[b])):
        d = np.abs(A - B).max(axis=-1)[:, 0, :] if A.shape[1] == 1 else np.abs(A - B).max(axis=-1).max(axis=1)
        r[what] = {"slot": [round(float(d[i, slot]), 3) for i in range(d.shape[0])],
                   "rank": [int((d[i] > d[i, slot]).sum()) + 1 for i in range(d.shape[0])],
                   "median_row": [round(float(np.median(d[i])), 3) for i in range(d.shape[0])],
                   "max_other_row": [round(float(np.delete(d[i], slot).max()), 3) for i in range(d.shape[0])],
                   "rows_over_threshold": int((d > th.l2_kv_rtol * np.abs(B).max()).sum())}
    out["pairs"][f"{a}~{b}"] = r
    print(a, b, "K at slot per layer", r["K"]["slot"], "rank", r["K"]["rank"], "V", r["V"]["slot"], flush=True)
out["uptime_after"] = uptime()
json.dump(out, open(out_path, "w"), indent=1)
print("wrote", out_path)
