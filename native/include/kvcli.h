// kvcli native API: observation, compaction and planning inside the patched llama.cpp.
//
// Exported from our build of libllama (our sources are compiled into the `llama` target),
// reached from Python through ctypes (kvcli/native/lib.py). Formats are those of
// docs/internals.md: slots, observations and plans. All functions are safe to call with
// bad arguments: they return a negative value (or NULL) and set kvcli_last_error().
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#  define KVCLI_API __declspec(dllexport)
#else
#  define KVCLI_API __attribute__((visibility("default")))
#endif

struct llama_context;
struct llama_model;
typedef int32_t kvcli_seq_id;

// ---------------------------------------------------------------------------------
// Identity
// ---------------------------------------------------------------------------------
KVCLI_API const char * kvcli_version(void);        // kvcli native version, e.g. "0.1.0"
KVCLI_API const char * kvcli_llama_commit(void);   // llama.cpp commit the library was built from
KVCLI_API const char * kvcli_build_flags(void);    // e.g. "GGML_NATIVE=ON GGML_CUDA=OFF SANITIZE=none"
KVCLI_API int32_t      kvcli_state_format(void);   // version of the compressed-state file format
KVCLI_API const char * kvcli_last_error(void);     // message of the last failed call on this thread ("" if none)

// ---------------------------------------------------------------------------------
// Observation: armed per context for one sequence; costs nothing when not armed.
// ---------------------------------------------------------------------------------
enum kvcli_obs_kind {
    KVCLI_OBS_WINDOW = 1,   // attention of the window queries summed over the window, per query head and slot
    KVCLI_OBS_COLSUM = 2,   // column sums of the causal attention of every armed query, per query head
    KVCLI_OBS_COLMAX = 4,   // column maxima: the largest attention any armed query gives each slot, per query head
    KVCLI_OBS_QUERY  = 8,   // the Q rows of the window queries (post-RoPE, as attention uses them), per query head,
                            // scaled so that the attention logit is q.k / sqrt(head_dim) (kq_scale folded in)
};
#define KVCLI_OBS_MAX_WINDOWS 16

// Arm observation of `seq_id` for the following llama_decode calls. Both kinds are reduced in the
// graph, layer by layer; only the sums reach the host (float32, accumulated per cell over ubatches).
// KVCLI_OBS_WINDOW: n_windows (1..KVCLI_OBS_MAX_WINDOWS) window lengths, given by their first
// positions: window i sums the softmax rows of the queries of seq_id at positions >= window_pos0[i]
// (rows added in decode order, in float32). Without KVCLI_OBS_WINDOW or KVCLI_OBS_QUERY, n_windows must be 0.
// KVCLI_OBS_COLSUM: every query of seq_id in an armed decode adds its row. KVCLI_OBS_COLMAX: each slot keeps the
// largest probability any such query gave it (kvzip's reconstruction scores). KVCLI_OBS_QUERY: the Q rows (exactly
// as attention uses them: post-RoPE, per query head) of the queries of seq_id at positions >= the smallest
// window_pos0 (it needs the window positions, with or without KVCLI_OBS_WINDOW), in decode order (expected
// attention's query statistics). Clears earlier captures.
KVCLI_API int32_t kvcli_observe_begin(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t kinds,
                                      int32_t n_windows, const int32_t * window_pos0);
// Disarm. Captured data stays readable until the next kvcli_observe_begin (or kvcli_observe_release).
KVCLI_API int32_t kvcli_observe_end(struct llama_context * ctx);
// Slots of the observed sequence (its cells now, in cell order).
KVCLI_API int32_t kvcli_observe_n_slots(struct llama_context * ctx);
// Query rows summed into window iw so far (its length once the prompt is decoded).
KVCLI_API int32_t kvcli_observe_n_window(struct llama_context * ctx, int32_t iw);
// dst: float[n_head][n_slots]             (Observation.window_sums[iw, il])
KVCLI_API int32_t kvcli_observe_read_window_sum(struct llama_context * ctx, int32_t il, int32_t iw, float * dst);
// dst: float[n_head][n_slots]             (Observation.colsum[il])
KVCLI_API int32_t kvcli_observe_read_colsum(struct llama_context * ctx, int32_t il, float * dst);
// dst: float[n_head][n_slots]             (Observation.colmax[il])
KVCLI_API int32_t kvcli_observe_read_colmax(struct llama_context * ctx, int32_t il, float * dst);
// Query rows captured so far (KVCLI_OBS_QUERY); pos (may be NULL): int32[n_rows], their positions.
KVCLI_API int32_t kvcli_observe_n_queries(struct llama_context * ctx, int32_t * pos);
// dst: float[n_head][n_rows][head_dim]    (Observation.queries[il])
KVCLI_API int32_t kvcli_observe_read_queries(struct llama_context * ctx, int32_t il, float * dst);
// Free layer il's accumulated sums (n_windows + 1 x n_head x the cache's size floats) once they are read, so the
// host does not hold them next to their copy; il = -1: every layer. Reading a released layer is an error.
KVCLI_API int32_t kvcli_observe_release(struct llama_context * ctx, int32_t il);

