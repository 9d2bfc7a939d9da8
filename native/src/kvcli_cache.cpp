// kvcli on the llama.cpp KV cache: what every part shares (the cache of a context, the support check,
// the extension, a sequence's cells, Hadamard rotation, the slot-bias tensors and rm_cells), the
// consistency hooks our patch calls from llama_kv_cache (seq_rm/seq_cp/seq_add/apply_ubatch) and the
// C API that reads the cache (rows, positions, headers, stats, biased cells, memory). Per-cell and
// per-sequence metadata: kvcli_cells.h; byte moves: kvcli_moves.cpp; compaction: kvcli_compact.cpp;
// K re-rotation: kvcli_reindex.cpp; state save/load: kvcli_state.cpp; observation: kvcli_graph.cpp.
//
// Layout facts this file relies on (llama.cpp 0c1e57098, src/llama-kv-cache.cpp):
//  - K of layer l is [n_embd_k_gqa, kv_size, n_stream]; the row of KV head h in cell c starts at
//    c*row_size(n_embd_k_gqa) + h*row_size(head_dim) (whole quant blocks when head_dim % blck == 0).
//  - V is the same when not transposed (flash attention on); transposed (flash attention off) it
//    is [kv_size] per element: element e of cell c sits at (e*kv_size + c)*type_size.
//  - Quantized cache types may be stored Hadamard-rotated (attn_rot_k/v, blocks of nrot floats);
//    kvcli reads and writes rows in the model's own space and rotates on the way.
#include "kvcli_cache.h"
#include "kvcli_hooks.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------

llama_kv_cache * kvcli_cache_of(llama_context * ctx) {
    if (!ctx) {
        throw kvcli_error("context is NULL");
    }
    llama_memory_t mem = ctx->get_memory();
    if (!mem) {
        throw kvcli_error("this context has no KV cache");
    }
    auto * kv = dynamic_cast<llama_kv_cache *>(mem);
    if (!kv) {
        kv = kvcli_iswa_base(mem); // sliding-window models: kvcli compresses the non-SWA layers' cache
    }
    if (!kv) {
        throw kvcli_error("kvcli needs a KV cache it can compact (models with recurrent or hybrid memory are "
                          "not supported)");
    }
    return kv;
}

void kvcli_require_supported(llama_kv_cache * kv) {
    const auto & hp = kvcli_access::hparams(*kv);
    if (kvcli_access::shared(*kv)) {
        throw kvcli_error("this KV cache shares its cells with another cache; kvcli cannot compact it");
    }
    if (kvcli_access::n_stream(*kv) != 1) {
        throw kvcli_error("kvcli needs a unified KV cache (create the context with kv_unified=true "
                          "when n_seq_max > 1)");
    }
    if (kvcli_access::n_swa(*kv) != 0 || kvcli_access::swa_type(*kv) != LLAMA_SWA_TYPE_NONE) {
        throw kvcli_error("kvcli cannot compact a sliding-window KV cache (it compresses the global layers' "
                          "cache of an iSWA model)");
    }
    if (kvcli_access::map_layer_ids(*kv).size() != kvcli_access::layers(*kv).size()) {
        throw kvcli_error("this model's layers share KV caches; kvcli cannot compact them");
    }
    if (hp.n_pos_per_embd() != 1) {
        throw kvcli_error("multi-dimensional positions (M-RoPE) are not supported by kvcli");
    }
    // attention soft-capping (gemma2) is reproduced: the observation caps its scores (kvcli_graph.cpp), the split
    // path passes the cap to flash attention (kvcli_attention.cpp) and the slot bias is part of the mask, added
    // after the cap as llama.cpp adds its mask
    if (hp.use_alibi || hp.f_max_alibi_bias > 0.0f) {
        throw kvcli_error("ALiBi models are not supported by kvcli");
    }
    if (hp.is_mla()) {
        throw kvcli_error("MLA attention is not supported by kvcli");
    }
    const auto & layers = kvcli_access::layers(*kv);
    if (layers.empty()) {
        throw kvcli_error("the KV cache has no layers");
    }
    const uint32_t hd_k = hp.n_embd_head_k(layers[0].il), hd_v = hp.n_embd_head_v(layers[0].il);
    const uint32_t nkv = hp.n_head_kv(layers[0].il), nh = hp.n_head(layers[0].il);
    for (const auto & L : layers) {
        if (hp.n_embd_head_k(L.il) != hd_k || hp.n_embd_head_v(L.il) != hd_v || hp.n_head_kv(L.il) != nkv ||
            hp.n_head(L.il) != nh || !L.v) {
            throw kvcli_error("kvcli needs the same head shapes in every layer");
        }
    }
    if (hd_k != hd_v) {
        throw kvcli_error("kvcli needs K and V heads of the same size");
    }
    if (nkv == 0 || nh % nkv != 0) {
        throw kvcli_error("n_head is not a multiple of n_head_kv");
    }
}

