"""tova: the entries the last prompt query attends to most (Oren et al. 2024; kvpress TOVAPress)."""
from kvcli.policies.base import Paper, Param, PolicySpec, window_param

SPEC = PolicySpec(
    name="tova",
    summary="top entries by the attention of the last prompt token, averaged over the layer's heads",
    keeps="per layer: the (budget - window) prefix slots the last `window` prompt queries (1: the last token alone) "
          "attend to most, their attention averaged over every query head of the layer (gqa=layer: the same slots in "
          "each KV head) or over the heads of each KV head's group (gqa=mean|max|sum), plus the last `window` slots",
    paper=Paper("Transformers are Multi-State RNNs", arxiv="2401.06104", venue="EMNLP 2024",
                code="github.com/schwartz-lab-NLP/TOVA; kvpress TOVAPress (NVIDIA/kvpress)"),
    params=(
        window_param(1, "1 (the last token: TOVA, kvpress TOVAPress)",
                     doc="the last `window` prompt queries score the others (their attention summed) and are always "
                         "kept; 1 is TOVA's last token"),
        Param("gqa", "choice", "layer", "how the attention of the query heads is combined: layer = the mean over "
              "every query head of the layer, the same score (and slots) for each KV head; mean|max|sum = over the "
              "query heads of each KV head's group, selection per KV head",
              paper_default="layer (TOVA and kvpress average over all heads)", choices=("layer", "mean", "max", "sum")),
    ),
    needs=("window",),
    window_param="window",
    budget_above="window",
    deviations=(
        "prefill-time one-shot, as kvpress's TOVAPress: the paper evicts one token at every decoding step (a cache "
        "of fixed size); kvcli scores once from the prompt's last query and then appends",
        "the last token is kept by rule (kvpress pads its score with the maximum + 1; TOVA does not enforce it); "
        "window=N scores by the attention of the last N queries summed and keeps those N slots",
        "attention summed in float64 from the engine's float32 window sums; ties go to the lower slot",
        "budget = entries per KV head (kvpress: a fraction removed, the same count per KV head)",
    ),
)
