// Re-indexing: the RoPE re-rotation of a compacted sequence's K rows to their new positions, run as
// llama.cpp's own K-shift step in a graph of our own on the device that holds each layer's K.
#include "kvcli_cache.h"

#include "ggml-alloc.h"

#include <algorithm>

namespace kvcli_cache_detail {

// The device whose backend can run graphs over a cache tensor: the buffer type's device; a host
// buffer type without one (ggml's plain CPU buffer type has none) is the CPU device's.
ggml_backend_dev_t cache_tensor_device(const ggml_tensor * t, uint32_t il) {
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(t->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    }
    if (!dev) {
        throw kvcli_error("the KV cache of layer " + std::to_string(il) + " is in a buffer (" +
                          ggml_backend_buft_name(buft) + ") no backend device owns; kvcli cannot run a graph on it");
    }
    return dev;
}

// The backend that runs kvcli's own graphs on `dev` for this cache (made once, kept with the cache).
ggml_backend_t graph_backend(kvcli_kv_ext & ext, ggml_backend_dev_t dev, int n_threads) {
    ggml_backend_t be = nullptr;
    for (auto & [d, b] : ext.graph_backends) {
        if (d == dev) {
            be = b.get();
        }
    }
    if (!be) {
        be = ggml_backend_dev_init(dev, nullptr);
        if (!be) {
            throw kvcli_error(std::string("could not start a backend on ") + ggml_backend_dev_name(dev));
        }
        ext.graph_backends.emplace_back(dev, ggml_backend_ptr(be));
    }
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    auto set_threads = reg ? (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
                           : nullptr;
    if (set_threads) {
        set_threads(be, std::max(1, n_threads));
    }
    return be;
}

ggml_context_ptr graph_context(size_t n_nodes, const std::string & what) {
    ggml_init_params ip = { ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), nullptr, true };
    ggml_context_ptr ctx(ggml_init(ip));
    if (!ctx) {
        throw kvcli_error("could not create the " + what + " graph context");
    }
    return ctx;
}

void run_graph(ggml_backend_t be, ggml_cgraph * gf, const std::string & what, const std::function<void()> & set_inputs) {
    ggml_gallocr_t ga = ggml_gallocr_new(ggml_backend_get_default_buffer_type(be));
    if (!ga) {
        throw kvcli_error("could not create the " + what + " graph allocator");
    }
    std::unique_ptr<ggml_gallocr, void (*)(ggml_gallocr_t)> ga_guard(ga, ggml_gallocr_free);
    if (!ggml_gallocr_alloc_graph(ga, gf)) {
        throw kvcli_error("could not allocate the " + what + " graph");
    }
    set_inputs();
    if (ggml_backend_graph_compute(be, gf) != GGML_STATUS_SUCCESS) {
        throw kvcli_error("the " + what + " graph failed to compute");
    }
    ggml_backend_synchronize(be);
}

// Throws when a layer's K cannot be re-rotated: no backend for its buffer, or RoPE factors that are not
// plain F32 tensors in memory.
void require_rerotatable(llama_context * ctx, llama_kv_cache * kv, kvcli_kv_ext & ext) {
    const auto & cparams = ctx->get_cparams();
    for (const auto & L : kvcli_access::layers(*kv)) {
        if (kvcli_access::hparams(*kv).has_rope(L.il)) {
            graph_backend(ext, cache_tensor_device(L.k, L.il), cparams.n_threads);
            const ggml_tensor * f = kvcli_access::model(*kv).get_rope_factors(cparams, L.il);
            if (f && (f->type != GGML_TYPE_F32 || !f->buffer)) {
                throw kvcli_error("this model's RoPE frequency factors are not an F32 tensor in memory; "
                                  "kvcli cannot re-rotate K");
            }
        }
    }
}

// Re-rotate the K rows of cells `dst` (the compacted sequence) by per-(layer, cell, KV head) position
// deltas: delta[i][j*n_head_kv + h] for cell dst[j] in cache (= plan) layer i. Runs llama.cpp's K-shift step
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
    device_groups groups;
    for (size_t ikv = 0; ikv < layers.size(); ++ikv) {
        const uint32_t il = layers[ikv].il;
        if (!hp.has_rope(il)) {
            continue; // this layer's K carries no position
        }
        bool any = false;
        for (int32_t d : delta[ikv]) {
            any = any || d != 0;
        }
        if (!any) {
            continue;
        }
        ggml_backend_dev_t dev = cache_tensor_device(layers[ikv].k, il);
        add_to_group(groups, dev, ikv);
    }

    for (auto & [dev, ikvs] : groups) {
        ggml_backend_t be = graph_backend(ext, dev, cparams.n_threads);
        // nodes per (layer, run): K view, position view and up to ~12 for the quantized path
        const size_t n_nodes = std::max<size_t>(GGML_DEFAULT_GRAPH_SIZE, ikvs.size() * runs.size() * 24 + 64);
        ggml_context_ptr gctx = graph_context(n_nodes, "re-indexing");
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
            std::copy(delta[ikvs[gi]].begin(), delta[ikvs[gi]].end(), pos_host.begin() + (ptrdiff_t) (gi * B * nkv));
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

        run_graph(be, gf, "re-indexing", [&] {
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
        });
    }
}

} // namespace kvcli_cache_detail
using namespace kvcli_cache_detail;
