// windowkv: review windows of `review_window` consecutive tokens scored by the observation window
// (mean or top-p mean over every query head), one index set per group of `shared_layers` layers.
// Twin: kvcli/reference/policies/windowkv.py. The registry (kvcli/policies/windowkv.py) resolves task,
// window, top_p, score and the group size, and computes the group budgets (the authors' schedule)
// once: they arrive as group_budgets, one per group.
#include "plan/plan.h"

#include <algorithm>

namespace {

void plan_windowkv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int alpha = static_cast<int>(params.get_int("window"));
    const int omega = static_cast<int>(params.get_int("review_window"));
    const int top_p = static_cast<int>(params.get_int("top_p"));
    const int gamma = static_cast<int>(params.get_int("shared_layers"));
    const bool topp = params.get_choice("score", {"mean", "topp"}) == "topp";
    const auto bg = params.get_int_list("group_budgets");
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "windowkv", alpha);
    // kept for memory safety: omega divides below, and each group's leader layer indexes the observation
    if (omega < 1 || gamma < 1) throw kvcli::PlanError("policy 'windowkv': review_window and shared_layers must be >= 1");
    if (bg.size() != static_cast<size_t>((obs.n_layer + gamma - 1) / gamma)) {
        throw kvcli::PlanError("policy 'windowkv': group_budgets has " + std::to_string(bg.size()) + " values, " +
                               std::to_string(obs.n_layer) + " layers in groups of " + std::to_string(gamma) + " need " +
                               std::to_string((obs.n_layer + gamma - 1) / gamma));
    }

    const int L = obs.n - alpha;                      // review context [0, L)
    const int N = (L + omega - 1) / omega;            // review windows, the last may be partial

    for (size_t g = 0; g < bg.size(); g++) {
        const int leader = static_cast<int>(g) * gamma;
        const int64_t bud = bg[g];
        std::vector<int32_t> kept;
        if (L <= bud) {
            kvcli::append_range(kept, 0, L);
        } else {
            std::vector<std::vector<double>> t(obs.n_head);
            for (int q = 0; q < obs.n_head; q++) {
                t[q] = kvcli::window_sum(obs, leader, q, alpha, L);
                kvcli::check_finite(t[q], "windowkv");
            }
            std::vector<double> s(N);
            for (int k = 0; k < N; k++) {
                const int a = k * omega, b = std::min(L, a + omega), size = b - a;
                const int cnt = topp ? std::min(top_p, size) : size;
                double acc = 0.0;  // heads in order, then tokens (mean: by position; topp: descending)
                for (int q = 0; q < obs.n_head; q++) {
                    if (topp) {
                        std::vector<double> x(t[q].begin() + a, t[q].begin() + b);
                        std::sort(x.begin(), x.end(), [](double u, double v) { return u > v; });
                        for (int i = 0; i < cnt; i++) acc += x[i];
                    } else {
                        for (int j = a; j < b; j++) acc += t[q][j];
                    }
                }
                s[k] = acc / static_cast<double>(obs.n_head * cnt);
            }
            const int64_t drop = (L - bud + omega - 1) / omega;   // L > bud here: a plain ceiling
            const int64_t keep_n = N - drop;
            if (keep_n > 0) {
                for (int32_t k : kvcli::topk_ascending(s, keep_n, "windowkv")) {
                    kvcli::append_range(kept, k * omega, std::min(L, (k + 1) * omega));
                }
            }
        }
        kvcli::append_range(kept, L, obs.n);
        const int l_end = std::min(obs.n_layer, leader + gamma);
        for (int l = leader; l < l_end; l++) {
            for (int h = 0; h < obs.n_head_kv; h++) out.at(l, h) = kept;
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("windowkv", plan_windowkv);
