"""pyramidkv: SnapKV selection with pyramid-shaped per-layer budgets (Cai et al., KVCache-Factory)."""
from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param, kernel_param, pool_param, \
    window_param


def layer_budgets(n_layer: int, n: int, budget: int, window: int, beta: int, schedule: str = "exact") -> list[int]:
    """Prefix entries each layer selects (the `window` last slots come on top).

    base = budget - window; min = base // beta; max = 2*base - min, capped to n - window; the line
    from max (layer 0) down to min (last layer). `schedule="exact"` (the default) rounds it so the
    layers sum to exactly n_layer * base (largest remainders, lower layer first): the mean is the
    budget. `schedule="factory"` is KVCache-Factory's integer rule, layer l gets
    max - l * ((max - min) // (n_layer - 1)): the floored step makes the line fall too slowly, so the
    layers keep more than the budget (mean 140.5 at budget 128 on 30 layers, see SPEC.budget_note).
    Prompts shorter than 2*base use SnapKV's uniform `base` (KVCache-Factory's middle branch).
    The caller handles n <= budget (no compression).
    """
    base = budget - window
    min_num = base // beta
    max_num = 2 * base - min_num
    if max_num >= n - window:
        max_num = n - window
        min_num = 2 * base - max_num
    if n < 2 * base or n_layer == 1:
        return [base] * n_layer
    if schedule == "factory":
        steps = (max_num - min_num) // (n_layer - 1)
        return [max_num - l * steps for l in range(n_layer)]
    # exact: b_l = max - l*(max-min)/(L-1), floored, remainder to the largest fractions
    d = n_layer - 1
    num = [max_num * d - l * (max_num - min_num) for l in range(n_layer)]
    out = [x // d for x in num]
    frac = [x % d for x in num]
    rest = n_layer * base - sum(out)
    for l in sorted(range(n_layer), key=lambda i: (-frac[i], i))[:rest]:
        out[l] += 1
    return out


def widest(p: dict, n_layer: int, n: int, budget: int) -> int:
    """Entries the widest layer keeps of n > budget (the schedule decides it: its prefix share + the window)."""
    return max(layer_budgets(n_layer, n, budget, p["window"], p["beta"], p["schedule"])) + p["window"]


SPEC = PolicySpec(
    name="pyramidkv",
    summary="SnapKV selection with pyramid per-layer budgets (more in lower layers)",
    keeps="per layer l: the window plus a linearly decreasing number of prefix slots chosen by pooled window "
          "attention per KV head (KVCache-Factory's schedule with `beta`)",
    paper=Paper("PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
                arxiv="2406.02069", code="github.com/Zefan-Cai/KVCache-Factory"),
    params=(
        window_param(8, "8 (KVCache-Factory's runner)"),
        kernel_param(7, "7 (KVCache-Factory's runner)"),
        pool_param("max", "max (KVCache-Factory's runner)"),
        Param("beta", "int", 20, "pyramid shape: the top layer keeps (budget - window) // beta prefix entries",
              paper_default=20, min=1, max=1000),
        Param("schedule", "choice", "exact", "exact: the pyramid line rounded so the layers keep budget x n_layer "
              "entries in all; factory: KVCache-Factory's integer schedule, whose floored step keeps more "
              "(see the budget note)", paper_default="factory", choices=("exact", "factory")),
        gqa_param("mean"),
    ),
    needs=("window",),
    window_param="window",
    budget_above="window",
    schedule=lambda p, budget, n_layer, n: {
        "layer_budgets": layer_budgets(n_layer, n, budget, p["window"], p["beta"], p["schedule"])},
    resolved_away=("beta", "schedule"),
    budget_note="average per layer = budget (window included) with the default schedule=exact; "
                "schedule=factory (KVCache-Factory's rule) keeps more, measured from the live cache (SmolLM2-135M, "
                "30 layers, 1,333-token prompt): 4,215 entries per KV head at budget 128 (mean 140.5, +9.8%), "
                "7,800 at budget 256 (mean 260.0, +1.6%); prompts shorter than 2 x (budget - window) get "
                "uniform budgets",
    deviations=(
        "selection per KV head, query heads of a group combined by `gqa` (mean); KVCache-Factory's default "
        "repeats the cache to query heads",
        "window attention summed in float64; ties go to the lower slot",
        "schedule=exact (the default) is a kvcli addition: KVCache-Factory's floored step keeps more than the "
        "budget, which an equal-budget comparison cannot have; schedule=factory is its rule",
    ),
    widest=widest,
)
