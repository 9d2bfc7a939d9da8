"""Native engine only, qwen2.5-coder-0.5b: does the decode right after spindlekv's compaction depend on what the
context held before (kvcli check's flow: L2's observing prefill, then each policy compressed, decoded, restored,
decoded again)? Compares the direct post-compaction decode with the same state saved and restored."""
import sys
import numpy as np
from kvcli.drivers import compress
from kvcli.drivers.check import CheckSettings, build_tokens, logits_distance
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession

T = 2
path = resolve_model("qwen2.5-coder-0.5b")
nat = NativeSession(path, n_ctx=0, cache_type="f16", flash_attn=True, n_threads=T)
toks = build_tokens(nat, open("examples/station-log.txt").read(), CheckSettings(budget=64, doc_tokens=1000))
nat.create_context(-(-(len(toks) + 16 + 8) // 256) * 256)
history = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] != "-" else []

def decode(n):
    out, tok = [], int(np.argmax(nat.logits(0)))
    for _ in range(n):
        nat.step({0: tok})
        l = nat.logits(0).copy()
        out.append(l)
        tok = int(np.argmax(l))
    return out

if history:
    nat.clear(0)
    nat.prefill(toks, seq=0, observe=("window", "colsum", "kv"), window=(8, 32))
for name in history:
    nat.clear(0)
    compress.compress_as(nat, toks, compress.resolve(path, name, 64), planner="native", plan_always=True)
    st = nat.save_seq(0)
    decode(16)
    nat.restore_seq(st, 0)
    decode(16)
nat.clear(0)
compress.compress_as(nat, toks, compress.resolve(path, "spindlekv", 64), planner="native", plan_always=True)
st = nat.save_seq(0)
a = decode(8)
nat.restore_seq(st, 0)
b = decode(8)
d = [logits_distance(x, y) for x, y in zip(a, b)]
print("history", history, "direct vs restored: first-step logits max abs %.3g KL %.3g; max over 8 steps KL %.3g; same "
                          "argmax %d/8"
      % (d[0][0], d[0][1], max(k for _, k in d), sum(int(np.argmax(x) == np.argmax(y)) for x, y in zip(a, b))),
      flush=True)
