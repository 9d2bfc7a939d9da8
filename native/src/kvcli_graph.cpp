// kvcli in the attention graph: the slot bias added to the KQ mask of a compacted cache, and
// observation of the attention (window sums and column sums) from exactly the Q, K, mask and
// scale that attention uses, computed with plain ggml ops so it runs on any backend. Both kinds are
// reduced in the graph, layer by layer: only [n_kv, n_windows or 1, n_head] floats per layer and
// ubatch reach the host, never the attention rows themselves.
//
// Soft-capped attention (gemma2): the observation caps the scores as llama.cpp does, before the mask (soft_cap).
//
// Shapes (one stream, kvcli_require_supported): q [head_dim, n_head, n_tokens] (rotated like K
// when the cache rotates), k view [head_dim, n_head_kv, n_kv, 1], kq_mask [n_kv, n_tokens, 1, 1]
// (F16 with flash attention, else F32), bias[l] [kv_size, n_head_kv] F32.
#include "kvcli_cache.h"
#include "kvcli_hooks.h"

#include "llama-graph.h"
#include "llama-impl.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvcli_graph_detail { namespace { // internal linkage; the outer name keeps unity builds apart

// the row selections of one layer's observation nodes, filled for each ubatch
class obs_input : public llm_graph_input_i {
public:
    ggml_tensor *        win_idx = nullptr; // I32 [n_win]: ubatch rows that are window queries (of the longest window)
    std::vector<int32_t> win_rows;
    ggml_tensor *        win_sel = nullptr; // F32 [n_windows, n_win]: 1 where row r belongs to window length i
    std::vector<float>   win_w;
    ggml_tensor *        col_sel = nullptr; // F32 [1, n_tokens]: 1 for rows of the observed sequence
    std::vector<float>   col_w;

    void set_input(const llama_ubatch * ubatch) override {
        GGML_UNUSED(ubatch);
        set(win_idx, win_rows.data(), win_rows.size() * sizeof(int32_t));
        set(win_sel, win_w.data(), win_w.size() * sizeof(float));
        set(col_sel, col_w.data(), col_w.size() * sizeof(float));
    }

    bool can_reuse(const llm_graph_params & params) override {
        GGML_UNUSED(params);
        return false; // rows differ per ubatch
    }

private:
    static void set(ggml_tensor * t, const void * data, size_t size) {
        if (t && t->buffer) {
            ggml_backend_tensor_set(t, data, 0, size);
        }
    }
};

bool row_in_seq(const llama_ubatch & ub, uint32_t i, llama_seq_id s) {
    for (int32_t j = 0; j < ub.n_seq_id[i]; ++j) {
        if (ub.seq_id[i][j] == s) {
            return true;
        }
    }
    return false;
}

// one ubatch's graph output on the host
std::vector<float> host_copy(ggml_tensor * t) {
    std::vector<float> tmp(ggml_nelements(t));
    ggml_backend_tensor_get(t, tmp.data(), 0, ggml_nbytes(t));
    return tmp;
}

// layer il's accumulator, `size` zeros when first used (0 is neutral for sums and for maxima of probabilities)
kvcli_acc & layer_acc(std::vector<kvcli_acc> & acc, uint32_t il, uint32_t n_layer, size_t size) {
    if (acc.size() != n_layer) {
        acc.clear();
        acc.resize(n_layer);
    }
    auto & a = acc[il];
    if (a.empty()) {
        a.allocate(size);
    }
    return a;
}

