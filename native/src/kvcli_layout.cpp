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
#include <cstring>

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

uint32_t view_start(const kvcli_kv_ext & ext, size_t ikv) {
    return std::max(layer_front(ext, ikv), ext.graph_first_seen);
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

// Several compressed sequences in one cache (kvcli batch): each one's dead slots lead its own block, but only a dead
// prefix of the whole cache can go unstored. Packing reorders every used cell so that those dead in more layers
// come first (each sequence keeps its cells' relative order: a k-way merge by that count), which for blocks whose
// layers keep alike puts every sequence's dead slots of a layer into one prefix. The used cells end up in
// [0, n_used); the rows, positions, sequence sets and slot biases move with them; then the cache is trimmed.
// Returns the number of cells that moved (0: already packed, or packing does not apply).
uint32_t pack(llama_context * ctx, llama_kv_cache * kv, kvcli_kv_ext & ext) {
    if (!ragged_wanted() || ext.bias.empty() || kvcli_access::v_trans(*kv) || kvcli_access::n_stream(*kv) != 1) {
        return 0; // nothing trimmed here (cells layout, nothing compressed, V transposed)
    }
    if (ext.obs.armed) {
        throw kvcli_error("the cache cannot be packed while a decode is observed");
    }
    auto & cells = kvcli_access::cells(*kv)[0];
    if (cells.get_has_shift()) {
        return 0; // a pending K-shift rotates rows by cell: pack after it ran
    }
    const uint32_t n_layer = ext.cells.n_layer(), nkv = ext.cells.n_head_kv(), end = cells.used_max_p1();
    // per sequence, its cells in cell order, each with the number of layers it is dead in (every KV head -inf)
    std::vector<std::vector<std::pair<uint32_t, uint32_t>>> per_seq;
    std::vector<llama_seq_id> seq_of_list;
    uint32_t n_used = 0;
    for (uint32_t c = 0; c < end; ++c) {
        if (cells.is_empty(c)) {
            continue;
        }
        if (cells.seq_count(c) != 1) {
            throw kvcli_error("cell " + std::to_string(c) + " is shared by several sequences: the cache cannot be packed");
        }
        uint32_t dead_layers = 0;
        for (uint32_t l = 0; ext.cells.biased(c) && l < n_layer; ++l) {
            bool dead = true;
            for (uint32_t h = 0; h < nkv && dead; ++h) {
                dead = ext.cells.bias(l, h, c) == -INFINITY;
            }
            dead_layers += dead;
        }
        const llama_seq_id s = cells.seq_get(c);
        size_t i = std::find(seq_of_list.begin(), seq_of_list.end(), s) - seq_of_list.begin();
        if (i == seq_of_list.size()) {
            seq_of_list.push_back(s);
            per_seq.emplace_back();
        }
        per_seq[i].push_back({ dead_layers, c });
        ++n_used;
    }
    // merge: the next cell is the head of the sequence whose head is dead in most layers (ties: the lower cell)
    std::vector<uint32_t> order; // order[j]: the cell that goes to cell j
    order.reserve(n_used);
    std::vector<size_t> at(per_seq.size(), 0);
    while (order.size() < n_used) {
        size_t best = per_seq.size();
        for (size_t i = 0; i < per_seq.size(); ++i) {
            if (at[i] == per_seq[i].size()) {
                continue;
            }
            const auto & cand = per_seq[i][at[i]];
            if (best == per_seq.size() || cand.first > per_seq[best][at[best]].first ||
                (cand.first == per_seq[best][at[best]].first && cand.second < per_seq[best][at[best]].second)) {
                best = i;
            }
        }
        order.push_back(per_seq[best][at[best]++].second);
    }
    uint32_t moved = 0;
    for (uint32_t j = 0; j < n_used; ++j) {
        moved += order[j] != j;
    }
    if (moved == 0) {
        return 0;
    }
    if (ctx) {
        ggml_backend_sched_synchronize(ctx->get_sched()); // no graph may still read the cells
    }
    layout_full(kv, ext); // every row exists while they move; trimmed again below

    // rows: each layer's K and V of cells [0, end) through the host, one tensor at a time
    std::vector<uint8_t> src, dst;
    for (auto & layer : kvcli_access::layers_mut(*kv)) {
        for (ggml_tensor * t : { layer.k, layer.v }) {
            const size_t row = t->nb[1];
            src.resize((size_t) end * row);
            dst.resize((size_t) n_used * row);
            ggml_backend_tensor_get(t, src.data(), 0, src.size());
            for (uint32_t j = 0; j < n_used; ++j) {
                std::memcpy(dst.data() + (size_t) j * row, src.data() + (size_t) order[j] * row, row);
            }
            ggml_backend_tensor_set(t, dst.data(), 0, dst.size());
        }
    }
    // cells: position, sequence (and M-RoPE ext), and the slot bias of every layer and KV head
    struct moved_cell {
        llama_pos         pos;
        llama_seq_id      seq;
        llama_kv_cell_ext cext;
        bool              biased;
        std::vector<float> bias; // [n_layer][n_head_kv]
    };
    std::vector<moved_cell> saved(n_used);
    for (uint32_t j = 0; j < n_used; ++j) {
        const uint32_t c = order[j];
        moved_cell & m = saved[j];
        m = { cells.pos_get(c), cells.seq_get(c), cells.ext_get(c), ext.cells.biased(c), {} };
        for (uint32_t l = 0; m.biased && l < n_layer; ++l) {
            for (uint32_t h = 0; h < nkv; ++h) {
                m.bias.push_back(ext.cells.bias(l, h, c));
            }
        }
    }
    std::vector<uint32_t> touched;
    for (uint32_t c = 0; c < end; ++c) {
        touched.push_back(c);
        if (!cells.is_empty(c)) {
            cells.rm(c);
        }
        ext.cells.rm(c);
    }
    for (uint32_t j = 0; j < n_used; ++j) {
        const moved_cell & m = saved[j];
        cells.pos_set(j, m.pos);
        cells.ext_set(j, m.cext);
        cells.seq_add(j, m.seq);
        for (uint32_t l = 0; m.biased && l < n_layer; ++l) {
            for (uint32_t h = 0; h < nkv; ++h) {
                ext.cells.set_bias(l, h, j, m.bias[(size_t) l * nkv + h]);
            }
        }
    }
    upload_bias(ext, touched);
    kvcli_access::heads(*kv)[0] = n_used;
    // an observation's accumulators are per cell: what they held no longer matches the cells
    ext.obs.have_colsum = ext.obs.have_colmax = false;
    ++ext.layout_gen; // no graph built over the old cells is reused
    layout_trim(kv, ext);
    return moved;
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

int32_t kvcli_layout_pack(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!kv->kvcli_ext) {
            return 0;
        }
        kv->kvcli_ext->ctx = ctx;
        return (int32_t) pack(ctx, kv, *kv->kvcli_ext);
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

int32_t kvcli_view_starts(struct llama_context * ctx, int32_t * out) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        const auto & layers = kvcli_access::layers(*kv);
        for (size_t i = 0; out && i < layers.size(); ++i) {
            out[i] = kv->kvcli_ext ? (int32_t) view_start(*kv->kvcli_ext, i) : 0;
        }
        return (int32_t) layers.size();
    });
}

} // extern "C"