kvcli_kv_ext & kvcli_ext_of(llama_kv_cache * kv) {
    if (!kv->kvcli_ext) {
        kv->kvcli_ext = std::make_shared<kvcli_kv_ext>();
    }
    return *kv->kvcli_ext;
}

void kvcli_check_seq(const llama_kv_cache & kv, llama_seq_id seq_id) {
    if (seq_id < 0 || (size_t) seq_id >= kvcli_access::seq_to_stream(kv).size() || seq_id >= LLAMA_MAX_SEQ) {
        throw kvcli_error("sequence id " + std::to_string(seq_id) + " is out of range");
    }
}

// The sequence's cells in the order of their positions (its slots): the cell order, unless the pool is fragmented
// (a question prefilled over a resident document's shared cells may land in cells freed below some of them), so
// that a plan's slots, the observation and the compaction see the entries in position order whatever the cells.
std::vector<uint32_t> kvcli_seq_cells(const llama_kv_cache & kv, llama_seq_id seq_id) {
    kvcli_check_seq(kv, seq_id);
    const auto & cells = kvcli_access::cells(kv)[kvcli_access::seq_to_stream(kv)[seq_id]];
    std::vector<uint32_t> res;
    bool ordered = true;
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i) && cells.seq_has(i, seq_id)) {
            ordered = ordered && (res.empty() || cells.pos_get(res.back()) < cells.pos_get(i));
            res.push_back(i);
        }
    }
    if (!ordered) {
        std::stable_sort(res.begin(), res.end(), [&](uint32_t a, uint32_t b) { return cells.pos_get(a) < cells.pos_get(b); });
    }
    return res;
}

namespace kvcli_cache_detail {

shapes shapes_of(const llama_kv_cache & kv) {
    const auto & hp = kvcli_access::hparams(kv);
    const auto & L0 = kvcli_access::layers(kv)[0];
    return { hp.n_layer(), (uint32_t) kvcli_access::layers(kv).size(), hp.n_head(L0.il), hp.n_head_kv(L0.il),
             hp.n_embd_head_k(L0.il), kv.get_size() };
}

// the rotation llama.cpp applies to K / V of this cache (0: none); see build_input_k_rot/v_rot
int rot_size(const llama_kv_cache & kv, int which) {
    if (which == 0) {
        if (!kvcli_access::rot_k(kv)) {
            return 0;
        }
        int nrot = 64;
        do {
            nrot *= 2;
        } while (kvcli_access::head_k_all(kv) % nrot == 0);
        return nrot / 2;
    }
    return kvcli_access::rot_v(kv) ? 64 : 0;
}

// y = H x on each block of n floats, H the n x n Hadamard matrix llama.cpp rotates this cache with
// (H^2 = I, so this both rotates and un-rotates)
void rotate(const llama_kv_cache & kv, float * x, int64_t len, int n) {
    kvcli_moves::hadamard_blocks(kvcli_access::hadamard(kv, n).data(), n, x, len);
}

// contiguous runs of ascending cell indices: (first, count)
std::vector<std::pair<uint32_t, uint32_t>> runs_of(const std::vector<uint32_t> & cells) {
    std::vector<std::pair<uint32_t, uint32_t>> runs;
    for (size_t i = 0; i < cells.size();) {
        size_t j = i + 1;
        while (j < cells.size() && cells[j] == cells[j - 1] + 1) {
            ++j;
        }
        runs.emplace_back(cells[i], (uint32_t) (j - i));
        i = j;
    }
    return runs;
}

void ensure_bias(llama_kv_cache * kv, kvcli_kv_ext & ext) {
    if (!ext.bias.empty()) {
        return;
    }
    const auto & layers = kvcli_access::layers(*kv);
    const shapes sh = shapes_of(*kv);

    // one context + buffer per buffer type, so each layer's bias lives where its K lives
    std::vector<std::pair<ggml_backend_buffer_type_t, ggml_context *>> ctxs;
    std::vector<ggml_tensor *> bias(layers.size(), nullptr);
    std::vector<ggml_context_ptr> owned;
    for (size_t i = 0; i < layers.size(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[i].k->buffer);
        ggml_context * ctx = nullptr;
        for (auto & [b, c] : ctxs) {
            if (b == buft) {
                ctx = c;
            }
        }
        if (!ctx) {
            ggml_init_params params = { layers.size() * ggml_tensor_overhead(), nullptr, true };
            ctx = ggml_init(params);
            if (!ctx) {
                throw kvcli_error("could not create the slot-bias context");
            }
            owned.emplace_back(ctx);
            ctxs.emplace_back(buft, ctx);
        }
        bias[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, sh.kv_size, sh.n_head_kv);
        ggml_format_name(bias[i], "kvcli_bias_l%u", layers[i].il);
    }
    std::vector<ggml_backend_buffer_ptr> bufs;
    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) {
            throw kvcli_error("could not allocate the slot bias");
        }
        ggml_backend_buffer_clear(buf, 0);
        bufs.emplace_back(buf);
    }
    ext.bias_ctxs = std::move(owned);
    ext.bias_bufs = std::move(bufs);
    ext.bias      = std::move(bias);
    ext.cells.init_bias(layers.size(), sh.n_head_kv, sh.kv_size);
}

