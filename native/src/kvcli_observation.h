// Observation state of one KV cache, owned by the graph code (kvcli_graph.cpp): what an armed llama_decode
// adds to the graphs it builds (per-layer window / column sum nodes) and what kvcli_graph.cpp accumulates on
// the host from them after each ubatch. The cache extension (kvcli_cache.h) only holds one of these.
#pragma once

#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

struct ggml_tensor;

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
    std::vector<std::vector<float>> winsum;      // per model layer: [n_windows][n_head][kv_size]
    std::vector<std::vector<float>> colsum;      // per model layer: [n_head][kv_size]
    bool                            have_colsum = false;
    std::vector<std::vector<float>> colmax;      // per model layer: [n_head][kv_size], maxima over the armed rows
    bool                            have_colmax = false;
    // per model layer: [n_rows][n_head][head_dim], in decode order, scaled so that attention's logit is
    // q.k / sqrt(head_dim) (llama.cpp's kq_scale folded in: phi3 scales Q before attention and uses kq_scale 1)
    std::vector<std::vector<float>> queries;
    std::vector<int32_t>            query_pos;   // [n_rows]: their positions
    int64_t                         query_width = 0;  // head_dim * n_head of a row
};
