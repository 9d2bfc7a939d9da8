// kvcli planning framework: a policy is a pure function (observation, params, budget) -> plan.
//
// Each policy is one file in native/src/policies/ that defines a function with the PolicyFn
// signature and registers it with KVCLI_REGISTER_POLICY. kvcli_plan_make (plan.cpp) parses the
// "key=value;key=value" string, validates the observation, calls the policy and checks the plan.
// The torch twin of every policy lives in kvcli/reference/policies/ and must give IDENTICAL plans
// on the same observation (docs/internals.md): scores are computed in double, summed in the order
// the helpers below document, and every top-k breaks ties by the lower index.
#pragma once

#include "kvcli.h"

#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvcli {

// A user-facing planning error (bad params, budget, observation); becomes kvcli_last_error().
struct PlanError : std::runtime_error {
    explicit PlanError(const std::string & msg) : std::runtime_error(msg) {}
};

// One layer's K and V rows, [n_head_kv][n][head_dim] float32 each: views into the observation's arrays, or
// buffers of its own filled by the observation's reader (Obs::layer_kv).
struct LayerKV {
    int n = 0, head_dim = 0;
    const float * keys = nullptr;
    const float * values = nullptr;
    std::vector<float> k_buf, v_buf;   // the rows read by a reader (keys/values point into them)

    LayerKV() = default;
    LayerKV(const LayerKV &) = delete;              // keys/values may point into k_buf/v_buf
    LayerKV & operator=(const LayerKV &) = delete;
    LayerKV(LayerKV &&) = default;                  // a moved vector keeps its buffer
    LayerKV & operator=(LayerKV &&) = default;

    const float * key_row(int h, int j) const { return keys + (static_cast<size_t>(h) * n + j) * static_cast<size_t>(head_dim); }
    const float * value_row(int h, int j) const { return values + (static_cast<size_t>(h) * n + j) * static_cast<size_t>(head_dim); }
};

struct Obs {
    int n_layer = 0, n_head = 0, n_head_kv = 0, head_dim = 0, n = 0, n_windows = 0;
    const int32_t * windows = nullptr;     // [n_windows]: the window lengths of window_sums
    const float * window_sums = nullptr;   // [n_windows][n_layer][n_head][n]
    const float * colsum = nullptr;   // [n_layer][n_head][n]
    const float * colmax = nullptr;   // [n_layer][n_head][n]: largest attention of any observed query (kvzip)
    const float * keys   = nullptr;   // [n_layer][n_head_kv][n][head_dim], or NULL with a reader
    const float * values = nullptr;
    int32_t (*read_kv)(void * user, int32_t il, float * keys, float * values) = nullptr;  // kvcli_kv_reader
    void * read_kv_user = nullptr;
    int n_query_rows = 0;                       // KVCLI_OBS_QUERY (require_query)
    const float * queries = nullptr;            // [n_layer][n_head][n_query_rows][head_dim]: post-RoPE Q rows
    const int32_t * query_positions = nullptr;  // [n_query_rows]
    const int32_t * positions = nullptr;        // [n]: the slots' positions
    kvcli_rope rope{KVCLI_ROPE_NONE, 0, 0.0, 0.0, nullptr};

    int group() const { return n_head / n_head_kv; }
    // index of window length w in windows, -1 if it was not observed
    int window_index(int w) const {
        for (int i = 0; i < n_windows; i++) {
            if (windows[i] == w) return i;
        }
        return -1;
    }
    // the sums over the last w window queries of query head q in layer l (w must be observed)
    const float * window_sum_row(int l, int q, int w) const {
        const size_t i = static_cast<size_t>(window_index(w));
        return window_sums + ((i * n_layer + l) * n_head + q) * static_cast<size_t>(n);
    }
    const float * colsum_row(int l, int q) const {
        return colsum + (static_cast<size_t>(l) * n_head + q) * static_cast<size_t>(n);
    }
    const float * colmax_row(int l, int q) const {
        return colmax + (static_cast<size_t>(l) * n_head + q) * static_cast<size_t>(n);
    }
    // query row r of query head q in layer l (head_dim floats)
    const float * query_row(int l, int q, int r) const {
        return queries + ((static_cast<size_t>(l) * n_head + q) * n_query_rows + r) * static_cast<size_t>(head_dim);
    }
    bool has_kv() const { return (keys && values) || read_kv; }
    // Layer l's K and V rows (require_kv first): views of keys/values, or read now by the reader. NaN is a
    // PlanError naming the policy. Merging planners take one layer at a time, so a native observation never
    // holds every layer's rows on the host (docs/internals.md, "Observation").
    LayerKV layer_kv(int l, const std::string & policy) const;
};

// Parsed "key=value;..." of one policy. The planner declares no parameter: kvcli's registry
// (kvcli/policies/) resolves every default, validates every range once and passes every parameter,
// closed-form layer schedules included (PolicySpec.native_params). A getter of a missing key, an
// unparsable value or a choice outside the policy's vocabulary is a PlanError, never a default.
// A policy reads every parameter and then calls finish(), which rejects keys it did not read.
// Range checks stay in a policy only where an index or a division needs them (a comment says so).
class Params {
public:
    Params(const std::string & policy, const char * text);
    int64_t     get_int(const std::string & key);
    double      get_float(const std::string & key);
    std::string get_choice(const std::string & key, const std::vector<std::string> & choices);
    // A comma-separated list; an empty value is the empty list.
    std::vector<int64_t> get_int_list(const std::string & key);
    void        finish() const;
    const std::string & policy() const { return policy_; }
private:
    std::string policy_;
    std::map<std::string, std::string> kv_;
    std::vector<std::string> known_;
    const std::string & value(const std::string & key);   // records the key; PlanError when it is missing
    PlanError bad(const std::string & key, const std::string & what) const;
};

