// compresskv: per layer, one token set shared by all KV heads, ranked by the pooled window attention
// of the layer's top `srh_k` semantic retrieval heads (calibration), with layer budgets from the
// offline error profile by Algorithm 1. Twin: kvcli/reference/policies/compresskv.py; allocator:
// kvcli/policies/compresskv.py:allocate.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace {

std::vector<int64_t> allocate(const std::vector<double> & e, int64_t budget, int64_t min_budget, int64_t max_factor,
                              bool round_robin) {
    const int n = static_cast<int>(e.size());
    const int64_t m = std::min(min_budget, budget), M = max_factor * budget, total = budget * n;
    const double R = static_cast<double>(total - m * n);
    std::vector<int64_t> b(n);
    for (int i = 0; i < n; i++) {
        b[i] = std::min(std::max(m + static_cast<int64_t>(std::nearbyint(e[i] * R)), m), M);  // half to even
    }
    int64_t d = total - std::accumulate(b.begin(), b.end(), int64_t(0));
    while (d != 0) {
        std::vector<int> cand;
        for (int i = 0; i < n; i++) {
            if (d > 0 ? b[i] < M : b[i] > m) cand.push_back(i);
        }
        if (cand.empty()) break;
        if (!round_robin) {
            int j = cand[0];
            for (int i : cand) {
                if (d > 0 ? e[i] > e[j] : e[i] < e[j]) j = i;   // strict: the lowest index on ties
            }
            b[j] += d > 0 ? 1 : -1;
            d += d > 0 ? -1 : 1;
            continue;
        }
        const bool give = d > 0;
        std::stable_sort(cand.begin(), cand.end(), [&](int a, int c) { return give ? e[a] > e[c] : e[a] < e[c]; });
        for (int i : cand) {
            if (d == 0) break;
            b[i] += give ? 1 : -1;
            d += give ? -1 : 1;
        }
    }
    return b;
}

void plan_compresskv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window", 8, 1, 4096));
    const int kernel = static_cast<int>(params.get_int("kernel", 5, 1, 255, true));
    const bool is_max = params.get_choice("pool", "avg", {"max", "avg"}) == "max";
    const int k = static_cast<int>(params.get_int("srh_k", 4, 1, 4096));
    const auto srh = params.get_int_list("srh", 0, 65535);
    const auto scores = params.get_float_list("layer_scores", 0.0, 1.0);
    const bool rr = params.get_choice("allocator", "paper", {"paper", "round_robin"}) == "round_robin";
    const int64_t min_budget = params.get_int("min_budget", 32, 1, 1 << 20);
    const int64_t max_factor = params.get_int("max_factor", 3, 1, 100);
    params.finish();
    kvcli::require_budget_above("compresskv", budget, "window", w);
    if (!srh.empty()) {
        if (srh.size() != static_cast<size_t>(obs.n_layer) * k) {
            throw kvcli::PlanError("policy 'compresskv': srh has " + std::to_string(srh.size()) + " head ids, expected " +
                                   std::to_string(obs.n_layer) + " layers x srh_k " + std::to_string(k) +
                                   " (calibration from another model?)");
        }
        for (int64_t q : srh) {
            if (q >= obs.n_head) {
                throw kvcli::PlanError("policy 'compresskv': srh names query head " + std::to_string(q) + ", the model has " +
                                       std::to_string(obs.n_head) + " (calibration from another model?)");
            }
        }
    }
    if (!scores.empty()) {
        if (scores.size() != static_cast<size_t>(obs.n_layer)) {
            throw kvcli::PlanError("policy 'compresskv': layer_scores has " + std::to_string(scores.size()) +
                                   " values, the observation has " + std::to_string(obs.n_layer) + " layers");
        }
        const double s = std::accumulate(scores.begin(), scores.end(), 0.0);
        if (std::fabs(s - 1.0) > 1e-3) throw kvcli::PlanError("policy 'compresskv': layer_scores must sum to 1");
    }
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "compresskv", w);

    const auto budgets = scores.empty() ? std::vector<int64_t>(obs.n_layer, budget)
                                        : allocate(scores, budget, min_budget, max_factor, rr);
    const int prefix = obs.n - w;
    for (int l = 0; l < obs.n_layer; l++) {
        std::vector<int32_t> kept;
        if (obs.n <= budgets[l]) {
            kvcli::append_range(kept, 0, obs.n);
        } else {
            std::vector<int> heads;
            if (srh.empty()) {
                for (int q = 0; q < obs.n_head; q++) heads.push_back(q);
            } else {
                for (int i = 0; i < k; i++) heads.push_back(static_cast<int>(srh[static_cast<size_t>(l) * k + i]));
            }
            std::vector<std::vector<double>> per_head;
            for (int q : heads) per_head.push_back(kvcli::pool1d(kvcli::window_sum(obs, l, q, w, prefix), kernel, is_max));
            const auto s = kvcli::gqa_combine(per_head, kvcli::Gqa::mean);   // mean over the scoring heads, in order
            kept = kvcli::topk_ascending(s, std::max<int64_t>(0, budgets[l] - w), "compresskv");
            kvcli::append_range(kept, prefix, obs.n);
        }
        for (int h = 0; h < obs.n_head_kv; h++) out.at(l, h) = kept;
    }
}

} // namespace

KVCLI_REGISTER_POLICY("compresskv", plan_compresskv);
