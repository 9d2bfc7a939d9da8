// Compaction of a sequence by a plan (kvcli_apply_plan, kvcli_apply_plan_reindexed), as named steps:
// validate, order (the plan's row moves, kvcli_moves.h), compose the slot bias, free the sequence's cells
// and take B, move the K/V bytes (on the host: read from the cache tensors, moved by kvcli_moves, written
// back; or on the device: a graph of get_rows / set_rows), rewrite the cells, upload the bias and, when
// re-indexing, re-rotate K (kvcli_reindex.cpp).
// A gather (kvcli_gather_plan) runs the same steps with a destination sequence: the source's cells (a resident
// document's, shared by seq_cp, and the question's) stay as they are, and the plan's entries are copied into B
// free cells of the destination, which alone gets their positions and slot bias.
#include "kvcli_cache.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

using kvcli_moves::move_list;
using kvcli_moves::row_format;

// what one compaction works on, filled in by the steps below in order
struct compaction {
    compaction(llama_context * ctx, llama_seq_id seq, const kvcli_plan_view * plan, bool reindex, int32_t p0,
               llama_seq_id dst_seq = -1)
        : ctx(ctx), seq(seq), plan(plan), reindex(reindex), p0(p0), dst_seq(dst_seq) {}

    llama_context *         ctx;
    llama_seq_id            seq;
    const kvcli_plan_view * plan;
    bool                    reindex;
    int32_t                 p0;
    llama_seq_id            dst_seq;  // a gather's destination (the source stays); -1: compact seq in place

    bool gather() const { return dst_seq >= 0; }
    llama_seq_id out_seq() const { return gather() ? dst_seq : seq; }

    llama_kv_cache *        kv  = nullptr;
    kvcli_kv_ext *          ext = nullptr;
    shapes                  sh  = {};
    std::vector<uint32_t>   src;      // the sequence's cells, ascending: its slots
    std::vector<int32_t>    src_pos;  // their positions
    std::vector<size_t>     ikv_of;   // the cache layer of every plan layer
    row_format              fk = {}, fv = {};
    move_list               moves;                       // (order)
    std::vector<std::vector<float>> new_bias;            // per plan layer: [n_head_kv][B] (compose_bias)
    std::vector<uint32_t>   dst;                         // the B cells the sequence keeps (take_cells)
    llama_pos               n_next = 0;                  // the position after the sequence's last
    int8_t                  path   = 0;                  // how the rows move: KVCLI_MOVES_* (validate)

    llama_kv_cells & cells() const { return kvcli_access::cells(*kv)[0]; }
};

// the cache and the sequence can be compacted as asked; gathers the sequence's cells and positions
void check_sequence(compaction & c) {
    c.kv = kvcli_cache_of(c.ctx);
    kvcli_require_supported(c.kv);
    kvcli_check_seq(*c.kv, c.seq);
    llama_synchronize(c.ctx);
    c.ext = &kvcli_ext_of(c.kv);
    c.ext->ctx = c.ctx;
    if (c.ext->obs.armed) {
        throw kvcli_error("observation is still armed: call kvcli_observe_end before applying a plan");
    }
    if (c.reindex && c.ext->cells.seq(c.seq).off_cell) {
        throw kvcli_error("sequence " + std::to_string(c.seq) + " was compacted without re-indexing (its entries keep "
                          "their original positions); it cannot be re-indexed: compact every step of it with "
                          "re-indexing, or none");
    }
    if (c.reindex && kvcli_is_iswa_base(*c.kv)) {
        // the SWA cache keeps the original positions, which the next token must continue
        throw kvcli_error("re-indexing (a chunked read) is not supported for models with sliding-window layers");
    }
    if (c.reindex && c.p0 < 0) {
        throw kvcli_error("re-indexing needs a first position p0 >= 0 (got " + std::to_string(c.p0) + ")");
    }
    if (c.gather()) {
        kvcli_check_seq(*c.kv, c.dst_seq);
        if (c.dst_seq == c.seq) {
            throw kvcli_error("a gather needs a destination sequence other than its source");
        }
        if (c.reindex) {
            throw kvcli_error("a gather keeps the source's positions: it cannot re-index");
        }
        if (!kvcli_seq_cells(*c.kv, c.dst_seq).empty()) {
            throw kvcli_error("the gather's destination sequence " + std::to_string(c.dst_seq) + " is not empty");
        }
    }
    c.sh  = shapes_of(*c.kv);
    c.src = kvcli_seq_cells(*c.kv, c.seq);
    if (c.src.empty()) {
        throw kvcli_error("sequence " + std::to_string(c.seq) + " is empty");
    }
    for (uint32_t cell : c.src) {
        if (!c.gather() && c.cells().seq_count(cell) != 1) {
            throw kvcli_error("sequence " + std::to_string(c.seq) +
                              " shares cells with another sequence (seq_cp); compact it before copying");
        }
        if (c.cells().get_shift(cell) != 0) {
            throw kvcli_error("sequence " + std::to_string(c.seq) + " has a pending K-shift; decode once first");
        }
        c.src_pos.push_back(c.cells().pos_get(cell));
    }
}

