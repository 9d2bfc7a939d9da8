// The ragged layout (issue #45): each cache layer holds K/V rows only for the cells it uses.
//
// A compaction rewrites a sequence into B cells, B = the widest (layer, KV head)'s kept count; a layer keeping
// fewer has dead slots (-inf slot bias). Compaction right-aligns every (layer, KV head)'s kept entries in its B
// cells (kvcli_moves::plan_moves), so the dead slots of a layer are the first cells of the block, and when the
// block starts the cache (the cells a compaction takes are the lowest free ones) every layer l has a dead prefix:
// cells [0, front_l) are held (by the compacted sequence: llama.cpp never writes a held cell) and dead in every KV
// head of l. Those rows are not stored: layer l's K and V are allocated for cells [front_l, kv_size) only, and
// llama.cpp's layer tensor is a header whose data pointer sits front_l rows before that allocation, so llama.cpp
// addresses cell c at the same offset as before (cpy_k / cpy_v write held-out cells, get_k / get_v views start at 0).
// Nothing may touch a row below the front:
//  - attention and observation view each layer from its front (kvcli_graph.cpp, kvcli_attention.cpp);
//  - reads of a sequence's rows (kvcli_seq_read_kv) read zeros there, as the dead slots held before;
//  - compaction, a state save and a K-shift go through the full layout (layout_full) and trim again after;
//  - cells freed or overwritten (seq_rm, seq_keep, clear, apply_ubatch) give any layer whose prefix is no longer
//    dead its rows back before llama.cpp can write them (layout_follow).
// Only flash-attention caches (V not transposed: a cell's V is one row) of one stream are trimmed; KVCLI_LAYOUT=cells
// keeps llama.cpp's allocation (every layer as wide as the widest).
// The new buffers replace llama.cpp's in the cache's own list (ctxs_bufs), so llama.cpp's clear, total_size and
// memory_breakdown see what is allocated.
#include "kvcli_cache.h"

#include "llama-impl.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kvcli_cache_detail {

// KVCLI_LAYOUT: ragged (default) | cells
bool ragged_wanted() {
    const char * env = std::getenv("KVCLI_LAYOUT");
    const std::string want = env && *env ? env : "ragged";
    if (want != "ragged" && want != "cells") {
        throw kvcli_error("KVCLI_LAYOUT must be ragged or cells (got '" + want + "')");
    }
    return want == "ragged";
}

namespace {

bool trimmed(const kvcli_kv_ext & ext) {
    return std::any_of(ext.front.begin(), ext.front.end(), [](uint32_t f) { return f > 0; });
}

} // namespace

uint32_t layer_front(const kvcli_kv_ext & ext, size_t ikv) {
    return ikv < ext.front.size() ? ext.front[ikv] : 0;
}

std::vector<uint32_t> allowed_fronts(const llama_kv_cache & kv, const kvcli_kv_ext & ext) {
    const auto & layers = kvcli_access::layers(kv);
    std::vector<uint32_t> front(layers.size(), 0);
    if (!ragged_wanted() || ext.bias.empty() || kvcli_access::v_trans(kv) || kvcli_access::n_stream(kv) != 1) {
        return front;
    }
    const auto & cells = kvcli_access::cells(kv)[0];
    if (cells.get_has_shift()) {
        return front; // llama.cpp's K-shift rotates every row of every layer
    }
    const uint32_t nkv = ext.cells.n_head_kv(), kv_size = cells.size();
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        uint32_t f = 0;
        // a row stays for the last cell: a layer always holds at least one
        while (f + 1 < kv_size && !cells.is_empty(f) && ext.cells.biased(f)) {
            bool dead = true;
            for (uint32_t h = 0; h < nkv && dead; ++h) {
                dead = ext.cells.bias(ikv, h, f) == -INFINITY;
            }
            if (!dead) {
                break;
            }
            ++f;
        }
        // the last held cell keeps its row: every graph's view (n_kv >= used_max_p1) then keeps at least one cell
        front[ikv] = std::min<uint32_t>(f, cells.used_max_p1() > 0 ? cells.used_max_p1() - 1 : 0);
    }
    return front;
}