// dst += b where b is not 0, in place (dst a view of a host accumulator, b the same shape, rows contiguous): a cell
// the rows cannot see (another sequence's: its probability is exactly 0) is neither read nor written, so its page of
// the accumulator stays untouched, never resident. Skipping an exact 0 leaves every sum as the add would, to the bit.
// Until a computed graph has added into the accumulator (userdata, kvcli_acc::written) its floats are all 0 and the
// values are written, not added (0 + b == b): a page is first touched by a write, which maps it once, where a read
// maps the zero page and the write after it copies that page and flushes the TLB of every thread's CPU (under perf
// the kernel's share of a served 16k question fell from 10.7% to 2.9%).
void add_nonzero(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth, void * userdata) {
    GGML_UNUSED(a);
    const bool add = static_cast<const kvcli_acc *>(userdata)->written();
    const int64_t n0 = b->ne[0], n1 = b->ne[1], rows = b->ne[1] * b->ne[2] * b->ne[3];
    for (int64_t r = ith; r < rows; r += nth) {
        const int64_t i1 = r % n1, i2 = (r / n1) % b->ne[2], i3 = r / (n1 * b->ne[2]);
        float * d = (float *) ((char *) dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
        const float * s = (const float *) ((const char *) b->data + i1 * b->nb[1] + i2 * b->nb[2] + i3 * b->nb[3]);
        for (int64_t c = 0; c < n0; ++c) {
            if (s[c] != 0.0f) {
                d[c] = add ? d[c] + s[c] : s[c];
            }
        }
    }
}

// The graph adds one ubatch's reduced sums t ([n_kv, n_w, n_head]) into the host accumulator acc ([n_w][n_head]
// [kv_size], cells c0..c0+n_kv-1) itself: t is then an intermediate the allocator reuses, where as a graph output
// every layer's would stay allocated to the end of the graph (n_layer x n_kv x n_head floats: 21 MiB at 16k cells
// on qwen2.5-0.5b by their shape) and then be copied once more on the host. Only the cells the rows see are written
// (add_nonzero): an answer's 260 cells beside a resident 16k document make the pages of 260 cells resident, not 16k.
// (heads h0.. of the layer's n_head: t may be one group of heads)
void add_into_host(ggml_context * ctx0, ggml_cgraph * gf, kvcli_acc & acc, ggml_tensor * t, int64_t c0,
                   uint32_t kv_size, int64_t n_head, int64_t h0 = 0) {
    const int64_t n_kv = t->ne[0], n_w = t->ne[1], n_h = t->ne[2];
    ggml_tensor * a = acc.tensor(kv_size, n_head, n_w);
    ggml_tensor * dst = ggml_view_3d(ctx0, a, n_kv, n_h, n_w, a->nb[1], a->nb[2],
                                     (size_t) c0 * sizeof(float) + (size_t) h0 * a->nb[1]);
    ggml_tensor * src = ggml_permute(ctx0, t, 0, 2, 1, 3);   // [n_kv, n_h, n_w], rows contiguous
    ggml_build_forward_expand(gf, ggml_map_custom2_inplace(ctx0, dst, src, add_nonzero, GGML_N_TASKS_MAX, &acc));
}

// adds one ubatch's reduced output t ([n_kv, n_w, n_head]) to acc[il] ([n_w][n_head][kv_size], cells c0..c0+n_kv-1)
void accumulate(ggml_tensor * t, std::vector<kvcli_acc> & acc, uint32_t il, uint32_t n_layer, int64_t n_w,
                int64_t c0, int64_t n_kv, int64_t n_head, uint32_t kv_size) {
    const std::vector<float> tmp = host_copy(t);   // [n_kv, n_w, n_head]
    auto & a = layer_acc(acc, il, n_layer, (size_t) n_w * n_head * kv_size);
    for (int64_t w = 0; w < n_w; ++w) {
        for (int64_t h = 0; h < n_head; ++h) {
            float * dst = a.data() + ((size_t) w * n_head + h) * kv_size + c0;
            const float * src = tmp.data() + ((size_t) h * n_w + w) * n_kv;
            for (int64_t c = 0; c < n_kv; ++c) {
                dst[c] += src[c];
            }
        }
    }
}

// max-combines one ubatch's column maxima t ([n_kv, 1, n_head]) into acc[il] ([n_head][kv_size], cells c0..c0+n_kv-1)
void accumulate_max(ggml_tensor * t, std::vector<kvcli_acc> & acc, uint32_t il, uint32_t n_layer,
                    int64_t c0, int64_t n_kv, int64_t n_head, uint32_t kv_size) {
    const std::vector<float> tmp = host_copy(t);
    auto & a = layer_acc(acc, il, n_layer, (size_t) n_head * kv_size);
    for (int64_t h = 0; h < n_head; ++h) {
        float * dst = a.data() + (size_t) h * kv_size + c0;
        const float * src = tmp.data() + (size_t) h * n_kv;
        for (int64_t c = 0; c < n_kv; ++c) {
            dst[c] = std::max(dst[c], src[c]);
        }
    }
}

// The softmax rows p [n_kv, n_rows, n_head] summed with 0/1 weights sel [n_out, n_rows] (a window length's rows, the
// observed sequence's rows): [n_kv, n_out, n_head] in float32. ggml's out_prod with p first adds whole rows of p (one
// multiply-add of n_kv floats per (row, output, head)); a product over the rows would first transpose p, a copy of
// every probability (measured: 10% of a 21-row observed prefill over 5.6k cells).
ggml_tensor * row_sums(ggml_context * ctx0, ggml_tensor * p, ggml_tensor * sel) {
    ggml_tensor * s = ggml_repeat_4d(ctx0, sel, sel->ne[0], sel->ne[1], p->ne[2], 1);   // the weights for every head
    return ggml_out_prod(ctx0, p, s);
}

// The observation's raw scores K^T Q [n_kv, rows, n_head] of kk [hd, n_kv, n_head_kv] and qq [hd, rows, n_head]: the
// product the attention's few-rows path makes (kvcli_kq_product) where it runs, so that the probabilities handed to
// that path (kvcli_pending::probs) are the ones it would make itself; else ggml's, broadcast over the query heads.
ggml_tensor * scores(ggml_context * ctx0, ggml_tensor * kk, ggml_tensor * qq) {
    if (ggml_tensor * kq = kvcli_kq_product(ctx0, kk, qq)) {
        return kq;
    }
    ggml_tensor * kq = ggml_mul_mat(ctx0, kk, qq);
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    return kq;
}

// llama.cpp's attention soft-capping of the raw scores (gemma2; build_attn_mha without flash attention):
// cap * tanh(kq / cap), before soft_max_ext adds the mask (+ the slot bias) and applies kq_scale. Flash attention
// caps kq * kq_scale instead: the two agree when kq_scale is 1 (kvcli_attn_hook refuses to observe otherwise).
ggml_tensor * soft_cap(ggml_context * ctx0, ggml_tensor * kq, float cap) {
    if (cap == 0.0f) {
        return kq;
    }
    return ggml_scale(ctx0, ggml_tanh(ctx0, ggml_scale(ctx0, kq, 1.0f / cap)), cap);
}

// The first cell any sequence of the ubatch holds (its own rows are placed before the graph is built): every row of
// the ubatch is masked from the cells before it. 0 with several streams (a cell index is per stream) or a transposed V
// (its cells are not the outer dimension the views trim).
uint32_t first_seen_cell(const llama_kv_cache & kv, const llama_ubatch & ub) {
    if (kvcli_access::n_stream(kv) != 1 || kvcli_access::v_trans(kv)) {
        return 0;
    }
    const auto & cells = kvcli_access::cells(kv)[0];
    const uint32_t end = cells.used_max_p1();
    for (uint32_t c = 0; c < end; ++c) {
        if (cells.is_empty(c)) {
            continue;
        }
        for (uint32_t s = 0; s < ub.n_seqs_unq; ++s) {
            if (cells.seq_has(c, ub.seq_id_unq[s])) {
                return c;
            }
        }
    }
    return 0;
}

} } // namespace kvcli_graph_detail
using namespace kvcli_graph_detail;

