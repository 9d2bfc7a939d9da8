"""Policy notes shown by `kvcli policies --explain` that concern how the drivers use a policy."""
from __future__ import annotations


def chunked_note(spec) -> str:
    """What a policy keeps across chunks (for `kvcli policies --explain`)."""
    if "query" in spec.needs:
        return ("Chunked prefill (--chunk N, or automatic when the document does not fit the context or --max-cache; "
                "bounded reading does not turn on by itself for it above 64 MiB of full cache, as it does for the "
                "other policies: its measured quality is the one-prefill scores'): after every chunk the statistics "
                "(mean and covariance) of that chunk's last `window` queries, the most recent ones as the last "
                "`window` prompt queries are in one prefill (all of a chunk shorter than the window), turned by the "
                "average rotation of the n_future positions after the chunk, score every held entry (the kept ones "
                "and the chunk's); the policy plans over them to the same budget, and their positions are re-indexed "
                "to B-k..B-1 per layer and KV head (right-aligned, K re-rotated). Nothing is carried across chunks "
                "but the kept entries: each step's statistics re-score everything held. The last chunk holds the "
                "prompt's end, so the last compression is the one-prefill policy over what was kept.")
    if "colmax" in spec.needs:
        return ("Chunked prefill (--chunk N, or automatic when the document does not fit the context or --max-cache; "
                "bounded reading does not turn on by itself for it above 64 MiB of full cache, as it does for the "
                "other policies: its measured quality is the one-prefill pass's): after every chunk the reconstruction "
                "pass runs over that chunk only ('repeat the previous context' and the chunk's tokens again, a chunk "
                "after the first introduced by the 8 tokens before it, in passes of repeat_chunk), scoring every held "
                "entry (the kept ones and the chunk's) by the largest attention its queries give it, then rolled "
                "back; the "
                "policy plans over the kept entries + the chunk, to the same budget, and their positions are "
                "re-indexed to B-k..B-1 per layer and KV head (right-aligned, K re-rotated). Carried across chunks: a "
                "kept entry's score is the larger of the maximum it carries from earlier chunks' passes and the new "
                "chunk's (the one-prefill pass's maximum over all passes, over the passes that ran while the entry "
                "was held: old entries compete with the new chunk on their best reconstruction score, not only on "
                "the new chunk's queries, which look mostly at the chunk they repeat). The cache holds at most "
                "budget + chunk + one pass (min(repeat_chunk, chunk) + the ~20-token instruction) cells; the pass's "
                "seconds are reconstruct_s in the stats.")
    if spec.name == "full":
        return ("Chunked prefill: not available (full keeps every token, so a document longer than the context "
                "cannot be read; choose a compressing policy).")
    carried = {
        "streamingllm": "the sinks and the most recent entries: StreamingLLM's own streaming form",
        "h2o": "column sums (the attention every entry received) are accumulated across chunks: a kept entry "
               "carries its score from earlier chunks and adds the new chunk's queries' attention, H2O's "
               "cumulative heavy hitters",
        "d2o": "accumulated column sums as in h2o; evicted entries are merged into kept ones at every chunk; "
               "merged entries keep their log-multiplicity bias and can be merged into again",
        "spindlekv": "every chunk re-runs the selection; codebook rows made at an earlier chunk are entries like "
                     "any other (their bias is kept) and may be replaced again",
        "windowkv": "the task is classified once from the instruction; every step's window re-scores the "
                    "held sentences/windows and the chunk's own",
        "pyramidkv": "the layer schedule is applied at every chunk; the widest layer keeps more than the budget, "
                     "so chunks shrink to keep the cache within budget + chunk",
        "dynamickv": "the per-layer budgets are recomputed at every chunk from that step's window",
        "compresskv": "the calibrated layer budgets and the semantic-retrieval heads' window scores at every chunk",
    }.get(spec.name, "only the kept entries: every step's window re-scores everything held")
    window = ("the chunk's queries (column sums of all of them)" if "colsum" in spec.needs else
              "the question: the prompt's last window, prefilled after the chunk and rolled back "
              "(--chunk-scoring question, the default; 'chunk' observes the chunk's own last window)"
              if "window" in spec.needs else "positions only")
    return ("Chunked prefill (--chunk N, automatic when the document does not fit the context or --max-cache): "
            "after every chunk the policy plans over the kept entries + the chunk, to the same budget, observing "
            f"{window}; the kept entries' positions are re-indexed to B-k..B-1 per layer and KV head (right-aligned, "
            "K re-rotated). "
            f"Carried across chunks: {carried}. The last chunk holds the question, so the last compression is the "
            "one-prefill policy on the question's window.")
