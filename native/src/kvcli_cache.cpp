// kvcli on the llama.cpp KV cache: compaction of a sequence by a plan, the per-layer per-KV-head
// slot bias, reading rows and positions back, stats, per-sequence headers, state save/load and
// the consistency hooks that our patch calls from llama_kv_cache (seq_rm/seq_cp/seq_add/...).
//
// Layout facts this file relies on (llama.cpp 0c1e57098, src/llama-kv-cache.cpp):
//  - K of layer l is [n_embd_k_gqa, kv_size, n_stream]; the row of KV head h in cell c starts at
//    c*row_size(n_embd_k_gqa) + h*row_size(head_dim) (whole quant blocks when head_dim % blck == 0).
//  - V is the same when not transposed (flash attention on); transposed (flash attention off) it
//    is [kv_size] per element: element e of cell c sits at (e*kv_size + c)*type_size.
//  - Quantized cache types may be stored Hadamard-rotated (attn_rot_k/v, blocks of nrot floats);
//    kvcli reads and writes rows in the model's own space and rotates on the way.
#include "kvcli_cache.h"
#include "kvcli_hooks.h"

#include "llama-impl.h"
#include "llama-io.h"

#include "ggml-alloc.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

// ---------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------

llama_kv_cache * kvcli_cache_of(llama_context * ctx) {
    if (!ctx) {
        throw kvcli_error("context is NULL");
    }
    llama_memory_t mem = ctx->get_memory();
    if (!mem) {
        throw kvcli_error("this context has no KV cache");
    }
    auto * kv = dynamic_cast<llama_kv_cache *>(mem);
    if (!kv) {
        throw kvcli_error("kvcli needs a plain KV cache (models with sliding-window, recurrent or hybrid "
                          "memory are not supported)");
    }
    return kv;
}

void kvcli_require_supported(llama_kv_cache * kv) {
    const auto & hp = kvcli_access::hparams(*kv);
    if (kvcli_access::shared(*kv)) {
        throw kvcli_error("this KV cache shares its cells with another cache; kvcli cannot compact it");
    }
    if (kvcli_access::n_stream(*kv) != 1) {
        throw kvcli_error("kvcli needs a unified KV cache (create the context with kv_unified=true "
                          "when n_seq_max > 1)");
    }
    if (kvcli_access::n_swa(*kv) != 0 || hp.swa_type != LLAMA_SWA_TYPE_NONE) {
        throw kvcli_error("sliding-window attention models are not supported by kvcli");
    }
    if (hp.n_pos_per_embd() != 1) {
        throw kvcli_error("multi-dimensional positions (M-RoPE) are not supported by kvcli");
    }
    if (hp.attn_soft_cap || hp.use_alibi || hp.f_max_alibi_bias > 0.0f) {
        throw kvcli_error("attention soft-capping / ALiBi models are not supported by kvcli");
    }
    if (hp.is_mla()) {
        throw kvcli_error("MLA attention is not supported by kvcli");
    }
    const auto & layers = kvcli_access::layers(*kv);
    if (layers.empty()) {
        throw kvcli_error("the KV cache has no layers");
    }
    const uint32_t hd_k = hp.n_embd_head_k(layers[0].il), hd_v = hp.n_embd_head_v(layers[0].il);
    const uint32_t nkv = hp.n_head_kv(layers[0].il), nh = hp.n_head(layers[0].il);
    for (const auto & L : layers) {
        if (hp.n_embd_head_k(L.il) != hd_k || hp.n_embd_head_v(L.il) != hd_v || hp.n_head_kv(L.il) != nkv ||
            hp.n_head(L.il) != nh || !L.v) {
            throw kvcli_error("kvcli needs the same head shapes in every layer");
        }
    }
    if (hd_k != hd_v) {
        throw kvcli_error("kvcli needs K and V heads of the same size");
    }
    if (nkv == 0 || nh % nkv != 0) {
        throw kvcli_error("n_head is not a multiple of n_head_kv");
    }
}

kvcli_kv_ext & kvcli_ext_of(llama_kv_cache * kv) {
    if (!kv->kvcli_ext) {
        kv->kvcli_ext = std::make_shared<kvcli_kv_ext>();
    }
    return *kv->kvcli_ext;
}

void kvcli_check_seq(const llama_kv_cache & kv, llama_seq_id seq_id) {
    if (seq_id < 0 || (size_t) seq_id >= kvcli_access::seq_to_stream(kv).size() || seq_id >= LLAMA_MAX_SEQ) {
        throw kvcli_error("sequence id " + std::to_string(seq_id) + " is out of range");
    }
}

std::vector<uint32_t> kvcli_seq_cells(const llama_kv_cache & kv, llama_seq_id seq_id) {
    kvcli_check_seq(kv, seq_id);
    const auto & cells = kvcli_access::cells(kv)[kvcli_access::seq_to_stream(kv)[seq_id]];
    std::vector<uint32_t> res;
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i) && cells.seq_has(i, seq_id)) {
            res.push_back(i);
        }
    }
    return res;
}

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

struct shapes {
    uint32_t n_layer_model; // hparams.n_layer
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t head_dim;
    uint32_t kv_size;
};

shapes shapes_of(const llama_kv_cache & kv) {
    const auto & hp = kvcli_access::hparams(kv);
    const auto & L0 = kvcli_access::layers(kv)[0];
    return { hp.n_layer(), hp.n_head(L0.il), hp.n_head_kv(L0.il), hp.n_embd_head_k(L0.il), kv.get_size() };
}

