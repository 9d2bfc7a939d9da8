// spindlekv (prefill): window-attention eviction with the linear depth schedule (Eq. 5-7), then a
// greedy similarity codebook per (layer, KV head) (Algorithm 1) whose key groups become single
// cells with bias log(count): K = unit(exemplar key) x mean magnitude, V = mean of the members'
// values rebuilt from the value codebook. The depth schedule is closed-form: kvcli/policies/spindlekv.py
// (parameters, layer_keep) computes it once and hands it over as layer_keep. Twin:
// kvcli/reference/policies/spindlekv.py. Digest: docs/design/methods/spindlekv.md.
// Float steps are the same IEEE operations, in the same order, as the Python twins.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "plan/plan.h"
#include "plan/similarity.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

// Algorithm 1 with incremental degrees over the rows x[i] (float32, d wide): the exemplars in pick
// order and each row's group. theta >= 1: no codebook, every row its own exemplar.
void greedy_cover(const std::vector<const float *> & x, int d, double theta, std::vector<int> & exemplars,
                  std::vector<int> & ref) {
    const int N = static_cast<int>(x.size());
    exemplars.clear();
    ref.assign(N, -1);
    if (theta >= 1.0) {
        for (int i = 0; i < N; i++) { exemplars.push_back(i); ref[i] = i; }
        return;
    }
    std::vector<double> norm(N);
    for (int i = 0; i < N; i++) norm[i] = std::sqrt(kvcli::sq_norm(x[i], d));
    std::vector<char> adj(static_cast<size_t>(N) * N, 0);
    std::vector<int64_t> deg(N, 0);
    for (int i = 0; i < N; i++) {
        for (int j = 0; j < N; j++) {
            const bool e = i == j || kvcli::cosine(kvcli::dot(x[i], x[j], d), norm[i], norm[j]) > theta;
            adj[static_cast<size_t>(i) * N + j] = e;
            deg[i] += e;
        }
    }
    std::vector<char> alive(N, 1);
    int n_alive = N;
    while (n_alive > 0) {
        int best = -1;
        for (int i = 0; i < N; i++) {
            if (alive[i] && (best < 0 || deg[i] > deg[best])) best = i;   // first maximum: lower slot
        }
        std::vector<int> members;
        for (int j = 0; j < N; j++) {
            if (alive[j] && adj[static_cast<size_t>(best) * N + j]) members.push_back(j);
        }
        for (int j : members) {
            ref[j] = static_cast<int>(exemplars.size());
            alive[j] = 0;
            n_alive--;
        }
        exemplars.push_back(best);
        for (int i = 0; i < N; i++) {
            for (int j : members) deg[i] -= adj[static_cast<size_t>(i) * N + j];
        }
    }
}

struct Replacement {
    int index;                 // the cell's index in its (layer, head)'s kept list
    std::vector<float> k, v;   // its K and V rows
};

