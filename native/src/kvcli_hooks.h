// Hooks that our llama.cpp patch (native/patches/0002-kvcli-cache-hooks.patch) calls from inside
// llama.cpp. Implemented in kvcli_cache.cpp (cells, bias, state) and kvcli_graph.cpp (graph).
// Every hook is a no-op until kvcli is used on the cache (kv->kvcli_ext stays null).
#pragma once

#include "ggml-backend.h"
#include "llama.h"
#include "llama-kv-cache.h"

#include <cstdint>
#include <vector>

struct ggml_context;
struct ggml_cgraph;
struct ggml_tensor;
struct llama_ubatch;
struct llama_context;
class llm_graph_result;
class llama_io_write_i;
class llama_io_read_i;

// graph variant of the cache now: 0 = the stock graph (no kvcli cache), nonzero for every kvcli cache (its attention
// goes through kvcli_attn_hook and kvcli_build_attn); changes whenever the graph must be rebuilt.
// Called by can_reuse and at graph build; reads the cache state only (no side effect).
uint64_t kvcli_graph_key(const llama_kv_cache_context * mctx);

// in build_attn (KV-cache overload): returns the mask to use (kq_mask + slot bias when a sequence
// is compacted) and adds the observation nodes when observation is armed; a layer of the ragged layout
// (kvcli_layout.cpp) gets *k and *v viewed from its first stored cell, and the mask to match
ggml_tensor * kvcli_attn_hook(ggml_context * ctx0, ggml_cgraph * gf, llm_graph_result * res,
                              const llama_kv_cache_context * mctx, const llama_ubatch & ubatch,
                              ggml_tensor * q, ggml_tensor ** k, ggml_tensor ** v, ggml_tensor * kq_b,
                              ggml_tensor * kq_mask, float kq_scale, int il);

// after a ubatch graph computed: copies observation outputs to host
void kvcli_after_compute(llama_context * lctx, const llama_ubatch & ubatch);

// the KV and output buffers zeroed when made or cleared, a host buffer's pages left non-resident (kvcli_cache.cpp)
void kvcli_clear_buffer(ggml_backend_buffer_t buf);

// A weight llama.cpp copied out of the model's mapping into a buffer of its own (the CPU's repacked layout, a GPU):
// the mapping's whole pages inside [data, data + size) are given back to the kernel (MADV_DONTNEED; a file mapping
// reads them from the file again if anything ever does). Called by the model loader (0006-kvcli-release-copied-weights).
void kvcli_release_mapped_pages(const void * data, size_t size);

// cache consistency
void kvcli_on_cells_freed(llama_kv_cache * kv);
void kvcli_on_seq_cp(llama_kv_cache * kv, llama_seq_id src, llama_seq_id dst);
void kvcli_on_apply_ubatch(llama_kv_cache * kv, const std::vector<llama_seq_id> & strm,
                           const std::vector<std::vector<uint32_t>> & idxs);
bool kvcli_refuse_shift(llama_kv_cache * kv, llama_seq_id seq_id, const char * op);

// state: prefix (model fingerprint, format, per-sequence headers) and suffix (slot bias)
void kvcli_state_write_prefix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id);
void kvcli_state_write_suffix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id);
void kvcli_state_read_prefix(llama_kv_cache * kv, llama_io_read_i & io, llama_seq_id seq_id);
void kvcli_state_read_suffix(llama_kv_cache * kv, llama_io_read_i & io, llama_seq_id seq_id,
                             const llama_kv_cache::slot_info_vec_t & sinfos);