ggml_tensor * kvcli_mul_mat_gqa(ggml_context * ctx0, ggml_tensor * a, ggml_tensor * b, bool f32_acc) {
    if (f32_acc) {   // a KQ's product: kvcli's kernel where it runs
        if (ggml_tensor * r = kvcli_kq_product(ctx0, a, b)) {
            return r;
        }
    }
    const int64_t ratio = a->ne[2] > 0 ? b->ne[2] / a->ne[2] : 0;
    if (ratio <= 1 || b->ne[2] != ratio * a->ne[2] || a->ne[3] != 1 || b->ne[3] != 1) {
        ggml_tensor * r = ggml_mul_mat(ctx0, a, b);
        if (f32_acc) {
            ggml_prec_set_acc(r, GGML_PREC_F32);
        }
        return r;
    }
    // ggml's CPU product broadcasts `a` over b's planes one plane (query head) at a time: at 30k cells and 8 rows that
    // streams a KV head's K and V 7 times a layer. Query head h = kv * ratio + j's columns lie, in a contiguous b, at
    // [j * N, (j + 1) * N) of KV head kv's plane of [K, N * ratio, n_head_kv]: the same dot products, one plane per KV head.
    if (!ggml_is_contiguous(b)) {
        b = ggml_cont(ctx0, b);
    }
    ggml_tensor * r = ggml_mul_mat(ctx0, a, ggml_reshape_3d(ctx0, b, b->ne[0], b->ne[1] * ratio, a->ne[2]));
    if (f32_acc) {
        ggml_prec_set_acc(r, GGML_PREC_F32);
    }
    return ggml_reshape_3d(ctx0, r, r->ne[0], b->ne[1], b->ne[2]);
}

uint64_t kvcli_graph_key(const llama_kv_cache_context * mctx) {
    if (!mctx) {
        return 0;
    }
    llama_kv_cache * kv = kvcli_access::kv(mctx);
    if (!kv) {
        return 0;
    }
    if (!kv->kvcli_ext) {
        return 1;   // nothing of kvcli's yet (kvcli_attn_hook makes its state)
    }
    auto & ext = *kv->kvcli_ext;
    const uint64_t bias = kvcli_bias_applies(mctx) ? 1 : 0;
    // the graph built next (after this call, for this ubatch) views the cells from the first one it can see
    const llama_ubatch * ub = kvcli_access::ubatch(mctx);
    ext.graph_first_seen = ub ? first_seen_cell(*kv, *ub) : 0;
    // never 0: every graph goes through kvcli_attn_hook and kvcli_build_attn, so that a ubatch of few rows is attended
    // the same way whether or not it is observed (kvcli_attention.cpp, the rows path). A relayout (kvcli_layout.cpp)
    // replaced the cache's tensors: a graph built over the old ones is not reused; nor is one whose views start at
    // another cell (bits 32-62)
    const uint64_t key = 1 | (bias << 1) | ((ext.layout_gen & 0x3fffffffu) << 2);
    if (ext.obs.armed) {
        // bit 63, and changed by every armed graph build (kvcli_attn_hook): no graph reuse while observing
        return key | (1ull << 63) | (((ext.obs.key_counter + 1) & 0x7fffffffu) << 32);
    }
    return key | ((uint64_t) (ext.graph_first_seen & 0x7fffffffu) << 32);
}

