"""d2o: variance-based layer budgets, H2O-style eviction per KV head, evicted entries merged into
their most similar kept key (Wan et al., D2O). Digest: docs/design/methods/d2o.md.

The layer schedule (`layer_weights`, `layer_budgets`) is plain Python float arithmetic shared by the
torch planner; native/src/policies/d2o.cpp performs the same IEEE operations in the same order
(exp from the same libm), so both engines give the same integer budgets. Unlike the closed-form
schedules of the other policies it cannot be handed to the native planner: its weights come from the
observation the planner reads (docs/internals.md, "Policies").
"""
from __future__ import annotations

import math

from kvcli.errors import KvcliError
from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param

SIGMA2_FLOOR = 1e-12   # a layer whose column sums are all equal would divide by zero


def layer_weights(sigma2: list[float], head_var: list[list[float]], allocation: str) -> list[float]:
    """Un-normalised share of each layer: sigma2[l] is the mean over query heads of the population
    variance of layer l's column sums; head_var[l][q] the per-head variances (for allocation=code)."""
    L = len(sigma2)
    if allocation == "uniform":
        return [1.0] * L
    if allocation == "inv_var":                      # Table 4 "reciprocal of variance"
        return [1.0 / max(s, SIGMA2_FLOOR) for s in sigma2]
    if allocation == "softmax_inv_var":              # Eq. 16 (paper): softmax over layers of 1/sigma2
        x = [1.0 / max(s, SIGMA2_FLOOR) for s in sigma2]
    elif allocation == "exp_decay":                  # Table 4: softmax of -sigma2
        x = [-s for s in sigma2]
    elif allocation == "code":   # authors' code: softmax(-v), v = mean of min-max-normalised head variances
        x = []
        for hv in head_var:
            lo, hi = min(hv), max(hv)
            acc = 0.0
            for v in hv:
                acc = acc + ((v - lo) / (hi - lo) if hi > lo else 0.0)
            x.append(-(acc / len(hv)))
    else:  # pragma: no cover - registry bug
        raise AssertionError(allocation)
    m = max(x)
    return [math.exp(v - m) for v in x]


def layer_budgets(weights: list[float], total: int, lo: int, hi: int) -> list[int]:
    """Integer budgets in [lo, hi] summing to `total` (lo*L <= total <= hi*L), proportional to weights.

    Water-filling: shares above hi (then below lo) are pinned and the rest is shared again among the
    free layers; the real shares are floored and the remaining units go to the largest fractional
    parts (lower layer first on ties). D2O's paper does not say how to clamp or round (digest §2.4).
    """
    L = len(weights)
    fixed: list[int | None] = [None] * L
    x = [0.0] * L
    while True:
        free = [l for l in range(L) if fixed[l] is None]
        if not free:
            break
        rem = total - sum(v for v in fixed if v is not None)
        asum = 0.0
        for l in free:
            asum = asum + weights[l]
        for l in free:
            x[l] = (rem * weights[l]) / asum if asum > 0.0 else rem / len(free)
        over = [l for l in free if x[l] > hi]
        if over:
            for l in over:
                fixed[l] = hi
            continue
        under = [l for l in free if x[l] < lo]
        if under:
            for l in under:
                fixed[l] = lo
            continue
        break
    out = [0] * L
    frac = [0.0] * L
    for l in range(L):
        if fixed[l] is not None:
            out[l] = fixed[l]
        else:
            out[l] = math.floor(x[l])
            frac[l] = x[l] - out[l]
    free = [l for l in range(L) if fixed[l] is None]
    rest = total - sum(out)
    while rest > 0:                                  # float rounding can leave any small remainder
        moved = False
        for l in sorted(free, key=lambda i: (-frac[i], i)):
            if rest > 0 and out[l] < hi:
                out[l] += 1
                rest -= 1
                moved = True
        if not moved:
            break
    while rest < 0:
        moved = False
        for l in sorted(free, key=lambda i: (frac[i], i)):
            if rest < 0 and out[l] > lo:
                out[l] -= 1
                rest += 1
                moved = True
        if not moved:
            break
    return out


