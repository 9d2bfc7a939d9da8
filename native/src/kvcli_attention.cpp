// kvcli: the attention of a layer whose KV cache holds a compacted sequence, on ops that the cache's
// own backend runs (issue #17).
//
// A compacted cache carries a slot bias per (cell, KV head), so its mask differs per head. The mask
// path (kvcli_attn_hook's [n_kv, n_tokens, n_head] mask into llama.cpp's attention) is fine without
// flash attention (soft_max_ext broadcasts a per-head mask on every backend) and on the CPU, but
// ggml-cuda's flash-attention kernels take only masks with ne[2] == 1: the scheduler then runs that op
// on the CPU. The split path gives flash attention one problem per KV head, batched in ggml's outer
// dimension (the one llama.cpp uses for KV streams, whose mask every kernel indexes per "sequence"):
//   Q    [hd, n_tokens, g, n_head_kv]   query head h*g + r at (r, h), g = n_head / n_head_kv
//   K, V [hd, n_kv, 1, n_head_kv]       views of the cache, no copy
//   mask [n_kv, n_tokens, 1, n_head_kv] llama.cpp's causal mask + the slot bias of KV head h
// and puts the output back in llama.cpp's head order. One op per layer, as llama.cpp's own.
#include "kvcli_attention.h"
#include "kvcli_cache.h"

#include "llama-impl.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvcli_attention_detail { namespace { // internal linkage; the outer name keeps unity builds apart

struct path_choice {
    int32_t      path; // kvcli_attn_path_kind, or -1 for a bad KVCLI_ATTN_PATH
    const char * why;
};

path_choice choose(bool flash_attn, bool cache_on_cpu) {
    const char * env = std::getenv("KVCLI_ATTN_PATH");
    const std::string s = env ? env : "";
    if (s != "" && s != "auto" && s != "split" && s != "mask") {
        return { -1, "KVCLI_ATTN_PATH must be auto, split or mask" };
    }
    if (!flash_attn) {
        return { KVCLI_ATTN_PATH_MASK, "flash attention is off: mul_mat + soft_max_ext take the per-head mask on every "
                                       "backend (KVCLI_ATTN_PATH applies to flash-attention contexts)" };
    }
    if (s == "split") {
        return { KVCLI_ATTN_PATH_SPLIT, "KVCLI_ATTN_PATH=split: flash attention per KV head, one op" };
    }
    if (s == "mask") {
        return { KVCLI_ATTN_PATH_MASK, "KVCLI_ATTN_PATH=mask: flash attention with a per-head mask (only the CPU "
                                       "kernel takes it: a cache on a GPU runs that op on the CPU)" };
    }
    if (cache_on_cpu) {
        return { KVCLI_ATTN_PATH_MASK, "auto, KV cache on the CPU: its flash-attention kernel takes the per-head mask" };
    }
    return { KVCLI_ATTN_PATH_SPLIT, "auto, KV cache on an accelerator: its flash-attention kernels take only masks "
                                    "shared by all heads, so one problem per KV head" };
}

