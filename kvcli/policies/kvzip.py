"""kvzip: query-agnostic scores from a context reconstruction pass (Kim et al., NeurIPS 2025; kvpress KVzipPress)."""
from kvcli.errors import KvcliError
from kvcli.policies.base import Paper, Param, PolicySpec
# its second pass, the context reconstruction (kvcli/policies/reconstruction.py): its prompts and default chunk
from kvcli.policies.reconstruction import RECONSTRUCTION, REPEAT_CHUNK, REPEAT_FIRST, REPEAT_NEXT, REPEAT_OVERLAP

__all__ = ["REPEAT_CHUNK", "REPEAT_FIRST", "REPEAT_NEXT", "REPEAT_OVERLAP", "SPEC", "widest"]


def _check(params: dict, budget: int) -> None:
    if budget <= params["sinks"] + params["recent"]:
        raise KvcliError(f"policy 'kvzip': budget {budget} must be larger than sinks + recent = "
                         f"{params['sinks'] + params['recent']} (they are kept inside the budget); lower them with "
                         "--policy-arg sinks=N / recent=N")


def widest(params: dict, n_layer: int, n: int, budget: int):
    """The widest (layer, KV head) of a plan: the budget per KV head with alloc=head; the scores decide otherwise."""
    return min(n, budget) if params["alloc"] == "head" else None


SPEC = PolicySpec(
    name="kvzip",
    summary="query-agnostic: entries the model attends to most when asked to repeat the prompt (context "
            "reconstruction), per KV head",
    keeps="the first `sinks` and the last `recent` slots, and the entries with the highest reconstruction score: "
          "the largest attention any query of the reconstruction pass (the prompt fed again after a 'repeat the "
          "previous context' instruction) gave them, the query heads of a KV head combined by `gqa` (max); chosen "
          "per KV head (alloc=head), per layer (alloc=layer) or over all layers (alloc=global)",
    paper=Paper("KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arxiv="2505.23416",
                venue="NeurIPS 2025", code="github.com/snu-mllab/KVzip; kvpress KVzipPress"),
    params=(
        Param("sinks", "int", 4, "first slots always kept (attention sinks)", paper_default="4 (kvpress n_sink)",
              min=0, max=4096),
        Param("recent", "int", 8, "last prompt slots always kept (the end of kvcli's prompt: the instruction's "
              "last tokens and the assistant turn's start, which the next token reads)",
              paper_default="none (kvpress compresses the context before the question is appended)",
              min=0, max=4096),
        Param("gqa", "choice", "max", "how the scores of the query heads that share a KV head are combined into "
              "that KV head's score (selection is per KV head)",
              paper_default="max over the group's query heads (kvpress, the authors' code)", choices=("mean", "max",
                                                                                                      "sum")),
        Param("alloc", "choice", "head", "how the budget is spread: head = budget entries per KV head (the cache "
              "stores each layer as wide as its widest KV head, so this keeps it at the budget); layer = budget x "
              "n_head_kv per "
              "layer over its KV heads (kvpress layerwise=True); global = budget x n_head_kv x n_layer over all "
              "(kvpress's default: heads and layers keep different counts; in memory each layer is as wide as its "
              "widest KV head, the .kvc file holds the live entries only)",
              paper_default="global (kvpress layerwise=False; the paper's non-uniform head budgets)",
              choices=("head", "layer", "global")),
        Param("repeat_chunk", "int", REPEAT_CHUNK, "prompt tokens fed again per reconstruction pass (each pass holds "
                                                   "the "
              "prompt + this many cells + the instruction; fewer when the context has less room)",
              paper_default="2048 (kvpress chunk_size; the authors' code 2K)", min=16, max=1 << 20),
    ),
    needs=("colmax",),
    second_pass=RECONSTRUCTION,
    agnostic=True,
    check=_check,
    widest=widest,
    resolved_away=("repeat_chunk",),
    budget_note="sinks and recent count inside the budget; alloc=head keeps budget per layer and KV head, "
                "alloc=layer/global keep budget x n_head_kv per layer / budget x n_head_kv x n_layer in total, "
                "different counts per KV head (in memory each layer is as wide as its widest KV head; a .kvc file "
                "leaves the dead entries out)",
    deviations=(
        "the reconstruction scores are the softmax over every entry the reconstruction query sees (the whole "
        "prompt and the reconstruction tokens before it); kvpress scores with a softmax over the sinks, the chunk "
        "being repeated and the reconstruction tokens only (the same for a prompt of one chunk, except for "
        "template tokens after the sinks, which kvpress never scores)",
        "the whole prompt is fed again (kvcli does not know where the template's head ends; kvpress repeats the "
        "context after it and scores those head tokens 0): head tokens are scored like any other",
        "the instruction is plain text appended after kvcli's prompt, which already opened the assistant turn; "
        "kvpress appends it inside the user turn and closes it with the template's assistant header",
        "budget per KV head by default (alloc=head); kvpress's default (alloc=global) spreads it unevenly over "
        "heads and layers, which a cache of equal-width cells pays for with its widest head. With alloc=global "
        "kvcli answers what kvpress's pipeline answers; per KV head it answered 7-8 points more (qwen2.5-coder-0.5b, "
        "8k tokens, budget 1024, 60 questions compressed once; docs/results.md); on real text (14 corpus documents, "
        "docs/results/real-text.md) the questions did not separate them and alloc=global was closer to the full "
        "cache (KL 0.016 vs 0.058) while holding 31-45% more bytes",
        "bounded reading (--chunk N, --max-cache, or a prompt longer than the context; not by default) runs the "
        "reconstruction pass chunk by chunk over that chunk only, scoring the kept entries and the chunk; a kept "
        "entry keeps the larger of its "
        "earlier maximum and the new one. The one-prefill pass scores every entry with the passes over the whole "
        "prompt (later chunks' passes see every earlier entry); bounded, an entry dropped at one chunk is never "
        "scored by later passes, and each pass's softmax runs over the kept entries + the chunk (closer to kvpress, "
        "whose softmax covers the sinks, the chunk repeated and the reconstruction tokens only)",
        "models with sliding-window layers (gemma2, gemma3) are refused, as kvpress refuses Gemma 3: llama.cpp's "
        "window cache cannot be rolled back past a reconstruction pass longer than its spare cells",
        "scores combined in float64 from the engine's float32 maxima; ties go to the lower (layer, head, slot)",
    ),
)