// the K/V rows of every plan layer can be moved: formats, and a cache layer of its own per plan layer
void check_layers(compaction & c) {
    const auto & layers = kvcli_access::layers(*c.kv);
    c.fk = { layers[0].k->type, c.sh.head_dim, c.sh.n_head_kv, false };
    c.fv = { layers[0].v->type, c.sh.head_dim, c.sh.n_head_kv, kvcli_access::v_trans(*c.kv) };
    c.fk.check(c.plan->n_replace > 0);
    c.fv.check(c.plan->n_replace > 0);

    // plan layer i is cache layer i (shapes::n_layer_plan): every cache layer is its model layer's own
    const auto & map_ids = kvcli_access::map_layer_ids(*c.kv);
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        auto it = map_ids.find(layers[il].il);
        if (it == map_ids.end() || it->second != il) {
            throw kvcli_error("layer " + std::to_string(layers[il].il) + " has no KV cache of its own; kvcli cannot "
                              "compact it");
        }
        c.ikv_of.push_back(il);
    }
}

// Whether the device path can move this cache's rows exactly: its rows go through float32 and back (get_rows /
// set_rows), which is the identity for f32 and f16 only (no Hadamard rotation either: llama.cpp rotates quantised
// caches only), and whole rows of a KV head must be contiguous.
bool device_movable(const compaction & c, std::string & why) {
    for (const row_format * f : { &c.fk, &c.fv }) {
        if (f->type != GGML_TYPE_F32 && f->type != GGML_TYPE_F16) {
            why = std::string("a ") + ggml_type_name(f->type) + " cache (the device path moves f32 and f16 rows only)";
            return false;
        }
        if (f->transposed) {
            why = "a transposed V cache (a context without flash attention)";
            return false;
        }
    }
    if (rot_size(*c.kv, 0) || rot_size(*c.kv, 1)) {
        why = "a cache whose rows llama.cpp rotates (Hadamard)";
        return false;
    }
    return true;
}

// KVCLI_COMPACT: auto (default) | host | device. auto moves on the device where a layer's K/V is not in host
// memory (a GPU: the rows then never cross to the host) and device_movable allows it.
int8_t moves_path(const compaction & c) {
    const char * env = std::getenv("KVCLI_COMPACT");
    const std::string want = env && *env ? env : "auto";
    if (want != "auto" && want != "host" && want != "device") {
        throw kvcli_error("KVCLI_COMPACT must be auto, host or device (got '" + want + "')");
    }
    if (want == "host") {
        return KVCLI_MOVES_HOST;
    }
    std::string why;
    const bool movable = device_movable(c, why);
    if (want == "device") {
        if (!movable) {
            throw kvcli_error("KVCLI_COMPACT=device cannot move the rows of " + why + "; unset it or set it to host");
        }
        return KVCLI_MOVES_DEVICE;
    }
    const auto & layers = kvcli_access::layers(*c.kv);
    bool off_host = false;
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        const auto & L = layers[c.ikv_of[il]];
        off_host = off_host || !ggml_backend_buffer_is_host(L.k->buffer) || !ggml_backend_buffer_is_host(L.v->buffer);
    }
    // a gather reads B rows a head out of a source as long as the resident document: the host path would copy
    // the source's whole span of every layer (the full cache, once per question), the graph only the kept rows
    return (off_host || c.gather()) && movable ? KVCLI_MOVES_DEVICE : KVCLI_MOVES_HOST;
}

// the cache, the sequence and the plan can be compacted as asked; throws before anything changes
void validate(compaction & c) {
    check_sequence(c);
    kvcli_moves::validate_plan(c.plan, c.sh.n_layer_plan, c.sh.n_head_kv, c.sh.head_dim, c.src.size());
    check_layers(c);
    c.path = moves_path(c);
    ragged_wanted(); // a bad $KVCLI_LAYOUT is refused before anything moves
    if (c.reindex) {
        require_rerotatable(c.ctx, c.kv, *c.ext);
    }
}