// the rotation llama.cpp applies to K / V of this cache (0: none); see build_input_k_rot/v_rot
int rot_size(const llama_kv_cache & kv, int which) {
    if (which == 0) {
        if (!kvcli_access::rot_k(kv)) {
            return 0;
        }
        int nrot = 64;
        do {
            nrot *= 2;
        } while (kvcli_access::head_k_all(kv) % nrot == 0);
        return nrot / 2;
    }
    return kvcli_access::rot_v(kv) ? 64 : 0;
}

// y = H x on each block of n floats, H the n x n Hadamard matrix llama.cpp rotates this cache with
// (H^2 = I, so this both rotates and un-rotates)
void rotate(const llama_kv_cache & kv, float * x, int64_t len, int n) {
    const std::vector<float> & H = kvcli_access::hadamard(kv, n);
    std::vector<float> tmp(n);
    for (int64_t b = 0; b + n <= len; b += n) {
        for (int i = 0; i < n; ++i) {
            float acc = 0.0f;
            const float * row = H.data() + (size_t) i * n;
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

// contiguous runs of ascending cell indices: (first, count)
std::vector<std::pair<uint32_t, uint32_t>> runs_of(const std::vector<uint32_t> & cells) {
    std::vector<std::pair<uint32_t, uint32_t>> runs;
    for (size_t i = 0; i < cells.size();) {
        size_t j = i + 1;
        while (j < cells.size() && cells[j] == cells[j - 1] + 1) {
            ++j;
        }
        runs.emplace_back(cells[i], (uint32_t) (j - i));
        i = j;
    }
    return runs;
}

void ensure_bias(llama_kv_cache * kv, kvcli_kv_ext & ext) {
    if (!ext.bias.empty()) {
        return;
    }
    const auto & layers = kvcli_access::layers(*kv);
    const shapes sh = shapes_of(*kv);

    // one context + buffer per buffer type, so each layer's bias lives where its K lives
    std::vector<std::pair<ggml_backend_buffer_type_t, ggml_context *>> ctxs;
    std::vector<ggml_tensor *> bias(layers.size(), nullptr);
    std::vector<ggml_context_ptr> owned;
    for (size_t i = 0; i < layers.size(); ++i) {
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[i].k->buffer);
        ggml_context * ctx = nullptr;
        for (auto & [b, c] : ctxs) {
            if (b == buft) {
                ctx = c;
            }
        }
        if (!ctx) {
            ggml_init_params params = { layers.size() * ggml_tensor_overhead(), nullptr, true };
            ctx = ggml_init(params);
            if (!ctx) {
                throw kvcli_error("could not create the slot-bias context");
            }
            owned.emplace_back(ctx);
            ctxs.emplace_back(buft, ctx);
        }
        bias[i] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, sh.kv_size, sh.n_head_kv);
        ggml_format_name(bias[i], "kvcli_bias_l%u", layers[i].il);
    }
    std::vector<ggml_backend_buffer_ptr> bufs;
    for (auto & [buft, ctx] : ctxs) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
        if (!buf) {
            throw kvcli_error("could not allocate the slot bias");
        }
        ggml_backend_buffer_clear(buf, 0);
        bufs.emplace_back(buf);
    }
    ext.bias_ctxs = std::move(owned);
    ext.bias_bufs = std::move(bufs);
    ext.bias      = std::move(bias);
    ext.bias_host.assign(layers.size(), std::vector<float>((size_t) sh.kv_size * sh.n_head_kv, 0.0f));
    ext.biased.assign(sh.kv_size, 0);
}

// write bias_host[ikv] for cells [c0, c0+n) of every head to the tensor
void push_bias(kvcli_kv_ext & ext, size_t ikv, uint32_t n_head_kv, uint32_t kv_size, uint32_t c0, uint32_t n) {
    for (uint32_t h = 0; h < n_head_kv; ++h) {
        const size_t off = (size_t) h * kv_size + c0;
        ggml_backend_tensor_set(ext.bias[ikv], ext.bias_host[ikv].data() + off, off * sizeof(float), n * sizeof(float));
    }
}

// zero the bias of cells (all layers, heads) and forget that they were biased
void clear_bias_cells(kvcli_kv_ext & ext, const std::vector<uint32_t> & cells, uint32_t n_head_kv, uint32_t kv_size) {
    std::vector<uint32_t> todo;
    for (uint32_t c : cells) {
        if (c < ext.biased.size() && ext.biased[c]) {
            todo.push_back(c);
            ext.biased[c] = 0;
        }
    }
    if (todo.empty()) {
        return;
    }
    std::sort(todo.begin(), todo.end());
    for (size_t ikv = 0; ikv < ext.bias.size(); ++ikv) {
        for (uint32_t h = 0; h < n_head_kv; ++h) {
            for (uint32_t c : todo) {
                ext.bias_host[ikv][(size_t) h * kv_size + c] = 0.0f;
            }
        }
        for (auto [c0, n] : runs_of(todo)) {
            push_bias(ext, ikv, n_head_kv, kv_size, c0, n);
        }
    }
}

// 64-bit FNV-1a
struct fnv {
    uint64_t h = 1469598103934665603ull;
    void add(const void * p, size_t n) {
        const auto * b = (const uint8_t *) p;
        for (size_t i = 0; i < n; ++i) {
            h = (h ^ b[i]) * 1099511628211ull;
        }
    }
    template <typename T> void add(const T & v) { add(&v, sizeof(v)); }
};

