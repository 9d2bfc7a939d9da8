"""kvcli's kvzip against kvpress 0.5.5's KVzipPress on the same GGUF and token ids (issue #32): the kept entries per
layer and KV head, Jaccard.

Two steps, each in its own venv (kvpress is never a kvcli dependency; benchmarks/setup_kvpress.sh makes its venv):

    /work/kvpress-venv/bin/python benchmarks/kvpress_kvzip.py peer --model M.gguf --doc D --tokens 1000 \\
        --budget 256 --out /tmp/peer.json          # kvpress: the context ids and the entries KVzipPress masks
    .venv/bin/python benchmarks/kvpress_kvzip.py kvcli --model M.gguf --peer /tmp/peer.json \\
        --json-out benchmarks/results/kvpress-kvzip.json     # kvcli's reference engine, same ids, Jaccard

The context is what kvpress's pipeline prefills before a question: the chat template's head and the document (the user
turn left open). kvpress removes `compression_ratio` = 1 - budget/n of all (layer, KV head, slot) entries; kvcli keeps
budget per KV head on average (alloc=global: budget x n_head_kv x n_layer over all; alloc=layer for kvpress's
layerwise=True), sinks=4 (kvpress n_sink), recent=0 (kvpress protects no recent token). Both run float32 torch on the
GGUF dequantised by transformers. What still differs is kvcli's documented deviations (kvcli policies --explain
kvzip): kvcli's softmax runs over everything the reconstruction query sees and it feeds back the whole context,
template head included, with its instruction as plain text; kvpress renormalises over the sinks, the chunk and the pass,
repeats the context after the template head (scoring the head 0) and closes the user turn before the repeat.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def peer(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    import kvpress.presses.kvzip_press as kz
    from kvpress import KVzipPress

    path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()

    class _Tok:   # kvpress loads the tokenizer by the model's name; a GGUF model's is in the file
        @staticmethod
        def from_pretrained(*_a, **_k):
            return tok
    kz.AutoTokenizer = _Tok

    # the context as kvpress's pipeline prefills it: the template's head + the document, the user turn open
    dummy = "dummy context"
    sep = "\n" + "#" * len(dummy)
    text = tok.apply_chat_template([{"role": "user", "content": dummy + sep}], add_generation_prompt=True,
                                   tokenize=False)
    head = text.split(sep)[0].split(dummy)[0]
    doc_ids = tok.encode(Path(args.doc).read_text(encoding="utf-8"), add_special_tokens=False)[:args.tokens]
    ids = tok.encode(head, add_special_tokens=False) + doc_ids
    n = len(ids)
    out = {"model": str(path), "n": n, "budget": args.budget, "ids": ids, "runs": {}}
    for layerwise in (False, True):
        ratio = 1.0 - args.budget / n
        press = KVzipPress(compression_ratio=ratio, layerwise=layerwise)
        t0 = time.perf_counter()
        with torch.no_grad(), press(model):
            model(input_ids=torch.tensor([ids]), past_key_values=DynamicCache())
        masked = {}
        for layer in model.model.layers:
            _, h_idx, s_idx = layer.self_attn.masked_key_indices
            masked[int(layer.self_attn.layer_idx)] = [h_idx.tolist(), s_idx.tolist()]
            del layer.self_attn.masked_key_indices
        out["runs"]["layer" if layerwise else "global"] = {"ratio": ratio, "seconds": time.perf_counter() - t0,
                                                           "masked": masked}
        print(f"kvpress layerwise={layerwise}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    Path(args.out).write_text(json.dumps(out))


def kvcli_side(args) -> None:
    import numpy as np

    from kvcli.drivers.compress import compress_as
    from kvcli.planning.planner import resolve
    from kvcli.reference.session import ReferenceSession

    p = json.loads(Path(args.peer).read_text())
    ids, n, budget = p["ids"], p["n"], p["budget"]
    s = ReferenceSession(args.model, n_ctx=-(-(n + min(n, 2048) + 64) // 256) * 256)
    info = s.info
    result = {"model": p["model"], "n": n, "budget": budget, "kvpress": "0.5.5", "allocations": {}}
    for alloc, run in p["runs"].items():
        cfg = resolve(args.model, "kvzip", budget, {"alloc": alloc, "sinks": 4, "recent": 0})
        s.clear(0)
        rep = compress_as(s, ids, cfg, planner="reference")
        rows = []
        for il in range(info.n_layer):
            h_idx, s_idx = run["masked"][str(info.kv_layers[il])]
            h_idx, s_idx = np.asarray(h_idx), np.asarray(s_idx)
            for h in range(info.n_head_kv):
                theirs = set(range(n)) - set(s_idx[h_idx == h].tolist())
                ours = set(rep.plan.kept(il, h).tolist())
                rows.append({"layer": il, "head": h, "kvcli": len(ours), "kvpress": len(theirs),
                             "jaccard": len(ours & theirs) / len(ours | theirs)})
        jac = np.array([r["jaccard"] for r in rows])
        result["allocations"][alloc] = {
            "jaccard_mean": float(jac.mean()), "jaccard_min": float(jac.min()), "jaccard_median": float(np.median(jac)),
            "entries_kvcli": int(sum(r["kvcli"] for r in rows)),
                                        "entries_kvpress": int(sum(r["kvpress"] for r in rows)),
            "kvpress_seconds": run["seconds"], "kvcli_reconstruct_s": rep.reconstruct_s, "per_head": rows}
        print(f"alloc={alloc}: Jaccard mean {jac.mean():.3f} min {jac.min():.3f} median {np.median(jac):.3f} "
              f"(kvcli {result['allocations'][alloc]['entries_kvcli']} entries, kvpress "
              f"{result['allocations'][alloc]['entries_kvpress']})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="side", required=True)
    a = sub.add_parser("peer", help="kvpress (run in its own venv)")
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
