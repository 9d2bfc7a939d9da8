"""pyramidkv: SnapKV selection with pyramid-shaped per-layer budgets (Cai et al., KVCache-Factory)."""
from kvcli.policies.base import Paper, Param, PolicySpec, gqa_param, kernel_param, needs_window_budget, \
    pool_param, window_param


def layer_budgets(n_layer: int, n: int, budget: int, window: int, beta: int, schedule: str = "factory") -> list[int]:
    """Prefix entries each layer selects (the `window` last slots come on top), KVCache-Factory's rule.

    base = budget - window; min = base // beta; max = 2*base - min, capped to n - window;
    layer l gets max - l * ((max - min) // (n_layer - 1)). Prompts shorter than 2*base use SnapKV's
    uniform `base` (KVCache-Factory's middle branch). `schedule="exact"` keeps the same line but
    rounds it so the layers sum to exactly n_layer * base (largest remainders, lower layer first).
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
        Param("schedule", "choice", "factory", "factory: KVCache-Factory's integer schedule (its floor makes "
              "the total a little larger than budget x n_layer); exact: the same line rounded to sum exactly",
              paper_default="factory", choices=("factory", "exact")),
        gqa_param("mean"),
    ),
    needs=("window",),
    window_param="window",
    budget_note="average per layer = budget (window included); with schedule=factory the integer step makes the "
                "layers sum to slightly more than budget x n_layer (e.g. +5% at budget 128 on 30 layers), "
                "schedule=exact sums exactly; prompts shorter than 2 x (budget - window) get uniform budgets",
    deviations=(
        "selection per KV head, query heads of a group combined by `gqa` (mean); KVCache-Factory's default "
        "repeats the cache to query heads",
        "window attention summed in float64; ties go to the lower slot",
        "schedule=exact is a kvcli addition (off by default)",
    ),
    check=needs_window_budget("pyramidkv"),
)
