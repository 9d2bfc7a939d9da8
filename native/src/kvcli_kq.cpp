// K^T Q of a few-rows call (kvcli_kq_product): a question's rows against every cell of a long document, on the CPU.
//
// ggml's product for it is tinyBLAS's F16 kernel: for each block of 4 cells x 6 query columns it zeroes 24 vector
// accumulators (GCC 12 keeps them in registers but also memsets their stack copy), multiplies along the head's
// dimensions, and reduces each accumulator horizontally. With a head's 64 dimensions that is 4 multiply-adds per
// output against a memset and a horizontal sum per output: under perf the product and its memset were ~23% of a 16k
// question (native/src/README.md, "Where a question's time goes"). Here the tile's K rows are transposed once and
// each multiply-add yields W cells' partial sums, so there is nothing to reduce and nothing to zero in memory.
//
// The sums are the same dot products in another order (along the dimensions, one multiply-add at a time; Q rounded to
// F16 for an F16 K as ggml rounds it): equal to float rounding, tested against ggml's product.
// x86-64 built by GCC, with AVX-512 or AVX2 + FMA + F16C (chosen at run time; KVCLI_KQ=avx2 takes the AVX2 kernel);
// elsewhere, and with KVCLI_KQ=ggml, ggml's product.
#include "kvcli_cache.h"

#include "ggml.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t KQ_HEAD_DIM_MAX = 256;   // a tile's transposed K lives on the thread's stack: 256 x 32 floats

struct kq_args {
    const char *  k;             // K [hd, n_kv, n_head_kv]: dimensions contiguous, F16 or F32
    size_t        k_cell, k_head;
    bool          k_f16;
    const float * q;             // Q [hd, rows, n_head] in F32: dimensions contiguous, rows and heads at any stride
    int64_t       q_row, q_head; // in floats
    float *       out;           // [n_kv, rows, n_head], contiguous
    int64_t       hd, n_kv, rows, n_head_kv, ratio;   // ratio: query heads per KV head (GQA)
};

}  // namespace

// GCC's per-region target pragmas (clang takes target attributes per function instead: it gets ggml's product)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace kq_avx2 {
using V = __m256;
constexpr int64_t W = 8;
static inline V zero() { return _mm256_setzero_ps(); }
static inline V load(const float * p) { return _mm256_loadu_ps(p); }
static inline void store(float * p, V x) { _mm256_storeu_ps(p, x); }
static inline V set1(float x) { return _mm256_set1_ps(x); }
static inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V load_f16(const uint16_t * p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) p)); }
static inline V round_f16(V x) { return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
#include "kvcli_kq_tiles.inc"
}  // namespace kq_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace kq_avx512 {
using V = __m512;
constexpr int64_t W = 16;
static inline V zero() { return _mm512_setzero_ps(); }
static inline V load(const float * p) { return _mm512_loadu_ps(p); }
static inline void store(float * p, V x) { _mm512_storeu_ps(p, x); }
static inline V set1(float x) { return _mm512_set1_ps(x); }
static inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
// the zero-masked forms of _mm512_cvtph_ps and _mm512_cvtps_ph, whose header's undefined pass-through GCC 12 warns
// about
static inline V load_f16(const uint16_t * p) {
    return _mm512_maskz_cvtph_ps((__mmask16) 0xFFFF, _mm256_loadu_si256((const __m256i *) p));
}
static inline V round_f16(V x) {
    return _mm512_maskz_cvtph_ps((__mmask16) 0xFFFF,
                                 _mm512_maskz_cvtps_ph((__mmask16) 0xFFFF, x, _MM_FROUND_TO_NEAREST_INT));
}
#include "kvcli_kq_tiles.inc"
}  // namespace kq_avx512
#pragma GCC pop_options

namespace {

// the widest set this CPU runs: 16 (AVX-512), 8 (AVX2 + FMA + F16C) or 0 (none: ggml's product)
int64_t kq_width() {
    static const int64_t w = __builtin_cpu_supports("avx512f") ? 16 :
        (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) ? 8 : 0;
    return w;
}

void kq_compute(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * k = dst->src[0], * q = dst->src[1];
    const kq_args a = {
        (const char *) k->data, k->nb[1], k->nb[2], k->type == GGML_TYPE_F16,
        (const float *) q->data, (int64_t) (q->nb[1] / sizeof(float)), (int64_t) (q->nb[2] / sizeof(float)),
        (float *) dst->data, k->ne[0], k->ne[1], q->ne[1], k->ne[2], q->ne[2] / k->ne[2],
    };
    if ((intptr_t) userdata == 16) {
        kq_avx512::run(a, ith, nth);
    } else {
        kq_avx2::run(a, ith, nth);
    }
}

}  // namespace

ggml_tensor * kvcli_kq_product(ggml_context * ctx0, ggml_tensor * k, ggml_tensor * q) {
    // KVCLI_KQ: ggml (ggml's product: a measurement's baseline), avx2 (the 8-wide kernel on a CPU that has AVX-512
    // too: what a test checks), else the widest kernel this CPU runs
    const char * env = std::getenv("KVCLI_KQ");
    const bool ggml_only = env && std::strcmp(env, "ggml") == 0, avx2 = env && std::strcmp(env, "avx2") == 0;
    const int64_t w = ggml_only ? 0 : avx2 ? std::min<int64_t>(kq_width(), 8) : kq_width();
    const bool takes = w > 0 && kvcli_on_cpu(k) &&
        (k->type == GGML_TYPE_F16 || k->type == GGML_TYPE_F32) && k->nb[0] == ggml_type_size(k->type) &&
        q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float) && q->nb[1] % sizeof(float) == 0 &&
        q->nb[2] % sizeof(float) == 0 && k->ne[0] == q->ne[0] && k->ne[0] % w == 0 &&
        k->ne[0] <= KQ_HEAD_DIM_MAX && k->ne[2] > 0 && q->ne[2] % k->ne[2] == 0 && k->ne[3] == 1 && q->ne[3] == 1;
    if (!takes) {
        return nullptr;
    }
    ggml_tensor * args[2] = { k, q };
    ggml_tensor * r = ggml_custom_4d(ctx0, GGML_TYPE_F32, k->ne[1], q->ne[1], q->ne[2], 1, args, 2, kq_compute,
                                     GGML_N_TASKS_MAX, (void *) (intptr_t) w);
    ggml_format_name(r, "kvcli_kq");   // what a test counts in the last graph
    return r;
}

#else

ggml_tensor * kvcli_kq_product(ggml_context *, ggml_tensor *, ggml_tensor *) {
    return nullptr;
}

#endif
