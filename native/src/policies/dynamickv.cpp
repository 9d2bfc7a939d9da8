// dynamickv: per-layer budgets from a global top-k over the pooled window scores of every layer
// seen so far, recomputed every `interval` layers (and at the last), shrink-only; per KV head.
// The schedule is replayed after prefill over the saved scores (equivalent: prefill attention is
// never compressed). Twin: kvcli/reference/policies/dynamickv.py. Digest: docs/design/methods/dynamickv.md §2.3.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace {

void plan_dynamickv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int ws = static_cast<int>(params.get_int("window"));
    const int kernel = static_cast<int>(params.get_int("kernel"));
    const bool is_max = kvcli::read_max_pool(params);
    const double r_max = params.get_float("r_max");
    const int m = static_cast<int>(params.get_int("interval"));
    const auto gqa = kvcli::read_gqa(params);
    params.finish();
    if (m < 1) throw kvcli::PlanError("policy 'dynamickv': interval must be >= 1");   // kept: l % m divides by it
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "dynamickv", ws);

    const int L = obs.n_layer, H = obs.n_head_kv;
    const int64_t P = obs.n - ws;                         // selectable prefix
    const int64_t base = budget - ws;
    const int64_t bmax = std::min<int64_t>(static_cast<int64_t>(r_max * static_cast<double>(base)), P);
    const int64_t total = base * L;

    // scores[(l * H + h) * P + j]: the flat (layer, head, slot) order of the global top-k
    std::vector<double> scores(static_cast<size_t>(L) * H * P);
    std::vector<std::vector<int32_t>> rank(static_cast<size_t>(L) * H);
    std::vector<int64_t> cur(L, 0);
    for (int l = 0; l < L; l++) {
        for (int h = 0; h < H; h++) {
            auto s = kvcli::snap_scores(obs, l, h, ws, static_cast<int>(P), kernel, is_max, gqa);
            rank[static_cast<size_t>(l) * H + h] = kvcli::rank_desc(s, "dynamickv");
            std::copy(s.begin(), s.end(), scores.begin() + (static_cast<size_t>(l) * H + h) * P);
        }
        cur[l] = bmax;
        if (!(l % m == m - 1 || l == L - 1)) continue;

        const int n_seen = l + 1;
        const int64_t M = static_cast<int64_t>(n_seen) * H * P;
        // clamped to [0, M] for memory safety (nth_element below); the registry's budget > window keeps base >= 1
        const int64_t k = std::clamp<int64_t>(base * H * n_seen, 0, M);
        std::vector<int64_t> idx(static_cast<size_t>(M));
        std::iota(idx.begin(), idx.end(), 0);
        auto better = [&](int64_t a, int64_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
        if (k < M) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
        std::vector<int64_t> c(n_seen, 0);
        for (int64_t i = 0; i < k; i++) c[idx[i] / (H * P)] += 1;
        for (auto & x : c) x /= n_seen;                  // the 1/n of Eq. 4, integer floor as the code
        int64_t sum_c = std::accumulate(c.begin(), c.end(), int64_t(0));
        if (l == L - 1) {
            c[l] += base * H - sum_c;                    // the code's rounding fix-up, last update only
            sum_c = base * H;
        }
        if (sum_c <= 0) continue;                        // nothing counted: keep the current budgets
        std::vector<int64_t> Z(n_seen);
        int64_t sum_z = 0;
        for (int j = 0; j < n_seen; j++) {
            const double t = static_cast<double>(c[j]) / static_cast<double>(sum_c);
            Z[j] = static_cast<int64_t>(static_cast<double>(bmax) * t);
            sum_z += Z[j];
        }
        if (sum_z <= 0) continue;
        const double r = static_cast<double>(sum_z) / static_cast<double>(total);
        std::vector<int64_t> Zp(n_seen);
        int64_t sum_zp = 0;
        for (int j = 0; j < n_seen; j++) {
            Zp[j] = static_cast<int64_t>(std::floor(static_cast<double>(Z[j]) / r));
            sum_zp += Zp[j];
        }
        Zp[l] += total - sum_zp;                         // residual to the most recent layer
        for (int j = 0; j < n_seen; j++) cur[j] = std::min(cur[j], std::min(Zp[j], P));  // shrink only
    }

    for (int l = 0; l < L; l++) {
        for (int h = 0; h < H; h++) {
            const auto & r = rank[static_cast<size_t>(l) * H + h];
            std::vector<int32_t> k(r.begin(), r.begin() + std::max<int64_t>(0, cur[l]));
            std::sort(k.begin(), k.end());
            kvcli::append_range(k, static_cast<int>(P), obs.n);
            out.at(l, h) = std::move(k);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("dynamickv", plan_dynamickv);