void upload_bias(kvcli_kv_ext & ext, const std::vector<uint32_t> & cells) {
    const auto runs = runs_of(cells);
    for (size_t ikv = 0; ikv < ext.bias.size(); ++ikv) {
        for (uint32_t h = 0; h < ext.cells.n_head_kv(); ++h) {
            const size_t row = (size_t) h * ext.bias[ikv]->ne[0]; // the tensor is [kv_size, n_head_kv]
            for (auto [c0, n] : runs) {
                ggml_backend_tensor_set(ext.bias[ikv], ext.cells.bias_run(ikv, h, c0, n), (row + c0) * sizeof(float),
                                        n * sizeof(float));
            }
        }
    }
}

void rm_cells(kvcli_kv_ext & ext, const std::vector<uint32_t> & cells) {
    std::vector<uint32_t> todo;
    for (uint32_t c : cells) {
        if (ext.cells.biased(c)) {
            ext.cells.rm(c);
            todo.push_back(c);
        }
    }
    std::sort(todo.begin(), todo.end());
    todo.erase(std::unique(todo.begin(), todo.end()), todo.end());
    upload_bias(ext, todo);
}

} // namespace kvcli_cache_detail
using namespace kvcli_cache_detail;

// ---------------------------------------------------------------------------------
// hooks called from the patched llama_kv_cache
// ---------------------------------------------------------------------------------

// Gives a host buffer's whole pages back to the kernel (MADV_DONTNEED: private anonymous memory reads back as
// zeros); returns the bytes given back, 0 where the kernel will not advise it (pinned host memory, not host memory).
static int64_t give_back_pages(ggml_backend_buffer_t buf, uintptr_t * lo_out = nullptr, uintptr_t * hi_out = nullptr) {
    const size_t size = ggml_backend_buffer_get_size(buf);
    if (size == 0 || !ggml_backend_buffer_is_host(buf)) {
        return 0;
    }
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(ggml_backend_buffer_get_base(buf)), end = begin + size;
    const uintptr_t lo = (begin + page - 1) & ~(page - 1), hi = end & ~(page - 1);
    if (hi <= lo || madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_DONTNEED) != 0) {
        return 0;
    }
    if (lo_out) {
        *lo_out = lo;
        *hi_out = hi;
    }
    return (int64_t) (hi - lo);
}

// What ggml_backend_buffer_clear(buf, 0) does, without making a host buffer resident: its whole pages are given
// back to the kernel (MADV_DONTNEED on private anonymous memory reads back as zeros) and only the partial pages at
// either end are written. llama.cpp clears the KV and output buffers when it makes them; a context of 32k cells
// then cost RSS for all 32k from the start, whatever the document held. A buffer the kernel will not advise
// (pinned host memory, not host memory at all) is cleared as before.
void kvcli_clear_buffer(ggml_backend_buffer_t buf) {
    if (buf == nullptr) {
        return;
    }
    uintptr_t lo = 0, hi = 0;
    if (give_back_pages(buf, &lo, &hi) > 0) {   // only the partial pages at either end are written
        auto * base = static_cast<uint8_t *>(ggml_backend_buffer_get_base(buf));
        std::memset(base, 0, lo - reinterpret_cast<uintptr_t>(base));
        const uintptr_t end = reinterpret_cast<uintptr_t>(base) + ggml_backend_buffer_get_size(buf);
        std::memset(reinterpret_cast<void *>(hi), 0, end - hi);
        return;
    }
    ggml_backend_buffer_clear(buf, 0);
}

