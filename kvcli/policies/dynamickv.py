"""dynamickv: per-layer budgets from a global top-k over window scores, updated every m layers (Zhou et al.)."""
from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param, kernel_param, pool_param, \
    window_param

SPEC = PolicySpec(
    name="dynamickv",
    summary="task-aware per-layer budgets from a progressive global top-k of window attention, per KV head",
    keeps="per layer: the window plus Z'_l prefix slots per KV head (top pooled window attention), where Z'_l "
          "comes from each layer's share of a global top-k over all layers seen so far, recomputed every "
          "`interval` layers",
    paper=Paper("DynamicKV: Task-Aware Adaptive KV Cache Compression for Long Context LLMs", arxiv="2412.14838",
                venue="EMNLP 2025 (per the authors' README)", code="github.com/DreamMr/DynamicKV"),
    params=(
        window_param(8, "8 (authors' scripts)"),
        kernel_param(7, "7 (authors' scripts)"),
        pool_param("avg", "avg for Llama-3 / InternLM, max for Mistral / Qwen2 (authors' scripts)"),
        Param("r_max", "float", 10.0, "provisional per-layer maximum = r_max x (budget - window)",
              paper_default="10 (5 for Qwen2)", min=1.0, max=1000.0),
        Param("interval", "int", 4, "m: budgets are recomputed after every m layers (and at the last layer)",
              paper_default="4 (hard-coded in the code)", min=1, max=1024),
        gqa_param("mean"),
    ),
    needs=("window",),
    window_param="window",
    budget_above="window",
    budget_note="layer budgets come out of the progressive rule and sum to at most budget x n_layer: budget freed "
                "by the shrink-only rule is not handed back (as in the authors' code)",
    deviations=(
        "per KV head: the pooled scores of the query heads of a group are combined by `gqa` (mean) and the "
        "global top-k counts base x n_head_kv x layers entries; the code repeats K/V to query heads (G x memory)",
        "the budget update is replayed after prefill over the saved per-layer scores, which gives the same "
        "result as the code's interleaved update (prefill attention is never compressed)",
        "an update is forced at the last layer when n_layer is not a multiple of `interval` (the code would "
        "leave the budgets unnormalised)",
        "a recomputed budget larger than what a layer holds is clamped (the code's slice duplicates window "
        "tokens); an update whose counts are all zero is skipped",
        "scores in float64 (the code sums in bf16/fp16); the global top-k breaks ties by (layer, head, slot)",
    ),
)