// which entry goes to which of the B cells (kvcli_moves::plan_moves)
void order(compaction & c) {
    c.moves = kvcli_moves::plan_moves(*c.plan, c.src_pos, c.reindex);
    if (c.reindex && (int64_t) c.p0 + c.moves.B > std::numeric_limits<int32_t>::max() / 2) {
        throw kvcli_error("re-indexing to p0 = " + std::to_string(c.p0) + " leaves no room for positions");
    }
}

// the new slot bias composes with the old one: an entry keeps what it carried (a dead entry stays -inf, a
// merged one its log-multiplicity) plus the plan's log_mult; -inf where a (layer, head) keeps fewer than B
void compose_bias(compaction & c) {
    ensure_bias(c.kv, *c.ext);
    const uint32_t nkv = c.sh.n_head_kv;
    c.new_bias.assign(c.sh.n_layer_plan, std::vector<float>((size_t) nkv * c.moves.B, -INFINITY));
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        for (uint32_t h = 0; h < nkv; ++h) {
            for (const auto * mv = c.moves.begin(il, h); mv != c.moves.end(il, h); ++mv) {
                const float old = c.ext->cells.bias(c.ikv_of[il], h, c.src[mv->slot]);
                c.new_bias[il][(size_t) h * c.moves.B + mv->out] = old + (c.plan->log_mult ? c.plan->log_mult[mv->entry] : 0.0f);
            }
        }
    }
}

// free the sequence's cells (kvcli's part of them: upload_new_bias), then take the B lowest free cells (usually its
// own first); a gather frees nothing and needs B free cells beside the source's
void take_cells(compaction & c) {
    c.n_next = c.cells().seq_pos_max(c.seq) + 1;
    if (c.gather()) {
        uint32_t n_free = 0;
        for (uint32_t cell = 0; cell < c.cells().size(); ++cell) {
            n_free += c.cells().is_empty(cell) ? 1 : 0;
        }
        if (n_free < (uint32_t) c.moves.B) {
            throw kvcli_error("the context is full: the gather needs " + std::to_string(c.moves.B) +
                              " free cells, " + std::to_string(n_free) + " are free");
        }
    }
    ggml_backend_sched_synchronize(c.ctx->get_sched());
    for (uint32_t cell : c.src) {
        if (!c.gather()) {
            c.cells().rm(cell);
        }
    }
    for (uint32_t cell = 0; cell < c.cells().size() && c.dst.size() < (size_t) c.moves.B; ++cell) {
        if (c.cells().is_empty(cell)) {
            c.dst.push_back(cell);
        }
    }
    GGML_ASSERT(c.dst.size() == (size_t) c.moves.B); // the sequence's own cells are free now (a gather: checked)
}

// the bytes of cells [lo, lo + n) of one cache tensor laid out as f, into buf (n cells as f)
void read_cells(ggml_tensor * t, const row_format & f, uint32_t kv_size, uint32_t lo, uint32_t n, std::vector<uint8_t> & buf) {
    buf.resize((size_t) n * f.cell_bytes());
    if (!f.transposed) {
        ggml_backend_tensor_get(t, buf.data(), (size_t) lo * f.cell_bytes(), buf.size());
        return;
    }
    const size_t el = f.elem_bytes();
    for (size_t e = 0; e < (size_t) f.head_dim * f.n_head_kv; ++e) {
        ggml_backend_tensor_get(t, buf.data() + e * n * el, (e * kv_size + lo) * el, (size_t) n * el);
    }
}

// buf (cells.size() cells as f) into those cells of one cache tensor, run by run
void write_cells(ggml_tensor * t, const row_format & f, uint32_t kv_size, const std::vector<uint32_t> & cells,
                 const std::vector<uint8_t> & buf) {
    const size_t n_all = cells.size(), el = f.elem_bytes(), cell = f.cell_bytes();
    size_t j0 = 0;
    for (auto [c0, n] : runs_of(cells)) {
        if (!f.transposed) {
            ggml_backend_tensor_set(t, buf.data() + j0 * cell, (size_t) c0 * cell, (size_t) n * cell);
        }
        for (size_t e = 0; f.transposed && e < (size_t) f.head_dim * f.n_head_kv; ++e) {
            ggml_backend_tensor_set(t, buf.data() + (e * n_all + j0) * el, (e * kv_size + c0) * el, (size_t) n * el);
        }
        j0 += n;
    }
}