// How many groups of KV heads (at most `want`, dividing n_head_kv) the attention of layer il can be built in: each
// group adds about `per_group` tensors, and llama.cpp sizes a graph's metadata and nodes for its own (8 x the model's
// tensors on most models). Greedy: a layer gets its groups when, after them, the graph still has room for every later
// layer at what the layers built so far in this graph took on average (from the first layer that asked: the prelude
// is not a layer's), and each later layer decides again. The graph's own arrays, which live in the same context, are
// not counted as tensors (they once made the first layers look many times their size, and refused them groups).
int64_t groups_with_room(ggml_context * ctx0, ggml_cgraph * gf, int il, int n_layer, int64_t n_head_kv, int64_t want,
                         int64_t per_group) {
    struct track {
        const ggml_cgraph * gf = nullptr;
        int il0 = 0, il = -1;
        int64_t nodes0 = 0, objs0 = 0;   // at the first layer that asked
    };
    static thread_local track t;
    const size_t per = ggml_tensor_overhead(), mem_used = ggml_used_mem(ctx0);
    const size_t own = gf ? ggml_graph_overhead_custom(ggml_graph_size(gf), false) : 0;
    const int64_t objs = (int64_t) ((mem_used - std::min(mem_used, own)) / per);
    const int64_t objs_left = (int64_t) ((ggml_get_mem_size(ctx0) - mem_used) / per);
    const int64_t nodes = gf ? ggml_graph_n_nodes(gf) : 0, nodes_left = gf ? ggml_graph_size(gf) - nodes : 0;
    if (t.gf != gf || il <= t.il) {   // a new graph (llama.cpp rebuilds into the same one)
        t = { gf, il, il, nodes, objs };
    }
    t.il = il;
    const int64_t done = il - t.il0, after = std::max(0, n_layer - il - 1);
    // a layer's tensors, those of the groups granted so far included (more than a layer without groups takes: the
    // estimate errs towards room); before any layer is done, what the prelude and this layer's start took, + 16
    const int64_t layer_objs  = done > 0 ? (objs - t.objs0) / done + 4 : objs + 16;
    const int64_t layer_nodes = done > 0 ? (nodes - t.nodes0) / done + 4 : nodes + 16;
    int64_t groups = std::min<int64_t>(want, n_head_kv);
    for (; groups > 1; --groups) {
        const int64_t extra = (groups - 1) * per_group;
        const bool room = objs_left >= extra + layer_objs * after + 64 &&
                          (!gf || nodes_left >= extra + layer_nodes * after + 64);
        if (room && n_head_kv % groups == 0) {
            break;
        }
    }
    return std::max<int64_t>(groups, 1);
}

// q [hd, n_head, n_tokens], k/v views of the cache [hd, n_head_kv, n_kv, 1] (V not transposed) from cell c0,
// kq_mask [n_kv, n_tps, 1, 1] F16 from cell c0, bias [kv_size, n_head_kv] F32 -> [hd_v * n_head, n_tokens];
// soft_cap: llama.cpp's logit_softcap of flash attention (0: none)
ggml_tensor * split_attention(ggml_context * ctx0, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v,
                              ggml_tensor * kq_mask, ggml_tensor * bias, int64_t c0, float kq_scale, float soft_cap,
                              int il) {
    const int64_t hd = q->ne[0], n_head = q->ne[1], n_tokens = q->ne[2];
    const int64_t n_head_kv = k->ne[1], n_kv = k->ne[2], g = n_head / n_head_kv;

    q = ggml_view_4d(ctx0, q, hd, g, n_head_kv, n_tokens, q->nb[1], q->nb[1] * g, q->nb[2], 0);
    q = ggml_permute(ctx0, q, 0, 2, 3, 1);  // [hd, n_tokens, g, n_head_kv]
    k = ggml_permute(ctx0, k, 0, 3, 1, 2);  // [hd, n_kv, 1, n_head_kv]
    v = ggml_permute(ctx0, v, 0, 3, 1, 2);
    // as build_attn_mha: flash attention reads K/V as F16 when the cache is F32
    if (k->type == GGML_TYPE_F32) {
        k = ggml_cast(ctx0, k, GGML_TYPE_F16);
    }
    if (v->type == GGML_TYPE_F32) {
        v = ggml_cast(ctx0, v, GGML_TYPE_F16);
    }

    ggml_tensor * b = ggml_view_4d(ctx0, bias, n_kv, 1, 1, n_head_kv, bias->nb[1], bias->nb[1], bias->nb[1],
                                   c0 * bias->nb[0]);
    ggml_tensor * mask = ggml_add(ctx0, ggml_repeat_4d(ctx0, kq_mask, n_kv, kq_mask->ne[1], 1, n_head_kv), b);

    ggml_tensor * cur = ggml_flash_attn_ext(ctx0, q, k, v, mask, kq_scale, 0.0f, soft_cap);
    ggml_prec_set_acc(cur, GGML_PREC_F32);
    ggml_format_name(cur, "kvcli_split_fa-%d", il);
    // [hd_v, g, n_tokens, n_head_kv] -> [hd_v * (g, n_head_kv), n_tokens]: llama.cpp's head order h*g + r.
    // One token (decoding): the output's memory is that order already, so a reshape, not a copy per layer.
    if (n_tokens == 1) {
        return ggml_reshape_2d(ctx0, cur, cur->ne[0] * n_head, 1);
    }
    return ggml_cont_2d(ctx0, ggml_permute(ctx0, cur, 0, 1, 3, 2), cur->ne[0] * n_head, n_tokens);
}

