// expected_attention (Devoto et al. 2025; kvpress ExpectedAttentionPress): query-agnostic scores from the statistics of
// the prompt's queries. Per layer and query head, the observed Q rows (the last `window`, post-RoPE; rows at positions
// below `sinks` left out) are turned back to before RoPE at their positions; their mean mu and covariance Sigma
// (divided by the row count) are turned by the average RoPE rotation R of positions next .. next + n_future - 1
// (next = the largest slot position + 1). A key k of slot j >= sinks gets softmax_j(R mu . k / sqrt(d) +
// k' R Sigma R' k / (2d)), combined over the query heads of its KV head (`gqa`), times ||v_j|| (+ epsilon first). The
// first `sinks` and last `recent` slots are kept, and the best (budget - sinks - recent) others per KV head, ties to the
// lower slot. float64 from the float32 observation.
// Twin: kvcli/reference/policies/expected_attention.py. Digest: docs/design/methods/expected_attention.md.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>

namespace {

const char * const NAME = "expected_attention";

// (mean cos, mean sin) of the angles pos x freqs[j] over pos = start .. start + count - 1, per pair j. Neumaier's
// compensated sum: n_future reaches 2^20 terms, and the torch twin's pairwise sum is accurate to a few ulps.
void mean_rotation(const kvcli::Rope & rope, int64_t start, int64_t count, std::vector<double> & c,
                   std::vector<double> & s) {
    const size_t half = rope.freqs.size();
    c.assign(half, 0.0);
    s.assign(half, 0.0);
    for (size_t j = 0; j < half; j++) {
        double sc = 0.0, ec = 0.0, ss = 0.0, es = 0.0;
        auto add = [](double & sum, double & err, double x) {
            const double t = sum + x;
            err += std::fabs(sum) >= std::fabs(x) ? (sum - t) + x : (x - t) + sum;
            sum = t;
        };
        for (int64_t t = 0; t < count; t++) {
            const double ang = static_cast<double>(start + t) * rope.freqs[j];
            add(sc, ec, std::cos(ang));
            add(ss, es, std::sin(ang));
        }
        c[j] = (sc + ec) / static_cast<double>(count);
        s[j] = (ss + es) / static_cast<double>(count);
    }
}

// One query head's statistics, turned by the mean rotation: mu_r [d] and the covariance R Sigma R' folded into an
// upper triangle (u[i][j] = 2 Sigma_ij for j > i, Sigma_ii on the diagonal, 0 below), so k' Sigma k = sum_j k_j t_j
// with t = u' k: half the products of the full form, in a loop over contiguous rows that vectorises.
struct QueryStats {
    std::vector<double> mu;
    std::vector<double> upper;   // [d][d], empty without the covariance term
};

// The rotations every query head shares: the un-rotation of each used row at its position, the mean rotation of the
// future positions (pair j's cos and sin in [r * half + j] and [j]).
struct Turns {
    std::vector<double> back_c, back_s, fut_c, fut_s;
};

QueryStats query_stats(const kvcli::Obs & obs, const kvcli::Rope & rope, int l, int q, const std::vector<int> & rows,
                       const Turns & tr, bool covariance) {
    const size_t d = static_cast<size_t>(obs.head_dim), half = d / 2, w = rows.size();
    std::vector<double> pre(w * d);   // the rows before RoPE
    for (size_t r = 0; r < w; r++) {
        const float * src = obs.query_row(l, q, rows[r]);
        double * x = &pre[r * d];
        for (size_t i = 0; i < d; i++) {
            x[i] = static_cast<double>(src[i]);
            if (std::isnan(x[i])) throw kvcli::PlanError("policy 'expected_attention': the observation contains NaN (queries)");
        }
        rope.turn(x, 1, &tr.back_c[r * half], &tr.back_s[r * half]);
    }
    QueryStats st;
    st.mu.assign(d, 0.0);
    for (size_t r = 0; r < w; r++) {
        for (size_t i = 0; i < d; i++) st.mu[i] += pre[r * d + i];
    }
    for (auto & m : st.mu) m /= static_cast<double>(w);
    if (covariance) {
        std::vector<double> cov(d * d, 0.0), x(d);
        for (size_t r = 0; r < w; r++) {
            for (size_t i = 0; i < d; i++) x[i] = pre[r * d + i] - st.mu[i];
            for (size_t i = 0; i < d; i++) {
                for (size_t j = 0; j < d; j++) cov[i * d + j] += x[i] * x[j];
            }
        }
        for (auto & v : cov) v /= static_cast<double>(w);
        for (size_t i = 0; i < d; i++) rope.turn(&cov[i * d], 1, tr.fut_c.data(), tr.fut_s.data());   // rows: Sigma R'
        for (size_t j = 0; j < d; j++) rope.turn(&cov[j], d, tr.fut_c.data(), tr.fut_s.data());       // columns: R Sigma R'
        st.upper.assign(d * d, 0.0);
        for (size_t i = 0; i < d; i++) {
            st.upper[i * d + i] = cov[i * d + i];
            for (size_t j = i + 1; j < d; j++) st.upper[i * d + j] = cov[i * d + j] + cov[j * d + i];
        }
    }
    rope.turn(st.mu.data(), 1, tr.fut_c.data(), tr.fut_s.data());
    return st;
}

void plan_expected_attention(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int64_t window = params.get_int("window");
    const int64_t n_future = params.get_int("n_future");
    const int sinks = static_cast<int>(params.get_int("sinks"));
    const int recent = static_cast<int>(params.get_int("recent"));
    const bool covariance = params.get_choice("covariance", {"on", "off"}) == "on";
    const bool vnorm = params.get_choice("vnorm", {"on", "off"}) == "on";
    const double epsilon = params.get_float("epsilon");
    const auto gqa = kvcli::read_gqa(params);
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_query(obs, NAME);
    kvcli::require_kv(obs, NAME);
    // kept: the slot ranges below need sinks + recent < budget < n; n_future and window: divisors and a row count
    if (sinks < 0 || recent < 0 || sinks + recent >= budget) {
        throw kvcli::PlanError("policy 'expected_attention': sinks + recent must be below the budget");
    }
    if (n_future < 1 || window < 1) throw kvcli::PlanError("policy 'expected_attention': window and n_future must be >= 1");
    const kvcli::Rope rope = kvcli::obs_rope(obs, NAME);
    const int L = obs.n_layer, H = obs.n_head_kv, G = obs.group(), d = obs.head_dim, half = d / 2, n = obs.n;

    // the last `window` observed rows, those at positions >= sinks
    std::vector<int> rows;
    for (int r = static_cast<int>(std::max<int64_t>(0, obs.n_query_rows - window)); r < obs.n_query_rows; r++) {
        if (obs.query_positions[r] >= sinks) rows.push_back(r);
    }
    if (rows.empty()) throw kvcli::PlanError("policy 'expected_attention': no observed query lies after the sinks");
    Turns tr;
    tr.back_c.resize(rows.size() * half);
    tr.back_s.resize(rows.size() * half);
    for (size_t r = 0; r < rows.size(); r++) {
        for (int j = 0; j < half; j++) {
            const double ang = static_cast<double>(obs.query_positions[rows[r]]) * rope.freqs[j];
            tr.back_c[r * half + j] = std::cos(ang);
            tr.back_s[r * half + j] = -std::sin(ang);
        }
    }
    const int64_t next = static_cast<int64_t>(*std::max_element(obs.positions, obs.positions + n)) + 1;
    mean_rotation(rope, next, n_future, tr.fut_c, tr.fut_s);

    const int lo = sinks, hi = n - recent, m = n - sinks;   // selectable [lo, hi); the softmax runs over [sinks, n)
    const int64_t per = budget - sinks - recent;
    const double sqrt_d = std::sqrt(static_cast<double>(d)), two_d = 2.0 * d;
    std::vector<double> keys(static_cast<size_t>(m) * d), t(static_cast<size_t>(d));
    for (int l = 0; l < L; l++) {
        std::vector<QueryStats> stats;
        stats.reserve(static_cast<size_t>(obs.n_head));
        for (int q = 0; q < obs.n_head; q++) {
            stats.push_back(query_stats(obs, rope, l, q, rows, tr, covariance));
        }
        const kvcli::LayerKV kv = obs.layer_kv(l, NAME);
        for (int h = 0; h < H; h++) {
            for (int j = 0; j < m; j++) {
                const float * k = kv.key_row(h, sinks + j);
                for (int i = 0; i < d; i++) keys[static_cast<size_t>(j) * d + i] = static_cast<double>(k[i]);
            }
            std::vector<std::vector<double>> per_q;
            per_q.reserve(static_cast<size_t>(G));
            for (int g = 0; g < G; g++) {
                const QueryStats & st = stats[static_cast<size_t>(h * G + g)];
                std::vector<double> logit(static_cast<size_t>(m));
                for (int j = 0; j < m; j++) {
                    const double * k = &keys[static_cast<size_t>(j) * d];
                    double dot = 0.0;
                    for (int i = 0; i < d; i++) dot += k[i] * st.mu[i];
                    double x = dot / sqrt_d;
                    if (covariance) {
                        std::fill(t.begin(), t.end(), 0.0);
                        for (int i = 0; i < d; i++) {
                            const double ki = k[i];
                            const double * u = &st.upper[static_cast<size_t>(i) * d];
                            for (int c = i; c < d; c++) t[c] += ki * u[c];
                        }
                        double quad = 0.0;
                        for (int i = 0; i < d; i++) quad += k[i] * t[i];
                        x = x + quad / two_d;
                    }
                    logit[j] = x;
                }
                kvcli::check_finite(logit, NAME);
                const double mx = *std::max_element(logit.begin(), logit.end());
                double sum = 0.0;
                for (auto & x : logit) {
                    x = std::exp(x - mx);
                    sum += x;
                }
                for (auto & x : logit) x /= sum;
                per_q.push_back(std::move(logit));
            }
            std::vector<double> score = kvcli::gqa_combine(per_q, gqa);
            if (vnorm) {
                for (int j = 0; j < m; j++) {
                    const float * v = kv.value_row(h, sinks + j);
                    double ss = 0.0;
                    for (int i = 0; i < d; i++) ss += static_cast<double>(v[i]) * static_cast<double>(v[i]);
                    score[j] = (score[j] + epsilon) * std::sqrt(ss);
                }
            }
            score.resize(static_cast<size_t>(hi - lo));   // slots lo .. hi - 1
            auto & kept = out.at(l, h);
            kvcli::append_range(kept, 0, lo);
            for (int32_t j : kvcli::topk_ascending(score, per, NAME)) kept.push_back(lo + j);
            kvcli::append_range(kept, hi, n);
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("expected_attention", plan_expected_attention);
