"""h2o: heavy hitters by accumulated attention of all prefill queries + a recent window (Zhang et al.)."""
from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param

SPEC = PolicySpec(
    name="h2o",
    summary="heavy hitters (attention accumulated over all prompt queries) + recent tokens",
    keeps="per KV head: the (budget - recent) prefix slots with the highest accumulated attention (column "
          "sums over every prefill query), plus the last `recent` slots",
    paper=Paper("H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
                arxiv="2306.14048", venue="NeurIPS 2023", code="github.com/FMInference/H2O"),
    params=(
        Param("recent", "int", 32, "most recent tokens always kept (inside the budget)",
              paper_default="budget/2 (the paper splits the cache equally between heavy hitters and recent "
                            "tokens); 32 in the prefill baselines of DynamicKV's harness, 8 in KVCache-Factory's",
              min=1, max=4096),
        gqa_param("mean"),
    ),
    needs=("colsum",),
    deviations=(
        "prefill-time one-shot variant (as KVCache-Factory and the WindowKV/DynamicKV papers run it): the paper "
        "evicts greedily at every decoding step; kvcli scores once with the column sums of the whole prefill "
        "attention and then appends",
        "no pooling; selection per KV head with the query heads of a group combined by `gqa` (mean); the code "
        "keeps per query head",
        "accumulated attention comes from the engine's colsum observation (float32), combined in float64",
    ),
    budget_above="recent",
)
