// Score helpers shared by the policies. The order of every floating-point sum here is mirrored
// by kvcli/reference/policies/_common.py, so the two engines compute bit-identical doubles and
// therefore identical kept sets. Only additions, comparisons and one division per value: no
// multiply-add that a compiler could contract differently.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kvcli {

namespace {
// the first len values of a float32 row as doubles; NaN is an error (before pooling: max pooling would hide it)
// Memory safety: a row holds n values, so len must lie in [0, n] (the registry's budget > window check
// keeps every policy's prefix there; this guards a direct C API call).
std::vector<double> row_scores(const float * row, int l, int len, int n) {
    if (len < 0 || len > n) {
        throw PlanError("scores of " + std::to_string(len) + " slots asked for, the observation has " + std::to_string(n));
    }
    std::vector<double> s(static_cast<size_t>(len));
    for (int j = 0; j < len; j++) {
        s[j] = static_cast<double>(row[j]);
        if (std::isnan(s[j])) throw PlanError("the observation contains NaN (layer " + std::to_string(l) + ")");
    }
    return s;
}
} // namespace

void keep_all(const Obs & obs, PlanOut & out) {
    for (auto & k : out.kept) {
        k.clear();
        append_range(k, 0, obs.n);
    }
}

void reserve_replacements(PlanOut & out, int64_t most) {
    const size_t r = static_cast<size_t>(std::max<int64_t>(0, most));
    out.replace_entry.reserve(r);
    out.replace_k.reserve(r * static_cast<size_t>(out.head_dim));
    out.replace_v.reserve(r * static_cast<size_t>(out.head_dim));
}

void append_range(std::vector<int32_t> & v, int a, int b) {
    for (int j = a; j < b; j++) v.push_back(j);
}

void require_window(const Obs & obs, const std::string & policy, int w) {
    if (!obs.window_sums) {
        throw PlanError("policy '" + policy + "' needs the window observation (observe \"window\")");
    }
    if (obs.window_index(w) < 0) {
        std::string have;
        for (int i = 0; i < obs.n_windows; i++) have += (i ? ", " : "") + std::to_string(obs.windows[i]);
        throw PlanError("policy '" + policy + "' needs the window sums of window " + std::to_string(w) +
                        ", the observation has window(s) " + have);
    }
}

void require_colsum(const Obs & obs, const std::string & policy) {
    if (!obs.colsum) throw PlanError("policy '" + policy + "' needs the colsum observation (observe \"colsum\")");
}

void require_colmax(const Obs & obs, const std::string & policy) {
    if (!obs.colmax) throw PlanError("policy '" + policy + "' needs the colmax observation (observe \"colmax\")");
}

void require_kv(const Obs & obs, const std::string & policy) {
    if (!obs.has_kv()) throw PlanError("policy '" + policy + "' needs the kv observation (observe \"kv\")");
}

LayerKV Obs::layer_kv(int l, const std::string & policy) const {
    if (l < 0 || l >= n_layer) throw PlanError("policy '" + policy + "': K/V of layer " + std::to_string(l) + " asked for");
    require_kv(*this, policy);
    LayerKV out;
    out.n = n;
    out.head_dim = head_dim;
    const size_t size = static_cast<size_t>(n_head_kv) * n * head_dim;
    if (keys && values) {
        out.keys = keys + static_cast<size_t>(l) * size;
        out.values = values + static_cast<size_t>(l) * size;
    } else {
        out.k_buf.resize(size);
        out.v_buf.resize(size);
        if (read_kv(read_kv_user, l, out.k_buf.data(), out.v_buf.data()) != 0) {
            throw PlanError("policy '" + policy + "': reading the K/V rows of layer " + std::to_string(l) + " failed");
        }
        out.keys = out.k_buf.data();
        out.values = out.v_buf.data();
    }
    for (size_t i = 0; i < size; i++) {
        if (std::isnan(out.keys[i]) || std::isnan(out.values[i])) {
            throw PlanError("policy '" + policy + "': the observation contains NaN (keys/values)");
        }
    }
    return out;
}

void require_query(const Obs & obs, const std::string & policy) {
    if (!obs.queries || obs.n_query_rows < 1 || !obs.query_positions || !obs.positions || obs.rope.type == KVCLI_ROPE_NONE) {
        throw PlanError("policy '" + policy + "' needs the query observation (observe \"query\": the Q rows, their "
                        "positions and the model's RoPE)");
    }
}

void Rope::turn(double * x, size_t stride, const double * c, const double * s) const {
    for (size_t j = 0; j < freqs.size(); j++) {
        double & xa = x[static_cast<size_t>(a(static_cast<int>(j))) * stride];
        double & xb = x[static_cast<size_t>(b(static_cast<int>(j))) * stride];
        const double va = xa, vb = xb;
        xa = c[j] * va - s[j] * vb;
        xb = s[j] * va + c[j] * vb;
    }
}

