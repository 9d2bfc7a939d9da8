"""Usage: KVCLI_THREADS=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/check_layer_swap.py BUDGET POLICY
(docs/results.md, "Native vs reference engine"). pyramidkv @256: is the first-token KL a property of the plans? In the NATIVE engine only: the native
plan vs the reference engine's plan (both applied to the same native prefill), and hybrids that take the
reference plan's kept set in one layer only."""
import json, sys, numpy as np
from pathlib import Path
from kvcli import compress
from kvcli.check import CheckSettings, build_tokens, restrict, logits_distance
from kvcli.models import default_model_path
from kvcli.native.session import NativeSession
from kvcli.plan import Plan
from kvcli.reference.session import ReferenceSession

budget, name = int(sys.argv[1]), sys.argv[2]
mp = default_model_path()
st = CheckSettings(budget=budget, doc_tokens=2000)
doc = Path("examples/station-log.txt").read_text()
nat = NativeSession(mp, n_ctx=0, cache_type="f16", flash_attn=True)
toks = build_tokens(nat, doc, st)
n = len(toks)
nat.create_context(-(-(n + 24) // 256) * 256)
spec, params = compress.resolve_for_model(mp, name, {}, budget)
kinds, w = spec.observe(params)
ref = ReferenceSession(mp, n_ctx=nat.n_ctx, n_seq=1)
obs_r = ref.prefill(toks, seq=0, observe=kinds, window=w)
del ref
nat.clear(0)
obs_n = nat.prefill(toks, seq=0, observe=kinds, window=w)
first = int(np.argmax(nat.logits(0)))
snap = nat.save_seq(0)
pn = compress.make_plan(spec, params, budget, obs_n, "native")
pr = compress.make_plan(spec, params, budget, obs_r, "native")   # same planner, reference observation

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
res = []
kn, kr = pn.kept_lists(), pr.kept_lists()
for l in range(pn.n_layer):
    hyb = [list(x) for x in kn]
    hyb[l] = kr[l]
    lh = after(Plan.from_lists(hyb))
    e, k = logits_distance(ln, lh)
    diff = sum(len(set(a.tolist()) ^ set(b.tolist())) for a, b in zip(kn[l], kr[l]))
    res.append((l, k, e, diff))
    print(f"  layer {l:2d}: {diff:3d} entries differ; KL vs native plan {k:.4f}, max abs {e:.3f}", flush=True)
json.dump({"kl": kl, "err": err, "layers": res}, open(f"benchmarks/results/check-layer-swap-{name}-{budget}.json", "w"))
