// kvcli on models with sliding-window layers (gemma3: llama_kv_cache_iswa holds two llama_kv_cache).
// The SWA layers' cache is bounded by the window already and stays llama.cpp's own; kvcli compresses
// the other ("base") cache, whose layers attend over the whole sequence (as kvpress does for Gemma 3).
// A plan then covers the base cache's layers (shapes::n_layer_plan); observation, slot bias and the
// compressed attention hook into those layers only (native/patches/0004-kvcli-iswa-attention.patch).
#include "kvcli_cache.h"

#include "llama-kv-cache-iswa.h"

llama_kv_cache * kvcli_iswa_base(llama_memory_t mem) {
    auto * iswa = dynamic_cast<llama_kv_cache_iswa *>(mem);
    return iswa ? iswa->get_base() : nullptr;
}

bool kvcli_is_iswa_base(const llama_kv_cache & kv) {
    // the base cache of an iSWA memory does not slide itself, but its model has sliding layers
    return kvcli_access::n_swa(kv) == 0 && kvcli_access::hparams(kv).swa_type != LLAMA_SWA_TYPE_NONE;
}

extern "C" {

int32_t kvcli_model_kv_layers(const struct llama_model * model, int32_t * il_out) {
    return kvcli_guarded([&] {
        if (!model) {
            throw kvcli_error("model is NULL");
        }
        const auto & hp = model->hparams;
        int32_t n = 0;
        for (uint32_t il = 0; il < hp.n_layer(); ++il) {
            if (hp.swa_type == LLAMA_SWA_TYPE_NONE || !hp.is_swa(il)) {
                if (il_out) {
                    il_out[n] = (int32_t) il;
                }
                ++n;
            }
        }
        return n;
    });
}

} // extern "C"