def split(capacity: int, heavy: int, recent: int) -> int:
    """Recent-window size M of a layer with C entries: C * recent / (heavy + recent) rounded half up, >= 1."""
    s = heavy + recent
    return min(capacity, max(1, (2 * capacity * recent + s) // (2 * s)))


def floor_entries(n: int, min_frac: float, budget: int) -> int:
    """Smallest per-layer budget: ceil(min_frac * n), at least 1, at most the budget."""
    return min(budget, max(1, math.ceil(min_frac * n)))


def full_layer_set(full_layers, n_layer: int) -> list[int]:
    """Layers kept uncompressed (negative = from the end), validated against the model."""
    out = set()
    for x in full_layers:
        l = x + n_layer if x < 0 else x
        if l < 0 or l >= n_layer:
            raise KvcliError(f"policy 'd2o': full_layers item {x} is outside the model's {n_layer} layers")
        out.add(l)
    if len(out) == n_layer:
        raise KvcliError("policy 'd2o': full_layers lists every layer; nothing would be compressed")
    return sorted(out)


def model_check(p: dict, info) -> None:
    """full_layers checked against the model's layers before it loads."""
    if p["full_layers"]:
        full_layer_set(p["full_layers"], info.n_layer)


def widest(p: dict, n_layer: int, n: int, budget: int) -> int | None:
    """A layer in full_layers keeps all n entries; without one, the variance of the scores sets the widest."""
    return n if full_layer_set(p["full_layers"], n_layer) else None


def _check(p: dict, budget: int) -> None:
    if p["heavy"] + p["recent"] < 1:
        raise KvcliError("policy 'd2o': heavy + recent must be >= 1")


SPEC = PolicySpec(
    name="d2o",
    summary="variance-based layer budgets, heavy hitters + recent per KV head, evicted keys merged into the nearest "
            "kept key",
    keeps="per layer l: C_l entries per KV head (C_l from the variance of the layer's accumulated attention, "
          "summing to budget x n_layer): the first `sinks` slots that receive attention, the top heavy hitters by "
          "accumulated "
          "attention (colsum) and the last M_l slots (N:M = heavy:recent); each evicted entry whose key has "
          "cosine similarity >= tau with its most similar kept key is merged into it (weighted average of K "
          "and V, written as a replacement row); the others are dropped",
    paper=Paper("D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of Large Language "
                "Models", arxiv="2406.13035", venue="ICLR 2025", code="github.com/AIoT-MLSys-Lab/D2O"),
    params=(
        Param("allocation", "choice", "softmax_inv_var",
              "layer budgets from sigma2_l = mean over query heads of the variance of the layer's column sums: "
              "softmax_inv_var = softmax(1/sigma2) (Eq. 16); inv_var = (1/sigma2)/sum; exp_decay = softmax(-sigma2); "
              "uniform; code = softmax(-v), v = mean over heads of min-max-normalised head variances (authors' code)",
              paper_default="softmax_inv_var (code: code)",
              choices=("softmax_inv_var", "inv_var", "exp_decay", "uniform", "code")),
        Param("heavy", "int", 3, "N of the N:M split of each layer's budget between heavy hitters (sinks "
              "included) and the recent window", paper_default="3 (code scripts: 1)", min=0, max=1000),
        Param("recent", "int", 1, "M of the N:M split (recent window M_l = C_l*M/(N+M), rounded half up, >= 1)",
              paper_default="1 (code scripts: 1)", min=0, max=1000),
        Param("sinks", "int", 4, "first slots always kept (those that receive attention: a re-indexed compaction's "
                                 "dead padding "
              "comes first and is skipped), counted inside the heavy hitters",
              paper_default="not stated (code: 4)", min=0, max=4096),
        Param("merge", "choice", "paper", "paper: k_c <- (e*k_c + sum exp(u_i) k_i) / (e + sum exp(u_i)), V with "
              "the same weights (Eq. 11-12); code: k_c <- (k_c + sum u_i k_i)/(1 + n_c) (authors' scatter mean, "
              "V alike); none: evicted entries are dropped", paper_default="paper",
              choices=("paper", "code", "none")),
        Param("tau", "choice", "head", "merge threshold = mean of the evicted entries' best similarity, over "
              "each KV head (head) or over every KV head of the layer (layer, the code's scalar per layer)",
              paper_default="head (code: layer)", choices=("head", "layer")),
        Param("min_frac", "float", 0.01, "smallest layer budget as a fraction of the prompt (and at least 1, "
              "at most the budget)", paper_default="not stated (code: ratio clamped to [0.01, 1])",
              min=0.0, max=1.0),
        Param("full_layers", "ints", (), "layers kept uncompressed (negative counts from the end); the others "
              "share budget x their count", paper_default="none (code: 0,1,-1)", min=-65536, max=65535),
        gqa_param("mean"),
    ),
    needs=("colsum", "kv"),
    budget_note="layer budgets C_l sum to budget x (number of compressed layers); a layer's share is clamped "
                "to [ceil(min_frac x n), n] and the excess shared among the other layers; layers listed in "
                "full_layers keep the whole prompt on top of that. In the native cache every layer holds as many "
                "cells as "
                "the widest layer (llama.cpp's cells are shared by all layers), so the bytes follow max C_l, not "
                "the mean",
    deviations=(
        "prefill only: the paper also evicts and merges at every decoding step (EMA threshold with beta = 0.7); "
        "kvcli compresses once after the prompt and then appends every generated token uncompressed, so the "
        "threshold is the paper's first-step value (the mean of the best similarities) and beta has no role",
        "selection and merging per KV head, the column sums of a group's query heads combined by `gqa` (mean); "
        "the authors' code repeats K/V to every query head before caching (g x the memory)",
        "sigma2_l is the population variance of each query head's column sums, averaged over the layer's heads "
        "(the paper leaves heads out; the code's unbiased variance makes no difference after its min-max "
        "normalisation); colsum comes from the engine's observation (float32), statistics in float64",
        "per-layer shares are clamped to [ceil(min_frac x n), n] and the excess is redistributed (the code clamps "
        "the ratio to [0.01, 1] without redistributing); rounding: floor then largest remainders",
        "merge targets are all kept entries, sinks and recent window included (as the code); similarity is the "
        "cosine of the cached (post-RoPE) keys, 0 for a zero key; ties go to the lower kept slot",
        "merge=code applies the code's scatter mean of u_i*x_i to V as well; its per-slot-index merge decision "
        "shared across heads (a code artefact) is not reproduced",
        "the compression happens after the prefill, not at the first decoding step with that step's attention "
        "row added (the code)",
    ),
    check=_check,
    model_check=model_check,
    widest=widest,
)
