"""Why does spindlekv's L3 arithmetic fail on qwen2.5-coder-0.5b (7acde29)? One prefill per engine; the native plan
and the reference's own plan compared, then decoded in both engines with the native plan, the reference plan, and
the native plan without its merged rows / log-multiplicities."""
import json
import sys
import numpy as np
from kvcli.drivers import compress
from kvcli.planning.planner import make_plan
from kvcli.drivers.check import CheckSettings, build_tokens, greedy_compare
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.planning.formats import Plan
from kvcli.reference.session import ReferenceSession

T = 2
path = resolve_model("qwen2.5-coder-0.5b")
pol = sys.argv[1] if len(sys.argv) > 1 else "spindlekv"
nat = NativeSession(path, n_ctx=0, cache_type="f16", flash_attn=True, n_threads=T)
toks = build_tokens(nat, open("examples/station-log.txt").read(), CheckSettings(budget=64, doc_tokens=1000))
nat.create_context(-(-(len(toks) + 24) // 256) * 256)
cfg = compress.resolve(path, pol, 64)
got = {}
compress.compress_as(nat, toks, cfg, planner="native", plan_always=True, on_step=lambda s, o, p: got.setdefault("n", p))
pn = got["n"]
state_n = nat.save_seq(0)
ref = ReferenceSession(path, n_ctx=nat.n_ctx, n_threads=T)
kinds, w = cfg.observe
obs_r = ref.prefill(toks, observe=kinds, window=w)
snap_r = ref.save_seq(0)
pr = make_plan(cfg.spec, cfg.params, 64, obs_r, "reference")
out = {"n": len(toks), "params": {k: str(v) for k, v in cfg.params.items()}}
out["n_kept_equal"] = bool(np.array_equal(pn.n_kept, pr.n_kept))
out["replaced"] = [int(pn.replace_entry.size), int(pr.replace_entry.size)]
for nm, p in (("native", pn), ("reference", pr)):
    out[nm] = {"log_mult_nonzero": None if p.log_mult is None else int(np.count_nonzero(p.log_mult)),
               "log_mult_max": None if p.log_mult is None else float(np.abs(p.log_mult).max()),
               "replace_k_absmax": None if p.replace_k is None else float(np.abs(p.replace_k).max()),
               "replace_v_absmax": None if p.replace_v is None else float(np.abs(p.replace_v).max()),
               "replace_k_finite": None if p.replace_k is None else bool(np.isfinite(p.replace_k).all()),
               "n_kept_layer0": p.n_kept[:, 0].tolist()}
print(json.dumps(out), flush=True)
strip = lambda d: {k: v for k, v in d.items() if k != "native_tokens"}

def run(plan_n, plan_r, tag, reprefill=False):
    if reprefill:
        nat.clear(0)
        nat.prefill(toks, seq=0)
        nat.apply_plan(plan_n, seq=0)
    else:
        nat.restore_seq(state_n, 0)
    ref.restore_seq(snap_r, 0)
    ref.apply_plan(plan_r, seq=0)
    r = strip(greedy_compare(nat, ref, 8))
    out[tag] = r
    print(tag, "KL %.4g logits %.3g greedy %.3f" % (r["kl"], r["logits_max_abs"], r["greedy_agree"]), flush=True)

run(pn, pn, "same_native_plan")
run(pn, pr, "own_plans")
bare = lambda p, lm: Plan(n_kept=p.n_kept, slots=p.slots, log_mult=(p.log_mult if lm else None))
run(bare(pn, True), bare(pn, True), "native_plan_no_merged_rows", reprefill=True)
run(bare(pn, False), bare(pn, False), "native_plan_no_merged_rows_no_log_mult", reprefill=True)
json.dump(out, open(f"/tmp/runs/{pol}_qwen_diag.json", "w"), indent=1)