void relayout(llama_kv_cache * kv, kvcli_kv_ext & ext, const std::vector<uint32_t> & want) {
    auto & layers = kvcli_access::layers_mut(*kv);
    std::vector<uint32_t> front = want;
    front.resize(layers.size(), 0);
    std::vector<uint32_t> old = ext.front;
    old.resize(layers.size(), 0);
    if (front == old) {
        return;
    }
    if (kvcli_access::v_trans(*kv) || kvcli_access::n_stream(*kv) != 1) {
        throw kvcli_error("the ragged layout needs a flash-attention cache of one stream");
    }
    const uint32_t kv_size = kv->get_size();
    if (ext.ctx) {
        ggml_backend_sched_synchronize(ext.ctx->get_sched()); // no graph may still read the old tensors
    }

    // one context (real tensors + llama.cpp-facing headers) and one buffer per buffer type, as llama.cpp allocates
    struct group {
        ggml_backend_buffer_type_t buft;
        ggml_context_ptr           ctx;
        ggml_backend_buffer_t      buf = nullptr;
    };
    std::vector<group> groups;
    std::vector<size_t> group_of(layers.size());
    std::vector<std::array<ggml_tensor *, 2>> real(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
        if (front[i] >= kv_size) {
            throw kvcli_error("layout front " + std::to_string(front[i]) + " leaves layer " +
                              std::to_string(layers[i].il) + " no row");
        }
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[i].k->buffer);
        size_t g = 0;
        while (g < groups.size() && groups[g].buft != buft) {
            ++g;
        }
        if (g == groups.size()) {
            ggml_init_params params = { 6 * layers.size() * ggml_tensor_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(params);
            if (!ctx) {
                throw kvcli_error("could not create the ragged layout's context");
            }
            groups.push_back({ buft, ggml_context_ptr(ctx) });
        }
        group_of[i] = g;
        ggml_context * ctx = groups[g].ctx.get();
        const uint32_t rows = kv_size - front[i];
        for (int w = 0; w < 2; ++w) {
            ggml_tensor * t = w == 0 ? layers[i].k : layers[i].v;
            real[i][w] = ggml_new_tensor_2d(ctx, t->type, t->ne[0], rows);
            ggml_format_name(real[i][w], "kvcli_cache_%c_l%u", w == 0 ? 'k' : 'v', layers[i].il);
        }
    }
    for (auto & g : groups) {
        g.buf = ggml_backend_alloc_ctx_tensors_from_buft(g.ctx.get(), g.buft);
        if (!g.buf) {
            for (auto & h : groups) {
                if (h.buf) {
                    ggml_backend_buffer_free(h.buf);
                }
            }
            throw kvcli_error("could not allocate the KV cache's ragged layout");
        }
        ggml_backend_buffer_clear(g.buf, 0);
    }

    // every row both layouts hold moves across (through the host, one layer at a time)
    std::vector<uint8_t> rows;
    for (size_t i = 0; i < layers.size(); ++i) {
        const uint32_t lo = std::max(front[i], old[i]);
        for (int w = 0; w < 2; ++w) {
            ggml_tensor * src = w == 0 ? layers[i].k : layers[i].v;
            const size_t row = src->nb[1];
            rows.resize((size_t) (kv_size - lo) * row);
            ggml_backend_tensor_get(src, rows.data(), (size_t) lo * row, rows.size());
            ggml_backend_tensor_set(real[i][w], rows.data(), (size_t) (lo - front[i]) * row, rows.size());
        }
    }

    // llama.cpp's headers: [n_embd, kv_size, 1] and the stream view [n_embd, kv_size], cell c at data + c * nb[1]
    for (size_t i = 0; i < layers.size(); ++i) {
        group & g = groups[group_of[i]];
        for (int w = 0; w < 2; ++w) {
            ggml_tensor * r = real[i][w];
            const size_t shift = (size_t) front[i] * r->nb[1];
            ggml_tensor * t3 = ggml_new_tensor_3d(g.ctx.get(), r->type, r->ne[0], kv_size, 1);
            ggml_tensor * t2 = ggml_new_tensor_2d(g.ctx.get(), r->type, r->ne[0], kv_size);
            for (ggml_tensor * t : { t3, t2 }) {
                t->buffer = g.buf;
                t->data   = (char *) r->data - shift;
            }
            ggml_format_name(t3, "cache_%c_l%u", w == 0 ? 'k' : 'v', layers[i].il);
            ggml_format_name(t2, "cache_%c_l%u (view)", w == 0 ? 'k' : 'v', layers[i].il);
            (w == 0 ? layers[i].k : layers[i].v) = t3;
            (w == 0 ? layers[i].k_stream : layers[i].v_stream)[0] = t2;
        }
    }
    auto & owned = kvcli_access::ctxs_bufs(*kv);
    owned.clear(); // frees the old buffers: no tensor of the cache points into them any more
    for (auto & g : groups) {
        owned.emplace_back(std::move(g.ctx), ggml_backend_buffer_ptr(g.buf));
    }
    std::vector<uint8_t>().swap(rows);
#if defined(__GLIBC__)
    // host buffers of a few MB come from the heap once glibc's dynamic mmap threshold has risen: freed, they stay
    // resident until the heap is trimmed, and a chunked read relayouts after every chunk
    malloc_trim(0);
#endif
    ext.front = front;
    ++ext.layout_gen;
    ext.trim_pending = false;
}

void layout_full(llama_kv_cache * kv, kvcli_kv_ext & ext) {
    if (trimmed(ext)) {
        relayout(kv, ext, std::vector<uint32_t>(ext.front.size(), 0));
    }
}

void layout_trim(llama_kv_cache * kv, kvcli_kv_ext & ext) {
    relayout(kv, ext, allowed_fronts(*kv, ext));
    ext.trim_pending = false;
}

void layout_follow(llama_kv_cache * kv, kvcli_kv_ext & ext) {
    if (!trimmed(ext)) {
        return;
    }
    std::vector<uint32_t> front = allowed_fronts(*kv, ext);
    for (size_t i = 0; i < front.size(); ++i) {
        front[i] = std::min(front[i], layer_front(ext, i));
    }
    relayout(kv, ext, front);
}

} // namespace kvcli_cache_detail

using namespace kvcli_cache_detail;

extern "C" {

int32_t kvcli_layout_trim(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (kv->kvcli_ext) {
            kv->kvcli_ext->ctx = ctx;
            layout_trim(kv, *kv->kvcli_ext);
        }
        return 0;
    });
}

int32_t kvcli_layout_fronts(struct llama_context * ctx, int32_t * out) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        const auto & layers = kvcli_access::layers(*kv);
        for (size_t i = 0; out && i < layers.size(); ++i) {
            out[i] = kv->kvcli_ext ? (int32_t) layer_front(*kv->kvcli_ext, i) : 0;
        }
        return (int32_t) layers.size();
    });
}

} // extern "C"
