"""gemma-3-270m's L2 K outlier (issue 31: a global layer's K row far beyond l2_kv_rtol at one slot): which token
it is, and where the engines' difference there comes from. Continues benchmarks/investigations/gemma_outlier.py (which
found a V
row of the typing_extensions licence moved by llama.cpp's 8-bit matmul inputs) for a K row.

The native engine gives K at its f16/flash setting (what check compares) and at f32/no-flash (the precision twin
L2 consults); the reference engine (float32, transformers on the GGUF dequantised) runs as shipped, then with
llama.cpp's quantisation of the matmul inputs emulated (ggml-cpu quantises the activation row to the weight type's
vec-dot type before every quantised matmul: Q8_0 for Q4_0/Q5_0/Q8_0 weights, Q8_K for the K-quants):
  q8_all       every quantised matmul of every layer
  q8_upstream  every quantised matmul of the layers before LAYER (the residual stream reaching LAYER)
  q8_local     only LAYER's Q/K/V projection input (the rounding of the K projection's own input)
  q8_all_but_local  q8_all without LAYER's Q/K/V projection input
and what the token's activations look like at LAYER (the k_proj input's block maxima, the quantisation error, the
K projection's RMS before the per-head K norm): why this token and not another.

Usage: DOC SLOT LAYER [DOC_TOKENS] [OUT.json]   (LAYER: a model layer, e.g. 11; SLOT -1: the worst K row of LAYER)
Runs with 1 thread (set OMP_NUM_THREADS=1 too)."""
import json
import subprocess
import sys
import time

import gguf
import numpy as np
import torch

from kvcli.drivers.check import CheckSettings, Thresholds, build_tokens
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.reference.model import load
from kvcli.reference.llamacpp_arithmetic import quantise_rows as quant
from kvcli.reference.session import ReferenceSession

doc, slot, layer = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
doc_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
out_path = sys.argv[5] if len(sys.argv) > 5 else "/tmp/gemma_outlier_k.json"
torch.set_num_threads(1)
path = resolve_model("gemma-3-270m")
uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
out = {"doc": doc, "doc_tokens": doc_tokens, "model_layer": layer, "uptime_before": uptime(),
       "command": "OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python " + " ".join(sys.argv)}
t_start = time.time()

