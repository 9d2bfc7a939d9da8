// pyramidkv: SnapKV selection with a pyramid of per-layer budgets (default schedule=exact: the layers keep
// budget x n_layer in all; schedule=factory: KVCache-Factory's floored rule, which keeps more)
// (kvcli/policies/pyramidkv.py: layer_budgets is the Python twin of the schedule below).
#include "plan/plan.h"

#include <algorithm>

namespace {

std::vector<int64_t> pyramid_budgets(int n_layer, int64_t n, int64_t budget, int64_t window, int64_t beta, bool exact) {
    const int64_t base = budget - window;
    int64_t min_num = base / beta;
    int64_t max_num = 2 * base - min_num;
    if (max_num >= n - window) {
        max_num = n - window;
        min_num = 2 * base - max_num;
    }
    if (n < 2 * base || n_layer == 1) return std::vector<int64_t>(n_layer, base);
    std::vector<int64_t> out(n_layer);
    if (!exact) {
        const int64_t steps = (max_num - min_num) / (n_layer - 1);
        for (int l = 0; l < n_layer; l++) out[l] = max_num - l * steps;
        return out;
    }
    // the same line, floored, the remainder to the largest fractions (lower layer first)
    const int64_t d = n_layer - 1;
    std::vector<int64_t> frac(n_layer);
    int64_t sum = 0;
    for (int l = 0; l < n_layer; l++) {
        const int64_t num = max_num * d - l * (max_num - min_num);  // >= 0: the line stays >= min_num >= 0
        out[l] = num / d;
        frac[l] = num % d;
        sum += out[l];
    }
    std::vector<int> order(n_layer);
    for (int l = 0; l < n_layer; l++) order[l] = l;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return frac[a] > frac[b]; });
    for (int64_t i = 0; i < n_layer * base - sum; i++) out[order[i]] += 1;
    return out;
}

void plan_pyramidkv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window", 8, 1, 4096));
    const int kernel = static_cast<int>(params.get_int("kernel", 7, 1, 255, true));
    const bool is_max = params.get_choice("pool", "max", {"max", "avg"}) == "max";
    const int64_t beta = params.get_int("beta", 20, 1, 1000);
    const bool exact = params.get_choice("schedule", "exact", {"exact", "factory"}) == "exact";
    const auto gqa = kvcli::parse_gqa(params.get_choice("gqa", "mean", {"mean", "max", "sum"}));
    params.finish();
    kvcli::require_budget_above("pyramidkv", budget, "window", w);
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "pyramidkv", w);
    const int prefix = obs.n - w;
    const auto budgets = pyramid_budgets(obs.n_layer, obs.n, budget, w, beta, exact);
    for (int l = 0; l < obs.n_layer; l++) {
        for (int h = 0; h < obs.n_head_kv; h++) {
            auto s = kvcli::snap_scores(obs, l, h, w, prefix, kernel, is_max, gqa);
            auto & k = out.at(l, h);
            k = kvcli::topk_ascending(s, budgets[l], "pyramidkv");
            kvcli::append_range(k, prefix, obs.n);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("pyramidkv", plan_pyramidkv);