// A ubatch of few query rows (a question after a resident document) on the CPU: ggml's flash-attention kernel takes
// a ubatch of under GGML_FA_TILE_Q (64) rows one row at a time, a scalar exp and two 64-wide f16 products per (row,
// head, cell); the same arithmetic as two matrix products runs 2-3x faster at 20 rows over 5.6k cells (measured:
// native/src/README.md, "What a later question costs"). Decoding (one row) keeps flash attention, whose one-row
// kernel splits the cells over the threads; 64 rows and more take ggml's tiled kernel.
constexpr int64_t FEW_ROWS_MAX = KVCLI_FEW_ROWS_MAX;

// the path layer il of a graph with a compacted sequence took (kvcli_attn_path_taken)
void record_path(kvcli_kv_ext & ext, int il, int32_t path) {
    if (ext.attn_path.size() <= (size_t) il) {
        ext.attn_path.resize(il + 1, 0);
    }
    ext.attn_path[il] = path;
}

bool few_rows(bool flash_attn, const ggml_tensor * q, const ggml_tensor * k, const ggml_tensor * v,
              const ggml_tensor * kq_b, const ggml_tensor * sinks, const ggml_tensor * kq_mask) {
    const char * env = std::getenv("KVCLI_ATTN_PATH");
    if (env && *env && std::strcmp(env, "auto") != 0) {
        return false;   // a path named by $KVCLI_ATTN_PATH is taken as named
    }
    auto plain = [](const ggml_tensor * t) { return t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_F32; };
    const int64_t n_tokens = q->ne[2];
    return flash_attn && kvcli_on_cpu(k) && n_tokens > 1 && n_tokens <= FEW_ROWS_MAX && !kq_b && !sinks &&
           k->ne[3] == 1 && kq_mask->ne[2] == 1 && kq_mask->ne[3] == 1 && plain(k) && plain(v) &&
           v->nb[1] <= v->nb[2] && q->ne[1] % k->ne[1] == 0 && k->ne[0] == q->ne[0];
}

// q [hd, n_head, n_tokens], k/v views of the cache [hd, n_head_kv, n_kv, 1] (V not transposed), mask [n_kv, n_tokens,
// 1 or n_head] -> [hd_v * n_head, n_tokens]. Flash attention's semantics: the soft cap applies to kq * kq_scale, the
// mask after it. V is read as F32, transposed once per layer (the cells' rows are contiguous in the products).
// p: the probabilities when the observation made them already (kvcli_pending::probs), else nullptr.
ggml_tensor * rows_attention_all(ggml_context * ctx0, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * mask,
                                 ggml_tensor * p, float kq_scale, float soft_cap, int il) {
    const int64_t n_head = q->ne[1], n_tokens = q->ne[2];
    if (!p) {
        ggml_tensor * kq = kvcli_mul_mat_gqa(ctx0, ggml_permute(ctx0, k, 0, 2, 1, 3), // [hd, n_kv, n_head_kv]
                                             ggml_permute(ctx0, q, 0, 2, 1, 3),      // [hd, n_tokens, n_head]
                                             true);                                  // [n_kv, n_tokens, n_head]
        float scale = kq_scale;
        if (soft_cap != 0.0f) {
            kq = ggml_scale(ctx0, ggml_tanh(ctx0, ggml_scale(ctx0, kq, kq_scale / soft_cap)), soft_cap);
            scale = 1.0f;
        }
        // in place: kq is a reshape of the product (kvcli_mul_mat_gqa), which ggml's allocator does not reuse for
        // the result by itself, and the CPU kernel reads each row before writing it
        p = ggml_soft_max_ext_inplace(ctx0, kq, mask, scale, 0.0f);
    }
    ggml_tensor * vt = ggml_cast(ctx0, ggml_permute(ctx0, v, 1, 2, 0, 3), GGML_TYPE_F32); // [n_kv, hd_v, n_head_kv]
    ggml_tensor * kqv = kvcli_mul_mat_gqa(ctx0, vt, p, false);                    // [hd_v, n_tokens, n_head]
    if (il >= 0) {
        ggml_format_name(kqv, "kvcli_rows_kqv-%d", il);
    }
    return ggml_cont_2d(ctx0, ggml_permute(ctx0, kqv, 0, 2, 1, 3), kqv->ne[0] * n_head, n_tokens);
}