// identifies the model a state was saved from: shapes, parameter count and the first bytes of
// the token embedding and output norm weights (two fine-tunes of one architecture differ there)
uint64_t model_fingerprint(const llama_kv_cache & kv) {
    const llama_model & model = kvcli_access::model(kv);
    const auto & hp = model.hparams;
    fnv f;
    f.add(hp.n_layer());
    f.add(hp.n_embd);
    f.add(hp.n_head());
    f.add(hp.n_head_kv());
    f.add(hp.n_embd_head_k());
    f.add(hp.n_embd_head_v());
    f.add((uint64_t) model.vocab.n_tokens());
    f.add((uint64_t) model.n_elements());
    for (const ggml_tensor * t : { (const ggml_tensor *) model.tok_embd, (const ggml_tensor *) model.output_norm }) {
        if (t && t->buffer) {
            std::vector<uint8_t> buf(std::min<size_t>(4096, ggml_nbytes(t)));
            ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
            f.add(buf.data(), buf.size());
        }
    }
    return f.h;
}

constexpr uint32_t STATE_MAGIC  = 0x4c43564b; // "KVCL"
constexpr uint32_t SUFFIX_MAGIC = 0x4243564b; // "KVCB"
constexpr uint32_t STATE_SEQ_OFF_CELL = 1;     // per-sequence flag: compacted without re-indexing

} } // namespace kvcli_cache_detail
using namespace kvcli_cache_detail;

// ---------------------------------------------------------------------------------
// hooks called from the patched llama_kv_cache
// ---------------------------------------------------------------------------------

void kvcli_on_cells_freed(llama_kv_cache * kv) {
    if (!kv->kvcli_ext) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    const auto & s2s = kvcli_access::seq_to_stream(*kv);
    for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
        if (ext.seqs[s].compressed && (size_t) s < s2s.size() &&
            kvcli_access::cells(*kv)[s2s[s]].seq_pos_min(s) < 0) {
            ext.seqs[s] = kvcli_seq_info{}; // an emptied sequence starts afresh
        }
    }
}

void kvcli_on_seq_cp(llama_kv_cache * kv, llama_seq_id src, llama_seq_id dst) {
    if (!kv->kvcli_ext || src < 0 || dst < 0 || src >= LLAMA_MAX_SEQ || dst >= LLAMA_MAX_SEQ) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    // the cells are shared, so is their bias: the copy is compressed like its source
    if (ext.seqs[src].compressed) {
        ext.seqs[dst] = ext.seqs[src];
    }
}

void kvcli_on_apply_ubatch(llama_kv_cache * kv, const std::vector<llama_seq_id> & strm,
                           const std::vector<std::vector<uint32_t>> & idxs) {
    if (!kv->kvcli_ext || kv->kvcli_ext->bias.empty()) {
        return;
    }
    auto & ext = *kv->kvcli_ext;
    const shapes sh = shapes_of(*kv);
    for (size_t s = 0; s < strm.size() && s < idxs.size(); ++s) {
        if (strm[s] != 0) {
            continue; // bias exists only for single-stream caches
        }
        bool any = false;
        for (uint32_t c : idxs[s]) {
            any = any || (c < ext.biased.size() && ext.biased[c]);
        }
        if (any) {
            clear_bias_cells(ext, idxs[s], sh.n_head_kv, sh.kv_size);
        }
    }
}

bool kvcli_refuse_shift(llama_kv_cache * kv, llama_seq_id seq_id, const char * op) {
    if (!kv->kvcli_ext || seq_id < 0 || seq_id >= LLAMA_MAX_SEQ || !kv->kvcli_ext->seqs[seq_id].compressed) {
        return false;
    }
    const std::string msg = std::string(op) + " refused: sequence " + std::to_string(seq_id) +
        " is compressed by kvcli; shifting its positions (context shift / K-shift) would corrupt it";
    kvcli_set_error(msg);
    LLAMA_LOG_ERROR("%s\n", msg.c_str());
    return true;
}

// ---------------------------------------------------------------------------------
// state: prefix [magic, format, fingerprint, headers] ... llama.cpp data ... suffix [bias]
// ---------------------------------------------------------------------------------

void kvcli_state_write_prefix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id) {
    const uint32_t magic = STATE_MAGIC, format = (uint32_t) kvcli_state_format();
    const uint64_t fp = model_fingerprint(*kv);
    io.write(&magic, sizeof(magic));
    io.write(&format, sizeof(format));
    io.write(&fp, sizeof(fp));

    std::vector<llama_seq_id> seqs;
    if (kv->kvcli_ext) {
        for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
            if (kv->kvcli_ext->seqs[s].compressed && (seq_id == -1 || s == seq_id)) {
                seqs.push_back(s);
            }
        }
    }
    const uint32_t n = seqs.size();
    io.write(&n, sizeof(n));
    for (llama_seq_id s : seqs) {
        io.write(&s, sizeof(s));
        io.write(&kv->kvcli_ext->seqs[s].header, sizeof(kvcli_state_header));
        const uint32_t flags = kv->kvcli_ext->seqs[s].off_cell ? STATE_SEQ_OFF_CELL : 0; // format 2
        io.write(&flags, sizeof(flags));
    }
}

