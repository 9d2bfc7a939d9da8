// pyramidkv: SnapKV selection with a pyramid of per-layer budgets. The schedule (beta, schedule=exact|factory)
// is closed-form: kvcli/policies/pyramidkv.py:layer_budgets computes it once and hands it over as
// layer_budgets (prefix entries per layer, the window comes on top).
#include "plan/plan.h"

namespace {

void plan_pyramidkv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window"));
    const int kernel = static_cast<int>(params.get_int("kernel"));
    const bool is_max = kvcli::read_max_pool(params);
    const auto gqa = kvcli::read_gqa(params);
    const auto budgets = params.get_int_list("layer_budgets");
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "pyramidkv", w);
    kvcli::require_per_layer(obs, "pyramidkv", "layer_budgets", budgets.size());   // memory: indexed by layer
    const int prefix = obs.n - w;
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
