// Compaction as plan -> byte moves on host buffers (kvcli_moves.h), and kvcli_compact_rows, the C entry
// point that runs them without a model.
#include "kvcli_moves.h"
#include "kvcli_internal.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

namespace kvcli_moves {

void validate_plan(const kvcli_plan_view * p, uint32_t n_layer, uint32_t n_head_kv, uint32_t head_dim, uint32_t n_slots) {
    if (!p) {
        throw kvcli_error("plan is NULL");
    }
    if ((uint32_t) p->n_layer != n_layer || (uint32_t) p->n_head_kv != n_head_kv || (uint32_t) p->head_dim != head_dim) {
        throw kvcli_error("plan shape [" + std::to_string(p->n_layer) + " layers, " + std::to_string(p->n_head_kv) +
                          " kv heads, head_dim " + std::to_string(p->head_dim) + "] does not match the model [" +
                          std::to_string(n_layer) + ", " + std::to_string(n_head_kv) + ", " +
                          std::to_string(head_dim) + "]");
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

move_list plan_moves(const kvcli_plan_view & p, const std::vector<int32_t> & src_pos, bool reindex) {
    const size_t n_lh = (size_t) p.n_layer * p.n_head_kv;
    move_list m;
    m.n_head_kv = p.n_head_kv;
    m.off.assign(n_lh + 1, 0);
    for (size_t i = 0; i < n_lh; ++i) {
        m.off[i + 1] = m.off[i] + p.n_kept[i];
        m.B = std::max(m.B, p.n_kept[i]);
    }
    std::vector<int32_t> rep_of(m.off.back(), -1);
    for (int32_t r = 0; r < p.n_replace; ++r) {
        rep_of[p.replace_entry[r]] = r;
    }
    auto pos_of = [&](int64_t e) {
        const int32_t s = p.slots[e];
        if (s < 0 || (size_t) s >= src_pos.size()) {
            throw kvcli_error("plan slot " + std::to_string(s) + " has no position");
        }
        return src_pos[s];
    };
    m.moves.resize(m.off.back());
    std::vector<int64_t> order;
    for (size_t i = 0; i < n_lh; ++i) {
        const int32_t n = p.n_kept[i];
        order.resize(n);
        std::iota(order.begin(), order.end(), m.off[i]);
        if (reindex) {
            std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pos_of(a) < pos_of(b); });
        }
        for (int32_t j = 0; j < n; ++j) {
            const int64_t e = order[j];
            m.moves[m.off[i] + j] = { e, (uint32_t) p.slots[e], (uint32_t) (m.B - n + j), rep_of[e] };
        }
    }
    return m;
}

void row_format::check(bool replacing) const {
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_blck_size(type) <= 0 || ggml_type_size(type) == 0) {
        throw kvcli_error("unknown cache type " + std::to_string((int) type));
    }
    if (head_dim == 0 || n_head_kv == 0) {
        throw kvcli_error("rows need head_dim > 0 and n_head_kv > 0");
    }
    if (transposed && ggml_is_quantized(type)) {
        throw kvcli_error("a quantized V cache needs flash attention");
    }
    if (!transposed && head_dim % ggml_blck_size(type) != 0) {
        throw kvcli_error("head_dim is not a whole number of quantization blocks of the cache type");
    }
    const bool plain = type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
    if (replacing && !plain && (!ggml_is_quantized(type) || ggml_quantize_requires_imatrix(type))) {
        throw kvcli_error(std::string("cannot write replacement rows into cache type ") + ggml_type_name(type));
    }
}

void move_rows(const row_format & f, const move_list & m, uint32_t il, const uint8_t * src, uint32_t n_src,
               const std::vector<uint32_t> & slot_cell, const float * replace, const float * H, int n_rot,
               uint8_t * dst) {
    const uint32_t hd = f.head_dim;
    const size_t cell = f.cell_bytes(), head = f.head_bytes(), el = f.elem_bytes();
    std::vector<float> row(hd);
    for (uint32_t h = 0; h < f.n_head_kv; ++h) {
        for (const row_move * mv = m.begin(il, h); mv != m.end(il, h); ++mv) {
            if (mv->out >= (uint32_t) m.B || mv->slot >= slot_cell.size() || slot_cell[mv->slot] >= n_src) {
                throw kvcli_error("row move out of range");
            }
            const size_t sc = slot_cell[mv->slot];
            if (mv->rep >= 0) {
                std::memcpy(row.data(), replace + (size_t) mv->rep * hd, hd * sizeof(float));
                if (H) {
                    hadamard_blocks(H, n_rot, row.data(), hd);
                }
            }
            if (!f.transposed) {
                uint8_t * d = dst + (size_t) mv->out * cell + h * head;
                if (mv->rep < 0) {
                    std::memcpy(d, src + sc * cell + h * head, head);
                } else {
                    from_float_row(f.type, row.data(), d, hd);
                }
                continue;
            }
            for (uint32_t i = 0; i < hd; ++i) {
                const size_t e = (size_t) h * hd + i;
                uint8_t * d = dst + (e * m.B + mv->out) * el;
                if (mv->rep < 0) {
                    std::memcpy(d, src + (e * n_src + sc) * el, el);
                } else {
                    from_float_row(f.type, row.data() + i, d, 1);
                }
            }
        }
    }
}