// The same, a group of KV heads at a time where the probabilities are its own to make (at most 4 groups, as
// rows_attention_grouped): the graph takes each group's chain whole before the next (concat's first source first),
// so the allocator frees a group's [n_kv, rows, heads] probabilities and F32 values before the next group's exist.
// Every head's products are the ones rows_attention_all makes, so the result is the same to the bit.
ggml_tensor * rows_attention(ggml_context * ctx0, ggml_cgraph * gf, int n_layer, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, ggml_tensor * mask, ggml_tensor * p, float kq_scale, float soft_cap, int il) {
    const int64_t n_head = q->ne[1], n_tokens = q->ne[2], n_head_kv = k->ne[1];
    const bool mask_per_head = mask->ne[2] == n_head && n_head > 1;
    const int64_t groups = !p && (mask->ne[2] == 1 || mask_per_head) ?
        groups_with_room(ctx0, gf, il, n_layer, n_head_kv, 4, 21) : 1;
    if (groups > 1) {
        const int64_t kv_step = n_head_kv / groups, q_step = kv_step * (n_head / n_head_kv);
        ggml_tensor * out = nullptr;
        for (int64_t g = 0; g < groups; ++g) {
            ggml_tensor * qg = ggml_view_3d(ctx0, q, q->ne[0], q_step, n_tokens, q->nb[1], q->nb[2],
                                            (size_t) g * q_step * q->nb[1]);
            ggml_tensor * kg = ggml_view_4d(ctx0, k, k->ne[0], kv_step, k->ne[2], 1, k->nb[1], k->nb[2], k->nb[3],
                                            (size_t) g * kv_step * k->nb[1]);
            ggml_tensor * vg = ggml_view_4d(ctx0, v, v->ne[0], kv_step, v->ne[2], 1, v->nb[1], v->nb[2], v->nb[3],
                                            (size_t) g * kv_step * v->nb[1]);
            ggml_tensor * mg = !mask_per_head ? mask : ggml_view_3d(ctx0, mask, mask->ne[0], mask->ne[1], q_step,
                                                                  mask->nb[1], mask->nb[2], (size_t) g * q_step * mask->nb[2]);
            ggml_tensor * o = rows_attention_all(ctx0, qg, kg, vg, mg, nullptr, kq_scale, soft_cap, -1);   // [hd_v * hg, rows]
            o = ggml_reshape_3d(ctx0, o, v->ne[0], q_step, n_tokens);
            ggml_format_name(o, "kvcli_rows_kqv-%d-g%d", il, (int) g);
            out = out ? ggml_concat(ctx0, out, o, 1) : o;
        }
        ggml_format_name(out, "kvcli_rows_kqv-%d", il);
        return ggml_reshape_2d(ctx0, out, out->ne[0] * n_head, n_tokens);   // concat's result is contiguous
    }
    return rows_attention_all(ctx0, q, k, v, mask, p, kq_scale, soft_cap, il);
}

