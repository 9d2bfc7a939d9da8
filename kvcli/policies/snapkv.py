"""snapkv: window attention, pooled, top-k per KV head + the observation window (Li et al.)."""
from kvcli.policies.base import Paper, PolicySpec, gqa_param, kernel_param, pool_param, window_param

SPEC = PolicySpec(
    name="snapkv",
    summary="top entries by pooled attention from the last prompt tokens, per KV head",
    keeps="per KV head: the (budget - window) prefix slots with the highest pooled window attention, plus "
          "the last `window` slots; every layer gets the same budget",
    paper=Paper("SnapKV: LLM Knows What You are Looking for Before Generation", arxiv="2404.14469",
                venue="NeurIPS 2024", code="github.com/FasterDecoding/SnapKV"),
    params=(
        window_param(32, "32 (SnapKV LongBench configs; kvpress 64; KVCache-Factory's runner 8)"),
        kernel_param(7, "7 (SnapKV configs and KVCache-Factory's runner; kvpress 5)"),
        pool_param("max", "max (SnapKV configs, KVCache-Factory's runner; kvpress avg)"),
        gqa_param("mean"),
    ),
    needs=("window",),
    window_param="window",
    budget_above="window",
    deviations=(
        "selection per KV head, scores of the query heads of a group combined by `gqa` (mean by default, as "
        "kvpress and KVCache-Factory's kv_head mode do); the paper and its code repeat the cache to every query "
        "head (more memory, per-query-head choices)",
        "window attention is summed over the window queries in float64 (the code sums in the model dtype, "
        "kvpress averages: same ranking); ties go to the lower slot",
        "kvpress differs by window 64, kernel 5, avg pooling: set window=64 kernel=5 pool=avg to reproduce it",
    ),
)
