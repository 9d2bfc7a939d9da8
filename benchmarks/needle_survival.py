"""Does a needle survive chunked reading? For NIAH prompts past the context, read in chunks by a policy
with each --chunk-scoring, the share of the needle sentence's tokens still held in the final cache
(mean over layers and KV heads, followed through every plan by kvcli.drivers.check.Origins) and the greedy
answer. The answer depends on what the 135M model makes of what is kept; the share does not.

    python benchmarks/needle_survival.py LENGTH DEPTHS [SCORINGS] [POLICY]
    python benchmarks/needle_survival.py 10240 0.1,0.5,0.9 question,chunk snapkv
"""
from __future__ import annotations

import sys
import time

import numpy as np

from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.drivers.check import Origins
from kvcli.evaluation.runner import _greedy
from kvcli.evaluation.tasks import niah_sample
from kvcli.models import default_model_path
from kvcli.native.session import NativeSession

BUDGET, CHUNK = 512, 1024


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    length, depths = int(argv[0]), [float(x) for x in argv[1].split(",")]
    scorings = argv[2].split(",") if len(argv) > 2 else ["question", "chunk"]
    policy = argv[3] if len(argv) > 3 else "snapkv"
    model = default_model_path()
    tok = NativeSession(model, n_ctx=None, n_threads=2)
    print(f"{policy}@{BUDGET}, chunks of {CHUNK}, NIAH {length} tokens", flush=True)
    for d in depths:
        s = niah_sample(tok, length, d, 0)
        toks = tok.tokenize(s.prompt)
        i0 = s.prompt.index(s.meta["needle"])
        a, b = len(tok.tokenize(s.prompt[:i0])), len(tok.tokenize(s.prompt[:i0 + len(s.meta["needle"])]))
        for sc in scorings:
            sess = NativeSession(model, n_ctx=2048, n_threads=2)
            o = Origins(sess.info.n_layer, sess.info.n_head_kv)
            t0 = time.perf_counter()
            prefill_and_compress(sess, toks, resolve(sess.model_path, policy, BUDGET, {}), chunk=CHUNK,
                                 cap=BUDGET + CHUNK, scoring=sc,
                                 on_step=lambda st, obs, plan, o=o: o.on_plan(obs.n, plan))
            kept = o.kept(sess.stats(0)["kv_cells"])
            share = np.mean([np.isin(np.arange(a, b), h).mean() for layer in kept for h in layer])
            pred = _greedy(sess, sess.logits(0), s.max_tokens)
            print(f"depth {d:.1f}  {sc:<8}  needle tokens {a}-{b}: {100 * share:5.1f}% held  "
                  f"answer {s.answers[0]}, said {pred!r}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            sess.close()
    tok.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