Rope obs_rope(const Obs & obs, const std::string & policy) {
    const kvcli_rope & r = obs.rope;
    const std::string why = "policy '" + policy + "' cannot undo this RoPE: ";
    if (r.type != KVCLI_ROPE_NORM && r.type != KVCLI_ROPE_NEOX) {
        // llama.cpp's other LLAMA_ROPE_TYPE_* values: not a rotation of one position per row
        const std::string name = r.type == 8 ? " (M-RoPE)" : r.type == 24 ? " (vision RoPE)" : r.type == 40 ? " (interleaved M-RoPE)" : "";
        throw PlanError(why + "rope type " + std::to_string(r.type) + name + "; only norm (0) and neox (2) are supported");
    }
    // the pairs index [0, head_dim): a rotation of every dimension only
    if (r.n_rot != obs.head_dim || obs.head_dim % 2 != 0) {
        throw PlanError(why + "partial rotary dimensions (" + std::to_string(r.n_rot) + " of " +
                        std::to_string(obs.head_dim) + ")");
    }
    if (!(r.freq_base > 0.0) || !std::isfinite(r.freq_base) || !(r.freq_scale > 0.0) || !std::isfinite(r.freq_scale)) {
        throw PlanError(why + "freq_base and freq_scale must be finite and positive");
    }
    Rope out;
    out.neox = r.type == KVCLI_ROPE_NEOX;
    out.freqs.resize(static_cast<size_t>(r.n_rot / 2));
    for (int j = 0; j < r.n_rot / 2; j++) {
        // the operations of kvcli/planning/rope.py, so both engines start from the same doubles
        double f = r.freq_scale * std::pow(r.freq_base, -static_cast<double>(2 * j) / static_cast<double>(r.n_rot));
        if (r.freq_factors) {
            const double k = static_cast<double>(r.freq_factors[j]);
            if (!(k > 0.0) || !std::isfinite(k)) throw PlanError(why + "its frequency factors must be finite and positive");
            f = f / k;
        }
        out.freqs[static_cast<size_t>(j)] = f;
    }
    return out;
}

void require_per_layer(const Obs & obs, const std::string & policy, const std::string & key, size_t size) {
    if (size != static_cast<size_t>(obs.n_layer)) {
        throw PlanError("policy '" + policy + "': " + key + " has " + std::to_string(size) + " values, the observation has " +
                        std::to_string(obs.n_layer) + " layers");
    }
}

std::vector<double> window_sum(const Obs & obs, int l, int q, int w, int len) {
    return row_scores(obs.window_sum_row(l, q, w), l, len, obs.n);
}

std::vector<double> colsum_scores(const Obs & obs, int l, int q, int len) {
    return row_scores(obs.colsum_row(l, q), l, len, obs.n);
}

std::vector<double> colmax_scores(const Obs & obs, int l, int q, int len) {
    return row_scores(obs.colmax_row(l, q), l, len, obs.n);
}

std::vector<double> pool1d(const std::vector<double> & s, int kernel, bool is_max) {
    if (kernel <= 1) return s;
    const int n = static_cast<int>(s.size()), h = kernel / 2;
    std::vector<double> out(s.size());
    for (int j = 0; j < n; j++) {
        if (is_max) {
            double m = -std::numeric_limits<double>::infinity();
            for (int i = j - h; i <= j + h; i++) {
                if (i >= 0 && i < n && s[i] > m) m = s[i];
            }
            out[j] = m;
        } else {
            double acc = 0.0;  // padding adds 0.0, which changes nothing: skip it
            for (int i = j - h; i <= j + h; i++) {
                if (i >= 0 && i < n) acc += s[i];
            }
            out[j] = acc / static_cast<double>(kernel);
        }
    }
    return out;
}

Gqa read_gqa(Params & params) {
    const std::string s = params.get_choice("gqa", {"mean", "max", "sum"});
    return s == "mean" ? Gqa::mean : s == "max" ? Gqa::max : Gqa::sum;
}

bool read_max_pool(Params & params) { return params.get_choice("pool", {"max", "avg"}) == "max"; }

std::vector<double> gqa_combine(const std::vector<std::vector<double>> & per_q, Gqa mode) {
    std::vector<double> out = per_q.at(0);
    for (size_t g = 1; g < per_q.size(); g++) {
        const auto & s = per_q[g];
        for (size_t j = 0; j < out.size(); j++) {
            if (mode == Gqa::max) {
                if (s[j] > out[j]) out[j] = s[j];
            } else {
                out[j] += s[j];
            }
        }
    }
    if (mode == Gqa::mean && per_q.size() > 1) {
        const double g = static_cast<double>(per_q.size());
        for (auto & x : out) x /= g;
    }
    return out;
}

std::vector<double> snap_scores(const Obs & obs, int l, int h, int w, int len, int kernel, bool is_max, Gqa gqa) {
    const int G = obs.group();
    std::vector<std::vector<double>> per_q;
    per_q.reserve(G);
    for (int g = 0; g < G; g++) per_q.push_back(pool1d(window_sum(obs, l, h * G + g, w, len), kernel, is_max));
    return gqa_combine(per_q, gqa);
}

void check_finite(const std::vector<double> & s, const std::string & policy) {
    for (double x : s) {
        if (std::isnan(x)) throw PlanError("policy '" + policy + "': the observation contains NaN");
    }
}

std::vector<int32_t> topk_ascending(const std::vector<double> & s, int64_t k, const std::string & policy) {
    check_finite(s, policy);
    const int64_t n = static_cast<int64_t>(s.size());
    k = std::max<int64_t>(0, std::min(k, n));
    std::vector<int32_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    auto better = [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
    if (k < n) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(static_cast<size_t>(k));
    std::sort(idx.begin(), idx.end());
    return idx;
}

std::vector<int32_t> rank_desc(const std::vector<double> & s, const std::string & policy) {
    check_finite(s, policy);
    std::vector<int32_t> idx(s.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    return idx;
}

} // namespace kvcli