nat = NativeSession(path, n_ctx=0, cache_type="f16", flash_attn=True, n_threads=1)
toks = build_tokens(nat, open(doc).read(), CheckSettings(doc_tokens=doc_tokens))
n = len(toks)
n_ctx = -(-(n + 24) // 256) * 256
out["n"] = n
kv_layers = list(nat.info.kv_layers) if nat.info.kv_layers else list(range(nat.info.n_layer))
li = kv_layers.index(layer)          # the observation's layer index of the model layer
out["kv_layers"] = kv_layers


def kv(sess):
    o = sess.prefill(toks, seq=0, observe=("kv",)).with_kv_arrays()
    return o.keys.astype(np.float64), o.values.astype(np.float64)


nat.create_context(n_ctx)
K16, V16 = kv(nat)
detok = nat.detokenize   # nat stays open: its vocabulary detokenizes below
tw = NativeSession(path, n_ctx=0, cache_type="f32", flash_attn=False, n_threads=1)
tw.create_context(n_ctx)
K32, V32 = kv(tw)
tw.close()
print("native done", round(time.time() - t_start), "s", flush=True)


def rows(a, b):  # per row max abs over head_dim: [layer, head, slot]
    return np.abs(a - b).max(axis=-1)


ref = ReferenceSession(path, n_ctx=n_ctx, n_threads=1)
model = load(path).model
th = Thresholds()

# what the K projection of LAYER sees (float32 reference, no emulation): its input and output per slot
att = model.model.layers[layer].self_attn
cap = {}
h1 = att.k_proj.register_forward_pre_hook(lambda m, a: cap.__setitem__("x", a[0][0].detach().clone()))
h2 = att.k_proj.register_forward_hook(lambda m, a, o: cap.__setitem__("k", o[0].detach().clone()))
h3 = model.model.layers[layer].register_forward_pre_hook(
    lambda m, a, kw=None: cap.__setitem__("h", (a[0] if a else kw["hidden_states"])[0].detach().clone()),
    with_kwargs=True)
Kref, Vref = kv(ref)
for h in (h1, h2, h3):
    h.remove()
t_ref = time.time()

if slot < 0:   # the worst K row of LAYER between the reference and native f16/flash
    slot = int(np.argmax(rows(Kref, K16)[li].max(axis=0)))
out["slot"] = slot
out["token"] = [toks[slot], detok([toks[slot]])]
out["context"] = detok(toks[max(0, slot - 12): slot + 4])
out["same_token_slots"] = [i for i, t in enumerate(toks) if t == toks[slot]]
print("slot", slot, "token", out["token"], "context", repr(out["context"]), flush=True)


reader = gguf.GGUFReader(str(path))
types = {t.name: t.tensor_type.name for t in reader.tensors}
names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def block_of(ty):
    return (256, False) if ty.endswith("_K") else (32, True)


# the token's activations at LAYER, against every other slot's
x, k_raw, hres = cap["x"].double(), cap["k"].double(), cap["h"].double()
blk, f16s = block_of(types[f"blk.{layer}.attn_k.weight"])
xq = quant(cap["x"], blk, f16s).double()
qerr = (xq - x).norm(dim=-1) / x.norm(dim=-1)                     # relative rounding error of the input row
xb = x.reshape(n, -1, blk)
peak = (xb.abs().amax(-1) / xb.pow(2).mean(-1).sqrt()).amax(-1)   # worst block's max / RMS
nh = att.config.num_key_value_heads
kr = k_raw.reshape(n, nh, -1).pow(2).mean(-1).sqrt().amin(-1)     # the K projection's RMS (smallest KV head)
# the K projection of the quantised input, before the norm: how far the rounding moves it, relative to its RMS
w = att.k_proj.weight.detach().double()
dk = ((xq - x) @ w.T).reshape(n, nh, -1)
dk_rel = (dk.pow(2).mean(-1).sqrt() / k_raw.reshape(n, nh, -1).pow(2).mean(-1).sqrt()).amax(-1)
hmax = hres.abs().amax(-1)


def where(v, higher=True):
    v = v.detach().numpy()
    rank = int((v > v[slot]).sum() if higher else (v < v[slot]).sum()) + 1
    return {"slot": float(v[slot]), "median": float(np.median(v)), "rank": rank, "of": n,
            "top5_slots": [int(i) for i in np.argsort(-v if higher else v)[:5]]}


out["activations"] = {
    "k_proj_weight_type": types[f"blk.{layer}.attn_k.weight"], "activation_block": blk,
    "input_rounding_rel": where(qerr),
    "input_block_peak_over_rms": where(peak),
    "k_proj_rms_before_norm": where(kr, higher=False),
    "k_proj_shift_rel_from_rounding": where(dk_rel),
    "residual_max_abs": where(hmax),
}
print("activations", json.dumps(out["activations"]), flush=True)


def summary(name, K, V):
    r = {}
    for what, A, N in (("K", K, K16), ("V", V, V16)):
        d = rows(A, N)
        scale = float(np.abs(A).max())
        over = np.argwhere(d > th.l2_kv_rtol * scale)
        r[what] = {"slot_by_layer": [float(d[i, :, slot].max()) for i in range(d.shape[0])],
                   "median_row": float(np.median(d)), "p999_row": float(np.quantile(d, 0.999)),
                   "scale": scale, "threshold": th.l2_kv_rtol * scale,
                   "rows_over": [[kv_layers[int(a)], int(b), int(c), float(d[a, b, c])] for a, b, c in over][:20],
                   "n_rows_over": int(len(over))}
    print(name, json.dumps({k: {kk: v[kk] for kk in ("slot_by_layer", "median_row", "n_rows_over", "rows_over")}
                            for k, v in r.items()}), flush=True)
    return r


twin = summary("native f32/no-flash vs f16/flash", K32, V32)
out["native_f32_noflash"] = twin
out["reference"] = summary("reference (float32)", Kref, Vref)
out["seconds_reference_prefill"] = round(t_ref - t_start)
del Kref, Vref


def hook_layers(layers, only=None):
    hooks = []
    for il in layers:
        for hf, gg in names.items():
            if only is not None and hf not in only:
                continue
            ty = types[f"blk.{il}.{gg}.weight"]
            if ty in ("F32", "F16", "BF16"):
                continue
            b, f16 = block_of(ty)
            hooks.append(model.model.layers[il].get_submodule(hf).register_forward_pre_hook(
                lambda m, a, b=b, f16=f16: (quant(a[0], b, f16),)))
    return hooks


qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
L = len(model.model.layers)
variants = {
    "q8_all": lambda: hook_layers(range(L)),
    "q8_upstream": lambda: hook_layers(range(layer)),
    "q8_local": lambda: hook_layers([layer], only=qkv),
    "q8_all_but_local": lambda: hook_layers([i for i in range(L) if i != layer])
    + hook_layers([layer], only=[k for k in names if k not in qkv]),
}
for name, make in variants.items():
    hooks = make()
    ref.clear(0)
    out["reference_" + name] = summary("reference + " + name, *kv(ref))
    for h in hooks:
        h.remove()
nat.close()
out["uptime_after"] = uptime()
out["seconds"] = round(time.time() - t_start)
json.dump(out, open(out_path, "w"), indent=1)
print("wrote", out_path, out["seconds"], "s")
