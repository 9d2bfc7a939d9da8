// kvcli_plan_make / kvcli_plan_free / kvcli_plan_get, parameter parsing and the policy registry.
#include "plan/plan.h"

#include "kvcli.h"
#include "kvcli_internal.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <new>

struct kvcli_plan {
    int32_t n_layer = 0, n_head_kv = 0, head_dim = 0;
    std::vector<int32_t> n_kept, slots;
    bool has_log_mult = false;
    std::vector<float> log_mult;
    std::vector<int32_t> replace_entry;
    std::vector<float> replace_k, replace_v;
};

namespace kvcli {

namespace {

std::string trim(const std::string & s) {
    size_t a = 0, b = s.size();
    while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) a++;
    while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) b--;
    return s.substr(a, b - a);
}

std::string lower(std::string s) {
    for (auto & c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}

std::map<std::string, PolicyFn> & registry_mut() {
    static std::map<std::string, PolicyFn> reg;  // function-local: safe from static-init order
    return reg;
}

std::string names() {
    std::string out;
    for (const auto & kv : registry_mut()) out += (out.empty() ? "" : ", ") + kv.first;
    return out;
}

} // namespace

PolicyRegistrar::PolicyRegistrar(const char * name, PolicyFn fn) { registry_mut()[name] = fn; }
const std::map<std::string, PolicyFn> & policy_registry() { return registry_mut(); }

Params::Params(const std::string & policy, const char * text) : policy_(policy) {
    std::string s = text ? text : "";
    size_t pos = 0;
    while (pos <= s.size()) {
        size_t end = s.find(';', pos);
        if (end == std::string::npos) end = s.size();
        std::string item = trim(s.substr(pos, end - pos));
        pos = end + 1;
        if (item.empty()) continue;
        size_t eq = item.find('=');
        if (eq == std::string::npos || trim(item.substr(0, eq)).empty()) {
            throw PlanError("policy '" + policy_ + "': malformed parameter '" + item + "' (expected key=value)");
        }
        std::string key = trim(item.substr(0, eq));
        if (kv_.count(key)) throw PlanError("policy '" + policy_ + "': parameter " + key + " given twice");
        kv_[key] = trim(item.substr(eq + 1));
    }
}

const std::string & Params::value(const std::string & key) {
    known_.push_back(key);
    auto it = kv_.find(key);
    if (it == kv_.end()) {
        throw PlanError("policy '" + policy_ + "': parameter " + key + " is missing (the native planner declares no "
                        "defaults: kvcli's registry passes every parameter, see PolicySpec.native_params)");
    }
    return it->second;
}

PlanError Params::bad(const std::string & key, const std::string & what) const {
    return PlanError("policy '" + policy_ + "': parameter " + key + " must be " + what);
}

namespace {
// strtoll / strtod of a whole item; false when it is empty, has trailing characters or does not fit
bool parse_int(const std::string & v, int64_t & x) {
    errno = 0;
    char * end = nullptr;
    x = std::strtoll(v.c_str(), &end, 10);
    return !v.empty() && *end == '\0' && errno != ERANGE;
}

bool parse_float(const std::string & v, double & x) {
    char * end = nullptr;
    x = std::strtod(v.c_str(), &end);
    return !v.empty() && *end == '\0' && std::isfinite(x);
}

std::vector<std::string> split_list(const std::string & v) {
    std::vector<std::string> out;
    size_t pos = 0;
    while (pos <= v.size()) {
        size_t end = v.find(',', pos);
        if (end == std::string::npos) end = v.size();
        std::string item = trim(v.substr(pos, end - pos));
        if (!item.empty()) out.push_back(item);
        pos = end + 1;
    }
    return out;
}
} // namespace

int64_t Params::get_int(const std::string & key) {
    const std::string & v = value(key);
    int64_t x = 0;
    if (!parse_int(v, x)) throw bad(key, "an integer (got '" + v + "')");
    return x;
}

double Params::get_float(const std::string & key) {
    const std::string & v = value(key);
    double x = 0.0;
    if (!parse_float(v, x)) throw bad(key, "a finite number (got '" + v + "')");
    return x;
}

