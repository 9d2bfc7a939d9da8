// kvcli cache internals (native/src/kvcli_{cache,compact,reindex,state,graph}.cpp): the per-cache extension
// state (slot-bias tensors, per-cell and per-sequence metadata in kvcli_cells.h, observation state in
// kvcli_observation.h) and the accessor our patch befriends.
#pragma once

#include "kvcli.h"

#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <array>
#include <functional>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvcli_cells.h"
#include "kvcli_internal.h"
#include "kvcli_moves.h"
#include "kvcli_observation.h"

struct kvcli_kv_ext {
    // slot bias: per KV-cache layer, F32 [kv_size, n_head_kv], allocated at the first compaction
    std::vector<ggml_context_ptr>        bias_ctxs;
    std::vector<ggml_backend_buffer_ptr> bias_bufs;
    std::vector<ggml_tensor *>           bias;       // indexed like the cache's layers

    // per cell: the host mirror of bias and whether it carries a row; per sequence: flags and header
    kvcli_cells cells;

    // a state being read: the sequence headers kvcli_state_read_prefix read, applied by
    // kvcli_state_read_suffix once llama.cpp has placed the cells (both run inside one
    // llama_kv_cache::state_read); empty otherwise
    struct pending_header {
        llama_seq_id       seq;
        kvcli_state_header header;
        uint32_t           flags;
    };
    std::vector<pending_header> pending_headers;

    // observation: what an armed llama_decode captures (kvcli_observation.h, kvcli_graph.cpp)
    kvcli_observation obs;

    // attention path (KVCLI_ATTN_PATH_*) each model layer took in the last graph built with a compacted
    // sequence (kvcli_attention.cpp); 0 = not built yet
    std::vector<int8_t> attn_path;
    // the last graph built over this cache (kvcli_attn_hook): after llama_decode its nodes sit in the context's
    // compute buffers, which kvcli_release_compute finds through them (ggml's scheduler does not expose them)
    ggml_cgraph * last_gf = nullptr;
    // the graph being built holds the rows of one sequence only (set by kvcli_attn_hook for kvcli_build_attn, whose
    // few-rows path computes every row against every cell: rows of several sequences each see few of them)
    bool graph_one_seq = false;

    // backends that run kvcli's own graphs (re-indexing's RoPE re-rotation, compaction's row moves), one per
    // device holding a layer's K/V, made on first use
    std::vector<std::pair<ggml_backend_dev_t, ggml_backend_ptr>> graph_backends;

    // how the last compaction moved the K/V rows (KVCLI_MOVES_*, kvcli_compact.cpp); 0 = none yet
    int8_t moves_path = 0;

    // the ragged layout (kvcli_layout.cpp): per cache layer, cells [0, front) hold no K/V row in that layer
    // (empty: every layer holds every cell, llama.cpp's own allocation); layout_gen changes with every relayout,
    // so a graph built over the old tensors is never reused
    std::vector<uint32_t> front;
    uint64_t              layout_gen = 0;
    // the first cell a sequence of the ubatch being built can see (kvcli_graph_key): every cell before it is masked
    // for all of its rows, so its attention views start there (an answer gathered beside a resident document attends
    // over its own cells, not the document's; view_start)
    uint32_t              graph_first_seen = 0;
    // a state was written or read through the full layout: trim again once llama.cpp's I/O has finished (its host
    // reader and writer move the rows when they are destroyed, after state_read / state_write return)
    bool                  trim_pending = false;
    // the context that owns the cache (set by kvcli's C entry points): a relayout waits for its graphs first
    llama_context *       ctx = nullptr;
};

// kvcli_graph.cpp: heads [h0, h1) of layer il's deferred window observation (kvcli_window_defer), its sums added into
// the host accumulator in the graph that deferred it; returns their probabilities [n_kv, n_rows, h1 - h0] (for the
// attention of the same rows: kvcli_attention.cpp)
ggml_tensor * kvcli_obs_window_group(ggml_context * ctx0, kvcli_kv_ext & ext, int il, int64_t h0, int64_t h1);