// The rows path over a window observation left to it (kvcli_window_defer): the observation's products and the
// attention's values a group of KV heads at a time, so that the allocator frees a group's [n_kv, rows, heads]
// probabilities and F32 values before the next group's are made (at 16k cells and 32 rows of qwen2.5-0.5b, 27 MiB
// of probabilities at once become 14 by their shape). At most 4 groups, fewer where the graph has no room for their
// nodes (groups_with_room).
ggml_tensor * rows_attention_grouped(ggml_context * ctx0, kvcli_kv_ext & ext, ggml_cgraph * gf, int n_layer,
                                     ggml_tensor * q, ggml_tensor * v, int il) {
    const int64_t n_head = q->ne[1], n_tokens = q->ne[2], n_head_kv = v->ne[1], ratio = n_head / n_head_kv;
    const int64_t groups = groups_with_room(ctx0, gf, il, n_layer, n_head_kv, 4, 25);
    const int64_t kv_step = n_head_kv / groups;
    ggml_tensor * out = nullptr;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t g0 = g * kv_step;
        ggml_tensor * p = kvcli_obs_window_group(ctx0, ext, il, g0 * ratio, (g0 + kv_step) * ratio); // [n_kv, rows, hg]
        ggml_tensor * vg = ggml_view_3d(ctx0, v, v->ne[0], kv_step, v->ne[2], v->nb[1], v->nb[2], (size_t) g0 * v->nb[1]);
        ggml_tensor * vt = ggml_cast(ctx0, ggml_permute(ctx0, vg, 1, 2, 0, 3), GGML_TYPE_F32);       // [n_kv, hd_v, gk]
        ggml_tensor * kqv = kvcli_mul_mat_gqa(ctx0, vt, p, false);                                    // [hd_v, rows, hg]
        ggml_format_name(kqv, "kvcli_rows_kqv-%d-g%d", il, (int) g);
        ggml_build_forward_expand(gf, kqv);
        out = out ? ggml_concat(ctx0, out, kqv, 2) : kqv;
    }
    return ggml_cont_2d(ctx0, ggml_permute(ctx0, out, 0, 2, 1, 3), out->ne[0] * n_head, n_tokens);
}

} } // namespace kvcli_attention_detail
using namespace kvcli_attention_detail;