void kvcli_state_write_suffix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id) {
    const uint32_t magic = SUFFIX_MAGIC;
    io.write(&magic, sizeof(magic));

    // the written cells, in the order llama_kv_cache::state_write wrote them (single stream)
    std::vector<uint32_t> cells;
    const bool has_bias = kv->kvcli_ext && !kv->kvcli_ext->bias.empty() && kvcli_access::n_stream(*kv) == 1;
    if (has_bias) {
        const auto & cs = kvcli_access::cells(*kv)[0];
        for (uint32_t i = 0; i < cs.size(); ++i) {
            if (!cs.is_empty(i) && (seq_id == -1 || cs.seq_has(i, seq_id))) {
                cells.push_back(i);
            }
        }
    }
    bool any = false;
    for (uint32_t c : cells) {
        any = any || kv->kvcli_ext->biased[c];
    }
    const uint32_t flag = any ? 1 : 0;
    io.write(&flag, sizeof(flag));
    if (!any) {
        return;
    }
    const shapes sh = shapes_of(*kv);
    const uint32_t n_layer = kv->kvcli_ext->bias.size(), n_cells = cells.size();
    io.write(&n_layer, sizeof(n_layer));
    io.write(&sh.n_head_kv, sizeof(sh.n_head_kv));
    io.write(&n_cells, sizeof(n_cells));
    std::vector<float> row(n_cells);
    for (uint32_t ikv = 0; ikv < n_layer; ++ikv) {
        for (uint32_t h = 0; h < sh.n_head_kv; ++h) {
            for (uint32_t i = 0; i < n_cells; ++i) {
                row[i] = kv->kvcli_ext->bias_host[ikv][(size_t) h * sh.kv_size + cells[i]];
            }
            io.write(row.data(), row.size() * sizeof(float));
        }
    }
}

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart
[[noreturn]] void state_fail(const std::string & msg) {
    kvcli_set_error(msg);
    throw std::runtime_error(msg);
}
} } // namespace kvcli_cache_detail
using namespace kvcli_cache_detail;

void kvcli_state_read_prefix(llama_kv_cache * kv, llama_io_read_i & io, llama_seq_id seq_id) {
    if (kv->kvcli_ext) {
        kv->kvcli_ext->pending_headers.clear(); // left by a read that failed between prefix and suffix
    }
    std::vector<kvcli_kv_ext::pending_header> headers;
    uint32_t magic = 0, format = 0;
    uint64_t fp = 0;
    io.read(&magic, sizeof(magic));
    if (magic != STATE_MAGIC) {
        state_fail("not a kvcli cache state (saved by a llama.cpp without the kvcli patch, or corrupted)");
    }
    io.read(&format, sizeof(format));
    if (format != (uint32_t) kvcli_state_format()) {
        state_fail("this cache state has kvcli state format " + std::to_string(format) + ", this build reads format " +
                   std::to_string(kvcli_state_format()));
    }
    io.read(&fp, sizeof(fp));
    if (fp != model_fingerprint(*kv)) {
        state_fail("this cache state was saved from another model than the one loaded");
    }
    uint32_t n = 0;
    io.read(&n, sizeof(n));
    if (n > LLAMA_MAX_SEQ) {
        state_fail("corrupted cache state (bad sequence header count)");
    }
    for (uint32_t i = 0; i < n; ++i) {
        llama_seq_id s;
        kvcli_state_header h;
        uint32_t flags = 0;
        io.read(&s, sizeof(s));
        io.read(&h, sizeof(h));
        io.read(&flags, sizeof(flags));
        if (s < 0 || s >= LLAMA_MAX_SEQ) {
            state_fail("corrupted cache state (bad sequence id)");
        }
        if (flags & ~STATE_SEQ_OFF_CELL) {
            state_fail("corrupted cache state (bad sequence flags)");
        }
        h.policy[sizeof(h.policy) - 1] = 0;
        h.kvcli_version[sizeof(h.kvcli_version) - 1] = 0;
        headers.push_back({ seq_id == -1 ? s : seq_id, h, flags });
    }
    if (n > 0) {
        try {
            kvcli_require_supported(kv);
        } catch (const std::exception & e) {
            state_fail(std::string("cannot load a compressed state here: ") + e.what());
        }
        kvcli_ext_of(kv).pending_headers = std::move(headers);
    }
}

void kvcli_state_read_suffix(llama_kv_cache * kv, llama_io_read_i & io, llama_seq_id seq_id,
                             const llama_kv_cache::slot_info_vec_t & sinfos) {
    std::vector<kvcli_kv_ext::pending_header> headers;
    if (kv->kvcli_ext) {
        headers.swap(kv->kvcli_ext->pending_headers);
    }
    try {
        uint32_t magic = 0, flag = 0;
        io.read(&magic, sizeof(magic));
        if (magic != SUFFIX_MAGIC) {
            state_fail("corrupted cache state (kvcli bias block missing)");
        }
        io.read(&flag, sizeof(flag));
        if (flag > 1) {
            state_fail("corrupted cache state (bad bias flag)");
        }
        std::vector<uint32_t> cells;
        for (const auto & si : sinfos) {
            if (!si.empty()) {
                cells.insert(cells.end(), si.idxs[0].begin(), si.idxs[0].end());
            }
        }
        if (flag == 1) {
            kvcli_require_supported(kv);
            const shapes sh = shapes_of(*kv);
            uint32_t n_layer = 0, n_head_kv = 0, n_cells = 0;
            io.read(&n_layer, sizeof(n_layer));
            io.read(&n_head_kv, sizeof(n_head_kv));
            io.read(&n_cells, sizeof(n_cells));
            if (n_layer != kvcli_access::layers(*kv).size() || n_head_kv != sh.n_head_kv || n_cells != cells.size()) {
                state_fail("corrupted cache state (slot-bias shape does not match the cells)");
            }
            auto & ext = kvcli_ext_of(kv);
            ensure_bias(kv, ext);
            std::vector<float> row(n_cells);
            for (uint32_t ikv = 0; ikv < n_layer; ++ikv) {
                for (uint32_t h = 0; h < n_head_kv; ++h) {
                    io.read(row.data(), row.size() * sizeof(float));
                    for (uint32_t i = 0; i < n_cells; ++i) {
                        if (std::isnan(row[i]) || row[i] == INFINITY) {
                            state_fail("corrupted cache state (invalid slot-bias value)");
                        }
                        ext.bias_host[ikv][(size_t) h * sh.kv_size + cells[i]] = row[i];
                    }
                }
            }
            std::vector<uint32_t> sorted = cells;
            std::sort(sorted.begin(), sorted.end());
            for (uint32_t c : sorted) {
                ext.biased[c] = 1;
            }
            for (uint32_t ikv = 0; ikv < n_layer; ++ikv) {
                for (auto [c0, n] : runs_of(sorted)) {
                    push_bias(ext, ikv, n_head_kv, sh.kv_size, c0, n);
                }
            }
        } else if (kv->kvcli_ext && !kv->kvcli_ext->bias.empty()) {
            // an uncompressed state: restored cells must not inherit a stale bias
            std::vector<uint32_t> sorted = cells;
            std::sort(sorted.begin(), sorted.end());
            const shapes sh = shapes_of(*kv);
            clear_bias_cells(*kv->kvcli_ext, sorted, sh.n_head_kv, sh.kv_size);
        }
        if (!headers.empty() && flag == 0) {
            state_fail("corrupted cache state (compressed sequence without slot bias)");
        }
        if (seq_id != -1 && kv->kvcli_ext) {
            kv->kvcli_ext->seqs[seq_id] = kvcli_seq_info{};
        }
        for (const auto & p : headers) {
            auto & ext = kvcli_ext_of(kv);
            ext.seqs[p.seq].compressed = true;
            ext.seqs[p.seq].off_cell   = (p.flags & STATE_SEQ_OFF_CELL) != 0;
            ext.seqs[p.seq].header     = p.header;
        }
    } catch (const std::exception & e) {
        kvcli_set_error(e.what());
        kv->state_clear(seq_id);
        if (kv->kvcli_ext && seq_id != -1) {
            kv->kvcli_ext->seqs[seq_id] = kvcli_seq_info{};
        }
        throw;
    }
}