// ---------------------------------------------------------------------------------
// Cache rows and layout of a sequence
// ---------------------------------------------------------------------------------
KVCLI_API int32_t kvcli_seq_n_slots(struct llama_context * ctx, kvcli_seq_id seq_id);
// which: 0 = K, 1 = V. dst: float[n_head_kv][n_slots][head_dim], dequantised, as attention sees them.
KVCLI_API int32_t kvcli_seq_read_kv(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t il, int32_t which, float * dst);
// dst: int32[n_slots], the position of each slot.
KVCLI_API int32_t kvcli_seq_positions(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t * dst);

// ---------------------------------------------------------------------------------
// Plans (docs/internals.md, "Plan")
// ---------------------------------------------------------------------------------
struct kvcli_plan_view {
    int32_t         n_layer;
    int32_t         n_head_kv;
    int32_t         head_dim;
    const int32_t * n_kept;          // [n_layer * n_head_kv]
    const int32_t * slots;           // [sum(n_kept)], ascending within each (l, h)
    const float   * log_mult;        // [sum(n_kept)] or NULL
    int32_t         n_replace;
    const int32_t * replace_entry;   // [n_replace] indices into slots
    const float   * replace_k;       // [n_replace * head_dim] or NULL when n_replace == 0
    const float   * replace_v;       // [n_replace * head_dim] or NULL when n_replace == 0
};

// Rewrite seq_id into max(n_kept) cells at the lowest free cell indices, set the slot bias,
// keep decoding at the original next position. Returns the new number of cells or < 0.
KVCLI_API int32_t kvcli_apply_plan(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan);

// A gather: the same plan applied to src_seq's slots, the kept entries copied into max(n_kept) free cells that
// dst_seq (empty) gets, at the positions a kvcli_apply_plan of src_seq would give them (decoding dst_seq continues
// at src_seq's next position), with the slot bias there alone. src_seq's cells, shared with other sequences or not
// (a resident document's, seq_cp), are left as they are: many questions' compressed caches derive from one full
// cache without copying or restoring it. Returns the destination's number of cells or < 0.
KVCLI_API int32_t kvcli_gather_plan(struct llama_context * ctx, kvcli_seq_id src_seq, kvcli_seq_id dst_seq,
                                    const struct kvcli_plan_view * plan);

// Repeated compaction: a plan may be applied to an already compacted sequence (its slots are the
// sequence's cells now, in cell order). The slot bias composes: a kept entry's new bias is the bias it
// had in its source cell (0 for a cell without one) + log_mult, so a dead (-inf) entry stays dead and a
// merged entry keeps its log-multiplicity.

// Same as kvcli_apply_plan, then re-indexing: per (layer, KV head), the kept entries, in the order of
// their current positions, get the positions p0+B-k, ..., p0+B-1 and sit in the last k of the B cells
// (right-aligned: the latest entry of every (layer, head) is next to the continuation at p0+B; dead
// padding comes first); each K row is re-rotated by
// delta = new - old position (per layer, KV head and entry) in a ggml graph on the backend of the
// device holding that layer's K (llama.cpp's K-shift step: quantized caches are dequantized,
// un-rotated, roped, rotated and requantized). A replacement row counts as sitting at its source
// slot's position. Cells get positions p0 .. p0+B-1 (B = max kept), so decoding continues at p0+B.
// Layers without RoPE are not rotated. Needs "entry position == cell position" for every entry:
// true for a sequence never compacted or only compacted by this function; a sequence compacted by
// kvcli_apply_plan is refused (kvcli_seq_is_reindexable() == 0) until it is emptied.
// Returns B or < 0. A failure after the cells were rewritten removes the sequence (the error says so).
KVCLI_API int32_t kvcli_apply_plan_reindexed(struct llama_context * ctx, kvcli_seq_id seq_id,
                                             const struct kvcli_plan_view * plan, int32_t p0);

