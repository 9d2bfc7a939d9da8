// streamingllm: the first `sinks` slots + the last (budget - sinks) slots (kvcli/policies/streamingllm.py).
#include "plan/plan.h"

namespace {
void plan_streamingllm(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int sinks = static_cast<int>(params.get_int("sinks"));
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    for (auto & k : out.kept) {
        kvcli::append_range(k, 0, sinks);
        kvcli::append_range(k, obs.n - (budget - sinks), obs.n);
    }
}
} // namespace

KVCLI_REGISTER_POLICY("streamingllm", plan_streamingllm);