ggml_tensor * kvcli_attn_hook(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
                              const llama_kv_cache_context * mctx, const llama_ubatch & ubatch,
                              ggml_tensor * q, ggml_tensor ** kp, ggml_tensor ** vp, ggml_tensor * kq_b,
                              ggml_tensor * kq_mask, float kq_scale, int il) {
    llama_kv_cache * kv = kvcli_access::kv(mctx);
    if (!kv) {
        return kq_mask;
    }
    auto & ext = kvcli_ext_of(kv);
    ext.graph_one_seq = ubatch.n_seqs_unq == 1;
    ext.last_gf = gf;
    if (ext.obs.armed) {
        // the observation nodes built here hold this ubatch's rows: a later ubatch must build its own
        // graph, so the key stored with this graph (taken before this call) must not match again
        ++ext.obs.key_counter;
    }
    const auto & map_ids = kvcli_access::map_layer_ids(*kv);
    auto it = map_ids.find(il);
    if (it == map_ids.end() || (*kp)->ne[3] != 1 || kq_mask->ne[3] != 1) {
        return kq_mask; // one stream only (kvcli_require_supported)
    }
    // the ragged layout: this layer stores cells [c0, kv_size) only, so K, V and the mask start at c0; and none of
    // the ubatch's sequences sees a cell before the first it holds (view_start)
    const int64_t c0 = kvcli_cache_detail::view_start(ext, it->second);
    if (c0 > 0) {
        *kp = kvcli_cache_detail::trim_cells(ctx0, *kp, 2, c0);
        *vp = kvcli_cache_detail::trim_cells(ctx0, *vp, 2, c0);
        kq_mask = ggml_cont(ctx0, kvcli_cache_detail::trim_cells(ctx0, kq_mask, 0, c0));
    }
    ggml_tensor * k = *kp;
    const int64_t n_kv = k->ne[2], n_head = q->ne[1], n_tps = kq_mask->ne[1];
    ggml_tensor * bias = nullptr;
    ggml_tensor * mask = kq_mask;
    if (kvcli_bias_applies(mctx)) {
        bias = kvcli_cache_detail::bias_per_query_head(ctx0, ext.bias[it->second], c0, n_kv, n_head);
        mask = ggml_add(ctx0, ggml_repeat_4d(ctx0, kq_mask, n_kv, n_tps, n_head, 1), bias);
    }
    if (!ext.obs.armed) {
        return mask;
    }
    if (ext.obs.pending.size() <= (size_t) il) {
        ext.obs.pending.resize(il + 1);
    }
    ext.obs.pending[il] = kvcli_pending{};
    if (kq_b) {
        ext.obs.error = "this model adds a KQ bias in attention; kvcli observation does not support it";
        return mask;
    }
    if (q->ne[2] != (int64_t) ubatch.n_tokens || n_tps != (int64_t) ubatch.n_tokens) {
        return mask; // not a plain decode graph
    }
    const auto & hp = kvcli_access::hparams(*kv);
    const float cap = hp.attn_soft_cap ? hp.f_attn_logit_softcapping : 0.0f;
    if (cap != 0.0f && kq_scale != 1.0f) {
        ext.obs.error = "this model soft-caps attention scores with a KQ scale other than 1, where llama.cpp's "
                        "attention paths differ; kvcli observation does not support it";
        return mask;
    }

    auto inp = std::make_unique<obs_input>();
    kvcli_pending pend;
    pend.c0 = c0;
    // a cache in host memory: the graph adds its sums into the host accumulators (add_into_host)
    // (k is a view of the cache's tensor: a view has no buffer until the graph is allocated, its source has)
    const ggml_tensor * k_data = k->view_src ? k->view_src : k;
    const bool host_sums = k_data->buffer && ggml_backend_buffer_is_host(k_data->buffer);
    const uint32_t n_layer = hp.n_layer(), kv_size = kv->get_size();
    ggml_tensor * kk = ggml_permute(ctx0, k, 0, 2, 1, 3); // [hd, n_kv, n_head_kv]

    // Both kinds: softmax rows [n_kv, rows, n_head] (the allocator runs the softmax in place of the
    // KQ product), reduced over the rows by a product with a 0/1 selection: out[i, c, h] =
    // sum_r sel[i, r] * p[c, r, h] in float32, over the rows transposed first (see below).
    if ((ext.obs.kinds & (KVCLI_OBS_WINDOW | KVCLI_OBS_QUERY)) && !ext.obs.win_pos0.empty()) {
        const llama_pos first = *std::min_element(ext.obs.win_pos0.begin(), ext.obs.win_pos0.end());
        std::vector<llama_pos> win_pos;
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            if (row_in_seq(ubatch, i, ext.obs.seq) && ubatch.pos[i] >= first) {
                inp->win_rows.push_back((int32_t) i);
                win_pos.push_back(ubatch.pos[i]);
            }
        }
        ggml_tensor * q2 = nullptr;   // [hd * n_head, n_win]: the window rows of Q
        if (!inp->win_rows.empty()) {
            inp->win_idx = ggml_new_tensor_1d(ctx0, GGML_TYPE_I32, (int64_t) inp->win_rows.size());
            ggml_set_input(inp->win_idx);
            q2 = ggml_is_contiguous(q) ? q : ggml_cont(ctx0, q);
            q2 = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, q2, q->ne[0] * n_head, q->ne[2]), inp->win_idx);
            if (ext.obs.kinds & KVCLI_OBS_QUERY) {
                // the window queries' Q rows themselves (expected attention's query statistics): a graph output
                ggml_format_name(q2, "kvcli_obs_qrows-%d", il);
                ggml_set_output(q2);
                ggml_build_forward_expand(gf, q2);
                pend.qrows = q2;
                // the rows are the model's queries where kq_scale is 1/sqrt(head_dim); a model that scales Q itself
                // (phi3: Q / sqrt(head_dim), kq_scale 1) gets its scale undone on the host, so every model's rows
                // mean the same (expected attention's logit mu.k / sqrt(head_dim))
                const double f = (double) kq_scale * std::sqrt((double) q->ne[0]);
                pend.qscale = std::fabs(f - 1.0) > 1e-6 ? (float) f : 1.0f;
            }
        }
        if (q2 && (ext.obs.kinds & KVCLI_OBS_WINDOW)) {
            const int64_t n_win = inp->win_rows.size(), n_w = ext.obs.win_pos0.size();
            inp->win_w.assign(n_w * n_win, 0.0f);
            for (int64_t r = 0; r < n_win; ++r) {
                for (int64_t w = 0; w < n_w; ++w) {
                    inp->win_w[r * n_w + w] = win_pos[r] >= ext.obs.win_pos0[w] ? 1.0f : 0.0f;
                }
            }
            inp->win_sel = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, n_w, n_win);
            ggml_set_input(inp->win_sel);
            ggml_tensor * mw = ggml_get_rows(ctx0, ggml_reshape_2d(ctx0, kq_mask, n_kv, n_tps), inp->win_idx); // F32
            if (bias) {
                mw = ggml_add(ctx0, ggml_repeat_4d(ctx0, mw, n_kv, n_win, n_head, 1), bias);
            }
            ggml_tensor * q3 = ggml_reshape_3d(ctx0, q2, q->ne[0], n_head, n_win);                // [hd, n_head, n_win]
            if (host_sums) {
                layer_acc(ext.obs.winsum, il, n_layer, (size_t) n_w * n_head * kv_size);
                pend.win_added = true;
            }
            if (host_sums && n_win == (int64_t) ubatch.n_tokens && n_win <= KVCLI_FEW_ROWS_MAX) {
                // every row of a few-rows ubatch: kvcli_build_attn builds it beside the attention, a group of
                // heads at a time (kvcli_obs_window_group)
                pend.defer = { gf, q3, k, mw, inp->win_sel, kq_scale, cap, c0, kv_size };
            } else {
                ggml_tensor * kq = scores(ctx0, kk, ggml_permute(ctx0, q3, 0, 2, 1, 3));       // [n_kv, n_win, n_head]
                kq = soft_cap(ctx0, kq, cap);
                ggml_tensor * p  = ggml_soft_max_ext(ctx0, kq, mw, kq_scale, 0.0f);
                if (n_win == (int64_t) ubatch.n_tokens) {
                    pend.probs = p;   // every row of the ubatch, in order: the attention's probabilities
                }
                ggml_tensor * ws = row_sums(ctx0, p, inp->win_sel);                   // [n_kv, n_w, n_head]
                ggml_format_name(ws, "kvcli_obs_winsum-%d", il);
                if (host_sums) {
                    add_into_host(ctx0, gf, ext.obs.winsum[il], ws, c0, kv_size, n_head);
                } else {
                    ggml_set_output(ws);
                    ggml_build_forward_expand(gf, ws);
                    pend.win = ws;
                }
            }
        }
    }
    if (ext.obs.kinds & (KVCLI_OBS_COLSUM | KVCLI_OBS_COLMAX)) {
        inp->col_w.assign(ubatch.n_tokens, 0.0f);
        bool any = false, all = true;
        for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
            if (row_in_seq(ubatch, i, ext.obs.seq)) {
                inp->col_w[i] = 1.0f;
                any = true;
            } else {
                all = false;
            }
        }
        if (any) {
            inp->col_sel = ggml_new_tensor_2d(ctx0, GGML_TYPE_F32, 1, ubatch.n_tokens);
            ggml_set_input(inp->col_sel);
            ggml_tensor * qq = ggml_permute(ctx0, q, 0, 2, 1, 3);       // [hd, n_tps, n_head]
            ggml_tensor * kq = scores(ctx0, kk, qq);                   // [n_kv, n_tps, n_head]
            ggml_tensor * p  = ggml_soft_max_ext(ctx0, soft_cap(ctx0, kq, cap), mask, kq_scale, 0.0f);
            pend.probs = p;       // every row of the ubatch: the attention's probabilities
            if (ext.obs.kinds & KVCLI_OBS_COLSUM) {
                ggml_tensor * cs = row_sums(ctx0, p, inp->col_sel);        // [n_kv, 1, n_head]
                ggml_format_name(cs, "kvcli_obs_colsum-%d", il);
                if (host_sums) {
                    add_into_host(ctx0, gf, layer_acc(ext.obs.colsum, il, n_layer, (size_t) n_head * kv_size), cs, c0,
                                  kv_size, n_head);
                    pend.col_added = true;
                } else {
                    ggml_set_output(cs);
                    ggml_build_forward_expand(gf, cs);
                    pend.col = cs;
                }
            }
            if (ext.obs.kinds & KVCLI_OBS_COLMAX) {
                // rows of other sequences are zeroed (probabilities are >= 0, so they cannot raise a maximum),
                // then a max pool whose kernel spans every row: [n_kv, 1, n_head]
                ggml_tensor * pm = all ? p : ggml_mul(ctx0, p, ggml_reshape_2d(ctx0, inp->col_sel, 1, ubatch.n_tokens));
                ggml_tensor * cm = ggml_pool_2d(ctx0, pm, GGML_OP_POOL_MAX, 1, (int) n_tps, 1, (int) n_tps, 0.0f, 0.0f);
                ggml_format_name(cm, "kvcli_obs_colmax-%d", il);
                ggml_set_output(cm);
                ggml_build_forward_expand(gf, cm);
                pend.cmax = cm;
            }
        }
    } else {
        inp->col_w.clear();
    }
    ext.obs.pending[il] = std::move(pend);
    res->add_input(std::move(inp));
    return mask;
}

