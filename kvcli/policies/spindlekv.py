"""spindlekv: window-attention eviction with a linear depth schedule, then a per-request similarity
codebook whose groups are merged into single cells (Tang et al., SpindleKV).
Digest: docs/design/methods/spindlekv.md.

How kvcli stores the codebook (the cheap honest route within the plan format): the kept entries of a
(layer, KV head) whose keys share a key-codebook row become ONE cell with a log-multiplicity bias
log(count); its K is the codebook row (the exemplar's unit key) scaled by the group's mean magnitude,
its V the mean of the group's values (each value first rebuilt from the value codebook, as the paper
stores it). Under the one approximation "every member's key equals the shared key", the attention
the cell receives equals the sum of its members' and its output the members' mean value: exact
softmax algebra, so the cache really shrinks by (kept entries - codebook rows).

`layer_keep` is the linear schedule (Eq. 5-6) in plain Python floats: the torch planner calls it and
the native planner receives its result (`layer_keep`, PolicySpec.schedule).
"""
from __future__ import annotations

import math

from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param, kernel_param, pool_param, window_param


def layer_keep(n_layer: int, n: int, budget: int, window: int, beta: float, low_budget: str) -> list[int]:
    """Context (non-window) entries each layer keeps per KV head, Eq. 5-6 with the digest's fixes.

    r_c = (budget - window) / (n - window); alpha = (1 + beta) / 2;
    r_c > alpha:        r_c(0) = 1,            r_c(L-1) = 2 r_c - 1   (the printed 1 - 2 r_c is a typo)
    beta < r_c <= alpha: r_c(0) = 2 r_c - beta, r_c(L-1) = beta
    r_c <= beta (undefined in the paper): uniform r_c, or shrink beta to r_c / 2
    r_c(l) linear in l (a one-layer model keeps r_c); k_l = floor(r_c(l) * (n - window)).
    """
    lc = n - window
    rc = (budget - window) / lc
    alpha = (1.0 + beta) / 2.0
    if rc > alpha:
        r0, rm = 1.0, 2.0 * rc - 1.0
    elif rc > beta:
        r0, rm = 2.0 * rc - beta, beta
    elif low_budget == "shrink":
        b = rc / 2.0
        r0, rm = 2.0 * rc - b, b
    else:
        r0, rm = rc, rc
    out = []
    for l in range(n_layer):
        r = rc if n_layer == 1 else r0 + ((rm - r0) * l) / (n_layer - 1)   # one layer: no line, just r_c
        out.append(min(lc, max(0, math.floor(r * lc))))
    return out


def widest(p: dict, n_layer: int, n: int, budget: int) -> int | None:
    """Entries the widest layer keeps of n > budget when no key merges (theta_k >= 1); None otherwise: how
    much the codebook merges depends on the keys."""
    if p["theta_k"] < 1.0:
        return None
    w = p["window"]
    return max(layer_keep(n_layer, n, budget, w, p["beta"], p["low_budget"])) + w



def _schedule(p: dict, budget: int, n_layer: int, n: int) -> dict:
    """For the native planner; a prompt that fits the budget is kept whole and needs none (layer_keep
    divides by n - window)."""
    return {"layer_keep": layer_keep(n_layer, n, budget, p["window"], p["beta"], p["low_budget"]) if n > budget
            else ()}


