// Compaction as plan -> byte moves, with no llama.cpp cache and no ggml tensor (testable on host buffers
// without a model: kvcli_compact_rows): the validation of a plan, the row moves it makes per (layer,
// KV head), and those moves on one layer's K or V bytes. kvcli_compact.cpp reads the rows from the cache
// tensors, runs these and writes the result back.
#pragma once

#include "kvcli.h"

#include "ggml.h"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvcli_moves {

// throws kvcli_error unless p is a plan of this shape for a sequence of n_slots slots
void validate_plan(const kvcli_plan_view * p, uint32_t n_layer, uint32_t n_head_kv, uint32_t head_dim, uint32_t n_slots);

// one kept entry of a (layer, KV head): where its row comes from and where it goes
struct row_move {
    int64_t  entry; // index into the plan's slots and log_mult
    uint32_t slot;  // the source slot of the sequence (plan slots[entry])
    uint32_t out;   // the output slot, 0 .. B-1 (the out-th of the B cells the sequence keeps)
    int32_t  rep;   // the plan's replacement row for this entry, or -1: the source row's bytes are copied
};

// the moves of a plan: those of (layer il, KV head h) are moves[off[il*n_head_kv + h] .. off[... + 1])
struct move_list {
    int32_t               B         = 0; // cells the sequence keeps: max(n_kept)
    uint32_t              n_head_kv = 0;
    std::vector<int64_t>  off;
    std::vector<row_move> moves;

    const row_move * begin(uint32_t il, uint32_t h) const { return moves.data() + off[(size_t) il * n_head_kv + h]; }
    const row_move * end(uint32_t il, uint32_t h) const { return moves.data() + off[(size_t) il * n_head_kv + h + 1]; }
};

// The moves of a validated plan. The j-th of the n entries a (layer, head) keeps is its j-th in the plan's
// order, or (reindex) in the order of the slots' positions src_pos (stable), so new positions keep the
// relative order; it goes to output slot j, or (reindex: right-aligned, dead padding first) B-n+j.
move_list plan_moves(const kvcli_plan_view & p, const std::vector<int32_t> & src_pos, bool reindex);

// how one layer's K or V rows lie in a host buffer of n cells
struct row_format {
    ggml_type type;
    uint32_t  head_dim;
    uint32_t  n_head_kv;
    // false: cell c's row of KV head h at c*cell_bytes() + h*head_bytes() (quantised types: whole blocks);
    // true (V of a cache without flash attention): element e = h*head_dim + d of cell c at (e*n + c)*elem
    bool      transposed;

    size_t head_bytes() const { return ggml_row_size(type, head_dim); }
    size_t cell_bytes() const { return transposed ? elem_bytes() * head_dim * n_head_kv : head_bytes() * n_head_kv; }
    size_t elem_bytes() const { return ggml_type_size(type); }
    // throws kvcli_error when rows of this format cannot be moved (partial quant blocks, quantised transposed)
    // or, when replacing, replacement rows cannot be written in its type
    void check(bool replacing) const;
};

// Writes the B cells of layer il into dst (B * f.cell_bytes() bytes, as f with n = B) from src (n_src cells
// as f with n = n_src). An entry's row is the bytes of its slot's cell slot_cell[slot] in src, or its
// replacement row replace[rep*head_dim ..] (floats: rotated by the n_rot x n_rot Hadamard matrix H when H,
// then converted to f.type). Cells no entry goes to are left as they are. Indices are checked.
void move_rows(const row_format & f, const move_list & m, uint32_t il, const uint8_t * src, uint32_t n_src,
               const std::vector<uint32_t> & slot_cell, const float * replace, const float * H, int n_rot,
               uint8_t * dst);

// y = H x on each block of n floats of x[0, len), H an n x n matrix (row-major)
void hadamard_blocks(const float * H, int n, float * x, int64_t len);
// one row of a cache type <-> float32 (quantised types: ggml_quantize_chunk, whole blocks)
void to_float_row(ggml_type type, const void * src, float * dst, int64_t n);
void from_float_row(ggml_type type, const float * src, void * dst, int64_t n);

} // namespace kvcli_moves
