// kvcli: the attention of a layer whose KV cache holds a compacted sequence, built with ops that
// the cache's own backend runs (issue #17). Called from build_attn by
// native/patches/0003-kvcli-compressed-attention.patch; native/src/README.md "CUDA" explains the paths.
#pragma once

struct ggml_context;
struct ggml_tensor;
class llama_kv_cache_context;

// The attention output [head_dim_v * n_head, n_tokens] of layer il through the split path, or nullptr:
// then build_attn goes on with llama.cpp's build_attn_mha and the mask kvcli_attn_hook returned (the
// mask path). kq_mask is llama.cpp's own mask [n_kv, n_tokens, 1, 1] (F16 with flash attention).
// Records which path layer il took (kvcli_attn_path_taken).
ggml_tensor * kvcli_build_attn(ggml_context * ctx0, const llama_kv_cache_context * mctx, bool flash_attn,
                               ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * kq_b,
                               ggml_tensor * sinks, ggml_tensor * kq_mask, float kq_scale, int il);