// fill_heads=widest: the layer holds as many slots per KV head as its widest head keeps (the ragged
// layout stores each layer as wide as that), so a head whose codebook merged more keeps its next-best
// context entries by score (ranks k, k+1, ... of its scores; the first k are kept already) as single
// cells up to the widest head's count. Twin: _fill_to_widest.
void fill_to_widest(kvcli::PlanOut & out, int l, int H, const std::vector<std::vector<double>> & scores, int64_t k,
                    std::vector<std::vector<Replacement>> & reps) {
    size_t width = 0;
    for (int h = 0; h < H; h++) width = std::max(width, out.at(l, h).size());
    for (int h = 0; h < H; h++) {
        auto & kept = out.at(l, h);
        auto & lm = out.log_mult[static_cast<size_t>(l) * H + h];
        const auto order = kvcli::rank_desc(scores[h], "spindlekv");
        const size_t from = static_cast<size_t>(std::max<int64_t>(0, k));
        const size_t to = std::min(order.size(), from + (width - kept.size()));
        if (from >= to) continue;
        // (slot, log multiplicity, replacement index or -1), merged in slot order
        std::vector<std::tuple<int32_t, float, int>> cells;
        std::vector<int> rep_of(kept.size(), -1);
        for (size_t i = 0; i < reps[h].size(); i++) rep_of[reps[h][i].index] = static_cast<int>(i);
        for (size_t ci = 0; ci < kept.size(); ci++) cells.emplace_back(kept[ci], lm[ci], rep_of[ci]);
        for (size_t r = from; r < to; r++) cells.emplace_back(order[r], 0.0f, -1);
        std::sort(cells.begin(), cells.end(), [](const auto & a, const auto & b) { return std::get<0>(a) < std::get<0>(b); });
        kept.clear();
        lm.clear();
        for (size_t i = 0; i < cells.size(); i++) {
            kept.push_back(std::get<0>(cells[i]));
            lm.push_back(std::get<1>(cells[i]));
            if (std::get<2>(cells[i]) >= 0) reps[h][std::get<2>(cells[i])].index = static_cast<int>(i);
        }
    }
}

