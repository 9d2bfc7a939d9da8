"""gemma-3-270m L2 outlier: which token, and whether llama.cpp's arithmetic (8-bit activations, f16 GELU table)
emulated in the reference moves the reference's row to the native one. Usage: DOC SLOT [DOC_TOKENS]"""
import json
import sys
import time
import numpy as np
import torch
from kvcli.drivers.check import CheckSettings, build_tokens
from kvcli.native.session import NativeSession
from kvcli.reference.session import ReferenceSession
from kvcli.reference.model import load
from kvcli.reference.llamacpp_arithmetic import use_ggml_cpu_gelu
from kvcli.models import resolve_model
import gguf

doc, slot = sys.argv[1], int(sys.argv[2])
doc_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 900
torch.set_num_threads(1)
path = resolve_model("gemma-3-270m")
out = {"doc": doc, "slot": slot, "doc_tokens": doc_tokens}
nat = NativeSession(path, n_ctx=0, cache_type="f16", flash_attn=True, n_threads=1)
toks = build_tokens(nat, open(doc).read(), CheckSettings(doc_tokens=doc_tokens))
n = len(toks)
n_ctx = -(-(n + 24) // 256) * 256
out["n"] = n
out["token"] = [toks[slot], nat.detokenize([toks[slot]])]
out["context"] = nat.detokenize(toks[max(0, slot - 12): slot + 4])
out["same_token_slots"] = [i for i, t in enumerate(toks) if t == toks[slot]]
print("token", out["token"], "context", repr(out["context"]), flush=True)

def kv(sess):
    o = sess.prefill(toks, seq=0, observe=("kv",)).with_kv_arrays()
    return o.keys.astype(np.float64), o.values.astype(np.float64)

nat.create_context(n_ctx)
t = time.time()
K16, V16 = kv(nat)
nat.close()
tw = NativeSession(path, n_ctx=0, cache_type="f32", flash_attn=False, n_threads=1)
tw.create_context(n_ctx)
K32, V32 = kv(tw)
tw.close()
print("native done", time.time() - t, flush=True)

def dist(a, b):  # per row max abs over head_dim: [layer, head, slot]
    return np.abs(a - b).max(axis=-1)

def summary(name, K, V):
    r = {}
    for what, A, N in (("K", K, K16), ("V", V, V16)):
        d = dist(A, N)                      # this reference vs native f16/flash
        worst = np.unravel_index(np.argmax(d), d.shape)
        r[what] = {"slot_by_layer": [float(d[l, :, slot].max()) for l in range(d.shape[0])],
                   "median_row": float(np.median(d)), "p999_row": float(np.quantile(d, 0.999)),
                   "worst": [int(x) for x in worst], "worst_value": float(d[worst]),
                   "scale": float(np.abs(A).max())}
    print(name, json.dumps(r), flush=True)
    return r

out["native_f32_noflash"] = summary("native f32/no-flash vs f16/flash", K32, V32)
ref = ReferenceSession(path, n_ctx=n_ctx, n_threads=1)
out["reference"] = summary("reference (float32)", *kv(ref))
model = load(path).model
use_ggml_cpu_gelu(model)
ref.clear(0)
out["reference_ggml_gelu"] = summary("reference + ggml f16 GELU", *kv(ref))

# llama.cpp's CPU matmul quantises the activation row to the weight type's vec-dot type: Q8_0 (blocks of 32, scale
# stored in f16) for Q4_0/Q5_0/Q8_0 weights, Q8_K (blocks of 256, f32 scale) for the K-quants
reader = gguf.GGUFReader(str(path))
types = {t.name: t.tensor_type.name for t in reader.tensors}
names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}

def q8(block, f16_scale):
    def hook(mod, args):
        x = args[0]
        shp = x.shape
        xb = x.reshape(*shp[:-1], shp[-1] // block, block)
        d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
        if f16_scale:
            d = d.to(torch.float16).to(x.dtype)
        q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))), torch.zeros_like(xb))
        return (q * d).reshape(shp),
    return hook

hooks, used = [], {}
for il, layer in enumerate(model.model.layers):
    for hf, gg in names.items():
        mod = layer.get_submodule(hf)
        ty = types[f"blk.{il}.{gg}.weight"]
        if ty in ("F32", "F16", "BF16"):
            continue
        kq = ty.endswith("_K")
        hooks.append(mod.register_forward_pre_hook(q8(256 if kq else 32, not kq)))
        used[ty] = used.get(ty, 0) + 1
out["quantised_inputs"] = used
ref.clear(0)
out["reference_ggml_gelu_q8_acts"] = summary("reference + ggml GELU + 8-bit activations", *kv(ref))
json.dump(out, open(sys.argv[4] if len(sys.argv) > 4 else "/tmp/runs/gemma_outlier.json", "w"), indent=1)
