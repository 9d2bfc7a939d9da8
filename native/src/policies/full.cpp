// full: keep everything (kvcli/policies/full.py).
#include "plan/plan.h"

namespace {
void plan_full(const kvcli::Obs & obs, kvcli::Params & params, int /*budget*/, kvcli::PlanOut & out) {
    params.finish();
    kvcli::keep_all(obs, out);
}
} // namespace

KVCLI_REGISTER_POLICY("full", plan_full);