// The repacked copy is what the CPU reads from the load on (28 MiB of qwen2.5-coder-0.5b's Q4_K weights): without
// this, the file's pages it was made from stay resident in the process beside it, never read again.
void kvcli_release_mapped_pages(const void * data, size_t size) {
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + size;
    const uintptr_t lo = (begin + page - 1) & ~(page - 1), hi = end & ~(page - 1);   // whole pages only
    if (hi > lo) {
        madvise(reinterpret_cast<void *>(lo), hi - lo, MADV_DONTNEED);   // advice: a refusal (mlock) keeps the pages
    }
}

bool kvcli_bias_applies(const llama_kv_cache_context * mctx) {
    llama_kv_cache * kv = kvcli_access::kv(mctx);
    if (!kv || !kv->kvcli_ext || kv->kvcli_ext->bias.empty() || !kv->kvcli_ext->cells.any_compressed()) {
        return false;
    }
    // A question prefilled over a resident document sees the document's cells only, which carry no bias, while an
    // answer compressed beside them does: its rows would otherwise add zeros per query head, [n_kv, rows, n_head]
    // F32 a layer (23 MB at 16k cells and 25 rows). The bias of a cell the rows cannot see is masked anyway.
    const llama_ubatch * ub = kvcli_access::ubatch(mctx);
    const auto & ext = *kv->kvcli_ext;
    const auto & s2s = kvcli_access::seq_to_stream(*kv);
    if (!ub || kvcli_access::n_stream(*kv) != 1) {
        return true;   // a graph reserved for no ubatch in particular, or several streams: as if any could
    }
    const auto & cells = kvcli_access::cells(*kv)[s2s[0]];
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (!ext.cells.biased(c)) {
            continue;
        }
        for (uint32_t i = 0; i < ub->n_seqs_unq; ++i) {
            if (cells.seq_has(c, ub->seq_id_unq[i])) {
                return true;
            }
        }
    }
    return false;
}

void kvcli_on_cells_freed(llama_kv_cache * kv) {
    if (!kv->kvcli_ext) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    const auto & s2s = kvcli_access::seq_to_stream(*kv);
    for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
        if (ext.cells.seq(s).compressed && (size_t) s < s2s.size() &&
            kvcli_access::cells(*kv)[s2s[s]].seq_pos_min(s) < 0) {
            ext.cells.seq_reset(s); // an emptied sequence starts afresh
        }
    }
    if (ext.bias.empty()) {
        return;
    }
    // the cells llama.cpp has just freed (seq_rm, seq_keep, clear) lose their bias too (bias exists only
    // for single-stream caches)
    const auto & cells = kvcli_access::cells(*kv)[0];
    std::vector<uint32_t> freed;
    for (uint32_t c = 0; c < cells.size(); ++c) {
        if (ext.cells.biased(c) && cells.is_empty(c)) {
            freed.push_back(c);
        }
    }
    rm_cells(ext, freed);
    layout_follow(kv, ext); // a freed cell below a layer's front gets its row back before llama.cpp reuses it
}

void kvcli_on_seq_cp(llama_kv_cache * kv, llama_seq_id src, llama_seq_id dst) {
    if (!kv->kvcli_ext || src < 0 || dst < 0 || src >= LLAMA_MAX_SEQ || dst >= LLAMA_MAX_SEQ) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    // the cells are shared, so is their bias: the copy is compressed like its source
    if (ext.cells.seq(src).compressed) {
        ext.cells.seq(dst) = ext.cells.seq(src);
    }
}

void kvcli_on_apply_ubatch(llama_kv_cache * kv, const std::vector<llama_seq_id> & strm,
                           const std::vector<std::vector<uint32_t>> & idxs) {
    if (!kv->kvcli_ext || kv->kvcli_ext->bias.empty()) {
        return;
    }
    // llama.cpp overwrites these cells (a cell still in use is freed first): a freed cell has no bias
    // already, one freed here loses it now
    for (size_t s = 0; s < strm.size() && s < idxs.size(); ++s) {
        if (strm[s] == 0) { // bias exists only for single-stream caches
            rm_cells(*kv->kvcli_ext, idxs[s]);
        }
    }
    auto & ext = *kv->kvcli_ext;
    layout_follow(kv, ext); // the graph that writes these cells is built after this
    if (ext.trim_pending) {
        layout_trim(kv, ext); // a state read or written since: its rows have moved by now
    }
}