// K and V of every layer: the span of the sequence's old cells is read (one layer at a time, so the host holds
// one layer's rows, not the sequence's), the moves build the B new cells on the host, which are written back.
// Kept rows are byte copies; replacement rows are rotated (quantised caches) and converted to the cache type.
void move_bytes_on_host(compaction & c) {
    const auto & layers = kvcli_access::layers(*c.kv);
    // the slots are in position order (kvcli_seq_cells), their cells need not ascend
    const uint32_t lo = *std::min_element(c.src.begin(), c.src.end());
    const uint32_t span = *std::max_element(c.src.begin(), c.src.end()) + 1 - lo, kv_size = c.sh.kv_size;
    std::vector<uint32_t> slot_cell(c.src.size());
    for (size_t i = 0; i < c.src.size(); ++i) {
        slot_cell[i] = c.src[i] - lo;
    }
    const int kr = rot_size(*c.kv, 0), vr = rot_size(*c.kv, 1);
    const float * hk = kr ? kvcli_access::hadamard(*c.kv, kr).data() : nullptr;
    const float * hv = vr ? kvcli_access::hadamard(*c.kv, vr).data() : nullptr;
    std::vector<uint8_t> old_rows, new_rows;
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        const auto & L = layers[c.ikv_of[il]];
        for (auto [t, f, replace, H, nrot] : { std::make_tuple(L.k, c.fk, c.plan->replace_k, hk, kr),
                                               std::make_tuple(L.v, c.fv, c.plan->replace_v, hv, vr) }) {
            read_cells(t, f, kv_size, lo, span, old_rows);
            new_rows.assign((size_t) c.moves.B * f.cell_bytes(), 0);
            kvcli_moves::move_rows(f, c.moves, il, old_rows.data(), span, slot_cell, replace, H, nrot, new_rows.data());
            write_cells(t, f, kv_size, c.dst, new_rows);
        }
    }
}

