// windowkv: review windows of `review_window` consecutive tokens scored by the observation window
// (mean or top-p mean over every query head), one index set per group of `shared_layers` layers,
// group budgets as the authors' code computes them. Twin: kvcli/reference/policies/windowkv.py;
// schedule and defaults: kvcli/policies/windowkv.py.
#include "plan/plan.h"

#include <algorithm>
#include <cstdlib>

namespace {

int group_size(int n_layer, int shared_layers) {
    if (shared_layers > 0) return std::min(shared_layers, n_layer);
    int best = 1;
    for (int d = 1; d <= n_layer; d++) {  // the divisor closest to n_layer / 4, the larger on a tie
        if (n_layer % d) continue;
        const int e = std::abs(4 * d - n_layer), eb = std::abs(4 * best - n_layer);
        if (e < eb || (e == eb && d > best)) best = d;
    }
    return best;
}

// Floor division for possibly negative numerators (b_first - b_last < 0 when gamma > lambda), as Python's //.
int64_t floordiv(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

std::vector<int64_t> group_budgets(int n_layer, int gamma, int64_t B, int64_t lam) {
    const int G = (n_layer + gamma - 1) / gamma;
    if (G == 1) return {B};
    const int64_t b_last = (B * gamma) / lam;
    const int64_t b_first = 2 * B - b_last;
    const int64_t step = floordiv(b_first - b_last, G - 1);
    std::vector<int64_t> out;
    for (int h = 0; h < G - 1; h++) out.push_back(std::max<int64_t>(0, b_first - h * step));
    out.push_back(std::max<int64_t>(0, b_last));
    return out;
}

void plan_windowkv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const std::string task = params.get_choice("task", "localization", {"localization", "aggregation"});
    int alpha = static_cast<int>(params.get_int("window", 0, 0, 4096));
    const int omega = static_cast<int>(params.get_int("review_window", 16, 1, 4096));
    int top_p = static_cast<int>(params.get_int("top_p", 0, 0, 4096));
    const int shared = static_cast<int>(params.get_int("shared_layers", 0, 0, 1024));
    const int64_t lam = params.get_int("beta", 14, 1, 1000);
    std::string score = params.get_choice("score", "auto", {"auto", "mean", "topp"});
    params.finish();
    if (alpha == 0) alpha = task == "localization" ? 16 : 32;
    if (top_p == 0) top_p = std::max(1, omega / 2);
    if (score == "auto") score = task == "localization" ? "mean" : "topp";
    const bool topp = score == "topp";

    kvcli::require_budget_above("windowkv", budget, "window", alpha);
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "windowkv", alpha);

    const int L = obs.n - alpha;                      // review context [0, L)
    const int gamma = group_size(obs.n_layer, shared);
    const auto bg = group_budgets(obs.n_layer, gamma, budget - alpha, lam);
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
            const int64_t drop = floordiv(L - bud + omega - 1, omega);
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
