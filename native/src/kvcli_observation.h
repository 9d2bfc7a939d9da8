// Observation state of one KV cache, owned by the graph code (kvcli_graph.cpp): what an armed llama_decode
// adds to the graphs it builds (per-layer window / column sum nodes) and what kvcli_graph.cpp accumulates on
// the host from them after each ubatch. The cache extension (kvcli_cache.h) only holds one of these.
#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

struct ggml_tensor;
struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;

// One layer's accumulated sums: zero pages from the OS, resident only where a sum was added (the cells the layer
// uses, not the whole context), returned to it on release. On a CPU cache the graph adds each ubatch's sums into
// them itself through `tensor` (a ggml tensor over these floats): no per-layer graph output held to the end of the
// graph, no second copy on the host.
class kvcli_acc {
public:
    kvcli_acc() = default;
    ~kvcli_acc() { release(); }
    kvcli_acc(kvcli_acc && o) noexcept { *this = std::move(o); }
    kvcli_acc & operator=(kvcli_acc && o) noexcept;
    kvcli_acc(const kvcli_acc &) = delete;
    kvcli_acc & operator=(const kvcli_acc &) = delete;

    void allocate(size_t n);    // n zeros (the previous floats released)
    void release();
    bool empty() const { return data_ == nullptr; }
    size_t size() const { return n_; }
    float * data() const { return data_; }
    // whether a computed graph has added into the floats since allocate(): until then the graph's adds write their
    // values instead (add_nonzero), so a page's first touch is a write, not a read of the zero page and a copy on
    // write (a TLB flush on every thread's CPU) after it
    bool written() const { return written_; }
    void mark_written() { written_ = data_ != nullptr; }
    // F32 [ne0, ne1, ne2] over the floats (ne0 * ne1 * ne2 == size()), in a host buffer the CPU backend computes on
    ggml_tensor * tensor(int64_t ne0, int64_t ne1, int64_t ne2);

private:
    float * data_ = nullptr;
    size_t n_ = 0, bytes_ = 0;
    bool written_ = false;
    ggml_context * ctx_ = nullptr;
    ggml_backend_buffer * buf_ = nullptr;
    ggml_tensor * t_ = nullptr;
};

// A ubatch of at most this many rows takes kvcli_attention.cpp's rows path on the CPU (its FEW_ROWS_MAX)
constexpr int64_t KVCLI_FEW_ROWS_MAX = 63;

// A window observation of every row of a few-rows ubatch, on a CPU cache: kvcli_attn_hook leaves it to
// kvcli_build_attn, which builds it a group of heads at a time beside the attention that reuses its probabilities
// (kvcli_obs_window_group), so that one group's [n_kv, rows, heads] products are freed before the next group's.
struct kvcli_window_defer {
    ggml_cgraph * gf   = nullptr;
    ggml_tensor * q3   = nullptr;    // [head_dim, n_head, n_rows]: the rows' Q
    ggml_tensor * k    = nullptr;    // [head_dim, n_head_kv, n_kv]: the layer's K (from its front)
    ggml_tensor * mask = nullptr;    // F32 [n_kv, n_rows, 1 or n_head]: llama.cpp's mask rows (+ the slot bias)
    ggml_tensor * sel  = nullptr;    // F32 [n_windows, n_rows]: obs_input::win_sel
    float kq_scale = 1.0f, cap = 0.0f;
    int64_t c0 = 0;                  // the cell of K's column 0
    uint32_t kv_size = 0;            // the accumulator's cells per head
};

// graph outputs of the ubatch being computed, per model layer
struct kvcli_pending {
    ggml_tensor * win = nullptr;     // F32 [n_windows, n_kv, n_head]: window rows summed per window length
    ggml_tensor * col = nullptr;     // F32 [1, n_kv, n_head]
    ggml_tensor * cmax = nullptr;    // F32 [n_kv, 1, n_head]: the largest probability of the rows, per cell
    ggml_tensor * qrows = nullptr;   // F32 [head_dim * n_head, n_win]: the window queries' Q rows
    float qscale = 1.0f;             // kq_scale x sqrt(head_dim): what the host multiplies the Q rows by
    int64_t c0 = 0;                  // the cell of column 0 (a layer of the ragged layout starts at its front)
    // F32 [n_kv, n_tokens, n_head]: the softmax rows of every row of the ubatch, when the observation made them
    // (the attention's own probabilities: kvcli_build_attn's rows path takes them instead of making them again)
    ggml_tensor * probs = nullptr;
    kvcli_window_defer defer;        // defer.gf set: the window observation is kvcli_build_attn's to build
    bool win_added = false;          // the window sums were added into the host accumulator by the graph itself
    bool col_added = false;          // the column sums too (kvcli_acc::tensor)
};

struct kvcli_observation {
    bool                   armed       = false;
    llama_seq_id           seq         = 0;      // the observed sequence
    int32_t                kinds       = 0;      // KVCLI_OBS_* bits
    std::vector<llama_pos> win_pos0;             // per window length: queries at positions >= win_pos0[i]
    uint64_t               key_counter = 0;      // graphs built while armed (kvcli_graph_key, kvcli_attn_hook)
    std::string            error;                // set when an armed graph could not observe

    std::vector<kvcli_pending>      pending;     // per model layer
    std::vector<int32_t>            win_rows;    // per window length: query rows summed so far
    std::vector<kvcli_acc>          winsum;      // per model layer: [n_windows][n_head][kv_size]
    std::vector<kvcli_acc>          colsum;      // per model layer: [n_head][kv_size]
    bool                            have_colsum = false;
    std::vector<kvcli_acc>          colmax;      // per model layer: [n_head][kv_size], maxima over the armed rows
    bool                            have_colmax = false;
    // per model layer: [n_rows][n_head][head_dim], in decode order, scaled so that attention's logit is
    // q.k / sqrt(head_dim) (llama.cpp's kq_scale folded in: phi3 scales Q before attention and uses kq_scale 1)
    std::vector<std::vector<float>> queries;
    std::vector<int32_t>            query_pos;   // [n_rows]: their positions
    int64_t                         query_width = 0;  // head_dim * n_head of a row
};