// The same B cells as move_bytes_on_host, byte for byte, by a graph on the backend of each layer's device:
// per layer and K/V, the cache viewed as rows of one KV head ([head_dim, n_head_kv * kv_size], row cell*n_head_kv + h);
// the kept rows gathered (get_rows, to float32) and scattered into their cells (set_rows), the replacement rows
// and the zeros of dead slots uploaded and scattered after them. Only the indices, replacement rows and zeros
// cross from the host.
void move_bytes_on_device(compaction & c) {
    const auto & layers = kvcli_access::layers(*c.kv);
    const uint32_t nkv = c.sh.n_head_kv, hd = c.sh.head_dim, kv_size = c.sh.kv_size;
    const int32_t B = c.moves.B;
    const int n_threads = c.ctx->get_cparams().n_threads;

    // per plan layer, the rows to gather (source row, destination row), replace (entry's row, destination) and zero
    struct layer_rows {
        std::vector<int32_t> src;
        std::vector<int64_t> dst, rep_dst, zero_dst;
        std::vector<int32_t> rep;
    };
    std::vector<layer_rows> rows(c.sh.n_layer_plan);
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        layer_rows & r = rows[il];
        for (uint32_t h = 0; h < nkv; ++h) {
            std::vector<bool> filled(B, false);
            for (const auto * mv = c.moves.begin(il, h); mv != c.moves.end(il, h); ++mv) {
                const int64_t to = (int64_t) c.dst[mv->out] * nkv + h;
                filled[mv->out] = true;
                if (mv->rep >= 0) {
                    r.rep.push_back(mv->rep);
                    r.rep_dst.push_back(to);
                } else {
                    r.src.push_back((int32_t) ((int64_t) c.src[mv->slot] * nkv + h));
                    r.dst.push_back(to);
                }
            }
            for (int32_t j = 0; j < B; ++j) {
                if (!filled[j]) {
                    r.zero_dst.push_back((int64_t) c.dst[j] * nkv + h);
                }
            }
        }
    }

    // plan layers grouped by the device holding their cache
    device_groups groups;
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        const auto & L = layers[c.ikv_of[il]];
        ggml_backend_dev_t dev = cache_tensor_device(L.k, L.il);
        if (cache_tensor_device(L.v, L.il) != dev) {
            throw kvcli_error("layer " + std::to_string(L.il) + " keeps K and V on different devices");
        }
        add_to_group(groups, dev, il);
    }

    for (auto & [dev, ils] : groups) {
        ggml_backend_t be = graph_backend(*c.ext, dev, n_threads);
        // per layer and K/V: a view, get_rows, three set_rows, their inputs (indices, rows)
        const size_t n_nodes = std::max<size_t>(GGML_DEFAULT_GRAPH_SIZE, ils.size() * 2 * 16 + 64);
        ggml_context_ptr gctx = graph_context(n_nodes, "compaction");
        ggml_context * g = gctx.get();
        ggml_cgraph * gf = ggml_new_graph_custom(g, n_nodes, false);
        std::vector<std::pair<ggml_tensor *, const void *>> inputs;   // tensor, host data of its bytes
        std::vector<std::vector<float>> host_rows;                    // replacement rows and zeros, kept alive
        auto input = [&](ggml_type type, int64_t ne0, int64_t ne1, const void * data) {
            ggml_tensor * t = ne1 > 0 ? ggml_new_tensor_2d(g, type, ne0, ne1) : ggml_new_tensor_1d(g, type, ne0);
            ggml_set_input(t);
            inputs.emplace_back(t, data);
            return t;
        };
        for (size_t il : ils) {
            const auto & L = layers[c.ikv_of[il]];
            const layer_rows & r = rows[il];
            for (auto [t, replace] : { std::make_pair(L.k, c.plan->replace_k), std::make_pair(L.v, c.plan->replace_v) }) {
                ggml_tensor * view = ggml_view_2d(g, t, hd, (int64_t) nkv * kv_size, ggml_row_size(t->type, hd), 0);
                ggml_tensor * out = view;
                if (!r.src.empty()) {
                    ggml_tensor * got = ggml_get_rows(g, view, input(GGML_TYPE_I32, (int64_t) r.src.size(), 0, r.src.data()));
                    out = ggml_set_rows(g, out, got, input(GGML_TYPE_I64, (int64_t) r.dst.size(), 0, r.dst.data()));
                }
                if (!r.rep.empty()) {
                    std::vector<float> & rr = host_rows.emplace_back((size_t) r.rep.size() * hd);
                    for (size_t i = 0; i < r.rep.size(); ++i) {
                        std::memcpy(rr.data() + i * hd, replace + (size_t) r.rep[i] * hd, hd * sizeof(float));
                    }
                    ggml_tensor * rep = input(GGML_TYPE_F32, hd, (int64_t) r.rep.size(), rr.data());
                    out = ggml_set_rows(g, out, rep, input(GGML_TYPE_I64, (int64_t) r.rep_dst.size(), 0, r.rep_dst.data()));
                }
                if (!r.zero_dst.empty()) {
                    std::vector<float> & zz = host_rows.emplace_back((size_t) r.zero_dst.size() * hd, 0.0f);
                    ggml_tensor * zero = input(GGML_TYPE_F32, hd, (int64_t) r.zero_dst.size(), zz.data());
                    out = ggml_set_rows(g, out, zero, input(GGML_TYPE_I64, (int64_t) r.zero_dst.size(), 0, r.zero_dst.data()));
                }
                if (out != view) {
                    ggml_build_forward_expand(gf, out);
                }
            }
        }
        run_graph(be, gf, "compaction", [&] {
            for (auto & [t, data] : inputs) {
                ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
            }
        });
    }
}

void move_bytes(compaction & c) {
    if (c.path == KVCLI_MOVES_DEVICE) {
        move_bytes_on_device(c);
    } else {
        move_bytes_on_host(c);
    }
    c.ext->moves_path = c.path;
}

// the B cells: positions p0 .. p0+B-1 (re-indexed), or n_next-B .. n_next-1 so decoding continues at n_next
void rewrite_cells(compaction & c) {
    const llama_pos first = c.reindex ? c.p0 : c.n_next - c.moves.B;
    for (int32_t j = 0; j < c.moves.B; ++j) {
        c.cells().pos_set(c.dst[j], first + j);
        c.cells().seq_add(c.dst[j], c.out_seq());
    }
    kvcli_access::heads(*c.kv)[0] = c.dst.back() + 1;
}

