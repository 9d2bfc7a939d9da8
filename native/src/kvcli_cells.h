// What kvcli keeps beside llama.cpp's cells (llama_kv_cells, one stream), the way llama_kv_cells keeps
// positions and sequence sets: per cell its slot-bias value in every cache layer and KV head (the host
// mirror of the bias tensors) and whether it carries one; per sequence the compaction flags and header.
// Like llama_kv_cells::rm, rm(c) resets everything kept for cell c. The hooks call it (through
// kvcli_cache_detail::rm_cells, which also zeroes the tensors) wherever llama.cpp frees a cell: seq_rm,
// seq_keep, clear, a cell apply_ubatch overwrites; compaction calls it for the cells it gives up. So a
// freed cell never carries a bias into its next use.
#pragma once

#include "kvcli.h"
#include "kvcli_internal.h"

#include "llama-cparams.h" // LLAMA_MAX_SEQ

#include <array>
#include <cstdint>
#include <string>
#include <vector>

struct kvcli_seq_info {
    bool               compressed = false;
    // set by a plain compaction (kvcli_apply_plan): entries keep their original RoPE positions while
    // their cells sit at n-B..n-1, so "entry position == cell position" no longer holds and
    // re-indexing (which rotates from the cell position) must be refused until the sequence is emptied
    bool               off_cell   = false;
    kvcli_state_header header     = {};
};

class kvcli_cells {
public:
    // bias values for n_layer cache layers x n_head_kv KV heads x kv_size cells, all 0, no cell biased
    void init_bias(uint32_t n_layer, uint32_t n_head_kv, uint32_t kv_size) {
        n_head_kv_ = n_head_kv;
        kv_size_   = kv_size;
        bias_.assign(n_layer, std::vector<float>((size_t) n_head_kv * kv_size, 0.0f));
        biased_.assign(kv_size, 0);
    }

    uint32_t n_layer() const { return (uint32_t) bias_.size(); }
    uint32_t n_head_kv() const { return n_head_kv_; }

    // whether cell c carries a bias row (one set since the cell was last freed)
    bool biased(uint32_t c) const { return c < biased_.size() && biased_[c]; }

    // the bias of (cache layer ikv, KV head h, cell c); 0 for a cell that carries none
    float bias(size_t ikv, uint32_t h, uint32_t c) const { return bias_.at(ikv)[at(h, c)]; }

    // sets a bias value; the cell carries a bias row from now until rm(c)
    void set_bias(size_t ikv, uint32_t h, uint32_t c, float v) {
        bias_.at(ikv)[at(h, c)] = v;
        biased_[c] = 1;
    }

    // the values of (ikv, h) for cells [c0, c0 + n): what the tensors are uploaded from
    const float * bias_run(size_t ikv, uint32_t h, uint32_t c0, uint32_t n) const {
        if (n == 0 || c0 + (uint64_t) n > kv_size_) {
            throw kvcli_error("slot-bias run [" + std::to_string(c0) + ", +" + std::to_string(n) + ") is outside the cache");
        }
        return bias_.at(ikv).data() + at(h, c0);
    }

    // cell c was freed: it carries no bias in any layer or head
    void rm(uint32_t c) {
        if (!biased(c)) {
            return;
        }
        for (auto & layer : bias_) {
            for (uint32_t h = 0; h < n_head_kv_; ++h) {
                layer[at(h, c)] = 0.0f;
            }
        }
        biased_[c] = 0;
    }

    kvcli_seq_info &       seq(llama_seq_id s)       { return seqs_.at(s); }
    const kvcli_seq_info & seq(llama_seq_id s) const { return seqs_.at(s); }

    // the sequence was emptied (or its state could not be restored): it starts afresh
    void seq_reset(llama_seq_id s) { seqs_.at(s) = kvcli_seq_info{}; }

    bool any_compressed() const {
        for (const auto & s : seqs_) {
            if (s.compressed) {
                return true;
            }
        }
        return false;
    }

private:
    size_t at(uint32_t h, uint32_t c) const {
        if (h >= n_head_kv_ || c >= kv_size_) {
            throw kvcli_error("slot bias of KV head " + std::to_string(h) + ", cell " + std::to_string(c) +
                              " is outside the cache");
        }
        return (size_t) h * kv_size_ + c;
    }

    uint32_t                        n_head_kv_ = 0;
    uint32_t                        kv_size_   = 0;
    std::vector<std::vector<float>> bias_;   // per cache layer: [n_head_kv][kv_size]
    std::vector<uint8_t>            biased_; // per cell
    std::array<kvcli_seq_info, LLAMA_MAX_SEQ> seqs_;
};