std::string Params::get_choice(const std::string & key, const std::vector<std::string> & choices) {
    const std::string & raw = value(key);
    std::string v = lower(raw);
    if (std::find(choices.begin(), choices.end(), v) == choices.end()) {
        std::string list;
        for (const auto & c : choices) list += (list.empty() ? "" : ", ") + c;
        throw bad(key, "one of " + list + " (got '" + raw + "')");
    }
    return v;
}

std::vector<int64_t> Params::get_int_list(const std::string & key) {
    std::vector<int64_t> out;
    for (const auto & item : split_list(value(key))) {
        int64_t x = 0;
        if (!parse_int(item, x)) throw bad(key, "a comma-separated list of integers (bad item '" + item + "')");
        out.push_back(x);
    }
    return out;
}

void Params::finish() const {
    for (const auto & kv : kv_) {
        if (std::find(known_.begin(), known_.end(), kv.first) == known_.end()) {
            std::string list;
            for (const auto & k : known_) list += (list.empty() ? "" : ", ") + k;
            throw PlanError("policy '" + policy_ + "' has no parameter '" + kv.first + "'; valid keys: " +
                            (list.empty() ? std::string("none") : list));
        }
    }
}

namespace {

void validate_obs(const kvcli_obs_view * v) {
    if (!v) throw PlanError("no observation given");
    if (v->n_layer < 1 || v->n_layer > 65536) throw PlanError("observation: n_layer must be in [1, 65536]");
    if (v->n_head < 1 || v->n_head_kv < 1 || v->n_head > 65536) throw PlanError("observation: bad head counts");
    if (v->n_head % v->n_head_kv != 0) {
        throw PlanError("observation: n_head (" + std::to_string(v->n_head) + ") is not a multiple of n_head_kv (" +
                        std::to_string(v->n_head_kv) + ")");
    }
    if (v->n_slots < 0) throw PlanError("observation: negative n_slots");
    if (v->n_windows < 0 || v->n_windows > KVCLI_OBS_MAX_WINDOWS || (v->n_windows > 0) != (v->window_sums != nullptr) ||
        (v->n_windows > 0 && !v->windows)) {
        throw PlanError("observation: window_sums needs 1.." + std::to_string(KVCLI_OBS_MAX_WINDOWS) + " window lengths");
    }
    for (int32_t i = 0; i < v->n_windows; i++) {
        if (v->windows[i] < 1 || v->windows[i] > v->n_slots) {
            throw PlanError("observation: window lengths must be in [1, n_slots]");
        }
        for (int32_t j = 0; j < i; j++) {
            if (v->windows[j] == v->windows[i]) throw PlanError("observation: window lengths must be distinct");
        }
    }
    if ((v->keys || v->read_kv || v->queries) && v->head_dim < 1) throw PlanError("observation: head_dim must be >= 1");
    if (v->n_query_rows < 0 || (v->n_query_rows > 0) != (v->queries != nullptr) ||
        (v->n_query_rows > 0 && !v->query_positions)) {
        throw PlanError("observation: queries need n_query_rows >= 1 and their positions");
    }
}

// The plan must be well formed whatever the policy did: ascending slots inside [0, n).
void finalize(const Obs & obs, PlanOut & p, kvcli_plan & out) {
    const size_t nh = static_cast<size_t>(p.n_layer) * p.n_head_kv;
    if (p.kept.size() != nh) throw PlanError("internal: policy produced a plan of the wrong shape");
    if (!p.log_mult.empty() && p.log_mult.size() != nh) throw PlanError("internal: log_mult of the wrong shape");
    out.n_layer = p.n_layer;
    out.n_head_kv = p.n_head_kv;
    out.head_dim = p.head_dim;
    out.n_kept.resize(nh);
    size_t total = 0;
    for (size_t i = 0; i < nh; i++) total += p.kept[i].size();
    out.slots.reserve(total);
    out.has_log_mult = !p.log_mult.empty();
    for (size_t i = 0; i < nh; i++) {
        const auto & k = p.kept[i];
        for (size_t j = 0; j < k.size(); j++) {
            if (k[j] < 0 || k[j] >= obs.n || (j > 0 && k[j] <= k[j - 1])) {
                throw PlanError("internal: policy produced slots that are not ascending inside [0, n)");
            }
        }
        out.n_kept[i] = static_cast<int32_t>(k.size());
        out.slots.insert(out.slots.end(), k.begin(), k.end());
        if (out.has_log_mult) {
            if (p.log_mult[i].size() != k.size()) throw PlanError("internal: log_mult does not match kept");
            out.log_mult.insert(out.log_mult.end(), p.log_mult[i].begin(), p.log_mult[i].end());
        }
    }
    const size_t r = p.replace_entry.size();
    if (p.replace_k.size() != r * p.head_dim || p.replace_v.size() != r * p.head_dim) {
        throw PlanError("internal: replacement rows of the wrong size");
    }
    for (int32_t e : p.replace_entry) {
        if (e < 0 || static_cast<size_t>(e) >= total) throw PlanError("internal: replace_entry out of range");
    }
    out.replace_entry = std::move(p.replace_entry);
    out.replace_k = std::move(p.replace_k);
    out.replace_v = std::move(p.replace_v);
}

} // namespace
} // namespace kvcli