ggml_tensor * kvcli_obs_window_group(ggml_context * ctx0, kvcli_kv_ext & ext, int il, int64_t h0, int64_t h1) {
    const kvcli_window_defer & d = ext.obs.pending[il].defer;
    const int64_t hd = d.q3->ne[0], n_head = d.q3->ne[1], n_rows = d.q3->ne[2];
    const int64_t n_head_kv = d.k->ne[1], n_kv = d.k->ne[2], ratio = n_head / n_head_kv;
    const int64_t g0 = h0 / ratio, g1 = h1 / ratio;   // the KV heads of query heads h0..h1-1 (GQA)
    ggml_tensor * qg = ggml_permute(ctx0, ggml_view_3d(ctx0, d.q3, hd, h1 - h0, n_rows, d.q3->nb[1], d.q3->nb[2],
                                                       (size_t) h0 * d.q3->nb[1]), 0, 2, 1, 3);   // [hd, rows, hg]
    ggml_tensor * kg = ggml_permute(ctx0, ggml_view_3d(ctx0, d.k, hd, g1 - g0, n_kv, d.k->nb[1], d.k->nb[2],
                                                       (size_t) g0 * d.k->nb[1]), 0, 2, 1, 3);    // [hd, n_kv, gk]
    ggml_tensor * kq = kvcli_mul_mat_gqa(ctx0, kg, qg, true);                                   // [n_kv, rows, hg]
    kq = soft_cap(ctx0, kq, d.cap);
    ggml_tensor * mask = d.mask->ne[2] == 1 ? d.mask :
        ggml_view_3d(ctx0, d.mask, n_kv, n_rows, h1 - h0, d.mask->nb[1], d.mask->nb[2], (size_t) h0 * d.mask->nb[2]);
    ggml_tensor * p = ggml_soft_max_ext_inplace(ctx0, kq, mask, d.kq_scale, 0.0f);   // as rows_attention_all
    ggml_tensor * ws = row_sums(ctx0, p, d.sel);                                                // [n_kv, n_w, hg]
    ggml_format_name(ws, "kvcli_obs_winsum-%d-h%d", il, (int) h0);
    add_into_host(ctx0, d.gf, ext.obs.winsum[il], ws, d.c0, d.kv_size, n_head, h0);
    return p;
}

