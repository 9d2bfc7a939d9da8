"""expected_attention: query-agnostic scores from the statistics of the prompt's queries (Devoto et al. 2025;
kvpress ExpectedAttentionPress). Digest: docs/design/methods/expected_attention.md."""
from kvcli.errors import KvcliError
from kvcli.policies.base import Paper, Param, PolicySpec


def _check(params: dict, budget: int) -> None:
    if budget <= params["sinks"] + params["recent"]:
        raise KvcliError(f"policy 'expected_attention': budget {budget} must be larger than sinks + recent = "
                         f"{params['sinks'] + params['recent']} (they are kept inside the budget); lower them with "
                         "--policy-arg sinks=N / recent=N")


def widest(params: dict, n_layer: int, n: int, budget: int):
    """Budget entries per KV head: the widest (layer, KV head) keeps the budget."""
    return min(n, budget)


SPEC = PolicySpec(
    name="expected_attention",
    summary="query-agnostic: the attention future queries are expected to give each entry (closed form from the "
            "prompt's query statistics), times the value's norm, per KV head",
    keeps="the first `sinks` and the last `recent` slots, and per KV head the entries with the highest expected "
          "attention: the mean and covariance of the last `window` prompt queries (before RoPE) rotated by the "
          "average RoPE rotation of the next `n_future` positions give each key exp(mu.k/sqrt(d) + k'Sigma k/(2d)), "
          "normalised over the keys after the sinks, averaged over the query heads of the KV head (`gqa`), times "
          "the value's norm",
    paper=Paper("Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution",
                arxiv="2510.00636", venue="2025", code="kvpress ExpectedAttentionPress (NVIDIA/kvpress)"),
    params=(
        Param("window", "int", 512, "prompt queries whose Q rows give the statistics (the last `window`; a prompt "
              "shorter than it gives all of its queries); their rows are observed, n_layer x n_head x window x "
              "head_dim floats. With the question in the prompt (re-selection, `run`) a short window (32: the "
              "question's queries) makes the policy question-aware: on qwen2.5-coder-0.5b at 8k, RULER needles 100 "
              "at 256-2048 entries and the chat re-selected 100 from 256, against 0-42 with 512 (docs/results.md)",
              paper_default="every prompt query after the sinks (kvpress)", min=2, max=4096),
        Param("n_future", "int", 512, "future positions whose RoPE rotation is averaged (the next n_future after the "
              "prompt)", paper_default="512 (kvpress n_future_positions)", min=1, max=1 << 20),
        Param("sinks", "int", 4, "first slots always kept, and left out of the statistics and of the normalisation",
              paper_default="4 (kvpress n_sink)", min=0, max=4096),
        Param("recent", "int", 8, "last prompt slots always kept (the end of kvcli's prompt: the instruction's last "
              "tokens and the assistant turn's start, which the next token reads)",
              paper_default="none (kvpress compresses the context before the question is appended)",
              min=0, max=4096),
        Param("covariance", "choice", "on", "add the covariance term k'Sigma k/(2d) to the expected logit",
              paper_default="on (kvpress use_covariance=True)", choices=("on", "off")),
        Param("vnorm", "choice", "on", "multiply the score by the value's norm, (score + epsilon) x ||v||",
              paper_default="on (kvpress use_vnorm=True)", choices=("on", "off")),
        Param("epsilon", "float", 0.0, "added to the score before the value-norm rescaling",
              paper_default="0 (kvpress epsilon)", min=0.0, max=1.0),
        Param("gqa", "choice", "mean", "how the scores of the query heads that share a KV head are combined into "
              "that KV head's score (selection is per KV head)",
              paper_default="mean over the group (kvpress)", choices=("mean", "max", "sum")),
    ),
    needs=("query", "kv"),
    window_param="window",
    agnostic=True,
    check=_check,
    widest=widest,
    budget_note="sinks and recent count inside the budget; budget entries per layer and KV head (kvpress's "
                "ScorerPress also keeps the same count per KV head)",
    deviations=(
        "statistics of the last `window` (512) prompt queries, not of every prompt query after the sinks: the "
        "observation holds their Q rows (n_layer x n_head x window x head_dim floats); window >= the prompt's "
        "length reproduces kvpress",
        "the queries are the Q rows attention used (post-RoPE, un-rotated exactly at their positions), so a "
        "projection bias (qwen2) and QK-norm are included as in kvpress 0.5.5's get_prerope_query_states; a model "
        "whose graph scales Q before attention (phi3 in llama.cpp) has that scale undone by the observation",
        "models whose RoPE is not a plain rotation of every dimension (YaRN, LongRoPE, an attention factor, partial "
        "rotary dimensions) and models with sliding-window layers (gemma2, gemma3) are refused in one line",
        "read in chunks (--chunk, --max-cache, a prompt longer than the context; bounded reading does not turn on "
        "by itself for it), every chunk is scored by the statistics of its own last `window` queries and the "
        "positions after it: the final scores are not the one-prefill ones (compress-once chat at 4k, budget 1024: "
        "the same 25% in 5 chunks as in one prefill, docs/results.md)",
        "the last `recent` prompt slots are always kept (kvcli's prompt ends with the instruction and the assistant "
        "header); kvpress keeps nothing but the sinks (recent=0 reproduces it)",
        "budget = entries per KV head (kvpress: a fraction removed, the same count per KV head); the native cache "
        "quantises K/V (f16 by default) where kvpress scores float32/bf16 keys",
        "ties go to the lower slot; scores in float64 from the engine's float32 rows",
    ),
)