extern "C" {

struct kvcli_plan * kvcli_plan_make(const char * policy, const char * params, int32_t budget,
                                    const struct kvcli_obs_view * obs) {
    using namespace kvcli;
    kvcli_clear_error();
    try {
        if (!policy) throw PlanError("no policy name given");
        const std::string name = policy;
        auto it = policy_registry().find(name);
        if (it == policy_registry().end()) {
            throw PlanError("unknown policy '" + name + "'; the native planner has: " + names());
        }
        validate_obs(obs);
        Obs o;
        o.n_layer = obs->n_layer; o.n_head = obs->n_head; o.n_head_kv = obs->n_head_kv;
        o.head_dim = obs->head_dim; o.n = obs->n_slots;
        o.n_windows = obs->window_sums ? obs->n_windows : 0; o.windows = obs->windows;
        o.window_sums = obs->window_sums; o.colsum = obs->colsum; o.keys = obs->keys; o.values = obs->values;
        o.read_kv = obs->read_kv; o.read_kv_user = obs->read_kv_user; o.colmax = obs->colmax;
        o.n_query_rows = obs->queries ? obs->n_query_rows : 0; o.queries = obs->queries;
        o.query_positions = obs->query_positions; o.positions = obs->positions; o.rope = obs->rope;
        Params p(name, params);
        PlanOut out;
        out.n_layer = o.n_layer;
        out.n_head_kv = o.n_head_kv;
        out.head_dim = o.head_dim > 0 ? o.head_dim : 0;
        out.kept.assign(static_cast<size_t>(o.n_layer) * o.n_head_kv, {});
        it->second(o, p, budget, out);
        auto * plan = new kvcli_plan();
        try {
            finalize(o, out, *plan);
        } catch (...) {
            delete plan;
            throw;
        }
        return plan;
    } catch (const std::bad_alloc &) {
        kvcli_set_error(std::string("policy '") + (policy ? policy : "?") + "': out of memory while planning");
    } catch (const std::exception & e) {
        kvcli_set_error(e.what());
    }
    return nullptr;
}

void kvcli_plan_free(struct kvcli_plan * plan) { delete plan; }

int32_t kvcli_plan_get(const struct kvcli_plan * plan, struct kvcli_plan_view * out) {
    kvcli_clear_error();
    if (!plan || !out) {
        kvcli_set_error("kvcli_plan_get: null argument");
        return -1;
    }
    out->n_layer = plan->n_layer;
    out->n_head_kv = plan->n_head_kv;
    out->head_dim = plan->head_dim;
    out->n_kept = plan->n_kept.data();
    out->slots = plan->slots.data();
    out->log_mult = plan->has_log_mult ? plan->log_mult.data() : nullptr;
    out->n_replace = static_cast<int32_t>(plan->replace_entry.size());
    out->replace_entry = plan->replace_entry.data();
    out->replace_k = plan->replace_entry.empty() ? nullptr : plan->replace_k.data();
    out->replace_v = plan->replace_entry.empty() ? nullptr : plan->replace_v.data();
    return 0;
}

} // extern "C"
