"""keydiff: question-agnostic, the keys least like their head's mean key (Park et al. 2025; kvpress KeyDiffPress)."""
from kvcli.policies.base import Paper, Param, PolicySpec


def widest(params: dict, n_layer: int, n: int, budget: int):
    """Budget entries per KV head: every (layer, KV head) keeps the budget."""
    return min(n, budget)


SPEC = PolicySpec(
    name="keydiff",
    summary="question-agnostic: the keys least similar to their KV head's mean key (negative cosine), per KV head",
    keeps="the last `recent` slots, and per layer and KV head the (budget - recent) others whose key has the lowest "
          "cosine similarity to the anchor, the mean of that head's normalised keys (every slot's, the recent ones "
          "included): score = -cos(k, anchor)",
    paper=Paper("KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in "
                "Resource-Constrained Environments", arxiv="2504.15364", venue="2025",
                code="kvpress KeyDiffPress (NVIDIA/kvpress)"),
    params=(
        Param("recent", "int", 8, "last prompt slots always kept (the end of kvcli's prompt: the instruction's last "
              "tokens and the assistant turn's start, which the next token reads); they count in the anchor",
              paper_default="none (kvpress scores every entry: it compresses the context before the question is "
                            "appended)", min=0, max=4096),
    ),
    needs=("kv",),
    agnostic=True,
    widest=widest,
    budget_above="recent",
    budget_note="recent counts inside the budget; budget entries per layer and KV head (kvpress's ScorerPress also "
                "keeps the same count per KV head)",
    deviations=(
        "one-shot at prefill, as kvpress's KeyDiffPress: the paper evicts block by block while the prompt is read "
        "(kvpress: BlockPress(KeyDiffPress)); kvcli's chunked reading (--chunk) comes closest: each chunk's keys "
        "and the kept ones are scored against their own mean",
        "the last `recent` (8) prompt slots are always kept (kvcli's prompt ends with the instruction and the "
        "assistant header); kvpress keeps nothing by rule (recent=0 reproduces it)",
        "the keys are the cached rows (after RoPE, as kvpress's); the native cache quantises them (f16 by default) "
        "where kvpress scores float32/bf16 keys; a zero key has score 0",
        "budget = entries per KV head (kvpress: a fraction removed, the same count per KV head)",
        "ties go to the lower slot; scores in float64 from the engine's float32 rows",
    ),
)