// ---------------------------------------------------------------------------------
// compaction
// ---------------------------------------------------------------------------------

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

void validate_plan(const kvcli_plan_view * p, const shapes & sh, uint32_t n_slots) {
    if (!p) {
        throw kvcli_error("plan is NULL");
    }
    if ((uint32_t) p->n_layer != sh.n_layer_model || (uint32_t) p->n_head_kv != sh.n_head_kv ||
        (uint32_t) p->head_dim != sh.head_dim) {
        throw kvcli_error("plan shape [" + std::to_string(p->n_layer) + " layers, " + std::to_string(p->n_head_kv) +
                          " kv heads, head_dim " + std::to_string(p->head_dim) + "] does not match the model [" +
                          std::to_string(sh.n_layer_model) + ", " + std::to_string(sh.n_head_kv) + ", " +
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

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

// The device whose backend can run graphs over a layer's K: the buffer type's device; a host
// buffer type without one (ggml's plain CPU buffer type has none) is the CPU device's.
ggml_backend_dev_t k_device(const ggml_tensor * k, uint32_t il) {
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(k->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (!dev) {
        throw kvcli_error("the K cache of layer " + std::to_string(il) + " is in a buffer (" +
                          ggml_backend_buft_name(buft) + ") no backend device owns; kvcli cannot re-rotate it");
    }
    return dev;
}

// The backend that runs graphs on `dev` for this cache (made once, kept with the cache).
ggml_backend_t rope_backend(kvcli_kv_ext & ext, ggml_backend_dev_t dev, int n_threads) {
    ggml_backend_t be = nullptr;
    for (auto & [d, b] : ext.rope_backends) {
        if (d == dev) {
            be = b.get();
        }
    }
    if (!be) {
        be = ggml_backend_dev_init(dev, nullptr);
        if (!be) {
            throw kvcli_error(std::string("could not start a backend on ") + ggml_backend_dev_name(dev) +
                              " to re-rotate K");
        }
        ext.rope_backends.emplace_back(dev, ggml_backend_ptr(be));
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto set_threads = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
                           : nullptr;
    if (set_threads) {
        set_threads(be, std::max(1, n_threads));
    }
    return be;
}

// Re-rotate the K rows of cells `dst` (the compacted sequence) by per-(layer, cell, KV head) position
// deltas: delta[il][j*n_head_kv + h] for cell dst[j]. Runs llama.cpp's K-shift step
// (llama_kv_cache::build_rope_shift) in a graph of our own on a backend of the device holding each
// layer's K, so quantized caches go through dequantize -> un-Hadamard -> RoPE -> Hadamard -> quantize
// as llama.cpp's own context shift does. Only the runs of `dst` are viewed: other sequences' cells
// are never touched.
void rerotate_k(llama_context * ctx, llama_kv_cache * kv, kvcli_kv_ext & ext, const std::vector<uint32_t> & dst,
                const std::vector<std::vector<int32_t>> & delta) {
    const auto & hp = kvcli_access::hparams(*kv);
    if (hp.rope_type == LLAMA_ROPE_TYPE_NONE) {
        return;
    }
    const auto & layers = kvcli_access::layers(*kv);
    const auto & cparams = ctx->get_cparams();
    const llama_model & model = kvcli_access::model(*kv);
    const shapes sh = shapes_of(*kv);
    const uint32_t nkv = sh.n_head_kv, hd = sh.head_dim, B = dst.size();
    const auto runs = runs_of(dst);
    const int nrot_had = rot_size(*kv, 0);

    // layers that need it, grouped by the device holding their K
    std::vector<std::pair<ggml_backend_dev_t, std::vector<size_t>>> groups;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const uint32_t il = layers[ikv].il;
        if (!hp.has_rope(il)) {
            continue; // this layer's K carries no position
        }
        bool any = false;
        for (int32_t d : delta[il]) {
            any = any || d != 0;
        }
        if (!any) {
            continue;
        }
        ggml_backend_dev_t dev = k_device(layers[ikv].k, il);
        auto it = std::find_if(groups.begin(), groups.end(), [&](const auto & g) { return g.first == dev; });
        if (it == groups.end()) {
            groups.push_back({ dev, {} });
            it = groups.end() - 1;
        }
        it->second.push_back(ikv);
    }

    for (auto & [dev, ikvs] : groups) {
        ggml_backend_t be = rope_backend(ext, dev, cparams.n_threads);
        // nodes per (layer, run): K view, position view and up to ~12 for the quantized path
        const size_t n_nodes = std::max<size_t>(GGML_DEFAULT_GRAPH_SIZE, ikvs.size() * runs.size() * 24 + 64);
        ggml_init_params ip = { ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), nullptr, true };
        ggml_context_ptr gctx(ggml_init(ip));
        if (!gctx) {
            throw kvcli_error("could not create the re-indexing graph context");
        }
        ggml_context * g = gctx.get();
        ggml_cgraph * gf = ggml_new_graph_custom(g, n_nodes, false);

        ggml_tensor * pos = ggml_new_tensor_1d(g, GGML_TYPE_I32, (int64_t) ikvs.size() * B * nkv);
        ggml_set_input(pos);
        ggml_tensor * rot = nullptr;
        if (nrot_had) {
            rot = ggml_new_tensor_2d(g, GGML_TYPE_F32, nrot_had, nrot_had);
            ggml_set_input(rot);
        }
        // rope factors are model tensors that may live on another backend: copied into inputs of this graph
        std::vector<std::pair<ggml_tensor *, ggml_tensor *>> factors; // (model tensor, our input)
        auto factor_input = [&](ggml_tensor * f) -> ggml_tensor * {
            if (!f) {
                return nullptr;
            }
            for (auto & [m, c] : factors) {
                if (m == f) {
                    return c;
                }
            }
            if (f->type != GGML_TYPE_F32 || !f->buffer) {
                throw kvcli_error("this model's RoPE frequency factors are not an F32 tensor in memory; "
                                  "kvcli cannot re-rotate K");
            }
            ggml_tensor * c = ggml_new_tensor(g, GGML_TYPE_F32, GGML_MAX_DIMS, f->ne);
            ggml_set_input(c);
            factors.emplace_back(f, c);
            return c;
        };

        std::vector<int32_t> pos_host((size_t) ikvs.size() * B * nkv, 0);
        for (size_t gi = 0; gi < ikvs.size(); ++gi) {
            const auto & L = layers[ikvs[gi]];
            const uint32_t il = L.il;
            std::copy(delta[il].begin(), delta[il].end(), pos_host.begin() + (ptrdiff_t) (gi * B * nkv));
            const uint32_t n_rot = hp.n_rot(il);
            const uint32_t n_embd_nope = hp.n_lora_kv > 0 ? hd - n_rot : 0;
            const size_t head_b = ggml_row_size(L.k->type, hd);
            const size_t row_b  = ggml_row_size(L.k->type, (int64_t) hd * nkv);
            ggml_tensor * fac = factor_input(model.get_rope_factors(cparams, il));
            const float fb = model.get_rope_freq_base(cparams, il), fs = model.get_rope_freq_scale(cparams, il);
            size_t j0 = 0;
            for (auto [c0, n] : runs) {
                // one "token" per (cell, KV head), so each gets its own delta: [n_rot, 1, n*n_head_kv]
                ggml_tensor * k = ggml_view_3d(g, L.k, n_rot, 1, (int64_t) n * nkv, head_b, head_b,
                                               (size_t) c0 * row_b + ggml_row_size(L.k->type, n_embd_nope));
                ggml_tensor * p = ggml_view_1d(g, pos, (int64_t) n * nkv, (gi * B * nkv + j0 * nkv) * sizeof(int32_t));
                ggml_build_forward_expand(gf, kvcli_access::rope_shift(*kv, cparams, g, k, p, rot, fac, fb, fs, il));
                j0 += n;
            }
        }

        ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
        if (!ga) {
            throw kvcli_error("could not create the re-indexing graph allocator");
        }
        std::unique_ptr<ggml_gallocr, void (*)(ggml_gallocr_t)> ga_guard(ga, ggml_gallocr_free);
        if (!ggml_gallocr_alloc_graph(ga, gf)) {
            throw kvcli_error("could not allocate the re-indexing graph");
        }
        ggml_backend_tensor_set(pos, pos_host.data(), 0, ggml_nbytes(pos));
        if (rot) {
            const auto & H = kvcli_access::hadamard(*kv, nrot_had);
            ggml_backend_tensor_set(rot, H.data(), 0, ggml_nbytes(rot));
        }
        for (auto & [m, c] : factors) {
            std::vector<uint8_t> buf(ggml_nbytes(m));
            ggml_backend_tensor_get(m, buf.data(), 0, buf.size());
            ggml_backend_tensor_set(c, buf.data(), 0, buf.size());
        }
        if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
            throw kvcli_error("the re-indexing graph failed to compute");
        }
        ggml_backend_synchronize(be);
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

    // every model layer must be a cache layer of its own (no reuse): the plan is per model layer
    std::vector<int32_t> ikv_of(sh.n_layer_model, -1);
    for (uint32_t il = 0; il < sh.n_layer_model; ++il) {
        auto it = map_ids.find(il);
        if (it == map_ids.end() || layers[it->second].il != il) {
            throw kvcli_error("layer " + std::to_string(il) + " has no KV cache of its own; kvcli cannot compact it");
        }
        ikv_of[il] = it->second;
    }

    std::vector<int64_t> off(sh.n_layer_model * nkv + 1, 0);
    int32_t B = 0;
    for (size_t i = 0; i < (size_t) sh.n_layer_model * nkv; ++i) {
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
        // fail before anything moves when a layer's K cannot be re-rotated (no backend for its buffer, or
        // rope factors that are not plain F32 tensors)
        const auto & cparams = ctx->get_cparams();
        for (const auto & L : layers) {
            if (kvcli_access::hparams(*kv).has_rope(L.il)) {
                rope_backend(ext, k_device(L.k, L.il), cparams.n_threads);
                const ggml_tensor * f = kvcli_access::model(*kv).get_rope_factors(cparams, L.il);
                if (f && (f->type != GGML_TYPE_F32 || !f->buffer)) {
                    throw kvcli_error("this model's RoPE frequency factors are not an F32 tensor in memory; "
                                      "kvcli cannot re-rotate K");
                }
            }
        }
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
        for (size_t i = 0; i < (size_t) sh.n_layer_model * nkv; ++i) {
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
    std::vector<std::vector<float>> new_bias(sh.n_layer_model, std::vector<float>((size_t) nkv * B, -INFINITY));
    for (uint32_t il = 0; il < sh.n_layer_model; ++il) {
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
        delta.assign(sh.n_layer_model, std::vector<int32_t>((size_t) B * nkv, 0));
        for (uint32_t il = 0; il < sh.n_layer_model; ++il) {
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
    for (uint32_t il = 0; il < sh.n_layer_model; ++il) {
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
    for (uint32_t il = 0; il < sh.n_layer_model; ++il) {
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

// ---------------------------------------------------------------------------------
// C API
// ---------------------------------------------------------------------------------

extern "C" {

int32_t kvcli_apply_plan(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, false, 0); });
}

int32_t kvcli_apply_plan_reindexed(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_plan_view * plan,
                                   int32_t p0) {
    return kvcli_guarded([&] { return apply_plan_impl(ctx, seq_id, plan, true, p0); });
}

int32_t kvcli_seq_is_reindexable(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        return (int32_t) !(kv->kvcli_ext && kv->kvcli_ext->seqs[seq_id].off_cell);
    });
}

int32_t kvcli_seq_is_compressed(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        return (int32_t) (kv->kvcli_ext && kv->kvcli_ext->seqs[seq_id].compressed);
    });
}

int32_t kvcli_seq_n_slots(struct llama_context * ctx, kvcli_seq_id seq_id) {
    return kvcli_guarded([&] { return (int32_t) kvcli_seq_cells(*kvcli_cache_of(ctx), seq_id).size(); });
}

int32_t kvcli_seq_positions(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t * dst) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        const auto cs = kvcli_seq_cells(*kv, seq_id);
        if (!dst) {
            throw kvcli_error("dst is NULL");
        }
        const auto & cells = kvcli_access::cells(*kv)[kvcli_access::seq_to_stream(*kv)[seq_id]];
        for (size_t i = 0; i < cs.size(); ++i) {
            dst[i] = cells.pos_get(cs[i]);
        }
        return (int32_t) cs.size();
    });
}

int32_t kvcli_seq_read_kv(struct llama_context * ctx, kvcli_seq_id seq_id, int32_t il, int32_t which, float * dst) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_require_supported(kv);
        const shapes sh = shapes_of(*kv);
        if (il < 0 || (uint32_t) il >= sh.n_layer_model || (which != 0 && which != 1) || !dst) {
            throw kvcli_error("kvcli_seq_read_kv: bad layer, which or dst");
        }
        auto it = kvcli_access::map_layer_ids(*kv).find(il);
        if (it == kvcli_access::map_layer_ids(*kv).end()) {
            throw kvcli_error("layer " + std::to_string(il) + " has no KV cache");
        }
        llama_synchronize(ctx);
        const auto & L = kvcli_access::layers(*kv)[it->second];
        const auto cs = kvcli_seq_cells(*kv, seq_id);
        const uint32_t hd = sh.head_dim, nkv = sh.n_head_kv, n = cs.size();
        ggml_tensor * t = which == 0 ? L.k : L.v;
        const bool trans = which == 1 && kvcli_access::v_trans(*kv);
        const int nrot = rot_size(*kv, which);
        if (n == 0) {
            return 0;
        }
        const uint32_t lo = cs.front(), hi = cs.back() + 1;
        std::vector<float> row(hd);
        if (!trans) {
            const size_t head_b = ggml_row_size(t->type, hd), row_b = ggml_row_size(t->type, (int64_t) hd * nkv);
            std::vector<uint8_t> buf((size_t) (hi - lo) * row_b);
            ggml_backend_tensor_get(t, buf.data(), (size_t) lo * row_b, buf.size());
            for (uint32_t i = 0; i < n; ++i) {
                for (uint32_t h = 0; h < nkv; ++h) {
                    to_float_row(t->type, buf.data() + (size_t) (cs[i] - lo) * row_b + h * head_b, row.data(), hd);
                    if (nrot) {
                        rotate(*kv, row.data(), hd, nrot);
                    }
                    std::memcpy(dst + ((size_t) h * n + i) * hd, row.data(), hd * sizeof(float));
                }
            }
        } else {
            const size_t el = ggml_type_size(t->type), kv_size = sh.kv_size;
            std::vector<uint8_t> buf((size_t) (hi - lo) * el);
            for (uint32_t e = 0; e < hd * nkv; ++e) {
                ggml_backend_tensor_get(t, buf.data(), ((size_t) e * kv_size + lo) * el, buf.size());
                const uint32_t h = e / hd, d = e % hd;
                for (uint32_t i = 0; i < n; ++i) {
                    float v;
                    to_float_row(t->type, buf.data() + (size_t) (cs[i] - lo) * el, &v, 1);
                    dst[((size_t) h * n + i) * hd + d] = v;
                }
            }
        }
        return (int32_t) n;
    });
}

