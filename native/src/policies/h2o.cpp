// h2o (prefill variant): per KV head, the (budget - recent) prefix slots with the highest attention
// accumulated over all prefill queries (colsum, combined over the GQA group) + the last `recent` slots.
#include "plan/plan.h"

namespace {
void plan_h2o(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int recent = static_cast<int>(params.get_int("recent"));
    const auto gqa = kvcli::read_gqa(params);
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_colsum(obs, "h2o");
    const int prefix = obs.n - recent, G = obs.group();
    for (int l = 0; l < obs.n_layer; l++) {
        for (int h = 0; h < obs.n_head_kv; h++) {
            std::vector<std::vector<double>> per_q;
            for (int g = 0; g < G; g++) per_q.push_back(kvcli::colsum_scores(obs, l, h * G + g, prefix));
            auto & k = out.at(l, h);
            k = kvcli::topk_ascending(kvcli::gqa_combine(per_q, gqa), budget - recent, "h2o");
            kvcli::append_range(k, prefix, obs.n);
        }
    }
}
} // namespace

KVCLI_REGISTER_POLICY("h2o", plan_h2o);