void kvcli_after_compute(llama_context * lctx, const llama_ubatch & ubatch) {
    llama_memory_t mem = lctx->get_memory();
    auto * kv = mem ? dynamic_cast<llama_kv_cache *>(mem) : nullptr;
    if (!kv && mem) {
        kv = kvcli_iswa_base(mem);
    }
    if (!kv || !kv->kvcli_ext || !kv->kvcli_ext->obs.armed) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    bool any = false;
    for (const auto & p : ext.obs.pending) {
        any = any || p.win || p.col || p.cmax || p.qrows || p.win_added || p.col_added;
    }
    if (!any) {
        return;
    }
    ggml_backend_sched_synchronize(lctx->get_sched());
    const uint32_t n_layer = kvcli_access::hparams(*kv).n_layer();
    const uint32_t kv_size = kv->get_size();

    // window rows counted once per ubatch (every layer saw the same rows), query positions too
    bool counted = false, queried = false;
    for (uint32_t il = 0; il < ext.obs.pending.size() && il < n_layer; ++il) {
        auto & p = ext.obs.pending[il];
        if (p.win || p.win_added) {
            const int64_t n_w = (int64_t) ext.obs.win_pos0.size();
            if (!counted) {
                for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
                    for (int64_t w = 0; w < n_w; ++w) {
                        ext.obs.win_rows[w] += row_in_seq(ubatch, i, ext.obs.seq) && ubatch.pos[i] >= ext.obs.win_pos0[w];
                    }
                }
                counted = true;
            }
            if (p.win) {   // else the graph added them itself (add_into_host)
                accumulate(p.win, ext.obs.winsum, il, n_layer, n_w, p.c0, p.win->ne[0], p.win->ne[2], kv_size);
            } else {
                ext.obs.winsum[il].mark_written();
            }
        }
        if (p.col_added) {
            ext.obs.colsum[il].mark_written();
        }
        if (p.col) {
            accumulate(p.col, ext.obs.colsum, il, n_layer, 1, p.c0, p.col->ne[0], p.col->ne[2], kv_size);
        }
        if (p.col || p.col_added) {
            ext.obs.have_colsum = true;
        }
        if (p.cmax) {
            accumulate_max(p.cmax, ext.obs.colmax, il, n_layer, p.c0, p.cmax->ne[0], p.cmax->ne[2], kv_size);
            ext.obs.have_colmax = true;
        }
        if (p.qrows) {
            // the window queries' Q rows, appended in decode order; their positions once per ubatch
            if (!queried) {
                const llama_pos first = *std::min_element(ext.obs.win_pos0.begin(), ext.obs.win_pos0.end());
                for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
                    if (row_in_seq(ubatch, i, ext.obs.seq) && ubatch.pos[i] >= first) {
                        ext.obs.query_pos.push_back(ubatch.pos[i]);
                    }
                }
                ext.obs.query_width = p.qrows->ne[0];
                queried = true;
            }
            if (ext.obs.queries.size() != n_layer) {
                ext.obs.queries.assign(n_layer, {});
            }
            std::vector<float> rows = host_copy(p.qrows);
            if (p.qscale != 1.0f) {
                for (auto & x : rows) x *= p.qscale;
            }
            auto & dst = ext.obs.queries[il];
            dst.insert(dst.end(), rows.begin(), rows.end());
        }
        p = kvcli_pending{};
    }
}

// ---------------------------------------------------------------------------------
// C API: observation
// ---------------------------------------------------------------------------------

