// kvzip (Kim et al., NeurIPS 2025): an entry's score is the largest attention any query of the context
// reconstruction pass gave it (Observation.colmax, per query head, observed while the prompt was fed again
// after a "repeat the context" instruction: kvcli/drivers/reconstruct.py), combined over the query heads of a
// KV head (`gqa`, max as kvpress). The first `sinks` and the last `recent` slots are always kept; the other
// (budget - sinks - recent) entries per KV head are chosen per KV head (alloc=head), per layer over its KV heads
// (alloc=layer, kvpress layerwise=True) or over every layer and KV head (alloc=global, kvpress's default).
// Twin: kvcli/reference/policies/kvzip.py. Digest: docs/design/methods/kvzip.md.
#include "plan/plan.h"

#include <algorithm>
#include <numeric>

namespace {

void plan_kvzip(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int sinks = static_cast<int>(params.get_int("sinks"));
    const int recent = static_cast<int>(params.get_int("recent"));
    const auto gqa = kvcli::read_gqa(params);
    const std::string alloc = params.get_choice("alloc", {"head", "layer", "global"});
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_colmax(obs, "kvzip");
    // kept: the indices below need sinks + recent < budget < n (the registry checks the budget)
    if (sinks < 0 || recent < 0 || sinks + recent >= budget) {
        throw kvcli::PlanError("policy 'kvzip': sinks + recent must be below the budget");
    }
    const int L = obs.n_layer, H = obs.n_head_kv, G = obs.group();
    const int lo = sinks, hi = obs.n - recent;            // the selectable slots [lo, hi)
    const int64_t P = hi - lo, per = budget - sinks - recent;

    // scores[(l * H + h) * P + j]: slot lo + j of (l, h): the flat order every top-k breaks ties by
    std::vector<double> scores(static_cast<size_t>(L) * H * P);
    for (int l = 0; l < L; l++) {
        for (int h = 0; h < H; h++) {
            std::vector<std::vector<double>> per_q;
            for (int g = 0; g < G; g++) {
                auto s = kvcli::colmax_scores(obs, l, h * G + g, hi);
                per_q.emplace_back(s.begin() + lo, s.end());
            }
            auto c = kvcli::gqa_combine(per_q, gqa);
            std::copy(c.begin(), c.end(), scores.begin() + (static_cast<size_t>(l) * H + h) * P);
        }
    }
    kvcli::check_finite(scores, "kvzip");
    // the chosen flat indices of [first, first + count) of `scores`, k of them
    std::vector<std::vector<int32_t>> chosen(static_cast<size_t>(L) * H);
    auto pick = [&](int64_t first, int64_t count, int64_t k) {
        std::vector<int64_t> idx(static_cast<size_t>(count));
        std::iota(idx.begin(), idx.end(), first);
        k = std::clamp<int64_t>(k, 0, count);
        auto better = [&](int64_t a, int64_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
        if (k < count) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
        for (int64_t i = 0; i < k; i++) {
            chosen[static_cast<size_t>(idx[i] / P)].push_back(static_cast<int32_t>(lo + idx[i] % P));
        }
    };
    if (alloc == "head") {
        for (int64_t lh = 0; lh < static_cast<int64_t>(L) * H; lh++) pick(lh * P, P, per);
    } else if (alloc == "layer") {
        for (int l = 0; l < L; l++) pick(static_cast<int64_t>(l) * H * P, H * P, per * H);
    } else {
        pick(0, static_cast<int64_t>(L) * H * P, per * H * L);
    }
    for (int l = 0; l < L; l++) {
        for (int h = 0; h < H; h++) {
            auto & k = out.at(l, h);
            auto & c = chosen[static_cast<size_t>(l) * H + h];
            std::sort(c.begin(), c.end());
            kvcli::append_range(k, 0, sinks);
            k.insert(k.end(), c.begin(), c.end());
            kvcli::append_range(k, hi, obs.n);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("kvzip", plan_kvzip);
