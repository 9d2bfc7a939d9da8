// keydiff (Park et al. 2025; kvpress KeyDiffPress): question-agnostic. Per layer and KV head, each key k_j (the cached
// row) is normalised, khat_j = k_j / |k_j| (0 for a zero key); the anchor is the mean of the n normalised keys (added
// in slot order, then one division), and score_j = -(khat_j . anchor) / |anchor| = -cos(k_j, anchor) (0 when the
// anchor is zero). The last `recent` slots are kept, and the (budget - recent) best of the others, ties to the lower
// slot. float64 from the float32 rows; every dot product sums its terms in index order from 0.0, one multiplication
// then one addition per term (no contraction, below), as the torch twin kvcli/reference/policies/keydiff.py does.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "plan/plan.h"

#include <cmath>

namespace {

const char * const NAME = "keydiff";

double dot(const double * a, const double * b, int d) {
    double acc = 0.0;
    for (int i = 0; i < d; i++) acc = acc + a[i] * b[i];
    return acc;
}

// The negative cosine of each of one head's n keys to their anchor.
std::vector<double> key_scores(const kvcli::LayerKV & kv, int h, int n, int d) {
    std::vector<double> khat(static_cast<size_t>(n) * d), anchor(static_cast<size_t>(d), 0.0);
    for (int j = 0; j < n; j++) {
        double * x = &khat[static_cast<size_t>(j) * d];
        const float * k = kv.key_row(h, j);
        for (int i = 0; i < d; i++) x[i] = static_cast<double>(k[i]);
        const double norm = std::sqrt(dot(x, x, d));
        for (int i = 0; i < d; i++) x[i] = norm > 0.0 ? x[i] / norm : 0.0;
        for (int i = 0; i < d; i++) anchor[i] = anchor[i] + x[i];
    }
    for (auto & a : anchor) a = a / static_cast<double>(n);
    const double a_norm = std::sqrt(dot(anchor.data(), anchor.data(), d));
    std::vector<double> s(static_cast<size_t>(n));
    for (int j = 0; j < n; j++) {
        s[j] = a_norm > 0.0 ? -(dot(&khat[static_cast<size_t>(j) * d], anchor.data(), d) / a_norm) : 0.0;
    }
    return s;
}

void plan_keydiff(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int recent = static_cast<int>(params.get_int("recent"));
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_kv(obs, NAME);
    // kept: the slot ranges below need 0 <= recent < budget < n
    if (recent < 0 || recent >= budget) throw kvcli::PlanError("policy 'keydiff': recent must be below the budget");
    const int hi = obs.n - recent;
    for (int l = 0; l < obs.n_layer; l++) {
        const kvcli::LayerKV kv = obs.layer_kv(l, NAME);
        for (int h = 0; h < obs.n_head_kv; h++) {
            std::vector<double> s = key_scores(kv, h, obs.n, obs.head_dim);
            s.resize(static_cast<size_t>(hi));
            auto & k = out.at(l, h);
            k = kvcli::topk_ascending(s, budget - recent, NAME);
            kvcli::append_range(k, hi, obs.n);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("keydiff", plan_keydiff);