namespace kvcli_graph_detail { namespace { // internal linkage; the outer name keeps unity builds apart

kvcli_kv_ext & observed(llama_context * ctx, llama_kv_cache ** kv_out = nullptr) {
    llama_kv_cache * kv = kvcli_cache_of(ctx);
    if (!kv->kvcli_ext) {
        throw kvcli_error("nothing was observed on this context (call kvcli_observe_begin first)");
    }
    if (!kv->kvcli_ext->obs.error.empty()) {
        throw kvcli_error(kv->kvcli_ext->obs.error);
    }
    if (kv_out) {
        *kv_out = kv;
    }
    return *kv->kvcli_ext;
}

// dst[h][i] = acc[il][(w * n_head + h) * kv_size + cells[i]]: a layer's accumulated sums over the sequence's cells
// (window sums when `window`, else column sums)
int32_t read_sums(llama_context * ctx, bool window, int32_t il, int32_t w, float * dst, bool colmax = false) {
    llama_kv_cache * kv = nullptr;
    auto & ext = observed(ctx, &kv);
    const auto & hp = kvcli_access::hparams(*kv);
    const int32_t n_w = window ? (int32_t) ext.obs.win_pos0.size() : 1;
    if (il < 0 || (uint32_t) il >= hp.n_layer() || w < 0 || w >= n_w || !dst) {
        throw kvcli_error(std::string(window ? "kvcli_observe_read_window_sum" : colmax ? "kvcli_observe_read_colmax"
                                      : "kvcli_observe_read_colsum") + ": bad layer, window index or dst");
    }
    const auto & acc = window ? ext.obs.winsum : colmax ? ext.obs.colmax : ext.obs.colsum;
    if (acc.size() <= (size_t) il || acc[il].empty()) {
        throw kvcli_error("layer " + std::to_string(il) + " was not observed (no armed llama_decode held tokens "
                          "of the observed sequence), or its sums were released (kvcli_observe_release)");
    }
    const auto cells = kvcli_seq_cells(*kv, ext.obs.seq);
    const int64_t n = cells.size(), n_head = hp.n_head(il);
    const uint32_t kv_size = kv->get_size();
    const float * src = acc[il].data() + (size_t) w * n_head * kv_size;
    for (int64_t h = 0; h < n_head; ++h) {
        for (int64_t i = 0; i < n; ++i) {
            dst[(size_t) h * n + i] = src[(size_t) h * kv_size + cells[i]];
        }
    }
    return (int32_t) n;
}

void require_window_kind(const kvcli_kv_ext & ext) {
    if (!(ext.obs.kinds & KVCLI_OBS_WINDOW)) {
        throw kvcli_error("window attention was not observed (kinds did not include KVCLI_OBS_WINDOW)");
    }
}

} } // namespace kvcli_graph_detail
using namespace kvcli_graph_detail;

extern "C" {

int32_t kvcli_observe_begin(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t kinds, int32_t n_windows,
                            const int32_t * window_pos0) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_require_supported(kv);
        kvcli_check_seq(*kv, seq_id);
        if (kinds <= 0 || (kinds & ~(KVCLI_OBS_WINDOW | KVCLI_OBS_COLSUM | KVCLI_OBS_COLMAX | KVCLI_OBS_QUERY)) != 0) {
            throw kvcli_error("observation kinds must be a non-empty combination of KVCLI_OBS_WINDOW, KVCLI_OBS_COLSUM, "
                              "KVCLI_OBS_COLMAX and KVCLI_OBS_QUERY");
        }
        const bool want_window = kinds & (KVCLI_OBS_WINDOW | KVCLI_OBS_QUERY);
        if (want_window != (n_windows > 0) || n_windows < 0 || n_windows > KVCLI_OBS_MAX_WINDOWS ||
            (n_windows > 0 && !window_pos0)) {
            throw kvcli_error("KVCLI_OBS_WINDOW and KVCLI_OBS_QUERY need 1.." + std::to_string(KVCLI_OBS_MAX_WINDOWS) +
                              " window first positions (and none without it)");
        }
        for (int32_t i = 0; i < n_windows; ++i) {
            if (window_pos0[i] < 0) {
                throw kvcli_error("window_pos0 must be >= 0");
            }
        }
        llama_synchronize(ctx);
        auto & ext = kvcli_ext_of(kv);
        ext.obs.armed     = true;
        ext.obs.seq   = seq_id;
        ext.obs.kinds = kinds;
        ext.obs.win_pos0.assign(window_pos0, window_pos0 + n_windows);
        ext.obs.win_rows.assign(n_windows, 0);
        ext.obs.error.clear();
        ext.obs.pending.clear();
        ext.obs.winsum.clear();
        ext.obs.colsum.clear();
        ext.obs.have_colsum = false;
        ext.obs.colmax.clear();
        ext.obs.have_colmax = false;
        ext.obs.queries.clear();
        ext.obs.query_pos.clear();
        ext.obs.query_width = 0;
        return 0;
    });
}

int32_t kvcli_observe_end(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        llama_synchronize(ctx);
        if (kv->kvcli_ext) {
            kv->kvcli_ext->obs.armed = false;
            kv->kvcli_ext->obs.pending.clear();
        }
        return 0;
    });
}

int32_t kvcli_observe_n_slots(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = nullptr;
        auto & ext = observed(ctx, &kv);
        return (int32_t) kvcli_seq_cells(*kv, ext.obs.seq).size();
    });
}

int32_t kvcli_observe_n_window(struct llama_context * ctx, int32_t iw) {
    return kvcli_guarded([&] {
        const auto & ext = observed(ctx);
        require_window_kind(ext);
        if (iw < 0 || (size_t) iw >= ext.obs.win_rows.size()) {
            throw kvcli_error("kvcli_observe_n_window: bad window index");
        }
        return ext.obs.win_rows[iw];
    });
}

