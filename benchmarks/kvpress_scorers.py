"""kvcli's keydiff and tova against kvpress 0.5.5's KeyDiffPress and TOVAPress on the same GGUF and token ids (issue
#65): the kept entries per layer and KV head, Jaccard. The method of benchmarks/kvpress_expected_attention.py.

Two steps, each in its own venv (kvpress is never a kvcli dependency; benchmarks/setup_kvpress.sh makes its venv):

    /work/kvpress-venv/bin/python benchmarks/kvpress_scorers.py peer --press keydiff --model M.gguf --doc D \\
        --tokens 1000 --budget 256 --out /tmp/peer.json      # kvpress: the context ids and the entries the press keeps
    .venv/bin/python benchmarks/kvpress_scorers.py kvcli --model M.gguf --peer /tmp/peer.json \\
        --json-out benchmarks/results/kvpress-keydiff.json   # kvcli's reference engine, same ids, Jaccard

The context is what kvpress's pipeline prefills before a question: the chat template's head and the document (the user
turn left open). kvpress keeps int(n x (1 - compression_ratio)) entries per KV head (ScorerPress's top-k per head);
the ratio is chosen so that this is the budget. kvcli runs with matched parameters: keydiff recent=0 (kvpress keeps
nothing by rule); tova window=1, gqa=layer (its defaults: the last query's attention averaged over every head of the
layer, the last token kept, as TOVAPress pads its score). float32 torch on the GGUF dequantised by transformers in
both; kvcli's native planner is run on the same observation too (it must equal the torch one: L1). What still
differs: kvpress scores in float32 (tova: attention computed from the layer's hidden states by its own
q_proj/RoPE/softmax), kvcli in float64 from the engine's observation; kvpress's top-k breaks ties its own way,
kvcli's to the lower slot.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PRESSES = {"keydiff": ("KeyDiffPress", {"recent": 0}), "tova": ("TOVAPress", {"window": 1, "gqa": "layer"})}


def peer(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress
    from kvpress.utils import compute_n_kept

    path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    dummy = "dummy context"
    sep = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                   tokenize=False)
    head = text.split(sep)[0].split(dummy)[0]
    doc_ids = tok.encode(Path(args.doc).read_text(encoding="utf-8"), add_special_tokens=False)[:args.tokens]
    ids = tok.encode(head, add_special_tokens=False) + doc_ids
    n = len(ids)
    kept: dict = {}
    base = getattr(kvpress, PRESSES[args.press][0])

    class Recording(base):
        """The press, whose compress notes the indices ScorerPress keeps (the same top-k)."""
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
            idx = scores.topk(compute_n_kept(keys.shape[2], self.compression_ratio), dim=-1).indices
            kept[int(module.layer_idx)] = idx[0].tolist()
            return super().compress(module, hidden_states, keys, values, attentions, kwargs)

    ratio = 1.0 - (args.budget + 0.5) / n       # int(n x (1 - ratio)) = budget
    press = Recording(compression_ratio=ratio)
    t0 = time.perf_counter()
    with torch.no_grad(), press(model):
        model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
    secs = time.perf_counter() - t0
    print(f"kvpress {base.__name__}: {secs:.1f}s", file=sys.stderr)
    Path(args.out).write_text(json.dumps({"press": args.press, "model": str(path), "n": n, "budget": args.budget,
                                          "ids": ids, "ratio": ratio, "seconds": secs, "kept": kept}))


def kvcli_side(args) -> None:
    import numpy as np

    from kvcli import policies
    from kvcli.planning.planner import make_plan, resolve
    from kvcli.reference.session import ReferenceSession

    p = json.loads(Path(args.peer).read_text())
    name, ids, n, budget = p["press"], p["ids"], p["n"], p["budget"]
    s = ReferenceSession(args.model, n_ctx=-(-(n + 64) // 256) * 256)
    info = s.info
    cfg = resolve(args.model, name, budget, dict(PRESSES[name][1]))
    kinds, w = cfg.observe
    t0 = time.perf_counter()
    obs = s.prefill(ids, observe=kinds, window=w)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = make_plan(cfg.spec, cfg.params, budget, obs, "reference")
    plan_s = time.perf_counter() - t0
    host = make_plan(cfg.spec, cfg.params, budget, obs, "native")
    rows = []
    for il in range(info.n_layer):
        theirs_l = p["kept"][str(info.kv_layers[il])]
        for h in range(info.n_head_kv):
            theirs, ours = set(theirs_l[h]), set(plan.kept(il, h).tolist())
            rows.append({"layer": il, "head": h, "kvcli": len(ours), "kvpress": len(theirs),
                         "jaccard": len(ours & theirs) / len(ours | theirs)})
    jac = np.array([r["jaccard"] for r in rows])
    same = bool(np.array_equal(plan.n_kept, host.n_kept) and np.array_equal(plan.slots, host.slots))
    result = {"policy": name, "press": PRESSES[name][0], "model": p["model"], "n": n, "budget": budget,
              "kvpress": "0.5.5", "params": cfg.params, "policy_line": policies.get(name).render(cfg.params),
              "jaccard_mean": float(jac.mean()), "jaccard_min": float(jac.min()),
              "jaccard_median": float(np.median(jac)), "native_planner_equals_torch": same,
              "kvpress_seconds": p["seconds"], "kvcli_prefill_s": prefill_s, "kvcli_plan_s": plan_s, "per_head": rows}
    print(f"{name}: Jaccard mean {jac.mean():.3f} min {jac.min():.3f} median {np.median(jac):.3f}; native (C++) "
          f"planner = torch planner: {same}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="side", required=True)
    a = sub.add_parser("peer", help="kvpress (run in its own venv)")
    a.add_argument("--press", required=True, choices=sorted(PRESSES))
    a.add_argument("--model", required=True)
    a.add_argument("--doc", required=True)
    a.add_argument("--tokens", type=int, default=1000, help="document tokens (after the template's head)")
    a.add_argument("--budget", type=int, default=256)
    a.add_argument("--out", required=True)
    b = sub.add_parser("kvcli", help="kvcli's reference engine on the peer's token ids")
    b.add_argument("--model", required=True)
    b.add_argument("--peer", required=True)
    b.add_argument("--json-out")
    args = ap.parse_args()
    (peer if args.side == "peer" else kvcli_side)(args)


if __name__ == "__main__":
    main()
