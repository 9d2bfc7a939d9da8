"""compresskv: SnapKV scored by each layer's semantic retrieval heads, error-aware layer budgets (Lin et al.).

Calibration (which heads, the per-layer error profile) comes from `kvcli calibrate compresskv`
and reaches the planners as two list parameters, `srh` and `layer_scores`; without them the
planner falls back to all-head scoring and uniform budgets (the caller warns about it).
"""
from __future__ import annotations

from kvcli.errors import KvcliError
from kvcli.policies.base import Paper, Param, PolicySpec, kernel_param, pool_param, window_param


def round_half_even(x: float) -> int:
    """numpy.round / C's nearbyint under the default rounding mode (the authors' code uses np.round)."""
    return int(round(x))  # Python's round() is half-to-even on floats


def allocate(scores, budget: int, min_budget: int = 32, max_factor: int = 3, mode: str = "paper") -> list[int]:
    """Per-layer budgets (window included) from the normalised error profile: Algorithm 1 of the paper.

    B_i = clip(m + round(e_i * (B*n - m*n)), m, M), M = max_factor * B, then the difference to B*n is
    handed out one unit at a time: mode "paper" gives each unit to the argmax (argmin when taking back)
    of e_i among the layers that can still move (lowest index on ties); "round_robin" (the authors'
    code) walks the movable layers in order of e (descending to give, ascending to take), one unit each.
    """
    n = len(scores)
    m = min(min_budget, budget)
    M = max_factor * budget
    total = budget * n
    R = total - m * n
    b = [min(max(m + round_half_even(e * R), m), M) for e in scores]
    d = total - sum(b)
    while d != 0:
        if d > 0:
            cand = [i for i in range(n) if b[i] < M]
        else:
            cand = [i for i in range(n) if b[i] > m]
        if not cand:
            break
        if mode == "paper":
            j = max(cand, key=lambda i: (scores[i], -i)) if d > 0 else min(cand, key=lambda i: (scores[i], i))
            b[j] += 1 if d > 0 else -1
            d += -1 if d > 0 else 1
            continue
        cand.sort(key=lambda i: -scores[i] if d > 0 else scores[i])   # stable: lower layer first on ties
        for i in cand:
            if d == 0:
                break
            b[i] += 1 if d > 0 else -1
            d += -1 if d > 0 else 1
    return b


def layer_budgets(p: dict, budget: int, n_layer: int) -> list[int]:
    """Per-layer budgets (window included): Algorithm 1 over the calibration's layer_scores, or uniform."""
    scores = p["layer_scores"]
    if not scores:
        return [budget] * n_layer
    if len(scores) != n_layer:
        raise KvcliError(f"policy 'compresskv': layer_scores has {len(scores)} values, the observation has "
                         f"{n_layer} layers")
    return allocate(scores, budget, p["min_budget"], p["max_factor"], p["allocator"])


def widest(p: dict, n_layer: int, n: int, budget: int) -> int | None:
    """Entries the widest layer keeps of n > budget: its calibrated budget B_l (window included), or all n where
    B_l >= n (None for a calibration of another layer count: the planner refuses it)."""
    if p["layer_scores"] and len(p["layer_scores"]) != n_layer:
        return None
    w = p["window"]
    return max(n if n <= b else max(0, b - w) + w for b in layer_budgets(p, budget, n_layer))


def _check(p: dict, budget: int) -> None:
    if p["layer_scores"]:
        s = sum(p["layer_scores"])
        if abs(s - 1.0) > 1e-3:
            raise KvcliError(f"policy 'compresskv': layer_scores must sum to 1 (they sum to {s:.6g})")


SPEC = PolicySpec(
    name="compresskv",
    summary="SnapKV scored by each layer's semantic retrieval heads, with error-aware layer budgets",
    keeps="per layer: the window plus the B_l - window prefix slots with the highest pooled window attention of "
          "the layer's top `srh_k` semantic retrieval heads (one set shared by all KV heads); B_l from the "
          "offline error profile (Algorithm 1)",
    paper=Paper("CompressKV: Semantic Retrieval Heads Know What Tokens Are Not Important Before Generation",
                arxiv="2508.02401", code="github.com/TUDa-HWAI/CompressKV"),
    params=(
        window_param(8, 8),
        kernel_param(5, 5),
        pool_param("avg", "avg"),
        Param("srh_k", "int", 4, "semantic retrieval heads per layer that score the tokens", paper_default=4,
              min=1, max=4096),
        Param("srh", "ints", (), "calibration: query-head ids, srh_k per layer, layer by layer (best first); "
              "empty = every query head scores (SnapKV-style fallback)",
              paper_default="found offline on needle-in-a-haystack probes", min=0, max=65535),
        Param("layer_scores", "floats", (), "calibration: normalised per-layer compression error (n_layer values "
              "summing to 1); empty = uniform budgets", paper_default="offline error profile at 32 tokens/layer",
              min=0.0, max=1.0),
        Param("allocator", "choice", "paper", "paper: Algorithm 1 (leftover units to the argmax/argmin layer); "
              "round_robin: the authors' code (leftover units spread one each by importance)",
              paper_default="paper", choices=("paper", "round_robin")),
        Param("min_budget", "int", 32, "m, the smallest layer budget (capped at the budget)", paper_default=32,
              min=1, max=1 << 20),
        Param("max_factor", "int", 3, "M = max_factor x budget, the largest layer budget", paper_default=3,
              min=1, max=100),
    ),
    needs=("window",),
    window_param="window",
    budget_above="window",
    schedule=lambda p, budget, n_layer, n: {"layer_budgets": layer_budgets(p, budget, n_layer)},
    resolved_away=("layer_scores", "allocator", "min_budget", "max_factor"),
    budget_note="layer budgets (window included) sum to budget x n_layer (Algorithm 1); a layer whose budget "
                "exceeds the prompt keeps the whole prompt and the difference is not handed to other layers",
    deviations=(
        "window attention summed in float64 and pooled per SRH head, then averaged over the SRH heads in "
        "calibration order (the code sums in fp16/bf16); ties go to the lower slot",
        "without calibration (srh / layer_scores empty) every query head scores and budgets are uniform; the "
        "paper always has calibration",
        "min_budget is capped at the budget so tiny budgets stay feasible (the paper uses m = 32 with budgets >= 128)",
        "a prompt no longer than the budget is kept whole in every layer (kvcli's rule for all policies); the code "
        "compares each layer's own B_l with the prompt, so a short prompt can still be cut in low-budget layers",
    ),
    check=_check,
    widest=widest,
    model_args="kvcli.calibration.lookup:policy_args",   # its offline calibration, found for the model (numpy only)
    calibrate="kvcli.calibration.command",               # kvcli calibrate compresskv / show
)