SPEC = PolicySpec(
    name="spindlekv",
    summary="window-attention eviction with a linear depth schedule + similarity codebook, merged cells",
    keeps="per layer l: the window plus k_l context entries per KV head by window attention (k_l linear in depth, "
          "Eq. 5-6: shallow layers keep more); then the kept keys of each (layer, KV head) are covered by a "
          "greedy codebook (cos > theta_k, Algorithm 1) and each codebook group becomes one cell with bias "
          "log(count): K = codebook row x mean magnitude, V = mean of the members' values (rebuilt from the "
          "value codebook, cos > theta_v)",
    paper=Paper("SpindleKV: A Novel KV Cache Reduction Method Balancing Both Shallow and Deep Layers",
                code="github.com/tyxqc/SpindleKV"),
    params=(
        window_param(8, "not given (guess: 8, PyramidKV's scripts)"),
        kernel_param(1, "none (no pooling in the equations)"),
        pool_param("max", "none"),
        Param("score_norm", "choice", "window", "window: window attention summed over the window queries "
              "(SnapKV, the prose); causal_count: the literal Eq. 2, each slot's sum divided by (n - slot)",
              paper_default="ambiguous (Eq. 2 divides by l - a)", choices=("window", "causal_count")),
        Param("beta", "float", 0.05, "smallest per-layer context keep ratio (deepest layer), also the 0.05 of "
              "Eq. 5; alpha = (1 + beta) / 2", paper_default=0.05, min=0.0, max=0.5),
        Param("low_budget", "choice", "uniform", "what to do when r_c <= beta (undefined in the paper, e.g. "
              "budget 256 on 8k tokens): uniform r_c in every layer, or shrink beta to r_c/2 and keep the line",
              paper_default="undefined", choices=("uniform", "shrink")),
        Param("theta_k", "float", 0.98, "key codebook threshold: a key joins an exemplar's group when their "
              "cosine similarity is > theta_k (1 = no key codebook: nothing merges)", paper_default=0.98,
              min=-1.0, max=1.0),
        Param("theta_v", "float", 0.95, "value codebook threshold (cos > theta_v); 1 = values kept exact",
              paper_default=0.95, min=-1.0, max=1.0),
        Param("k_scale", "choice", "mean", "magnitude of a merged cell's key: mean = the members' mean norm times "
              "the codebook row; exemplar = the exemplar's own (raw) key", paper_default="each member keeps its "
              "own magnitude (impossible once merged)", choices=("mean", "exemplar")),
        Param("codebook_layers", "int", 0, "codebook (and merging) only in the first N layers; 0 = every layer "
              "(the threshold itself makes it bite mainly in shallow layers)", paper_default="all layers "
              "(inferred)", min=0, max=65536),
        Param("fill_heads", "choice", "widest", "widest: in a codebook layer, a KV head whose codebook merged more "
              "than the layer's widest head keeps its next-best context entries (by score, unmerged) up to that "
              "head's count, so the layer's memory (the native cache stores each layer as wide as its widest KV "
              "head) holds live entries, not dead slots; off: every head keeps only its codebook cells",
              paper_default="off (the paper stores a codebook and per-entry indices, not cells)",
              choices=("widest", "off")),
        gqa_param("mean"),
    ),
    needs=("window", "kv"),
    window_param="window",
    budget_note="the budget is the eviction-stage budget (r = budget / n, window included, Eq. 5-6; floors make "
                "the layers sum to at most budget x n_layer); the codebook then merges entries, so the cache "
                "ends up smaller by a data-dependent amount that cannot be set in advance: read the achieved "
                "ratio from kv_bytes / kv_bytes_full. The native cache stores each layer as wide as its own widest KV "
                "head (the ragged layout), so the codebook saves bytes where it narrows a layer's widest head; its "
                "KV heads merge different counts, and with fill_heads=widest (the default) the heads that merged "
                "more keep their next-best entries in the slots the layer holds anyway (fill_heads=off: dead slots, "
                "held / live 1.10-1.14 on qwen2.5-coder-0.5b, benchmarks/layout.py)",
    deviations=(
        "storage: instead of a codebook plus a per-entry (index, magnitude, position) rebuilt in the graph, each "
        "key-codebook group of a (layer, KV head) becomes one cell with bias log(count). This approximates every "
        "member's key by the shared row x the group's mean magnitude (the members lie within cos > theta_k of "
        "it); its value is the mean of the members' values (exact given equal keys). The value codebook saves "
        "no further memory in this storage; it only reproduces the paper's value quantisation (theta_v=1 "
        "turns it off)",
        "the key codebook is built on the cached post-RoPE keys: a merged cell must stand for its members at "
        "their own positions, which pre-RoPE similarity (the paper's) does not guarantee",
        "selection per KV head with the window scores of the group's query heads combined by `gqa` (mean: the "
        "paper's 'w/o repeat' ablation, Eq. 3); the paper's default repeats K/V to every query head and "
        "relies on the codebook to deduplicate the copies",
        "codebook scope: one key and one value codebook per (layer, KV head), over that head's kept entries "
        "(window included); the paper's scope is ambiguous (head or layer)",
        "the codebook also grows during decoding in the paper; kvcli appends generated tokens uncompressed",
        "fill_heads=widest (default): a KV head whose codebook merged more than its layer's widest head keeps its "
        "next-best context entries unmerged up to that head's count (the layer's memory is its widest head's in "
        "kvcli's cache; the paper's codebook storage has no such padding)",
        "window attention summed in float64; cosine similarities in float64 from the float32 rows; ties (top-k "
        "and the greedy cover's maximum degree) go to the lower slot",
    ),
    budget_above="window",
    schedule=_schedule,
    resolved_away=("beta", "low_budget"),
    widest=widest,
)
