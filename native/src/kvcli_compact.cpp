// Compaction of a sequence by a plan (kvcli_apply_plan, kvcli_apply_plan_reindexed): validate the plan,
// compose the kept entries' slot bias, move their K/V bytes into B cells (re-quantized where a row is
// replaced), rewrite the cells' metadata, upload the bias and, when re-indexing, re-rotate K
// (kvcli_reindex.cpp).
#include "kvcli_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

void validate_plan(const kvcli_plan_view * p, const shapes & sh, uint32_t n_slots) {
    if (!p) {
        throw kvcli_error("plan is NULL");
    }
    if ((uint32_t) p->n_layer != sh.n_layer_plan || (uint32_t) p->n_head_kv != sh.n_head_kv ||
        (uint32_t) p->head_dim != sh.head_dim) {
        throw kvcli_error("plan shape [" + std::to_string(p->n_layer) + " layers, " + std::to_string(p->n_head_kv) +
                          " kv heads, head_dim " + std::to_string(p->head_dim) + "] does not match the model [" +
                          std::to_string(sh.n_layer_plan) + ", " + std::to_string(sh.n_head_kv) + ", " +
                          std::to_string(sh.head_dim) + "]");
    }
    if (!p->n_kept || (!p->slots && p->n_layer * p->n_head_kv > 0)) {
        throw kvcli_error("plan has no n_kept/slots arrays");
    }
    int64_t total = 0;
    int32_t bmax = 0;
    for (int32_t i = 0; i < p->n_layer * p->n_head_kv; ++i) {
        const int32_t n = p->n_kept[i];
        if (n < 0 || (uint32_t) n > n_slots) {
            throw kvcli_error("plan keeps " + std::to_string(n) + " entries for a (layer, head) of a sequence with " +
                              std::to_string(n_slots) + " slots");
        }
        for (int32_t j = 0; j < n; ++j) {
            const int32_t s = p->slots[total + j];
            if (s < 0 || (uint32_t) s >= n_slots) {
                throw kvcli_error("plan slot " + std::to_string(s) + " is outside [0, " + std::to_string(n_slots) + ")");
            }
            if (j > 0 && s <= p->slots[total + j - 1]) {
                throw kvcli_error("plan slots of layer " + std::to_string(i / p->n_head_kv) + " head " +
                                  std::to_string(i % p->n_head_kv) + " are not strictly ascending");
            }
            if (p->log_mult && (std::isnan(p->log_mult[total + j]) || p->log_mult[total + j] == INFINITY)) {
                throw kvcli_error("plan log_mult values must be finite or -inf");
            }
        }
        total += n;
        bmax = std::max(bmax, n);
    }
    if (bmax == 0) {
        throw kvcli_error("the plan keeps nothing; remove the sequence instead");
    }
    if (p->n_replace < 0 || p->n_replace > total) {
        throw kvcli_error("plan n_replace out of range");
    }
    if (p->n_replace > 0) {
        if (!p->replace_entry || !p->replace_k || !p->replace_v) {
            throw kvcli_error("plan has replacements without replace_entry/replace_k/replace_v");
        }
        std::vector<uint8_t> seen(total, 0);
        for (int32_t r = 0; r < p->n_replace; ++r) {
            const int32_t e = p->replace_entry[r];
            if (e < 0 || e >= total) {
                throw kvcli_error("plan replace_entry " + std::to_string(e) + " is out of range");
            }
            if (seen[e]) {
                throw kvcli_error("plan replaces entry " + std::to_string(e) + " twice");
            }
            seen[e] = 1;
            for (int32_t d = 0; d < p->head_dim; ++d) {
                if (!std::isfinite(p->replace_k[(size_t) r * p->head_dim + d]) ||
                    !std::isfinite(p->replace_v[(size_t) r * p->head_dim + d])) {
                    throw kvcli_error("plan replacement rows must be finite");
                }
            }
        }
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
                               bool reindex, int32_t p0) {
    llama_kv_cache * kv = kvcli_cache_of(ctx);
    kvcli_require_supported(kv);
    kvcli_check_seq(*kv, seq_id);
    llama_synchronize(ctx);

    auto & ext = kvcli_ext_of(kv);
    if (ext.armed) {
        throw kvcli_error("observation is still armed: call kvcli_observe_end before applying a plan");
    }
    if (reindex && ext.seqs[seq_id].off_cell) {
        throw kvcli_error("sequence " + std::to_string(seq_id) + " was compacted without re-indexing (its entries keep "
                          "their original positions); it cannot be re-indexed: compact every step of it with "
                          "re-indexing, or none");
    }
    if (reindex && kvcli_is_iswa_base(*kv)) {
        // the SWA cache keeps the original positions, which the next token must continue
        throw kvcli_error("re-indexing (a chunked read) is not supported for models with sliding-window layers");
    }
    if (reindex && p0 < 0) {
        throw kvcli_error("re-indexing needs a first position p0 >= 0 (got " + std::to_string(p0) + ")");
    }
    const shapes sh = shapes_of(*kv);
    auto & cells = kvcli_access::cells(*kv)[0];
    const std::vector<uint32_t> src = kvcli_seq_cells(*kv, seq_id);
    if (src.empty()) {
        throw kvcli_error("sequence " + std::to_string(seq_id) + " is empty");
    }
    for (uint32_t c : src) {
        if (cells.seq_count(c) != 1) {
            throw kvcli_error("sequence " + std::to_string(seq_id) +
                              " shares cells with another sequence (seq_cp); compact it before copying");
        }
        if (cells.get_shift(c) != 0) {
            throw kvcli_error("sequence " + std::to_string(seq_id) + " has a pending K-shift; decode once first");
        }
    }
    validate_plan(plan, sh, src.size());

    const auto & layers = kvcli_access::layers(*kv);
    const auto & map_ids = kvcli_access::map_layer_ids(*kv);
    const bool v_trans = kvcli_access::v_trans(*kv);
    const ggml_type tk = layers[0].k->type, tv = layers[0].v->type;
    const uint32_t hd = sh.head_dim, nkv = sh.n_head_kv, kv_size = sh.kv_size;
    const size_t k_head = ggml_row_size(tk, hd);
    const size_t k_row  = ggml_row_size(tk, (int64_t) hd * nkv);
    if (hd % ggml_blck_size(tk) != 0 || (!v_trans && hd % ggml_blck_size(tv) != 0)) {
        throw kvcli_error("head_dim is not a whole number of quantization blocks of the cache type");
    }
    const size_t v_head = v_trans ? 0 : ggml_row_size(tv, hd);
    const size_t v_row  = v_trans ? 0 : ggml_row_size(tv, (int64_t) hd * nkv);
    const size_t v_el   = ggml_type_size(tv);
    if (v_trans && ggml_is_quantized(tv)) {
        throw kvcli_error("a quantized V cache needs flash attention");
    }

    // plan layer i is cache layer i (shapes::n_layer_plan): every cache layer is its model layer's own
    std::vector<int32_t> ikv_of(sh.n_layer_plan, -1);
    for (uint32_t il = 0; il < sh.n_layer_plan; ++il) {
        auto it = map_ids.find(layers[il].il);
        if (it == map_ids.end() || it->second != il) {
            throw kvcli_error("layer " + std::to_string(layers[il].il) + " has no KV cache of its own; kvcli cannot "
                              "compact it");
        }
        ikv_of[il] = il;
    }

    std::vector<int64_t> off(sh.n_layer_plan * nkv + 1, 0);
    int32_t B = 0;
    for (size_t i = 0; i < (size_t) sh.n_layer_plan * nkv; ++i) {
        off[i + 1] = off[i] + plan->n_kept[i];
        B = std::max(B, plan->n_kept[i]);
    }
    if (reindex && (int64_t) p0 + B > std::numeric_limits<int32_t>::max() / 2) {
        throw kvcli_error("re-indexing to p0 = " + std::to_string(p0) + " leaves no room for positions");
    }
    std::vector<int32_t> rep_of(off.back(), -1);
    for (int32_t r = 0; r < plan->n_replace; ++r) {
        rep_of[plan->replace_entry[r]] = r;
    }
    if (reindex) {
        require_rerotatable(ctx, kv, ext); // fail before anything moves
    }

    // which plan entry goes to output slot j of (l, h): the plan's order, or (re-indexing) the order of
    // the entries' current positions, so new positions keep their relative order (they are the same
    // unless another sequence's cells made this one's cells out of position order)
    std::vector<llama_pos> src_pos(src.size());
    for (size_t i = 0; i < src.size(); ++i) {
        src_pos[i] = cells.pos_get(src[i]);
    }
    std::vector<int64_t> order(off.back());
    for (int64_t e = 0; e < off.back(); ++e) {
        order[e] = e;
    }
    if (reindex) {
        for (size_t i = 0; i < (size_t) sh.n_layer_plan * nkv; ++i) {
            std::stable_sort(order.begin() + off[i], order.begin() + off[i + 1], [&](int64_t a, int64_t b) {
                return src_pos[plan->slots[a]] < src_pos[plan->slots[b]];
            });
        }
    }

    // output slot of the j-th kept entry of a (layer, head) keeping n: j, or B-n+j when re-indexing
    auto out_slot = [&](int32_t n, int32_t j) { return reindex ? B - n + j : j; };

    // the new slot bias composes with the old one: an entry keeps what it carried (a dead entry stays
    // -inf, a merged one its log-multiplicity) plus the plan's log_mult; computed before cells move
    ensure_bias(kv, ext);
    std::vector<std::vector<float>> new_bias(sh.n_layer_plan, std::vector<float>((size_t) nkv * B, -INFINITY));
    for (uint32_t il = 0; il < sh.n_layer_plan; ++il) {
        const size_t ikv = ikv_of[il];
        for (uint32_t h = 0; h < nkv; ++h) {
            const int64_t o = off[(size_t) il * nkv + h];
            const int32_t n = plan->n_kept[(size_t) il * nkv + h];
            for (int32_t j = 0; j < n; ++j) {
                const int64_t e = order[o + j];
                const uint32_t c = src[plan->slots[e]];
                const float old = ext.biased[c] ? ext.bias_host[ikv][(size_t) h * kv_size + c] : 0.0f;
                new_bias[il][(size_t) h * B + out_slot(n, j)] = old + (plan->log_mult ? plan->log_mult[e] : 0.0f);
            }
        }
    }

    const int kr = rot_size(*kv, 0), vr = rot_size(*kv, 1);

    const uint32_t lo = src.front(), hi = src.back() + 1;
    const llama_pos n_next = cells.seq_pos_max(seq_id) + 1;

    // free the sequence, then take the B lowest free cells (usually its own first cells)
    ggml_backend_sched_synchronize(ctx->get_sched());
    // a layer's old rows are read just before that layer is rewritten (every model layer has a K/V
    // tensor of its own, checked above), so the host holds one layer's rows at a time, not the sequence's
    std::vector<uint8_t> old_k, old_v;
    auto read_old_rows = [&](size_t ikv) {
        old_k.resize((size_t) (hi - lo) * k_row);
        ggml_backend_tensor_get(layers[ikv].k, old_k.data(), (size_t) lo * k_row, old_k.size());
        if (!v_trans) {
            old_v.resize((size_t) (hi - lo) * v_row);
            ggml_backend_tensor_get(layers[ikv].v, old_v.data(), (size_t) lo * v_row, old_v.size());
        } else {
            old_v.resize((size_t) (hi - lo) * hd * nkv * v_el);
            for (uint32_t e = 0; e < hd * nkv; ++e) {
                ggml_backend_tensor_get(layers[ikv].v, old_v.data() + (size_t) e * (hi - lo) * v_el,
                                        ((size_t) e * kv_size + lo) * v_el, (size_t) (hi - lo) * v_el);
            }
        }
    };
    for (uint32_t c : src) {
        cells.rm(c);
    }
    std::vector<uint32_t> dst;
    for (uint32_t c = 0; c < cells.size() && dst.size() < (size_t) B; ++c) {
        if (cells.is_empty(c)) {
            dst.push_back(c);
        }
    }
    GGML_ASSERT(dst.size() == (size_t) B); // the sequence's own cells are free now
    const auto dst_runs = runs_of(dst);

    // re-indexing: position delta of every (layer, output slot, KV head); a replacement row counts as
    // sitting at its source slot's position (it replaces that row, in the same post-RoPE space)
    std::vector<std::vector<int32_t>> delta;
    if (reindex) {
        delta.assign(sh.n_layer_plan, std::vector<int32_t>((size_t) B * nkv, 0));
        for (uint32_t il = 0; il < sh.n_layer_plan; ++il) {
            for (uint32_t h = 0; h < nkv; ++h) {
                const int64_t o = off[(size_t) il * nkv + h];
                const int32_t n = plan->n_kept[(size_t) il * nkv + h];
                for (int32_t j = 0; j < n; ++j) {
                    const int32_t s = out_slot(n, j);
                    delta[il][(size_t) s * nkv + h] = p0 + s - src_pos[plan->slots[order[o + j]]];
                }
            }
        }
    }

    std::vector<float> tmp(hd);
    std::vector<uint8_t> qbuf(std::max(k_head, v_head) + 64);
    for (uint32_t il = 0; il < sh.n_layer_plan; ++il) {
        const size_t ikv = ikv_of[il];
        read_old_rows(ikv);
        // K (and untransposed V): rows of B cells, built on host, written run by run
        std::vector<uint8_t> nk((size_t) B * k_row, 0), nv(v_trans ? 0 : (size_t) B * v_row, 0);
        std::vector<uint8_t> nvt(v_trans ? (size_t) hd * nkv * B * v_el : 0, 0);
        for (uint32_t h = 0; h < nkv; ++h) {
            const int64_t o = off[(size_t) il * nkv + h];
            const int32_t n = plan->n_kept[(size_t) il * nkv + h];
            for (int32_t j = 0; j < n; ++j) {
                const int64_t e = order[o + j];
                const uint32_t sc = src[plan->slots[e]] - lo; // source cell, relative to lo
                const int32_t r = rep_of[e];
                const int32_t s = out_slot(n, j);
                uint8_t * kd = nk.data() + (size_t) s * k_row + h * k_head;
                if (r < 0) {
                    std::memcpy(kd, old_k.data() + (size_t) sc * k_row + h * k_head, k_head);
                } else {
                    std::memcpy(tmp.data(), plan->replace_k + (size_t) r * hd, hd * sizeof(float));
                    if (kr) {
                        rotate(*kv, tmp.data(), hd, kr);
                    }
                    from_float_row(tk, tmp.data(), kd, hd);
                }
                if (!v_trans) {
                    uint8_t * vd = nv.data() + (size_t) s * v_row + h * v_head;
                    if (r < 0) {
                        std::memcpy(vd, old_v.data() + (size_t) sc * v_row + h * v_head, v_head);
                    } else {
                        std::memcpy(tmp.data(), plan->replace_v + (size_t) r * hd, hd * sizeof(float));
                        if (vr) {
                            rotate(*kv, tmp.data(), hd, vr);
                        }
                        from_float_row(tv, tmp.data(), vd, hd);
                    }
                } else {
                    for (uint32_t d = 0; d < hd; ++d) {
                        const uint32_t e2 = h * hd + d;
                        uint8_t * vd = nvt.data() + ((size_t) e2 * B + s) * v_el;
                        if (r < 0) {
                            std::memcpy(vd, old_v.data() + ((size_t) e2 * (hi - lo) + sc) * v_el, v_el);
                        } else {
                            from_float_row(tv, plan->replace_v + (size_t) r * hd + d, vd, 1);
                        }
                    }
                }
            }
        }
        size_t j0 = 0;
        for (auto [c0, n] : dst_runs) {
            ggml_backend_tensor_set(layers[ikv].k, nk.data() + j0 * k_row, (size_t) c0 * k_row, (size_t) n * k_row);
            if (!v_trans) {
                ggml_backend_tensor_set(layers[ikv].v, nv.data() + j0 * v_row, (size_t) c0 * v_row, (size_t) n * v_row);
            } else {
                for (uint32_t e2 = 0; e2 < hd * nkv; ++e2) {
                    ggml_backend_tensor_set(layers[ikv].v, nvt.data() + ((size_t) e2 * B + j0) * v_el,
                                            ((size_t) e2 * kv_size + c0) * v_el, (size_t) n * v_el);
                }
            }
            j0 += n;
        }
    }

    // cells: positions p0 .. p0+B-1 (re-indexed), or n_next-B .. n_next-1 so decoding continues at n_next
    const llama_pos first = reindex ? p0 : n_next - B;
    for (int32_t j = 0; j < B; ++j) {
        cells.pos_set(dst[j], first + j);
        cells.seq_add(dst[j], seq_id);
    }
    kvcli_access::heads(*kv)[0] = dst.back() + 1;

    // slot bias: composed values for kept entries, -inf where a (layer, head) has fewer than B
    for (uint32_t il = 0; il < sh.n_layer_plan; ++il) {
        const size_t ikv = ikv_of[il];
        for (uint32_t h = 0; h < nkv; ++h) {
            float * row = ext.bias_host[ikv].data() + (size_t) h * kv_size;
            for (int32_t j = 0; j < B; ++j) {
                row[dst[j]] = new_bias[il][(size_t) h * B + j];
            }
        }
        for (auto [c0, n] : dst_runs) {
            push_bias(ext, ikv, nkv, kv_size, c0, n);
        }
    }
    for (uint32_t c : dst) {
        ext.biased[c] = 1;
    }
    ext.seqs[seq_id].compressed = true;
    ext.seqs[seq_id].off_cell   = !reindex;

    if (reindex) {
        try {
            rerotate_k(ctx, kv, ext, dst, delta);
        } catch (const std::exception & e) {
            // the rows were moved but not rotated: a sequence that would attend wrongly is removed instead
            kv->seq_rm(seq_id, -1, -1);
            throw kvcli_error(std::string(e.what()) + " (sequence " + std::to_string(seq_id) + " was removed)");
        }
    }
    return B;
}

extern "C" {

int32_t kvcli_apply_plan(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, false, 0); });
}

int32_t kvcli_apply_plan_reindexed(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan,
                                   int32_t p0) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, true, p0); });
}

} // extern "C"