bool kvcli_refuse_shift(llama_kv_cache * kv, llama_seq_id seq_id, const char * op) {
    if (!kv->kvcli_ext || seq_id < 0 || seq_id >= LLAMA_MAX_SEQ || !kv->kvcli_ext->cells.seq(seq_id).compressed) {
        if (kv->kvcli_ext) {
            // llama.cpp's K-shift rotates every row of every layer: the full layout until the next compaction
            layout_full(kv, *kv->kvcli_ext);
        }
        return false;
    }
    const std::string msg = std::string(op) + " refused: sequence " + std::to_string(seq_id) +
        " is compressed by kvcli; shifting its positions (context shift / K-shift) would corrupt it";
    kvcli_set_error(msg);
    LLAMA_LOG_ERROR("%s\n", msg.c_str());
    return true;
}

// ---------------------------------------------------------------------------------
// C API
// ---------------------------------------------------------------------------------

extern "C" {
int32_t kvcli_seq_is_reindexable(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        return (int32_t) !(kv->kvcli_ext && kv->kvcli_ext->cells.seq(seq_id).off_cell);
    });
}

int32_t kvcli_seq_is_compressed(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        return (int32_t) (kv->kvcli_ext && kv->kvcli_ext->cells.seq(seq_id).compressed);
    });
}

int32_t kvcli_seq_n_slots(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] { return (int32_t) kvcli_seq_cells(*kvcli_cache_of(ctx), seq_id).size(); });
}

int32_t kvcli_seq_positions(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t * dst) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        const auto cs = kvcli_seq_cells(*kv, seq_id);
        if (!dst) {
            throw kvcli_error("dst is NULL");
        }
        const auto & cells = kvcli_access::cells(*kv)[kvcli_access::seq_to_stream(*kv)[seq_id]];
        for (size_t i = 0; i < cs.size(); ++i) {
            dst[i] = cells.pos_get(cs[i]);
        }
        return (int32_t) cs.size();
    });
}

int32_t kvcli_seq_read_kv(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t il, int32_t which, float * dst) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_require_supported(kv);
        const shapes sh = shapes_of(*kv);
        if (il < 0 || (uint32_t) il >= sh.n_layer_model || (which != 0 && which != 1) || !dst) {
            throw kvcli_error("kvcli_seq_read_kv: bad layer, which or dst");
        }
        auto it = kvcli_access::map_layer_ids(*kv).find(il);
        if (it == kvcli_access::map_layer_ids(*kv).end()) {
            throw kvcli_error("layer " + std::to_string(il) + " has no KV cache");
        }
        llama_synchronize(ctx);
        const auto & L = kvcli_access::layers(*kv)[it->second];
        const auto cs = kvcli_seq_cells(*kv, seq_id);
        const uint32_t hd = sh.head_dim, nkv = sh.n_head_kv, n = cs.size();
        ggml_tensor * t = which == 0 ? L.k : L.v;
        const bool trans = which == 1 && kvcli_access::v_trans(*kv);
        const int nrot = rot_size(*kv, which);
        if (n == 0) {
            return 0;
        }
        const uint32_t lo = *std::min_element(cs.begin(), cs.end()), hi = *std::max_element(cs.begin(), cs.end()) + 1;
        std::vector<float> row(hd);
        if (!trans) {
            const size_t head_b = ggml_row_size(t->type, hd), row_b = ggml_row_size(t->type, (int64_t) hd * nkv);
            // rows below the layer's front (kvcli_layout.cpp) are not stored: zeros, as the dead slots they are
            const uint32_t from = std::min(hi, std::max(lo, kv->kvcli_ext ? layer_front(*kv->kvcli_ext, it->second) : 0u));
            std::vector<uint8_t> buf((size_t) (hi - lo) * row_b, 0);
            if (hi > from) {
                ggml_backend_tensor_get(t, buf.data() + (size_t) (from - lo) * row_b, (size_t) from * row_b,
                                        (size_t) (hi - from) * row_b);
            }
            for (uint32_t i = 0; i < n; ++i) {
                for (uint32_t h = 0; h < nkv; ++h) {
                    to_float_row(t->type, buf.data() + (size_t) (cs[i] - lo) * row_b + h * head_b, row.data(), hd);
                    if (nrot) {
                        rotate(*kv, row.data(), hd, nrot);
                    }
                    std::memcpy(dst + ((size_t) h * n + i) * hd, row.data(), hd * sizeof(float));
                }
            }
        } else {
            const size_t el = ggml_type_size(t->type), kv_size = sh.kv_size;
            std::vector<uint8_t> buf((size_t) (hi - lo) * el);
            for (uint32_t e = 0; e < hd * nkv; ++e) {
                ggml_backend_tensor_get(t, buf.data(), ((size_t) e * kv_size + lo) * el, buf.size());
                const uint32_t h = e / hd, d = e % hd;
                for (uint32_t i = 0; i < n; ++i) {
                    float v;
                    to_float_row(t->type, buf.data() + (size_t) (cs[i] - lo) * el, &v, 1);
                    dst[((size_t) h * n + i) * hd + d] = v;
                }
            }
        }
        return (int32_t) n;
    });
}