// Compaction without a model (tests; native/src/kvcli_moves.h): the byte moves kvcli_apply_plan* make on one
// kind of cache row, run on host buffers. type: a ggml_type; transposed: V of a cache without flash
// attention; which: 0 = K (replacement rows from plan->replace_k), 1 = V (replace_v), written in `type`
// without the Hadamard rotation a quantised cache adds. src: plan->n_layer blocks of n_src_cells cells, each
// cell n_head_kv rows of row_size(type, head_dim) bytes (transposed: per block, element e = h*head_dim + d of
// cell c at e*n_src_cells + c); slot_cells[n_slots]: the src cell of each slot of the sequence;
// src_pos[n_slots]: their positions, which order the entries when reindex != 0 (as
// kvcli_apply_plan_reindexed: right-aligned, padding first). dst: n_layer blocks of B = max(n_kept)
// cells in the same layout; a cell no entry goes to is left as it is. src_size / dst_size (bytes) must
// be exactly those. Returns B or < 0.
KVCLI_API int32_t kvcli_compact_rows(const struct kvcli_plan_view * plan, int32_t type, int32_t transposed,
                                     int32_t which, int32_t reindex, int32_t n_slots, const int32_t * slot_cells,
                                     const int32_t * src_pos, int32_t n_src_cells, const void * src,
                                     int64_t src_size, void * dst, int64_t dst_size);

// Whether seq_id has been compacted (and so refuses K-shift / seq_add / seq_div).
KVCLI_API int32_t kvcli_seq_is_compressed(struct llama_context * ctx, kvcli_seq_id seq_id);
// Whether every entry of seq_id sits at its cell's position (1), so kvcli_apply_plan_reindexed accepts it;
// 0 after a kvcli_apply_plan. Carried by state save/load (kvcli state format 2).
KVCLI_API int32_t kvcli_seq_is_reindexable(struct llama_context * ctx, kvcli_seq_id seq_id);

// Header stored with a compressed state (llama_state_seq_* carry it with the slot bias).
struct kvcli_state_header {
    char    policy[32];
    int32_t budget;
    int32_t original_tokens;
    char    kvcli_version[16];
};
KVCLI_API int32_t kvcli_seq_set_header(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_state_header * h);
KVCLI_API int32_t kvcli_seq_get_header(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_state_header * h);

// ---------------------------------------------------------------------------------
// Stats, measured from the live cache (seq_id = -1: the whole cache)
// ---------------------------------------------------------------------------------
struct kvcli_stats {
    int32_t n_cells;        // cells the sequence occupies
    int64_t k_bytes;        // bytes of K held in those cells (all layers)
    int64_t v_bytes;
    int64_t bias_bytes;     // slot-bias bytes held for those cells
    int64_t live_entries;   // (layer, kv head, cell) triples that are not -inf
};
// per_layer_cells: int32[n_layer] or NULL; per_head_entries: int32[n_layer * n_head_kv] or NULL
KVCLI_API int32_t kvcli_stats_get(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_stats * out,
                                  int32_t * per_layer_cells, int32_t * per_head_entries);

// Cells of the whole cache that carry a slot-bias row (kvcli's per-cell metadata, native/src/kvcli_cells.h).
// A cell loses its row when llama.cpp frees it (seq_rm, seq_keep, clear, overwrite), so every one of them is
// held by a sequence. Returns the count (0 before the first compaction) or < 0.
KVCLI_API int32_t kvcli_cells_with_bias(struct llama_context * ctx);

// Memory the context's KV cache has allocated (whatever it holds): the K/V buffers llama.cpp sized for
// kv_size cells, and kvcli's slot-bias buffers (allocated at the first compaction), in bytes as the
// backend buffers report them.
struct kvcli_memory {
    int32_t kv_size;        // cells the cache was allocated for
    int64_t kv_bytes;       // K + V buffer bytes (ggml_backend_buffer_get_size over the cache's buffers)
    int64_t bias_bytes;     // slot-bias buffer bytes (0 before the first compaction)
};
KVCLI_API int32_t kvcli_memory_get(struct llama_context * ctx, struct kvcli_memory * out);

// Gives the pages of the context's compute buffers in host memory back to the kernel (MADV_DONTNEED): what a
// graph leaves there is scratch, which the next graph writes before it reads. A document read in ubatches of
// hundreds of rows, or a question prefilled with observation, touches far more of the buffer than a decoded token;
// without this those pages stay resident for the context's life. Costs the next graph its page faults only.
// Buffers in device memory, or host memory the kernel will not advise (pinned), are left as they are.
// released: the bytes given back (may be NULL). Returns 0 or < 0 (kvcli_last_error).
KVCLI_API int32_t kvcli_release_compute(struct llama_context * ctx, int64_t * released);