ggml_tensor * kvcli_build_attn(ggml_context * ctx0, const llama_kv_cache_context * mctx, bool flash_attn,
                               ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * kq_b,
                               ggml_tensor * sinks, ggml_tensor * kq_mask, float kq_scale, int il) {
    llama_kv_cache * kv = kvcli_access::kv(mctx);
    if (!kv || !kv->kvcli_ext || il < 0) {
        return nullptr;
    }
    auto & ext = *kv->kvcli_ext;
    const auto & map_ids = kvcli_access::map_layer_ids(*kv);
    const auto it = map_ids.find(il);
    if (it == map_ids.end()) {
        return nullptr;
    }
    const bool biased = kvcli_bias_applies(mctx);
    const auto & hp = kvcli_access::hparams(*kv);
    const float cap = hp.attn_soft_cap ? hp.f_attn_logit_softcapping : 0.0f;
    // kvcli_attn_hook viewed K and V from the layer's front or the ubatch's first visible cell; llama.cpp's mask follows
    const int64_t c0 = kvcli_cache_detail::view_start(ext, it->second);
    const bool rows = ext.graph_one_seq && few_rows(flash_attn, q, k, v, kq_b, sinks, kq_mask);
    // a window observation kvcli_attn_hook left to this layer's attention (kvcli_window_defer)
    kvcli_window_defer * defer = ext.obs.armed && (size_t) il < ext.obs.pending.size() &&
                                 ext.obs.pending[il].defer.gf ? &ext.obs.pending[il].defer : nullptr;
    if (defer) {
        const bool matches = defer->q3->ne[2] == q->ne[2] && defer->k->ne[2] == k->ne[2] && q->ne[1] % v->ne[1] == 0;
        ggml_tensor * out = nullptr;
        if (rows && matches) {
            if (biased) {
                record_path(ext, il, KVCLI_ATTN_PATH_ROWS);
            }
            out = rows_attention_grouped(ctx0, ext, defer->gf, (int) hp.n_layer(), q, v, il);
        } else {
            kvcli_obs_window_group(ctx0, ext, il, 0, q->ne[1]);   // the observation alone, every head at once
        }
        defer->gf = nullptr;   // built
        if (out) {
            return out;
        }
    }
    if (rows) {
        ggml_tensor * mask = c0 > 0 ? ggml_cont(ctx0, kvcli_cache_detail::trim_cells(ctx0, kq_mask, 0, c0)) : kq_mask;
        if (biased) {
            const int64_t n_kv = k->ne[2], n_head = q->ne[1];
            mask = ggml_add(ctx0, ggml_repeat_4d(ctx0, mask, n_kv, mask->ne[1], n_head, 1),
                            kvcli_cache_detail::bias_per_query_head(ctx0, ext.bias[it->second], c0, n_kv, n_head));
            record_path(ext, il, KVCLI_ATTN_PATH_ROWS);
        }
        // the observation's probabilities of this ubatch's rows, where it made them (the same Q, K, mask and scale)
        ggml_tensor * p = ext.obs.armed && (size_t) il < ext.obs.pending.size() ? ext.obs.pending[il].probs : nullptr;
        if (p && (p->ne[0] != k->ne[2] || p->ne[1] != q->ne[2] || p->ne[2] != q->ne[1])) {
            p = nullptr;
        }
        return rows_attention(ctx0, ext.last_gf, (int) hp.n_layer(), q, k, v, mask, p, kq_scale, cap, il);
    }
    if (!biased) {
        return nullptr; // no slot bias: llama.cpp's attention as it is (observation only)
    }
    const path_choice c = choose(flash_attn, kvcli_on_cpu(k));
    if (c.path < 0) {
        // kvcli's Python side refuses a bad value before any context exists; a C caller gets the log line
        LLAMA_LOG_ERROR("kvcli: %s (got '%s'); layer %d takes the mask path\n", c.why, std::getenv("KVCLI_ATTN_PATH"), il);
    }
    // the split path needs what build_attn_mha's flash-attention branch would see: no KQ bias or sinks
    // (per query head), one stream, V not transposed, llama.cpp's F16 mask shared by all heads
    const bool split = c.path == KVCLI_ATTN_PATH_SPLIT && flash_attn && !kq_b && !sinks && k->ne[3] == 1 &&
                       v->nb[1] <= v->nb[2] && kq_mask->type == GGML_TYPE_F16 && kq_mask->ne[2] == 1 &&
                       kq_mask->ne[3] == 1 && q->ne[1] % k->ne[1] == 0;
    record_path(ext, il, split ? KVCLI_ATTN_PATH_SPLIT : KVCLI_ATTN_PATH_MASK);
    if (!split) {
        return nullptr;
    }
    if (c0 > 0) {
        kq_mask = kvcli_cache_detail::trim_cells(ctx0, kq_mask, 0, c0);
    }
    // soft-capping (gemma2) as build_attn_mha passes it: the slot bias, in the mask, is added after the cap
    return split_attention(ctx0, q, k, v, kq_mask, ext.bias[it->second], c0, kq_scale, cap, il);
}

// whether the tensor's memory belongs to a CPU device (ggml's plain CPU buffer type names no device:
// then host memory counts as the CPU's)
bool kvcli_on_cpu(const ggml_tensor * t) {
    const ggml_tensor * src = t->view_src ? t->view_src : t;
    if (!src->buffer) {
        return false;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(src->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    return dev ? ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU : ggml_backend_buft_is_host(buft);
}

extern "C" {

int32_t kvcli_attn_path_choose(int32_t flash_attn, int32_t cache_on_cpu, char * why, int32_t why_size) {
    kvcli_clear_error();
    const path_choice c = choose(flash_attn != 0, cache_on_cpu != 0);
    if (why && why_size > 0) {
        const size_t n = std::min(std::strlen(c.why), (size_t) why_size - 1);
        std::memcpy(why, c.why, n);
        why[n] = '\0';
    }
    if (c.path < 0) {
        kvcli_set_error(c.why);
    }
    return c.path;
}

int32_t kvcli_attn_path_taken(struct llama_context * ctx, int32_t il) {
    try {
        kvcli_clear_error();
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (il < 0 || (uint32_t) il >= kvcli_access::hparams(*kv).n_layer()) {
            throw kvcli_error("kvcli_attn_path_taken: bad layer " + std::to_string(il));
        }
        const auto * ext = kv->kvcli_ext.get();
        return ext && (size_t) il < ext->attn_path.size() ? ext->attn_path[il] : 0;
    } catch (const std::exception & e) {
        kvcli_set_error(e.what());
        return -1;
    }
}

} // extern "C"
