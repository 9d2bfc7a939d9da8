// snapkv: per KV head, the (budget - window) prefix slots with the highest pooled window attention
// (summed over the window queries, pooled per query head, combined over the GQA group) + the window.
// kvcli/policies/snapkv.py declares and validates the parameters; kvcli/reference/policies/snapkv.py is the twin.
#include "plan/plan.h"

namespace {
void plan_snapkv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window"));
    const int kernel = static_cast<int>(params.get_int("kernel"));
    const bool is_max = kvcli::read_max_pool(params);
    const auto gqa = kvcli::read_gqa(params);
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "snapkv", w);
    const int prefix = obs.n - w;
    for (int l = 0; l < obs.n_layer; l++) {
        for (int h = 0; h < obs.n_head_kv; h++) {
            auto s = kvcli::snap_scores(obs, l, h, w, prefix, kernel, is_max, gqa);
            auto & k = out.at(l, h);
            k = kvcli::topk_ascending(s, budget - w, "snapkv");
            kvcli::append_range(k, prefix, obs.n);
        }
    }
}
} // namespace

KVCLI_REGISTER_POLICY("snapkv", plan_snapkv);