// The plan being built: kept slots per (layer, kv head), ascending; optional log_mult and
// replacement rows (merging policies).
struct PlanOut {
    int n_layer = 0, n_head_kv = 0, head_dim = 0;
    std::vector<std::vector<int32_t>> kept;      // [n_layer * n_head_kv]
    std::vector<std::vector<float>>   log_mult;  // empty, or one list per (l, h) matching kept
    std::vector<int32_t> replace_entry;          // indices into the flattened slots
    std::vector<float>   replace_k, replace_v;   // [n_replace * head_dim]

    std::vector<int32_t> & at(int l, int h) { return kept[static_cast<size_t>(l) * n_head_kv + h]; }
};

using PolicyFn = void (*)(const Obs & obs, Params & params, int budget, PlanOut & out);

struct PolicyRegistrar {
    PolicyRegistrar(const char * name, PolicyFn fn);
};
const std::map<std::string, PolicyFn> & policy_registry();

#define KVCLI_REGISTER_POLICY(NAME, FN) \
    static const ::kvcli::PolicyRegistrar kvcli_registrar_##FN(NAME, FN)

// ---------------------------------------------------------------------------------------------
// Helpers shared by the policies (plan/scores.cpp). Orders of summation are part of the contract
// with the torch twins (kvcli/reference/policies/_common.py).
// ---------------------------------------------------------------------------------------------

// Every (l, h) keeps slots [0, n).
void keep_all(const Obs & obs, PlanOut & out);
// Room for up to `most` replacement rows (merging policies), so they are never copied while they grow: a
// reservation is address space; only the rows written become resident.
void reserve_replacements(PlanOut & out, int64_t most);
// The slots [a, b) appended to v (v must end below a).
void append_range(std::vector<int32_t> & v, int a, int b);

// Requirements, with clear errors naming the policy. require_window: the window sums of length w.
void require_window(const Obs & obs, const std::string & policy, int w);
void require_colsum(const Obs & obs, const std::string & policy);
void require_colmax(const Obs & obs, const std::string & policy);
// keys and values (or their reader) present (merging policies); Obs::layer_kv checks each layer for NaN.
void require_kv(const Obs & obs, const std::string & policy);
// The query observation (Q rows, their positions, the slots' positions and the RoPE) present.
void require_query(const Obs & obs, const std::string & policy);
// A per-layer list handed over by the registry (a closed-form schedule) has one value per layer.
void require_per_layer(const Obs & obs, const std::string & policy, const std::string & key, size_t size);

// s[j] = (double) window_sums[window w][l][q][j], j < len: the attention slot j received from the last w
// window queries, summed in the graph (float32, rows in decode order) or by the reference engine (float64,
// then rounded to float32). Both planners read the same float32 array, so they compute the same doubles.
std::vector<double> window_sum(const Obs & obs, int l, int q, int w, int len);
// s[j] = (double) colsum[l][q][j], j < len.
std::vector<double> colsum_scores(const Obs & obs, int l, int q, int len);
// s[j] = (double) colmax[l][q][j], j < len.
std::vector<double> colmax_scores(const Obs & obs, int l, int q, int len);
// 1-D pooling, stride 1, centred (kernel odd). avg: zero padding, terms added left to right from
// 0.0, divided by kernel (count_include_pad). max: -inf padding.
std::vector<double> pool1d(const std::vector<double> & s, int kernel, bool is_max);
// Combine the scores of the query heads of one KV head: mean (sum in head order, then / G),
// max, or sum.
enum class Gqa { mean, max, sum };
// The shared parameters: gqa (mean|max|sum) and pool (true for max, false for avg).
Gqa read_gqa(Params & params);
bool read_max_pool(Params & params);
std::vector<double> gqa_combine(const std::vector<std::vector<double>> & per_q, Gqa mode);
// The pooled, combined window score of KV head h in layer l over the first len slots.
std::vector<double> snap_scores(const Obs & obs, int l, int h, int w, int len, int kernel, bool is_max, Gqa gqa);
// Indices of the k largest scores (ties: lower index), ascending. Throws on NaN.
std::vector<int32_t> topk_ascending(const std::vector<double> & s, int64_t k, const std::string & policy);
// All indices by descending score, ties by lower index (a stable sort on -score). Throws on NaN.
std::vector<int32_t> rank_desc(const std::vector<double> & s, const std::string & policy);
void check_finite(const std::vector<double> & s, const std::string & policy);

// RoPE as llama.cpp rotates the observed Q/K rows (kvcli_rope; kvcli/planning/rope.py computes the same
// frequencies): rotary pair j, dimensions (a(j), b(j)), turns by the angle pos x freqs[j].
struct Rope {
    std::vector<double> freqs;   // [n_rot / 2] = [head_dim / 2]
    bool neox = false;
    int a(int j) const { return neox ? j : 2 * j; }
    int b(int j) const { return neox ? j + static_cast<int>(freqs.size()) : 2 * j + 1; }
    // x[dim * stride], dim < head_dim, with every pair turned by (c[j], s[j]): a' = c a - s b, b' = s a + c b
    void turn(double * x, size_t stride, const double * c, const double * s) const;
};
// The observation's RoPE (require_query first): freqs[j] = freq_scale x freq_base^(-2j / n_rot) / freq_factors[j].
// A rope type other than norm/neox, partial rotary dimensions or a bad number is a PlanError naming the policy.
Rope obs_rope(const Obs & obs, const std::string & policy);

} // namespace kvcli