// ggml_mul_mat(a, b) for a [K, M, n_head_kv] shared by each KV head's query heads in b [K, N, n_head] (GQA), the
// result [M, N, n_head] laid out as ggml_mul_mat's: as one product per KV head over its query heads' columns side by
// side, so that `a` (a layer's K, or its V transposed) is read once per KV head rather than once per query head
// (kvcli_graph.cpp). f32_acc: GGML_PREC_F32 on the product (a KQ's).
ggml_tensor * kvcli_mul_mat_gqa(ggml_context * ctx0, ggml_tensor * a, ggml_tensor * b, bool f32_acc);

// whether t (or the tensor it views) lives in a CPU buffer (kvcli_attention.cpp)
bool kvcli_on_cpu(const ggml_tensor * t);

// kvcli_kq.cpp: K^T Q of k [hd, n_kv, n_head_kv] (F16 or F32) and q [hd, rows, n_head] (F32, rows and heads at any
// stride; query head h against KV head h / (n_head / n_head_kv)) -> [n_kv, rows, n_head] F32, ggml_mul_mat's products
// by a kernel for a head's short dot products; nullptr where it does not run (not x86-64 with AVX2 or AVX-512 built
// by GCC, K not on the CPU, a layout it does not take, KVCLI_KQ=ggml): the caller then takes ggml's product
ggml_tensor * kvcli_kq_product(ggml_context * ctx0, ggml_tensor * k, ggml_tensor * q);

// reaches the private parts of llama_kv_cache (our patch declares it a friend)
struct kvcli_access {
    static llama_kv_cache * kv(const llama_kv_cache_context * mctx) { return mctx->kv; }
    // the ubatch the context is at; nullptr for a context made to reserve graphs (no ubatches)
    static const llama_ubatch * ubatch(const llama_kv_cache_context * mctx) {
        return mctx->i_cur < mctx->ubatches.size() ? &mctx->ubatches[mctx->i_cur] : nullptr;
    }

    static auto & layers(const llama_kv_cache & kv)        { return kv.layers; }
    static auto & layers_mut(llama_kv_cache & kv)          { return kv.layers; }
    static auto & ctxs_bufs(llama_kv_cache & kv)           { return kv.ctxs_bufs; }
    static auto & map_layer_ids(const llama_kv_cache & kv) { return kv.map_layer_ids; }
    static auto & cells(llama_kv_cache & kv)               { return kv.v_cells; }
    static const auto & cells(const llama_kv_cache & kv)   { return kv.v_cells; }
    static auto & heads(llama_kv_cache & kv)               { return kv.v_heads; }
    static auto & seq_to_stream(const llama_kv_cache & kv) { return kv.seq_to_stream; }
    static bool   v_trans(const llama_kv_cache & kv)       { return kv.v_trans; }
    static uint32_t n_stream(const llama_kv_cache & kv)    { return kv.n_stream; }
    static uint32_t n_swa(const llama_kv_cache & kv)       { return kv.n_swa; }
    static llama_swa_type swa_type(const llama_kv_cache & kv) { return kv.swa_type; }
    static bool   rot_k(const llama_kv_cache & kv)         { return kv.attn_rot_k; }
    static bool   rot_v(const llama_kv_cache & kv)         { return kv.attn_rot_v; }
    static int32_t head_k_all(const llama_kv_cache & kv)   { return kv.n_embd_head_k_all; }
    static const llama_model & model(const llama_kv_cache & kv)     { return kv.model; }
    static const llama_hparams & hparams(const llama_kv_cache & kv) { return kv.hparams; }
    static bool   shared(const llama_kv_cache & kv)        { return kv.other != nullptr; }
    // the n x n Hadamard matrix llama.cpp rotates K / V with (built for every power of two from 64 to the head size)
    static const std::vector<float> & hadamard(const llama_kv_cache & kv, int64_t n) { return kv.attn_rot_hadamard.at(n); }
    // llama.cpp's own K-shift step for one K view: (dequantize, un-rotate,) RoPE by `shift`, (rotate, quantize)
    static ggml_tensor * rope_shift(const llama_kv_cache & kv, const llama_cparams & cparams, ggml_context * ctx,
                                    ggml_tensor * cur, ggml_tensor * shift, ggml_tensor * rot, ggml_tensor * factors,
                                    float freq_base, float freq_scale, uint32_t il) {
        return kv.build_rope_shift(cparams, ctx, cur, shift, rot, factors, freq_base, freq_scale, il);
    }
};

