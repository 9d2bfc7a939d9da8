"""Options several commands share."""
from __future__ import annotations

import click

model_option = click.option("--model", "-m", metavar="PATH.gguf", default=None,
                            help="GGUF model (llama architecture). Default: $KVCLI_MODEL, else the bundled "
                                 "SmolLM2-135M-Instruct Q4_1.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
threads_option = click.option("--threads", type=click.IntRange(1, 1024), default=None,
                              help="CPU threads of llama.cpp. Default: $KVCLI_THREADS, else the CPUs this process "
                                   "may use (affinity, cgroup quota). On a busy machine fewer threads are faster: "
                                   "ggml's threads spin at every node while one waits for a core.")


def chunk_options(f):
    """--chunk / --max-cache: documents longer than the context are read in chunks (kvcli/chunked.py)."""
    f = click.option("--max-cache", type=click.IntRange(1), default=None, metavar="CELLS",
                     help="Most cells the KV cache may hold; a longer document is read in chunks and compressed "
                          "after each.")(f)
    f = click.option("--chunk", type=click.IntRange(0), default=None, metavar="N",
                     help="Read the document in chunks of N tokens, compressing to --budget after each and "
                          "re-indexing positions (peak cache: budget + N). Default: on, with 1024, when the "
                          "document does not fit the model's context or --max-cache; 0 = off.")(f)
    f = chunk_scoring_option(f)
    return f


chunk_scoring_option = click.option(
    "--chunk-scoring", type=click.Choice(["question", "chunk"]), default="question", show_default=True,
    help="For a document read in chunks, the queries that score each chunk (window policies): 'question' = the "
         "prompt's last window (the question), prefilled after the chunk and rolled back, as FINCH does; "
         "'chunk' = the chunk's own last window.")
