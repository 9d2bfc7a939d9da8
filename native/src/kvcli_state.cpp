// kvcli's part of a saved cache state: a prefix [magic, format, model fingerprint, per-sequence headers]
// before llama.cpp's own data and a suffix [slot bias of the written cells] after it, written and read by
// the hooks our patch calls from llama_kv_cache::state_write / state_read.
#include "kvcli_cache.h"
#include "kvcli_hooks.h"

#include "llama-impl.h"
#include "llama-io.h"

#include <algorithm>
#include <cmath>

namespace kvcli_cache_detail { namespace { // internal linkage; the outer name keeps unity builds apart

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
// state: prefix [magic, format, fingerprint, headers] ... llama.cpp data ... suffix [bias]
// ---------------------------------------------------------------------------------

void kvcli_state_write_prefix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id) {
    if (kv->kvcli_ext) {
        // llama.cpp writes every row of the written cells: the full layout while it does (trimmed again by the
        // suffix); the cache is the context's own, not a constant one
        layout_full(const_cast<llama_kv_cache *>(kv), *kv->kvcli_ext);
    }
    const uint32_t magic = STATE_MAGIC, format = (uint32_t) kvcli_state_format();
    const uint64_t fp = model_fingerprint(*kv);
    io.write(&magic, sizeof(magic));
    io.write(&format, sizeof(format));
    io.write(&fp, sizeof(fp));

    std::vector<llama_seq_id> seqs;
    if (kv->kvcli_ext) {
        for (llama_seq_id s = 0; s < LLAMA_MAX_SEQ; ++s) {
            if (kv->kvcli_ext->cells.seq(s).compressed && (seq_id == -1 || s == seq_id)) {
                seqs.push_back(s);
            }
        }
    }
    const uint32_t n = seqs.size();
    io.write(&n, sizeof(n));
    for (llama_seq_id s : seqs) {
        io.write(&s, sizeof(s));
        const kvcli_seq_info & info = kv->kvcli_ext->cells.seq(s);
        io.write(&info.header, sizeof(kvcli_state_header));
        const uint32_t flags = info.off_cell ? STATE_SEQ_OFF_CELL : 0; // format 2
        io.write(&flags, sizeof(flags));
    }
}

void kvcli_state_write_suffix(const llama_kv_cache * kv, llama_io_write_i & io, llama_seq_id seq_id) {
    const uint32_t magic = SUFFIX_MAGIC;
    io.write(&magic, sizeof(magic));
    if (kv->kvcli_ext) {
        // not now: llama.cpp's host writer reads the rows after state_write returns (kvcli_layout_trim, next ubatch)
        kv->kvcli_ext->trim_pending = true;
    }

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
        any = any || kv->kvcli_ext->cells.biased(c);
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
                row[i] = kv->kvcli_ext->cells.bias(ikv, h, cells[i]);
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
                        ext.cells.set_bias(ikv, h, cells[i], row[i]);
                    }
                }
            }
            std::vector<uint32_t> sorted = cells;
            std::sort(sorted.begin(), sorted.end());
            upload_bias(ext, sorted);
        } else if (kv->kvcli_ext && !kv->kvcli_ext->bias.empty()) {
            // an uncompressed state: restored cells carry no bias (a whole-cache restore places cells
            // without apply_ubatch)
            rm_cells(*kv->kvcli_ext, cells);
        }
        if (!headers.empty() && flag == 0) {
            state_fail("corrupted cache state (compressed sequence without slot bias)");
        }
        if (seq_id != -1 && kv->kvcli_ext) {
            kv->kvcli_ext->cells.seq_reset(seq_id);
        }
        for (const auto & p : headers) {
            kvcli_seq_info & info = kvcli_ext_of(kv).cells.seq(p.seq);
            info.compressed = true;
            info.off_cell   = (p.flags & STATE_SEQ_OFF_CELL) != 0;
            info.header     = p.header;
        }
        if (kv->kvcli_ext) {
            // not now: llama.cpp's host reader writes the rows after state_read returns
            kv->kvcli_ext->trim_pending = true;
        }
    } catch (const std::exception & e) {
        kvcli_set_error(e.what());
        kv->state_clear(seq_id);
        if (kv->kvcli_ext && seq_id != -1) {
            kv->kvcli_ext->cells.seq_reset(seq_id);
        }
        throw;
    }
}