void hadamard_blocks(const float * H, int n, float * x, int64_t len) {
    std::vector<float> tmp(n);
    for (int64_t b = 0; b + n <= len; b += n) {
        for (int i = 0; i < n; ++i) {
            float acc = 0.0f;
            const float * row = H + (size_t) i * n;
            for (int k = 0; k < n; ++k) {
                acc += row[k] * x[b + k];
            }
            tmp[i] = acc;
        }
        std::memcpy(x + b, tmp.data(), n * sizeof(float));
    }
}

void to_float_row(ggml_type type, const void * src, float * dst, int64_t n) {
    const auto * tr = ggml_get_type_traits(type);
    if (type == GGML_TYPE_F32) {
        std::memcpy(dst, src, n * sizeof(float));
    } else if (tr->to_float) {
        tr->to_float(src, dst, n);
    } else {
        throw kvcli_error(std::string("cannot dequantize cache type ") + ggml_type_name(type));
    }
}

void from_float_row(ggml_type type, const float * src, void * dst, int64_t n) {
    switch (type) {
        case GGML_TYPE_F32:  std::memcpy(dst, src, n * sizeof(float)); return;
        case GGML_TYPE_F16:  ggml_fp32_to_fp16_row(src, (ggml_fp16_t *) dst, n); return;
        case GGML_TYPE_BF16: ggml_fp32_to_bf16_row(src, (ggml_bf16_t *) dst, n); return;
        default: break;
    }
    if (!ggml_is_quantized(type) || ggml_quantize_requires_imatrix(type)) {
        throw kvcli_error(std::string("cannot write replacement rows into cache type ") + ggml_type_name(type));
    }
    ggml_quantize_chunk(type, src, dst, 0, 1, n, nullptr);
}

} // namespace kvcli_moves

extern "C" {

int32_t kvcli_compact_rows(const struct kvcli_plan_view * plan, int32_t type, int32_t transposed, int32_t which,
                           int32_t reindex, int32_t n_slots, const int32_t * slot_cells, const int32_t * src_pos,
                           int32_t n_src_cells, const void * src, int64_t src_size, void * dst, int64_t dst_size) {
    using namespace kvcli_moves;
    return kvcli_guarded([&] {
        if (!plan || plan->n_layer <= 0 || plan->n_head_kv <= 0 || plan->head_dim <= 0) {
            throw kvcli_error("kvcli_compact_rows: plan is NULL or has no layers, heads or head_dim");
        }
        if (which != 0 && which != 1) {
            throw kvcli_error("kvcli_compact_rows: which must be 0 (K) or 1 (V)");
        }
        if (n_slots <= 0 || n_src_cells <= 0 || !slot_cells || !src || !dst || (reindex && !src_pos)) {
            throw kvcli_error("kvcli_compact_rows: no slots, source cells or buffers");
        }
        const row_format f{ (ggml_type) type, (uint32_t) plan->head_dim, (uint32_t) plan->n_head_kv, transposed != 0 };
        f.check(plan->n_replace > 0);
        validate_plan(plan, plan->n_layer, plan->n_head_kv, plan->head_dim, n_slots);
        std::vector<uint32_t> slot_cell(n_slots);
        for (int32_t s = 0; s < n_slots; ++s) {
            if (slot_cells[s] < 0 || slot_cells[s] >= n_src_cells) {
                throw kvcli_error("kvcli_compact_rows: slot " + std::to_string(s) + " names a cell outside the source");
            }
            slot_cell[s] = slot_cells[s];
        }
        const std::vector<int32_t> pos = reindex ? std::vector<int32_t>(src_pos, src_pos + n_slots) : std::vector<int32_t>();
        const move_list m = plan_moves(*plan, pos, reindex != 0);
        const size_t in_layer = (size_t) n_src_cells * f.cell_bytes(), out_layer = (size_t) m.B * f.cell_bytes();
        if (src_size != (int64_t) (in_layer * plan->n_layer) || dst_size != (int64_t) (out_layer * plan->n_layer)) {
            throw kvcli_error("kvcli_compact_rows: buffer sizes " + std::to_string(src_size) + " / " +
                              std::to_string(dst_size) + " bytes, the rows need " + std::to_string(in_layer * plan->n_layer) +
                              " / " + std::to_string(out_layer * plan->n_layer));
        }
        const float * replace = which == 0 ? plan->replace_k : plan->replace_v;
        for (int32_t il = 0; il < plan->n_layer; ++il) {
            move_rows(f, m, il, (const uint8_t *) src + il * in_layer, n_src_cells, slot_cell, replace, nullptr, 0,
                      (uint8_t *) dst + il * out_layer);
        }
        return m.B;
    });
}

} // extern "C"