void plan_spindlekv(const kvcli::Obs & obs, kvcli::Params & params, int budget, kvcli::PlanOut & out) {
    const int w = static_cast<int>(params.get_int("window"));
    const int kernel = static_cast<int>(params.get_int("kernel"));
    const bool is_max = kvcli::read_max_pool(params);
    const bool causal_count = params.get_choice("score_norm", {"window", "causal_count"}) == "causal_count";
    const double theta_k = params.get_float("theta_k");
    const double theta_v = params.get_float("theta_v");
    const bool scale_exemplar = params.get_choice("k_scale", {"mean", "exemplar"}) == "exemplar";
    const int64_t cb_param = params.get_int("codebook_layers");
    const auto gqa = kvcli::read_gqa(params);
    const auto keep = params.get_int_list("layer_keep");
    const bool fill_widest = params.get_choice("fill_heads", {"widest", "off"}) == "widest";
    params.finish();
    if (obs.n <= budget) return kvcli::keep_all(obs, out);
    kvcli::require_window(obs, "spindlekv", w);
    kvcli::require_kv(obs, "spindlekv");
    kvcli::require_per_layer(obs, "spindlekv", "layer_keep", keep.size());   // memory: indexed by layer

    const int L = obs.n_layer, H = obs.n_head_kv, G = obs.group(), n = obs.n, D = obs.head_dim;
    const int prefix = n - w;
    const int64_t cb_layers = cb_param == 0 ? L : cb_param;
    out.log_mult.assign(static_cast<size_t>(L) * H, {});
    int64_t most = 0;   // replacement rows: at most one per entry kept by the codebook layers
    for (int l = 0; l < L && l < cb_layers; l++) most += (std::max<int64_t>(0, keep[l]) + w) * H;
    kvcli::reserve_replacements(out, most);
    int64_t offset = 0;
    for (int l = 0; l < L; l++) {
        kvcli::LayerKV kv;   // this layer's rows only, read where the codebook needs them
        if (l < cb_layers) kv = obs.layer_kv(l, "spindlekv");
        std::vector<std::vector<double>> scores(H);
        std::vector<std::vector<Replacement>> reps(H);   // per head: (index in its kept list, K, V)
        for (int h = 0; h < H; h++) {
            std::vector<std::vector<double>> per_q;
            for (int g = 0; g < G; g++) {
                auto s = kvcli::window_sum(obs, l, h * G + g, w, prefix);
                if (causal_count) {
                    for (int j = 0; j < prefix; j++) s[j] = s[j] / static_cast<double>(n - j);
                }
                per_q.push_back(kvcli::pool1d(s, kernel, is_max));
            }
            scores[h] = kvcli::gqa_combine(per_q, gqa);
            auto slots = kvcli::topk_ascending(scores[h], keep[l], "spindlekv");
            kvcli::append_range(slots, prefix, n);
            auto & kept = out.at(l, h);
            auto & lm = out.log_mult[static_cast<size_t>(l) * H + h];
            if (l >= cb_layers) {
                kept = slots;
                lm.assign(slots.size(), 0.0f);
                continue;
            }
            const int N = static_cast<int>(slots.size());
            std::vector<const float *> K(N), V(N);
            std::vector<double> k_norm(N), v_norm(N);
            for (int i = 0; i < N; i++) {
                K[i] = kv.key_row(h, slots[i]);
                V[i] = kv.value_row(h, slots[i]);
                k_norm[i] = std::sqrt(kvcli::sq_norm(K[i], D));
                v_norm[i] = std::sqrt(kvcli::sq_norm(V[i], D));
            }
            std::vector<int> k_ex, k_ref, v_ex, v_ref;
            greedy_cover(K, D, theta_k, k_ex, k_ref);
            greedy_cover(V, D, theta_v, v_ex, v_ref);
            // v_hat_i added to acc: the value rebuilt from the value codebook (exact for an exemplar)
            auto add_v_hat = [&](int i, std::vector<double> & acc) {
                const int e = v_ex[v_ref[i]];
                for (int d = 0; d < D; d++) {
                    const double x = e == i ? static_cast<double>(V[i][d])
                                            : (static_cast<double>(V[e][d]) / v_norm[e]) * v_norm[i];
                    acc[d] = acc[d] + x;
                }
            };
            std::vector<int> cells = k_ex;
            std::sort(cells.begin(), cells.end());
            std::vector<std::vector<int>> members(k_ex.size());
            for (int i = 0; i < N; i++) members[k_ref[i]].push_back(i);   // ascending
            for (size_t ci = 0; ci < cells.size(); ci++) {
                const int e = cells[ci];
                const auto & mem = members[k_ref[e]];
                kept.push_back(slots[e]);
                lm.push_back(static_cast<float>(std::log(static_cast<double>(mem.size()))));
                std::vector<double> k(D), v(D, 0.0);
                if (mem.size() == 1) {
                    if (v_ex[v_ref[e]] == e) continue;   // the cell is the entry itself
                    for (int d = 0; d < D; d++) k[d] = K[e][d];
                    add_v_hat(e, v);
                } else {
                    if (scale_exemplar) {
                        for (int d = 0; d < D; d++) k[d] = K[e][d];
                    } else {
                        double acc = 0.0;
                        for (int i : mem) acc = acc + k_norm[i];
                        const double scale = acc / static_cast<double>(mem.size());
                        for (int d = 0; d < D; d++) k[d] = (static_cast<double>(K[e][d]) / k_norm[e]) * scale;
                    }
                    for (int i : mem) add_v_hat(i, v);
                    for (int d = 0; d < D; d++) v[d] = v[d] / static_cast<double>(mem.size());
                }
                Replacement r{static_cast<int>(ci), std::vector<float>(D), std::vector<float>(D)};
                for (int d = 0; d < D; d++) r.k[d] = static_cast<float>(k[d]);
                for (int d = 0; d < D; d++) r.v[d] = static_cast<float>(v[d]);
                reps[h].push_back(std::move(r));
            }
        }
        if (fill_widest && l < cb_layers) fill_to_widest(out, l, H, scores, keep[l], reps);
        for (int h = 0; h < H; h++) {
            for (const auto & r : reps[h]) {
                out.replace_entry.push_back(static_cast<int32_t>(offset + r.index));
                out.replace_k.insert(out.replace_k.end(), r.k.begin(), r.k.end());
                out.replace_v.insert(out.replace_v.end(), r.v.begin(), r.v.end());
            }
            offset += static_cast<int64_t>(out.at(l, h).size());
        }
    }
}

} // namespace

KVCLI_REGISTER_POLICY("spindlekv", plan_spindlekv);
