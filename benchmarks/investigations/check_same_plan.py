"""Usage: [KVCLI_MODEL=PATH|NAME] KVCLI_THREADS=1 OMP_NUM_THREADS=1 .venv/bin/python
benchmarks/investigations/check_same_plan.py
BUDGET POLICY[,POLICY] [DOC [DOC_TOKENS]]
(docs/results/engine-agreement.md, "Native vs reference engine"). Why does L3 differ? For each policy: (a) L3 as kvcli
check does it
(each engine its own observation and
planner); (b) the reference engine applying the NATIVE plan (same kept sets, same merged rows), so the
only difference left is the engines' arithmetic; (c) native planner on the reference observation vs torch
planner on it (L1 on the reference's observation).
`kvcli check` itself now reports (a) as plan agreement and (b) as L3's arithmetic verdict (docs/internals.md, "kvcli
check"); this script stays for (c) and for comparing both on one prefill."""
import json
import os
import sys
import numpy as np
from kvcli.planning.planner import make_plan, resolve_for_model
from kvcli.drivers.check import greedy_compare, compare_plans
from kvcli.models import default_model_path, resolve_model
from kvcli.reference.session import ReferenceSession
from check_setup import native_prompt

budget = int(sys.argv[1])
names = sys.argv[2].split(",")
mp = resolve_model(os.environ.get("KVCLI_MODEL"))   # a path or a pulled model's name; default: the bundled model
tag_model = "" if mp == default_model_path() else f"-{mp.stem}"
nat, toks, tag = native_prompt(sys.argv, mp, budget)
n = len(toks)
ref = ReferenceSession(mp, n_ctx=2 * nat.n_ctx, n_seq=2)
base = ref.prefill(toks, seq=0, observe=("window", "colsum", "kv"), window=32)
out = {"n": n, "budget": budget}
strip = lambda d: {k: v for k, v in d.items() if k != "native_tokens"}
for name in names:
    spec, params = resolve_for_model(mp, name, {}, budget)
    kinds, w = spec.observe(params)
    nat.clear(0)
    obs_n = nat.prefill(toks, seq=0, observe=kinds, window=w)
    pn = make_plan(spec, params, budget, obs_n, "native")
    obs_r = base.restrict(kinds, w)
    pr = make_plan(spec, params, budget, obs_r, "reference")
    pr_native = make_plan(spec, params, budget, obs_r, "native")
    d = {"budgets_equal": bool(np.array_equal(pn.n_kept, pr.n_kept)),
         "n_kept_native_l": pn.n_kept[:, 0].tolist(), "n_kept_ref_l": pr.n_kept[:, 0].tolist(),
         "l1_on_reference_obs": compare_plans(pr_native, pr, 1e-5)["pass"]}
    nat.apply_plan(pn, seq=0)
    ref.copy_seq(0, 1)
    ref.apply_plan(pr, seq=1)
    d["own_plans"] = strip(greedy_compare(nat, ref, 16, 0, 1))
    ref.clear(1)
    nat.clear(0)
    nat.prefill(toks, seq=0)
    nat.apply_plan(pn, seq=0)
    ref.copy_seq(0, 1)
    ref.apply_plan(pn, seq=1)
    d["same_native_plan"] = strip(greedy_compare(nat, ref, 16, 0, 1))
    ref.clear(1)
    out[name] = d
    KEYS = ("kl", "logits_max_abs", "greedy_agree", "greedy_prefix", "kl_max")
    print(name, "budgets_equal", d["budgets_equal"], "l1_ref_obs", d["l1_on_reference_obs"],
          "| own plans: KL %.4f maxabs %.3f greedy %.3f prefix %d klmax %.4f" % tuple(d["own_plans"][k] for k in KEYS),
          "| same plan: KL %.4f maxabs %.3f greedy %.3f prefix %d klmax %.4f" % tuple(d["same_native_plan"][k]
                                                                                  for k in KEYS),
          file=sys.stderr, flush=True)
json.dump(out, open(f"benchmarks/results/check-same-plan-{budget}{tag_model}{tag}.json", "w"), indent=1)