// How many nodes of the last graph built over the context's cache carry a name starting with `prefix` (kvcli names
// its own nodes: kvcli_obs_winsum-IL[-hH], kvcli_rows_kqv-IL[-gG], ...): which path a ubatch took, for tests.
KVCLI_API int32_t kvcli_last_graph_count(struct llama_context * ctx, const char * prefix);

// The model layers whose KV cache kvcli compresses, in order: every layer of a model without sliding-window
// layers, the global (non-SWA) layers of one with them (their cache is the base cache of llama.cpp's
// llama_kv_cache_iswa; the SWA layers keep llama.cpp's window cache). A plan's layer i is the i-th of them.
// Writes them to il_out (room for n_layer, or NULL) and returns their number.
KVCLI_API int32_t kvcli_model_kv_layers(const struct llama_model * model, int32_t * il_out);

// ---------------------------------------------------------------------------------
// Attention of compacted caches (native/src/README.md, "CUDA")
// ---------------------------------------------------------------------------------
enum kvcli_attn_path_kind {
    // the slot bias in a per-query-head mask [n_kv, n_tokens, n_head] given to llama.cpp's own attention:
    // with flash attention only the CPU kernel takes such a mask; without it mul_mat + soft_max_ext
    // take it on every backend
    KVCLI_ATTN_PATH_MASK  = 1,
    // flash attention with the KV heads as its outer batch dimension: Q [hd, n_tokens, group, n_head_kv],
    // K/V [hd, n_kv, 1, n_head_kv], mask [n_kv, n_tokens, 1, n_head_kv] = causal mask + slot bias of
    // each KV head; every backend's flash-attention kernels take it (flash-attention contexts only)
    KVCLI_ATTN_PATH_SPLIT = 2,
    // a ubatch of 2..63 query rows on the CPU (a question read after a resident document): the matrix-product
    // form, KQ = K^T Q, soft_max_ext (causal mask + slot bias), V^T P, where ggml's CPU flash attention would take
    // its per-row kernel (auto only; native/src/README.md, "What a later question costs")
    KVCLI_ATTN_PATH_ROWS  = 3,
};
// The path the layers of a compacted cache take, from $KVCLI_ATTN_PATH (auto | split | mask; read when
// a graph is built), the context's flash-attention setting and whether the cache sits on a CPU device.
// why: a one-line reason (may be NULL). Returns a kvcli_attn_path_kind, or < 0 for a bad $KVCLI_ATTN_PATH.
KVCLI_API int32_t kvcli_attn_path_choose(int32_t flash_attn, int32_t cache_on_cpu, char * why, int32_t why_size);
// The kvcli_attn_path_kind that layer il took in the last graph ctx built with a compacted sequence;
// 0 when none was built yet, < 0 on bad arguments.
KVCLI_API int32_t kvcli_attn_path_taken(struct llama_context * ctx, int32_t il);

// How a compaction moves the kept K/V rows into the sequence's B cells (native/src/README.md, "CUDA"):
enum kvcli_moves_path_kind {
    // read to host memory, moved there (kvcli_moves.h), written back: every cache type and layout
    KVCLI_MOVES_HOST   = 1,
    // a graph of get_rows / set_rows on the backend holding each layer's K/V, no round trip through host
    // memory: f32 and f16 caches in llama.cpp's row layout (flash attention; V not transposed)
    KVCLI_MOVES_DEVICE = 2,
};
// $KVCLI_COMPACT (auto | host | device; read at every compaction): auto takes the device path where a layer's
// cache is not in host memory and its type and layout allow it, else the host path; device forces it on any
// backend (the CPU too, so the CPU CI tests it) and makes a compaction it cannot do fail.
// The kvcli_moves_path_kind of the last compaction on ctx; 0 when there was none, < 0 on error.
KVCLI_API int32_t kvcli_compact_path_taken(struct llama_context * ctx);

