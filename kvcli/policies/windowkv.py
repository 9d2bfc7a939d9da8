"""windowkv: whole review windows chosen by a task-dependent score, shared by groups of layers (Zuo et al.)."""
from kvcli.errors import KvcliError
from kvcli.policies.base import Paper, Param, PolicySpec

OBS_WINDOW_BY_TASK = {"localization": 16, "aggregation": 32}   # alpha, the paper's LLaMA3-8B values
SCORE_BY_TASK = {"localization": "mean", "aggregation": "topp"}  # the paper's rule (the demo code swaps them)


def group_size(n_layer: int, shared_layers: int) -> int:
    """gamma: `shared_layers`, or (0) the divisor of n_layer closest to n_layer / 4 (4 groups, as the paper's
    configurations: 32 -> 8, 28 -> 7; SmolLM2's 30 -> 6), the larger divisor on a tie."""
    if shared_layers > 0:
        return min(shared_layers, n_layer)
    divisors = [d for d in range(1, n_layer + 1) if n_layer % d == 0]
    # compare |d - n/4| as |4d - n| to stay in integers
    return min(divisors, key=lambda d: (abs(4 * d - n_layer), -d))


def group_budgets(n_layer: int, gamma: int, review_budget: int, lam: int) -> list[int]:
    """Per-group review budgets as the authors' code computes them (digest §2.2, [C]).

    G = ceil(n_layer / gamma); b_last = B*gamma // lam; b_first = 2B - b_last; linear with an integer step.
    Each layer of group g keeps budget[g] review entries (not budget[g] / gamma: see the digest).
    """
    G = -(-n_layer // gamma)
    if G == 1:
        return [review_budget]
    b_last = (review_budget * gamma) // lam
    b_first = 2 * review_budget - b_last
    step = (b_first - b_last) // (G - 1)
    return [max(0, b_first - h * step) for h in range(G - 1)] + [max(0, b_last)]


def layer_budgets(n_layer: int, gamma: int, review_budget: int, lam: int) -> list[int]:
    bg = group_budgets(n_layer, gamma, review_budget, lam)
    return [bg[l // gamma] for l in range(n_layer)]


def widest(p: dict, n_layer: int, n: int, budget: int) -> int | None:
    """Entries the widest group keeps of n > budget: its whole review windows + the observation window; None
    when that depends on whether the scores pick the last, partial review window."""
    alpha, omega = p["window"], p["review_window"]
    L = n - alpha                               # the review context, in N windows, the last one `last` long
    N = -(-L // omega)
    last = L - (N - 1) * omega
    lo = hi = 0
    for bud in group_budgets(n_layer, group_size(n_layer, p["shared_layers"]), budget - alpha, p["beta"]):
        if L <= bud:
            a = b = L
        else:
            k = max(N - (-(-(L - bud) // omega)), 0)   # windows kept (as the planners count them)
            a, b = max(k * omega - (omega - last), 0), k * omega
        lo, hi = max(lo, a), max(hi, b)
    return lo + alpha if lo == hi else None


def _resolve(p: dict) -> dict:
    p = dict(p)
    if p["window"] == 0:
        p["window"] = OBS_WINDOW_BY_TASK[p["task"]]
    if p["top_p"] == 0:
        p["top_p"] = max(1, p["review_window"] // 2)
    if p["score"] == "auto":
        p["score"] = SCORE_BY_TASK[p["task"]]
    return p


def _schedule(p: dict, budget: int, n_layer: int, n: int) -> dict:
    """For the native planner: the group size gamma and the group budgets (review budget = budget - window)."""
    gamma = group_size(n_layer, p["shared_layers"])
    return {"shared_layers": gamma, "group_budgets": group_budgets(n_layer, gamma, budget - p["window"], p["beta"])}


def _resolve_instruction(p: dict, instruction: str | None) -> dict:
    """task=auto -> the task kvcli's classifier (kvcli/taskclass) gives the instruction, before anything
    that depends on the task (window, score) is resolved, so both engines get the same concrete task."""
    if p["task"] != "auto":
        return p
    if instruction is None or not str(instruction).strip():
        raise KvcliError("policy 'windowkv': task=auto classifies the instruction, but none reached the policy "
                         "here (no question/instruction was given); pass --policy-arg task=localization (QA over "
                         "a document) or task=aggregation (summaries, few-shot, code)")
    from kvcli.taskclass import resolve_task  # noqa: PLC0415 - loads its weights only when auto is asked for

    p = dict(p)
    p["task"] = resolve_task(str(instruction), who="policy 'windowkv': task=auto").task
    return p


SPEC = PolicySpec(
    name="windowkv",
    summary="whole review windows of consecutive tokens, task-dependent score, shared by layer groups",
    keeps="per group of `shared_layers` layers (one index set for every layer and head of the group): the "
          "review windows of `review_window` tokens with the best window score, up to the group budget, plus "
          "the observation window",
    paper=Paper("WindowKV: Task-Adaptive Group-Wise KV Cache Window Selection for Efficient LLM Inference",
                venue="2025", code="github.com/optim996/WindowKV"),
    params=(
        Param("task", "choice", "localization", "localization (QA: window score = mean) or aggregation "
              "(summary, few-shot, counting, code: mean of the top_p scores); auto = kvcli's task classifier "
              "on the instruction (docs/windowkv-task-classifier.md)",
              paper_default="BERT classifier (weights unreleased)", choices=("localization", "aggregation", "auto")),
        Param("window", "int", 0, "observation window alpha; 0 = by task (16 localization, 32 aggregation)",
              paper_default="16 / 32 (LLaMA3-8B), 4 / 16 (Qwen2.5-1.5B)", min=0, max=4096),
        Param("review_window", "int", 16, "review window size omega (tokens per window)",
              paper_default="8 / 16 (LLaMA3-8B), 32 (Qwen2.5-1.5B)", min=1, max=4096),
        Param("top_p", "int", 0, "tokens per window averaged by the top-p score; 0 = review_window // 2",
              paper_default="unstated; code: review_window // 2", min=0, max=4096),
        Param("shared_layers", "int", 0, "gamma, layers per group sharing one index set; 0 = the divisor of "
              "n_layer closest to n_layer / 4", paper_default="8 (LLaMA3-8B), 7 (Qwen2.5-1.5B): 4 groups",
              min=0, max=1024),
        Param("beta", "int", 14, "lambda, pyramid shape of the group budgets", paper_default=14, min=1, max=1000),
        Param("score", "choice", "auto", "window score: auto = by task as the paper (localization mean, "
              "aggregation topp); mean or topp force one (the authors' demo pairs them the other way round)",
              paper_default="auto", choices=("auto", "mean", "topp")),
    ),
    needs=("window",),
    window_param="window",
    budget_note="budget - window is the review budget B fed to the authors' group schedule; each layer keeps "
                "its group's review budget (whole windows, so up to review_window - 1 more or fewer) plus the "
                "window; the schedule's integer floors make the average slightly above B",
    resolve_instruction=_resolve_instruction,
    resolve=_resolve,
    budget_above="window",
    schedule=_schedule,
    resolved_away=("task", "beta"),   # the task became window and score; beta the group budgets
    widest=widest,
    deviations=(
        "the budget includes the observation window (kvcli's convention): the authors' code adds alpha entries "
        "on top of B, kvcli feeds budget - window to the schedule",
        "group budgets as the authors' code computes them (each layer of group g gets b_g), not the paper's "
        "Eq. 5-7 read literally (b_g spread over the group's layers); see the digest",
        "n_layer not divisible by gamma: the last group is smaller (the code crashes); auto gamma picks a divisor",
        "a group whose budget is smaller than one window keeps only the observation window and its own layers "
        "use that (the code keeps reusing the previous group's indices: a bug)",
        "kept windows are stored in position order (the code stores them in score order: same attention)",
        "task=auto is kvcli's own classifier, not the paper's fine-tuned BERT (weights never released): a "
        "logistic regression over word and character n-grams of the instruction alone (the BERT read the first "
        "and last 256 tokens of the whole prompt), trained on instructions written for kvcli; held-out accuracy "
        "and its limits in docs/windowkv-task-classifier.md. It refuses instructions it knows too little of",
        "scores summed in float64 over window queries, heads and tokens in a fixed order; ties go to the lower "
        "window",
    ),
)
