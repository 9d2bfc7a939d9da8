"""streamingllm: attention sinks + the most recent tokens (Xiao et al.)."""
from kvcli.policies.base import Paper, Param, PolicySpec

SPEC = PolicySpec(
    name="streamingllm",
    summary="attention sinks (first tokens) + the most recent tokens",
    keeps="the first `sinks` slots and the last (budget - sinks) slots, the same in every layer and head",
    paper=Paper("Efficient Streaming Language Models with Attention Sinks", arxiv="2309.17453", venue="ICLR 2024",
                code="github.com/mit-han-lab/streaming-llm"),
    params=(Param("sinks", "int", 4, "initial tokens always kept (attention sinks)", paper_default=4, min=0,
                  max=4096),),
    deviations=(
        "prefill-time only, as KVCache-Factory and kvpress use it as a baseline: the paper evicts while "
        "streaming during decoding, kvcli compresses the prompt once and then appends",
        "no key re-rotation: kept keys keep their original RoPE positions (kvpress's default; the paper "
        "re-numbers positions inside the cache)",
    ),
    budget_above="sinks",
)