// the llama_kv_cache of a context (the non-SWA cache of an iSWA model), or an error naming why kvcli cannot use it
llama_kv_cache * kvcli_cache_of(llama_context * ctx);
// kvcli_iswa.cpp: the non-SWA ("base") cache of an iSWA memory, nullptr for any other memory
llama_kv_cache * kvcli_iswa_base(llama_memory_t mem);
// kvcli_iswa.cpp: whether kv is the base cache of a model with sliding-window layers
bool kvcli_is_iswa_base(const llama_kv_cache & kv);
// the cache checks that compaction, bias and observation need (one stream, no SWA, plain attention)
void kvcli_require_supported(llama_kv_cache * kv);
kvcli_kv_ext & kvcli_ext_of(llama_kv_cache * kv);
// whether the ubatch mctx is at attends with the slot bias: some cell one of its sequences sees carries a bias row
// (kvcli_cache.cpp; the graph key, kvcli_attn_hook and kvcli_build_attn decide by it alike)
bool kvcli_bias_applies(const llama_kv_cache_context * mctx);
// cells of seq_id in cell order (stream of seq_id)
std::vector<uint32_t> kvcli_seq_cells(const llama_kv_cache & kv, llama_seq_id seq_id);
void kvcli_check_seq(const llama_kv_cache & kv, llama_seq_id seq_id);