// The ragged layout (native/src/kvcli_layout.cpp; $KVCLI_LAYOUT = ragged (default) | cells, read at every
// compaction and trim): each cache layer stores the cells from its front on, the leading cells held and dead in
// every KV head of that layer having no row. Compaction trims; a saved or restored state leaves the cache in the
// full layout until kvcli_layout_trim (or the next decoded ubatch) trims it again. Returns 0, < 0 on error.
KVCLI_API int32_t kvcli_layout_trim(struct llama_context * ctx);
// per cache layer (kvcli_model_kv_layers order), the first cell it stores, into out (may be NULL); returns the
// number of cache layers, < 0 on error
KVCLI_API int32_t kvcli_layout_fronts(struct llama_context * ctx, int32_t * out);
// per cache layer, the first cell the attention of the last ubatch decoded viewed: the layer's front, or the first
// cell a sequence of that ubatch holds where that is later (every cell before it is masked for all of its rows: an
// answer gathered beside a resident document attends over its own cells). Returns the number of cache layers.
KVCLI_API int32_t kvcli_view_starts(struct llama_context * ctx, int32_t * out);
// Several compressed sequences in one cache (kvcli batch): reorders every used cell, each sequence keeping its
// cells' order, so that cells dead in more cache layers come first and the used cells fill [0, n_used), then trims:
// the dead slots of every sequence, not only of the block at the start of the cache, go unstored. Refused while a
// decode is observed or when a cell is shared by several sequences; does nothing under KVCLI_LAYOUT=cells or for a
// cache without flash attention. Returns the cells that moved, < 0 on error.
KVCLI_API int32_t kvcli_layout_pack(struct llama_context * ctx);

// ---------------------------------------------------------------------------------
// Planning: a pure function of an observation; needs no model.
// ---------------------------------------------------------------------------------
// Reads layer `il`'s K and V rows of an observed sequence into keys and values ([n_head_kv][n_slots][head_dim]
// float32 each, K post-RoPE, as kvcli_seq_read_kv); 0 on success, nonzero on failure. The planner of a merging
// policy calls it once per layer it merges, so it holds one layer's rows at a time (Observation.kv_reader).
typedef int32_t (*kvcli_kv_reader)(void * user, int32_t il, float * keys, float * values);

// RoPE of the observed Q/K rows (Observation.rope, kvcli/planning/rope.py): rotary pair j turns by the angle
// pos x theta_j, theta_j = freq_scale x freq_base^(-2j / n_rot) / freq_factors[j] (freq_factors NULL: 1), over
// dimensions (2j, 2j + 1) for KVCLI_ROPE_NORM and (j, j + n_rot / 2) for KVCLI_ROPE_NEOX (llama.cpp's
// LLAMA_ROPE_TYPE_NORM / _NEOX values). Other rope types and scalings are refused by the planners that need it.
enum kvcli_rope_type {
    KVCLI_ROPE_NONE = -1,
    KVCLI_ROPE_NORM = 0,
    KVCLI_ROPE_NEOX = 2,
};
struct kvcli_rope {
    int32_t       type;          // kvcli_rope_type
    int32_t       n_rot;         // rotated dimensions
    double        freq_base;
    double        freq_scale;
    const float * freq_factors;  // [n_rot / 2] or NULL
};

struct kvcli_obs_view {
    int32_t         n_layer, n_head, n_head_kv, head_dim, n_slots, n_windows;
    const int32_t * windows;     // [n_windows]: distinct window lengths, or NULL when n_windows == 0
    const float *   window_sums; // [n_windows][n_layer][n_head][n_slots] or NULL (Observation.window_sums)
    const float * colsum;     // [n_layer][n_head][n_slots] or NULL
    const float * keys;       // [n_layer][n_head_kv][n_slots][head_dim] or NULL
    const float * values;     // [n_layer][n_head_kv][n_slots][head_dim] or NULL
    kvcli_kv_reader read_kv;  // when keys and values are NULL: the K/V rows, one layer at a time, or NULL
    void *          read_kv_user;
    const float * colmax;     // [n_layer][n_head][n_slots] or NULL (Observation.colmax)
    // KVCLI_OBS_QUERY (expected attention): the Q rows of the last prompt queries, post-RoPE, as attention used them
    int32_t         n_query_rows;     // 0 when none were observed
    const float *   queries;          // [n_layer][n_head][n_query_rows][head_dim] or NULL (Observation.queries)
    const int32_t * query_positions;  // [n_query_rows] or NULL
    const int32_t * positions;        // [n_slots] or NULL: the slots' positions (Observation.positions)
    struct kvcli_rope rope;           // how positions rotate the Q/K rows (rope.type KVCLI_ROPE_NONE: not given)
};

struct kvcli_plan;  // opaque, owned by the library

// params: "key=value;key=value" (lists as comma-separated values), validated against the policy.
KVCLI_API struct kvcli_plan * kvcli_plan_make(const char * policy, const char * params, int32_t budget,
                                              const struct kvcli_obs_view * obs);
KVCLI_API void    kvcli_plan_free(struct kvcli_plan * plan);
KVCLI_API int32_t kvcli_plan_get(const struct kvcli_plan * plan, struct kvcli_plan_view * out); // views stay valid until free

#ifdef __cplusplus
}
#endif