int32_t kvcli_seq_set_header(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_state_header * h) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        if (!h) {
            throw kvcli_error("header is NULL");
        }
        auto & ext = kvcli_ext_of(kv);
        if (!ext.cells.seq(seq_id).compressed) {
            throw kvcli_error("sequence " + std::to_string(seq_id) + " is not compressed; a header describes a compaction");
        }
        kvcli_state_header c = *h;
        c.policy[sizeof(c.policy) - 1] = 0;
        std::memset(c.kvcli_version, 0, sizeof(c.kvcli_version));
        std::strncpy(c.kvcli_version, kvcli_version(), sizeof(c.kvcli_version) - 1);
        ext.cells.seq(seq_id).header = c;
        return 0;
    });
}

int32_t kvcli_seq_get_header(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_state_header * h) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        if (!h) {
            throw kvcli_error("header is NULL");
        }
        if (!kv->kvcli_ext || !kv->kvcli_ext->cells.seq(seq_id).compressed) {
            std::memset(h, 0, sizeof(*h));
            return 0;
        }
        *h = kv->kvcli_ext->cells.seq(seq_id).header;
        return 1;
    });
}

int32_t kvcli_stats_get(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_stats * out,
                        int32_t * per_layer_cells, int32_t * per_head_entries) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!out) {
            throw kvcli_error("out is NULL");
        }
        const auto & layers = kvcli_access::layers(*kv);
        const auto & hp = kvcli_access::hparams(*kv);
        const bool v_trans = kvcli_access::v_trans(*kv);
        std::vector<std::pair<uint32_t, uint32_t>> held; // (stream, cell)
        if (seq_id == -1) {
            const auto & all = kvcli_access::cells(*kv);
            for (uint32_t s = 0; s < all.size(); ++s) {
                for (uint32_t i = 0; i < all[s].size(); ++i) {
                    if (!all[s].is_empty(i)) {
                        held.emplace_back(s, i);
                    }
                }
            }
        } else {
            const uint32_t s = (kvcli_check_seq(*kv, seq_id), kvcli_access::seq_to_stream(*kv)[seq_id]);
            for (uint32_t c : kvcli_seq_cells(*kv, seq_id)) {
                held.emplace_back(s, c);
            }
        }
        // bytes held: every layer's rows of the held cells, from the layer's front on (kvcli_layout.cpp)
        int64_t k_bytes = 0, v_bytes = 0;
        for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
            const auto & L = layers[ikv];
            const uint32_t f = kv->kvcli_ext ? layer_front(*kv->kvcli_ext, ikv) : 0;
            const int64_t rows = std::count_if(held.begin(), held.end(), [&](const auto & sc) { return sc.second >= f; });
            k_bytes += rows * (int64_t) ggml_row_size(L.k->type, hp.n_embd_k_gqa(L.il));
            if (L.v) {
                v_bytes += rows * (v_trans ? (int64_t) hp.n_embd_v_gqa(L.il) * ggml_type_size(L.v->type)
                                           : (int64_t) ggml_row_size(L.v->type, hp.n_embd_v_gqa(L.il)));
            }
        }
        const kvcli_kv_ext * ext = kv->kvcli_ext && !kv->kvcli_ext->bias.empty() ? kv->kvcli_ext.get() : nullptr;
        const uint32_t n_layer = hp.n_layer();
        std::vector<int32_t> plc(n_layer, 0), phe;
        int64_t live = 0, biased_cells = 0;
        // per-head counts need uniform head counts (checked when bias exists; else count n_head_kv(il))
        const uint32_t nkv0 = hp.n_head_kv(0);
        phe.assign((size_t) n_layer * nkv0, 0);
        const auto & map_ids = kvcli_access::map_layer_ids(*kv);
        for (auto [s, c] : held) {
            const bool b = ext && s == 0 && ext->cells.biased(c);
            biased_cells += b;
            for (uint32_t il = 0; il < n_layer; ++il) {
                auto it = map_ids.find(il);
                if (it == map_ids.end()) {
                    continue;
                }
                const uint32_t nkv = hp.n_head_kv(il);
                bool any = false;
                for (uint32_t h = 0; h < nkv; ++h) {
                    const bool is_live = !b || ext->cells.bias(it->second, h, c) != -INFINITY;
                    if (is_live) {
                        ++live;
                        any = true;
                        if (h < nkv0) {
                            phe[(size_t) il * nkv0 + h]++;
                        }
                    }
                }
                plc[il] += any;
            }
        }
        out->n_cells      = (int32_t) held.size();
        out->k_bytes      = k_bytes;
        out->v_bytes      = v_bytes;
        out->bias_bytes   = ext ? biased_cells * (int64_t) ext->bias.size() * nkv0 * (int64_t) sizeof(float) : 0;
        out->live_entries = live;
        if (per_layer_cells) {
            std::copy(plc.begin(), plc.end(), per_layer_cells);
        }
        if (per_head_entries) {
            std::copy(phe.begin(), phe.end(), per_head_entries);
        }
        return (int32_t) held.size();
    });
}