// Shared by kvcli_cache.cpp, kvcli_compact.cpp, kvcli_reindex.cpp and kvcli_state.cpp (defined in
// kvcli_cache.cpp unless named otherwise).
namespace kvcli_cache_detail {

struct shapes {
    uint32_t n_layer_model; // hparams.n_layer
    // the layers a plan covers: the cache's own layers in model order (every model layer for a plain cache,
    // the non-SWA layers of an iSWA model; plan layer i is cache layer i, kvcli_require_supported)
    uint32_t n_layer_plan;
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim;
    uint32_t kv_size;
};
shapes shapes_of(const llama_kv_cache & kv);

// the rotation llama.cpp applies to K (which = 0) / V (1) of this cache, in floats per block (0: none)
int rot_size(const llama_kv_cache & kv, int which);
// y = H x on each block of n floats of x[0, len) with the cache's n x n Hadamard matrix (its own inverse)
void rotate(const llama_kv_cache & kv, float * x, int64_t len, int n);
using kvcli_moves::from_float_row;
using kvcli_moves::to_float_row;
// contiguous runs of ascending cell indices: (first, count)
std::vector<std::pair<uint32_t, uint32_t>> runs_of(const std::vector<uint32_t> & cells);

// slot bias: allocate the per-layer tensors (and ext.cells' host values) on first use
void ensure_bias(llama_kv_cache * kv, kvcli_kv_ext & ext);
// write ext.cells' bias values of the given ascending cells (every layer and KV head) to the tensors
void upload_bias(kvcli_kv_ext & ext, const std::vector<uint32_t> & cells);
// the cells were freed: ext.cells.rm(c) for each, and the tensors follow
void rm_cells(kvcli_kv_ext & ext, const std::vector<uint32_t> & cells);

// kvcli_reindex.cpp: the device holding a cache tensor (of layer il, for messages), and the backend that runs
// kvcli's graphs on it
ggml_backend_dev_t cache_tensor_device(const ggml_tensor * t, uint32_t il);
ggml_backend_t graph_backend(kvcli_kv_ext & ext, ggml_backend_dev_t dev, int n_threads);
// kvcli_reindex.cpp: a no-alloc context for one of kvcli's own graphs of up to n_nodes nodes, and the running of
// such a graph on be (its tensors allocated on be's buffer type, set_inputs fills them, then compute and wait);
// `what` names the graph in errors
ggml_context_ptr graph_context(size_t n_nodes, const std::string & what);
void run_graph(ggml_backend_t be, ggml_cgraph * gf, const std::string & what, const std::function<void()> & set_inputs);
// layers grouped by the device holding their cache, in first-seen order (one graph per device)
using device_groups = std::vector<std::pair<ggml_backend_dev_t, std::vector<size_t>>>;
inline void add_to_group(device_groups & groups, ggml_backend_dev_t dev, size_t layer) {
    for (auto & [d, layers] : groups) {
        if (d == dev) {
            layers.push_back(layer);
            return;
        }
    }
    groups.push_back({ dev, { layer } });
}
// a view of t without its first c0 cells along dimension dim (K/V views: 2, a mask: 0), strides unchanged
inline ggml_tensor * trim_cells(ggml_context * ctx, ggml_tensor * t, int dim, int64_t c0) {
    int64_t ne[4] = { t->ne[0], t->ne[1], t->ne[2], t->ne[3] };
    ne[dim] -= c0;
    return ggml_view_4d(ctx, t, ne[0], ne[1], ne[2], ne[3], t->nb[1], t->nb[2], t->nb[3], (size_t) c0 * t->nb[dim]);
}

// bias of layer il, cells [c0, c0 + n_kv), as [n_kv, 1, n_head, 1]: query head q uses KV head q / (n_head/n_head_kv)
inline ggml_tensor * bias_per_query_head(ggml_context * ctx0, ggml_tensor * bias, int64_t c0, int64_t n_kv, int64_t n_head) {
    const int64_t n_head_kv = bias->ne[1];
    const int64_t g = n_head / n_head_kv;
    ggml_tensor * b = ggml_view_4d(ctx0, bias, n_kv, 1, n_head_kv, 1, bias->nb[1], bias->nb[1], bias->nb[1] * n_head_kv,
                                   c0 * bias->nb[0]);
    if (g > 1) {
        b = ggml_repeat_4d(ctx0, b, n_kv, g, n_head_kv, 1);      // [n_kv, g, n_head_kv]: element (j, r, h) = bias[j, h]
        b = ggml_reshape_4d(ctx0, b, n_kv, 1, n_head, 1);        // head q = r + g*h
    }
    return b;
}

// kvcli_layout.cpp: the ragged layout. A layer's rows start at its front: the leading cells that are held and
// dead (-inf slot bias in every KV head) in that layer have no row there. Attention, observation and reads start
// at the front; every path that would touch a row below it (compaction, state save, a K-shift) first returns the
// cache to the full layout (layout_full) and re-trims after (layout_trim).
uint32_t layer_front(const kvcli_kv_ext & ext, size_t ikv);
// where the graph being built views layer ikv's cells from: its front, or the first cell the ubatch can see if later
uint32_t view_start(const kvcli_kv_ext & ext, size_t ikv);
// $KVCLI_LAYOUT: ragged (default) or cells; anything else throws
bool ragged_wanted();
// the fronts the cache's cells allow now (all 0 under KVCLI_LAYOUT=cells or where trimming does not apply)
std::vector<uint32_t> allowed_fronts(const llama_kv_cache & kv, const kvcli_kv_ext & ext);
// reallocates every layer's K/V for these fronts, keeping each row that both layouts hold
void relayout(llama_kv_cache * kv, kvcli_kv_ext & ext, const std::vector<uint32_t> & front);
void layout_full(llama_kv_cache * kv, kvcli_kv_ext & ext);
void layout_trim(llama_kv_cache * kv, kvcli_kv_ext & ext);
// cells were freed or overwritten: any layer whose front is no longer allowed gets its rows back
void layout_follow(llama_kv_cache * kv, kvcli_kv_ext & ext);

// kvcli_reindex.cpp: throws when a layer's K cannot be re-rotated (checked before anything moves)
void require_rerotatable(llama_context * ctx, llama_kv_cache * kv, kvcli_kv_ext & ext);
// kvcli_reindex.cpp: re-rotate the K rows of cells `dst` by delta[il][j*n_head_kv + h] positions
void rerotate_k(llama_context * ctx, llama_kv_cache * kv, kvcli_kv_ext & ext, const std::vector<uint32_t> & dst,
                const std::vector<std::vector<int32_t>> & delta);

} // namespace kvcli_cache_detail