// the freed cells lose their bias, the B cells get the composed one; both go to the tensors
void upload_new_bias(compaction & c) {
    for (uint32_t cell : c.src) {
        if (!c.gather()) {
            c.ext->cells.rm(cell);
        }
    }
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        for (uint32_t h = 0; h < c.sh.n_head_kv; ++h) {
            for (int32_t j = 0; j < c.moves.B; ++j) {
                c.ext->cells.set_bias(c.ikv_of[il], h, c.dst[j], c.new_bias[il][(size_t) h * c.moves.B + j]);
            }
        }
    }
    std::vector<uint32_t> changed = c.gather() ? std::vector<uint32_t>() : c.src;
    changed.insert(changed.end(), c.dst.begin(), c.dst.end());
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    upload_bias(*c.ext, changed);
    kvcli_seq_info & info = c.ext->cells.seq(c.out_seq());
    info.compressed = true;
    info.off_cell   = !c.reindex;
}

// re-indexing: K of every (layer, output slot, KV head) rotated by delta = new - old position; a replacement
// row counts as sitting at its source slot's position (it replaces that row, in the same post-RoPE space)
void rerotate(compaction & c) {
    const uint32_t nkv = c.sh.n_head_kv;
    std::vector<std::vector<int32_t>> delta(c.sh.n_layer_plan, std::vector<int32_t>((size_t) c.moves.B * nkv, 0));
    for (uint32_t il = 0; il < c.sh.n_layer_plan; ++il) {
        for (uint32_t h = 0; h < nkv; ++h) {
            for (const auto * mv = c.moves.begin(il, h); mv != c.moves.end(il, h); ++mv) {
                delta[il][(size_t) mv->out * nkv + h] = c.p0 + (int32_t) mv->out - c.src_pos[mv->slot];
            }
        }
    }
    try {
        rerotate_k(c.ctx, c.kv, *c.ext, c.dst, delta);
    } catch (const std::exception & e) {
        // the rows were moved but not rotated: a sequence that would attend wrongly is removed instead
        c.kv->seq_rm(c.seq, -1, -1);
        throw kvcli_error(std::string(e.what()) + " (sequence " + std::to_string(c.seq) + " was removed)");
    }
}

} } // namespace kvcli_cache_detail
using namespace kvcli_cache_detail;

// reindex: give the kept entries of every (layer, KV head) the positions p0+B-k, ..., p0+B-1 in the order of
// their current positions (K re-rotated), cells p0 .. p0+B-1; else cells n-B .. n-1 and entries keep theirs.
// Re-indexed entries are right-aligned in the B cells (dead padding first): the most recent entry of every
// (layer, KV head) sits at p0+B-1, next to the continuation at p0+B. Left-aligned, a (layer, head) keeping
// k < B entries would see its latest entry B-k positions before the next token (a gap the model reads as
// distance: text after a chunked read of a policy with per-layer budgets degenerated into repetition).
static int32_t apply_plan_impl(llama_context * ctx, llama_seq_id seq_id, const kvcli_plan_view * plan,
                               bool reindex, int32_t p0, llama_seq_id dst_seq = -1) {
    compaction c(ctx, seq_id, plan, reindex, p0, dst_seq);
    validate(c);
    order(c);
    // the moves read and write rows of every cell: through the full layout, trimmed again once the cells are
    // rewritten (kvcli_layout.cpp); a failure in between leaves the full layout, which is always valid
    layout_full(c.kv, *c.ext);
    compose_bias(c);
    take_cells(c);
    move_bytes(c);
    rewrite_cells(c);
    upload_new_bias(c);
    if (reindex) {
        rerotate(c);
    }
    layout_trim(c.kv, *c.ext);
    return c.moves.B;
}

extern "C" {

int32_t kvcli_apply_plan(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, false, 0); });
}

int32_t kvcli_compact_path_taken(struct llama_context * ctx) {
    return kvcli_guarded([&] {
        const auto * ext = kvcli_cache_of(ctx)->kvcli_ext.get();
        return (int32_t) (ext ? ext->moves_path : 0);
    });
}

int32_t kvcli_gather_plan(struct llama_context * ctx, kvcli_seq_id src_seq, kvcli_seq_id dst_seq,
                          const struct kvcli_plan_view * plan) {
    if (dst_seq < 0) {
        return kvcli_guarded([&]() -> int32_t { throw kvcli_error("a gather needs a destination sequence >= 0"); });
    }
    return kvcli_guarded([&] { return apply_plan_impl(ctx, src_seq, plan, false, 0, dst_seq); });
}

int32_t kvcli_apply_plan_reindexed(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan,
                                   int32_t p0) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, true, p0); });
}

} // extern "C"