int32_t kvcli_cells_with_bias(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        int32_t n = 0;
        for (uint32_t c = 0; kv->kvcli_ext && c < kv->get_size(); ++c) {
            n += kv->kvcli_ext->cells.biased(c);
        }
        return n;
    });
}

int32_t kvcli_memory_get(struct llama_context * ctx, struct kvcli_memory * out) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!out) {
            throw kvcli_error("out is NULL");
        }
        int64_t kv_bytes = 0; // the context's whole memory: with sliding-window layers, both caches
        for (const auto & [buft, size] : ctx->get_memory()->memory_breakdown()) {
            kv_bytes += (int64_t) size;
        }
        int64_t bias_bytes = 0;
        if (kv->kvcli_ext) {
            for (const auto & buf : kv->kvcli_ext->bias_bufs) {
                bias_bytes += buf ? (int64_t) ggml_backend_buffer_get_size(buf.get()) : 0;
            }
        }
        out->kv_size    = (int32_t) kv->get_size();
        out->kv_bytes   = kv_bytes;
        out->bias_bytes = bias_bytes;
        return 0;
    });
}

int32_t kvcli_release_compute(struct llama_context * ctx, int64_t * released) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        int64_t total = 0;
        ggml_cgraph * gf = kv->kvcli_ext ? kv->kvcli_ext->last_gf : nullptr;
        std::vector<ggml_backend_buffer_t> seen;
        for (int i = 0; gf && i < ggml_graph_n_nodes(gf); ++i) {
            ggml_backend_buffer_t buf = ggml_graph_node(gf, i)->buffer;   // NULL until the graph is allocated
            if (!buf || ggml_backend_buffer_get_usage(buf) != GGML_BACKEND_BUFFER_USAGE_COMPUTE ||
                std::find(seen.begin(), seen.end(), buf) != seen.end()) {
                continue;
            }
            seen.push_back(buf);
            total += give_back_pages(buf);
        }
        if (released) {
            *released = total;
        }
        return 0;
    });
}

int32_t kvcli_last_graph_count(struct llama_context * ctx, const char * prefix) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!prefix) {
            throw kvcli_error("prefix is NULL");
        }
        ggml_cgraph * gf = kv->kvcli_ext ? kv->kvcli_ext->last_gf : nullptr;
        const size_t n = std::strlen(prefix);
        int32_t count = 0;
        for (int i = 0; gf && i < ggml_graph_n_nodes(gf); ++i) {
            count += std::strncmp(ggml_graph_node(gf, i)->name, prefix, n) == 0;
        }
        return count;
    });
}

} // extern "C"