int32_t kvcli_observe_read_window_sum(struct llama_context * ctx, int32_t il, int32_t iw, float * dst) {
    return kvcli_guarded([&] {
        const auto & ext = observed(ctx);
        require_window_kind(ext);
        return read_sums(ctx, true, il, iw, dst);
    });
}

int32_t kvcli_observe_release(struct llama_context * ctx, int32_t il) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = nullptr;
        auto & ext = observed(ctx, &kv);
        const int32_t n_layer = (int32_t) kvcli_access::hparams(*kv).n_layer();
        if (il < -1 || il >= n_layer) {
            throw kvcli_error("kvcli_observe_release: bad layer " + std::to_string(il));
        }
        if (ext.obs.armed) {
            throw kvcli_error("kvcli_observe_release: the observation is still armed (call kvcli_observe_end first)");
        }
        const int32_t lo = il < 0 ? 0 : il, hi = il < 0 ? n_layer : il + 1;
        for (auto * acc : {&ext.obs.winsum, &ext.obs.colsum, &ext.obs.colmax}) {
            for (int32_t l = lo; l < hi && (size_t) l < acc->size(); ++l) {
                (*acc)[l].release();                    // its pages back to the OS
            }
        }
        for (int32_t l = lo; l < hi && (size_t) l < ext.obs.queries.size(); ++l) {
            std::vector<float>().swap(ext.obs.queries[l]);   // clear() would keep the capacity
        }
#if defined(__GLIBC__)
        // a layer's accumulators (n_head x kv_size floats, ~260 KB at 7k cells) sit on the heap once glibc's
        // dynamic mmap threshold has risen: freed, they stay resident until the heap is trimmed, while their
        // copy is being written (measured: a transient +7 MB at 7k tokens without this)
        malloc_trim(0);
#endif
        return 0;
    });
}

int32_t kvcli_observe_read_colsum(struct llama_context * ctx, int32_t il, float * dst) {
    return kvcli_guarded([&] {
        const auto & ext = observed(ctx);
        if (!(ext.obs.kinds & KVCLI_OBS_COLSUM)) {
            throw kvcli_error("column sums were not observed (kinds did not include KVCLI_OBS_COLSUM)");
        }
        if (!ext.obs.have_colsum) {
            throw kvcli_error("no column sums were captured (no armed llama_decode held tokens of the observed sequence)");
        }
        return read_sums(ctx, false, il, 0, dst);
    });
}

int32_t kvcli_observe_read_colmax(struct llama_context * ctx, int32_t il, float * dst) {
    return kvcli_guarded([&] {
        const auto & ext = observed(ctx);
        if (!(ext.obs.kinds & KVCLI_OBS_COLMAX)) {
            throw kvcli_error("column maxima were not observed (kinds did not include KVCLI_OBS_COLMAX)");
        }
        if (!ext.obs.have_colmax) {
            throw kvcli_error("no column maxima were captured (no armed llama_decode held tokens of the observed sequence)");
        }
        return read_sums(ctx, false, il, 0, dst, true);
    });
}

int32_t kvcli_observe_n_queries(struct llama_context * ctx, int32_t * pos) {
    return kvcli_guarded([&] {
        const auto & ext = observed(ctx);
        if (!(ext.obs.kinds & KVCLI_OBS_QUERY)) {
            throw kvcli_error("query rows were not observed (kinds did not include KVCLI_OBS_QUERY)");
        }
        if (pos) {
            std::copy(ext.obs.query_pos.begin(), ext.obs.query_pos.end(), pos);
        }
        return (int32_t) ext.obs.query_pos.size();
    });
}

int32_t kvcli_observe_read_queries(struct llama_context * ctx, int32_t il, float * dst) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = nullptr;
        const auto & ext = observed(ctx, &kv);
        if (!(ext.obs.kinds & KVCLI_OBS_QUERY)) {
            throw kvcli_error("query rows were not observed (kinds did not include KVCLI_OBS_QUERY)");
        }
        const auto & hp = kvcli_access::hparams(*kv);
        if (il < 0 || (uint32_t) il >= hp.n_layer() || !dst) {
            throw kvcli_error("kvcli_observe_read_queries: bad layer or dst");
        }
        const int64_t n_rows = (int64_t) ext.obs.query_pos.size(), n_head = hp.n_head(il);
        if (ext.obs.queries.size() <= (size_t) il || ext.obs.queries[il].empty() || n_rows == 0 ||
            ext.obs.query_width % n_head != 0 || (int64_t) ext.obs.queries[il].size() != n_rows * ext.obs.query_width) {
            throw kvcli_error("layer " + std::to_string(il) + ": no query rows were captured (no armed llama_decode held "
                              "window queries of the observed sequence), or they were released (kvcli_observe_release)");
        }
        const int64_t hd = ext.obs.query_width / n_head;
        const float * src = ext.obs.queries[il].data();   // [n_rows][n_head][hd]
        for (int64_t h = 0; h < n_head; ++h) {
            for (int64_t r = 0; r < n_rows; ++r) {
                std::memcpy(dst + ((size_t) h * n_rows + r) * hd, src + ((size_t) r * n_head + h) * hd, hd * sizeof(float));
            }
        }
        return (int32_t) n_rows;
    });
}

} // extern "C"
