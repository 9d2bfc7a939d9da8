"""Issue #30 diagnostics: why re-selected windowkv, d2o and spindlekv answer only the first digit(s) of a planted value.

For each planted fact: re-select the prompt (StoredDocument.reselect, as `kvcli chat` does) for a configuration,
print per layer how many KV heads keep the fact's tokens (" is", " ", the digits, "."), and the greedy answer over the
compacted cache ("plain"; "no-merge-rows": the same plan without its replacement rows and log multiplicities). The
answer's first token is the prefill's logits (full cache), as in kvcli chat/eval. Groups that list two
configurations plan the second from the first's observation (d2o merge=none reads no K/V; a second K/V-reading
plan fails once the first was applied: run it as its own group).

    python examples/make_docs.py --tokens 3000 --facts 3 --seed 21 -o /tmp/x/doc.txt --facts-json /tmp/x/facts.json
    python benchmarks/investigations/reselect_digits.py OUT.txt windowkv,snapkv,spindlekv_nocb 1 [STORE.kvc]

As run for benchmarks/results/reselect-digits-qwen-3k-b128.json (the store was first read by StoredDocument.read
and its .kvc file copied; later runs loaded it)."""
import dataclasses
import os
import json
import sys
import time
import numpy as np
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.drivers.reselect import StoredDocument
from kvcli.planning.planner import resolve, make_plan
from kvcli.evaluation.chat import render, ask, prefix_text
from kvcli.evaluation.runner import _greedy

out = open(sys.argv[1], "w", buffering=1)
def say(*a):
    print(*a, file=out, flush=True)
model = resolve_model("qwen2.5-coder-0.5b")
text = open("/tmp/x/doc.txt").read()
facts = json.load(open("/tmp/x/facts.json"))
STORE = sys.argv[4] if len(sys.argv) > 4 else "/tmp/x/store.kvc"
budget = 128
s = NativeSession(model, n_ctx=4608, n_threads=2)
# groups sharing one observation: (base policy, [(label, args)])
groups = {
    "snapkv": [("snapkv", {})],
    "spindlekv_k7": [("spindlekv kernel=7", {"kernel": 7})],
    "windowkv_w32": [("windowkv window=32", {"window": 32})],
    "spindlekv_nocb": [("spindlekv theta=1", {"theta_k": 1.0, "theta_v": 1.0})],
    "windowkv": [("windowkv", {})],
    "d2o": [("d2o", {}), ("d2o merge=none", {"merge": "none"})],
    "spindlekv": [("spindlekv", {}), ("spindlekv theta=1", {"theta_k": 1.0, "theta_v": 1.0})],
}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(groups)
head = s.tokenize(prefix_text(s, text, False))
t0 = time.time()
store = StoredDocument.from_file(STORE, s) if os.path.exists(STORE) else StoredDocument.read(s, head, colsum=True)
say("stored", store.split, f"{time.time()-t0:.0f}s")
tb = lambda t: s.token_bytes(t).decode("utf-8", "replace")

def digit_slots(prompt, ans):
    toks = [tb(t) for t in prompt]
    for i in range(2, len(toks) - len(ans)):
        if "".join(toks[i:i + len(ans)]) == ans and toks[i - 2].strip() == "is":
            return list(range(i - 2, i + len(ans) + 1))
    return None

def kept_map(plan, slots):
    """per layer: for each of the slots, how many KV heads keep it"""
    rows = []
    kl = plan.kept_lists()
    for l in range(plan.n_layer):
        rows.append("".join(str(sum(int(x in set(kl[l][h].tolist())) for h in range(plan.n_head_kv))) for x in slots))
    return " ".join(rows)

for f in facts[:int(sys.argv[3])]:
    prompt = s.tokenize(render(s, text, [], ask(f["question"])))
    ds = digit_slots(prompt, f["answer"])
    say(f"== fact {f['answer']} n={len(prompt)} slots(is+digits)={ds}")
    if "full" not in sys.argv[3:]:
        pass
    for g in only:
        cfgs = [(lab, resolve(model, g.split("_")[0], budget, args)) for lab, args in groups[g]]
        seen = {}
        def grab(obs, plan, seen=seen):
            seen.update(obs=obs, state=s.save_seq(0), plan=plan)
        if 0 in s.seqs:
            s.clear(0)
        r = store.reselect(s, prompt, cfgs[0][1], seq=0, on_step=grab)
        first = s.logits(0).copy()
        for lab, cfg in cfgs:
            plan = seen["plan"] if lab == cfgs[0][0] else make_plan(cfg.spec, cfg.params, cfg.budget, seen["obs"],
                                                                    s.engine)
            say(f"{lab}: n_kept min/max/mean {plan.n_kept.min()}/{plan.n_kept.max()}/{plan.n_kept.mean():.1f} "
                f"replaced {len(plan.replace_entry)}")
            say("   kept heads per layer for [is,sp,d1..d4,.]:", kept_map(plan, ds) if ds else "?")
            variants = [("plain", plan, False)]
            if len(plan.replace_entry) or plan.log_mult is not None:
                variants.append(("no-merge-rows", dataclasses.replace(plan, log_mult=None,
                                 replace_entry=np.zeros(0, np.int32), replace_k=None, replace_v=None), False))
            for vlab, p, ri in variants:
                s.restore_seq(seen["state"], 0)
                s.apply_plan(p, seq=0, reindex=ri)
                ans = _greedy(s, first, 12)
                say(f"   {vlab:14s} -> {ans!r}")
        # the full cache, for reference (once)
        s.restore_seq(seen["state"], 0)
        if g == only[0]:
            say(f"   full           -> {_greedy(s, first, 12)!r}")
        s.clear(0)
        seen.clear()
say("done", f"{time.time()-t0:.0f}s")
store.close()