int32_t kvcli_seq_set_header(struct llama_context * ctx, kvcli_seq_id seq_id, const struct kvcli_state_header * h) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        if (!h) {
            throw kvcli_error("header is NULL");
        }
        auto & ext = kvcli_ext_of(kv);
        if (!ext.seqs[seq_id].compressed) {
            throw kvcli_error("sequence " + std::to_string(seq_id) + " is not compressed; a header describes a compaction");
        }
        kvcli_state_header c = *h;
        c.policy[sizeof(c.policy) - 1] = 0;
        std::memset(c.kvcli_version, 0, sizeof(c.kvcli_version));
        std::strncpy(c.kvcli_version, kvcli_version(), sizeof(c.kvcli_version) - 1);
        ext.seqs[seq_id].header = c;
        return 0;
    });
}

int32_t kvcli_seq_get_header(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_state_header * h) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        kvcli_check_seq(*kv, seq_id);
        if (!h) {
            throw kvcli_error("header is NULL");
        }
        if (!kv->kvcli_ext || !kv->kvcli_ext->seqs[seq_id].compressed) {
            std::memset(h, 0, sizeof(*h));
            return 0;
        }
        *h = kv->kvcli_ext->seqs[seq_id].header;
        return 1;
    });
}

int32_t kvcli_stats_get(struct llama_context * ctx, kvcli_seq_id seq_id, struct kvcli_stats * out,
                        int32_t * per_layer_cells, int32_t * per_head_entries) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!out) {
            throw kvcli_error("out is NULL");
        }
        const auto & layers = kvcli_access::layers(*kv);
        const auto & hp = kvcli_access::hparams(*kv);
        const bool v_trans = kvcli_access::v_trans(*kv);
        std::vector<std::pair<uint32_t, uint32_t>> held; // (stream, cell)
        if (seq_id == -1) {
            const auto & all = kvcli_access::cells(*kv);
            for (uint32_t s = 0; s < all.size(); ++s) {
                for (uint32_t i = 0; i < all[s].size(); ++i) {
                    if (!all[s].is_empty(i)) {
                        held.emplace_back(s, i);
                    }
                }
            }
        } else {
            const uint32_t s = (kvcli_check_seq(*kv, seq_id), kvcli_access::seq_to_stream(*kv)[seq_id]);
            for (uint32_t c : kvcli_seq_cells(*kv, seq_id)) {
                held.emplace_back(s, c);
            }
        }
        int64_t k_cell = 0, v_cell = 0;
        for (const auto & L : layers) {
            k_cell += ggml_row_size(L.k->type, hp.n_embd_k_gqa(L.il));
            if (L.v) {
                v_cell += v_trans ? (int64_t) hp.n_embd_v_gqa(L.il) * ggml_type_size(L.v->type)
                                  : (int64_t) ggml_row_size(L.v->type, hp.n_embd_v_gqa(L.il));
            }
        }
        const kvcli_kv_ext * ext = kv->kvcli_ext && !kv->kvcli_ext->bias.empty() ? kv->kvcli_ext.get() : nullptr;
        const uint32_t n_layer = hp.n_layer();
        const uint32_t kv_size = kv->get_size();
        std::vector<int32_t> plc(n_layer, 0), phe;
        int64_t live = 0, biased_cells = 0;
        // per-head counts need uniform head counts (checked when bias exists; else count n_head_kv(il))
        const uint32_t nkv0 = hp.n_head_kv(0);
        phe.assign((size_t) n_layer * nkv0, 0);
        const auto & map_ids = kvcli_access::map_layer_ids(*kv);
        for (auto [s, c] : held) {
            const bool b = ext && s == 0 && ext->biased[c];
            biased_cells += b;
            for (uint32_t il = 0; il < n_layer; ++il) {
                auto it = map_ids.find(il);
                if (it == map_ids.end()) {
                    continue;
                }
                const uint32_t nkv = hp.n_head_kv(il);
                bool any = false;
                for (uint32_t h = 0; h < nkv; ++h) {
                    const bool is_live = !b || ext->bias_host[it->second][(size_t) h * kv_size + c] != -INFINITY;
                    if (is_live) {
                        ++live;
                        any = true;
                        if (h < nkv0) {
                            phe[(size_t) il * nkv0 + h]++;
                        }
                    }
                }
                plc[il] += any;
            }
        }
        out->n_cells      = (int32_t) held.size();
        out->k_bytes      = (int64_t) held.size() * k_cell;
        out->v_bytes      = (int64_t) held.size() * v_cell;
        out->bias_bytes   = ext ? biased_cells * (int64_t) ext->bias.size() * nkv0 * (int64_t) sizeof(float) : 0;
        out->live_entries = live;
        if (per_layer_cells) {
            std::copy(plc.begin(), plc.end(), per_layer_cells);
        }
        if (per_head_entries) {
            std::copy(phe.begin(), phe.end(), per_head_entries);
        }
        return (int32_t) held.size();
    });
}

int32_t kvcli_memory_get(struct llama_context * ctx, struct kvcli_memory * out) {
    return kvcli_guarded([&] {
        llama_kv_cache * kv = kvcli_cache_of(ctx);
        if (!out) {
            throw kvcli_error("out is NULL");
        }
        int64_t kv_bytes = 0;
        for (const auto & [buft, size] : kv->memory_breakdown()) {
            kv_bytes += (int64_t) size;
        }
        int64_t bias_bytes = 0;
        if (kv->kvcli_ext) {
            for (const auto & buf : kv->kvcli_ext->bias_bufs) {
                bias_bytes += buf ? (int64_t) ggml_backend_buffer_get_size(buf.get()) : 0;
            }
        }
        out->kv_size    = (int32_t) kv->get_size();
        out->kv_bytes   = kv_bytes;
        out->bias_bytes = bias_bytes;
        return 0;
    });
}

} // extern "C"
