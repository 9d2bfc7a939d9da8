// tova (Oren et al. 2024; kvpress TOVAPress): the (budget - window) prefix slots the last `window` prompt queries
// (1: the last token) attend to most, plus the last `window` slots. The attention (window sums) is combined over every
// query head of the layer (gqa=layer: the mean, one score and one selection for every KV head) or over each KV head's
// group (gqa=mean|max|sum, read as snapkv's). Twin: kvcli/reference/policies/tova.py (kvcli/policies/tova.py declares
// and validates the parameters).
#include "plan/plan.h"

namespace {

void plan_tova(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window"));
    const std::string mode = params.get_choice("gqa", {"layer", "mean", "max", "sum"});
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "tova", w);
    const int prefix = obs.n - w, G = obs.group();
    const kvcli::Gqa gqa = mode == "max" ? kvcli::Gqa::max : mode == "sum" ? kvcli::Gqa::sum : kvcli::Gqa::mean;
    for (int l = 0; l < obs.n_layer; l++) {
        std::vector<std::vector<double>> per_q;
        for (int q = 0; q < obs.n_head; q++) per_q.push_back(kvcli::window_sum(obs, l, q, w, prefix));
        std::vector<double> layer_score;
        if (mode == "layer") layer_score = kvcli::gqa_combine(per_q, kvcli::Gqa::mean);
        for (int h = 0; h < obs.n_head_kv; h++) {
            auto & k = out.at(l, h);
            if (mode == "layer") {
                k = kvcli::topk_ascending(layer_score, budget - w, "tova");
            } else {
                std::vector<std::vector<double>> group(per_q.begin() + h * G, per_q.begin() + (h + 1) * G);
                k = kvcli::topk_ascending(kvcli::gqa_combine(group, gqa), budget - w, "tova");
            }
            kvcli::append_range(k, prefix, obs.n);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("tova", plan_tova);
