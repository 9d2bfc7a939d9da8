"""Usage: [KVCLI_MODEL=PATH|NAME] KVCLI_THREADS=1 OMP_NUM_THREADS=1 .venv/bin/python
benchmarks/investigations/check_layer_swap.py
BUDGET POLICY [DOC [DOC_TOKENS]]
(docs/results/engine-agreement.md, "Native vs reference engine"). pyramidkv @256: is the first-token KL a property of
the plans? In the
NATIVE engine only: the native
plan vs the reference engine's plan (both applied to the same native prefill), and hybrids that take the
reference plan's kept set in one layer only."""
import json
import os
import sys
import numpy as np
from kvcli.planning.planner import make_plan, resolve_for_model
from kvcli.drivers.check import logits_distance
from kvcli.models import default_model_path, resolve_model
from kvcli.planning.formats import Plan
from kvcli.reference.session import ReferenceSession
from check_setup import native_prompt

budget, name = int(sys.argv[1]), sys.argv[2]
mp = resolve_model(os.environ.get("KVCLI_MODEL"))   # a path or a pulled model's name; default: the bundled model
tag_model = "" if mp == default_model_path() else f"-{mp.stem}"
nat, toks, tag = native_prompt(sys.argv, mp, budget)
n = len(toks)
spec, params = resolve_for_model(mp, name, {}, budget)
kinds, w = spec.observe(params)
ref = ReferenceSession(mp, n_ctx=nat.n_ctx, n_seq=1)
obs_r = ref.prefill(toks, seq=0, observe=kinds, window=w)
del ref
nat.clear(0)
obs_n = nat.prefill(toks, seq=0, observe=kinds, window=w)
first = int(np.argmax(nat.logits(0)))
snap = nat.save_seq(0)
pn = make_plan(spec, params, budget, obs_n, "native")
pr = make_plan(spec, params, budget, obs_r, "native")   # same planner, reference observation

def after(plan):
    nat.restore_seq(snap, 0)
    nat.apply_plan(plan, seq=0)
    nat.step({0: first})
    return nat.logits(0).copy()

ln = after(pn)
lr = after(pr)
err, kl = logits_distance(ln, lr)
top = lambda l: [(int(i), round(float(l[i]), 3)) for i in np.argsort(-l)[:3]]
print(f"{name}@{budget}: native engine, native plan vs reference-observation plan: KL {kl:.4f} max abs {err:.3f}; "
      f"top3 {top(ln)} vs {top(lr)}; first token {first} {nat.detokenize([first])!r}", flush=True)
def hybrid(pa: Plan, pb: Plan, layer: int) -> Plan:
    """pa's kept sets, merged rows and log-multiplicities everywhere but `layer`, which comes from pb."""
    src = [pb if l == layer else pa for l in range(pa.n_layer)]
    kept = [src[l].kept_lists()[l] for l in range(pa.n_layer)]
    lm = None
    if pa.log_mult is not None or pb.log_mult is not None:
        lm = []
        for l in range(pa.n_layer):
            s, off = src[l], src[l].offsets()
            lm.append([np.zeros(len(kept[l][h]), np.float32) if s.log_mult is None else
                       s.log_mult[off[l, h]:off[l, h] + len(kept[l][h])] for h in range(pa.n_head_kv)])
    out = Plan.from_lists(kept, log_mult=lm)
    new_off = out.offsets()
    ents, ks, vs = [], [], []
    for l in range(pa.n_layer):
        s, off = src[l], src[l].offsets()
        for h in range(pa.n_head_kv):
            lo, hi = off[l, h], off[l, h] + len(kept[l][h])
            sel = (s.replace_entry >= lo) & (s.replace_entry < hi)
            if sel.any():
                ents.append(s.replace_entry[sel] - lo + new_off[l, h])
                ks.append(s.replace_k[sel])
                vs.append(s.replace_v[sel])
    if ents:
        out.replace_entry = np.concatenate(ents).astype(np.int32)
        out.replace_k = np.concatenate(ks).astype(np.float32)
        out.replace_v = np.concatenate(vs).astype(np.float32)
    return out


assert np.allclose(after(hybrid(pn, pr, -1)), ln, atol=1e-4)   # the hybrid that takes no layer from pr is pn
res = []
kn, kr = pn.kept_lists(), pr.kept_lists()
for l in range(pn.n_layer):
    lh = after(hybrid(pn, pr, l))
    e, k = logits_distance(ln, lh)
    diff = sum(len(set(a.tolist()) ^ set(b.tolist())) for a, b in zip(kn[l], kr[l]))
    res.append((l, k, e, diff))
    print(f"  layer {l:2d}: {diff:3d} entries differ; KL vs native plan {k:.4f}, max abs {e:.3f}", flush=True)
json.dump({"kl": kl, "err": err, "layers": res},
          open(f"benchmarks/results/check-layer-swap-{name}-{budget}{tag_model}{tag}.json", "w"))
