// compresskv: per layer, one token set shared by all KV heads, ranked by the pooled window attention
// of the layer's top `srh_k` semantic retrieval heads (calibration), with layer budgets (window
// included) from the offline error profile by Algorithm 1: kvcli/policies/compresskv.py:allocate
// computes them once and hands them over as layer_budgets. Twin: kvcli/reference/policies/compresskv.py.
#include "plan/plan.h"

#include <algorithm>

namespace {

void plan_compresskv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window"));
    const int kernel = static_cast<int>(params.get_int("kernel"));
    const bool is_max = kvcli::read_max_pool(params);
    const int k = static_cast<int>(params.get_int("srh_k"));
    const auto srh = params.get_int_list("srh");
    const auto budgets = params.get_int_list("layer_budgets");
    params.finish();
    // kept for memory safety: the head ids index the observation (a calibration from another model)
    if (!srh.empty()) {
        if (srh.size() != static_cast<size_t>(obs.n_layer) * k) {
            throw kvcli::PlanError("policy 'compresskv': srh has " + std::to_string(srh.size()) + " head ids, expected " +
                                   std::to_string(obs.n_layer) + " layers x srh_k " + std::to_string(k) +
                                   " (calibration from another model?)");
        }
        for (int64_t q : srh) {
            if (q < 0 || q >= obs.n_head) {
                throw kvcli::PlanError("policy 'compresskv': srh names query head " + std::to_string(q) + ", the model has " +
                                       std::to_string(obs.n_head) + " (calibration from another model?)");
            }
        }
    }
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "compresskv", w);
    kvcli::require_per_layer(obs, "compresskv", "layer_budgets", budgets.size());   // memory: indexed by layer
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
